"""The resume stage's judgement (pure): bit-identical losses at the same layout, the fp32 tolerance at
another, data order compared directly, and each rank's RNG state against the baseline rank with its role."""
from __future__ import annotations

from migrate.stages.resume import Continuation, compare_continuations

DECISIONS = [{"target_rank": 0, "policy": "carry", "source_rank": 0, "fingerprint": "aa"},
             {"target_rank": 1, "policy": "replicate", "source_rank": 0, "fingerprint": "aa"},
             {"target_rank": 2, "policy": "derive", "source_rank": None, "fingerprint": "dd"}]


def _run(losses, samples, rng):
    return Continuation(layout="x", start_step=6, records=tuple({"step": 7 + i, "loss": v} for i, v in enumerate(losses)),
                        samples=tuple(tuple(s) for s in samples), rng=tuple(tuple(r) for r in rng))


BASE = _run([4.0, 3.5, 3.0], [[1, 2], [3, 4], [5, 6]], [["aa"] * 3, ["aa"] * 3])


def _judge(target, same_layout=False):
    return compare_continuations(target, BASE, same_layout=same_layout, rng_decisions=DECISIONS, rtol=1e-5, atol=1e-6)


def test_matching_continuation_passes_and_reports_the_largest_difference():
    v = _judge(_run([4.0, 3.5 + 1e-7, 3.0], BASE.samples, [["aa"], ["aa"], ["dd"]]))
    assert v.passed and v.reasons == () and abs(v.max_loss_diff - 1e-7) < 1e-12
    assert v.data_order.startswith("identical: 3 global batches, 6 samples")
    assert "carry, derive, replicate" in v.rng


def test_same_layout_requires_bit_identical_losses():
    v = _judge(_run([4.0, 3.5 + 1e-7, 3.0], BASE.samples, [["aa"], ["aa"], ["dd"]]), same_layout=True)
    assert v.reasons[0].startswith("loss differs at step 8 at the same layout (must be bit-identical)")


def test_loss_beyond_tolerance_names_the_step_and_numbers():
    v = _judge(_run([4.0, 3.5, 3.01], BASE.samples, [["aa"], ["aa"], ["dd"]]))
    assert v.reasons == ("loss differs beyond fp32 reduction tolerance at step 9: target 3.01 baseline 3.0 |diff| "
                         "0.01 > atol 1e-06 + rtol 1e-05 * |baseline| = 3.1e-05",)


def test_data_order_is_checked_on_its_own():
    v = _judge(_run([4.0, 3.5, 3.0], [[1, 2], [5, 6], [7, 8]], [["aa"], ["aa"], ["dd"]]))
    assert v.reasons == ("data order differs from step 8: target consumed [5, 6] baseline [3, 4]",)


def test_rng_state_differing_from_its_role_is_named_per_rank():
    v = _judge(_run([4.0, 3.5, 3.0], BASE.samples, [["aa"], ["bb"], ["ee"]]))
    assert len(v.reasons) == 2
    assert v.reasons[0] == ("RNG state of rank 1 at resumed step 7 is not what the checkpoint should carry: target bb "
                            "but the baseline's rank 0 (replicate) has aa")
    assert "the state derived by the conversion (derive) has dd" in v.reasons[1]


def _full(losses, grad_norms, lrs, consumed):
    records = tuple({"step": 7 + i, "loss": v, "grad_norm": g, "lr": lr, "consumed_samples": c}
                    for i, (v, g, lr, c) in enumerate(zip(losses, grad_norms, lrs, consumed)))
    return Continuation(layout="x", start_step=6, records=records, samples=BASE.samples, rng=(("aa",) * 3, ("aa",) * 3))


FULL = _full([4.0, 3.5, 3.0], [1.0, 0.9, 0.8], [1e-3, 9e-4, 8e-4], [16, 18, 20])


def _judge_full(target, same_layout=False):
    return compare_continuations(target, FULL, same_layout=same_layout, rng_decisions=[], rtol=1e-5, atol=1e-6,
                                 grad_norm_rtol=1e-4, lr_rtol=1e-6)


def test_grad_norm_lr_and_consumed_samples_are_compared_per_step():
    ok = _judge_full(_full([4.0, 3.5, 3.0], [1.0, 0.9 * (1 + 5e-5), 0.8], [1e-3, 9e-4, 8e-4], [16, 18, 20]))
    assert ok.passed, ok.reasons
    assert abs(ok.max_grad_norm_rel_diff - 5e-5) < 1e-9

    lr_reset = _judge_full(_full([4.0, 3.5, 3.0], [1.0, 0.9, 0.8], [1e-4, 2e-4, 3e-4], [16, 18, 20]))
    assert lr_reset.reasons == ("learning rate differs at step 7: target 0.0001 baseline 0.001, relative 0.9 > lr_rtol "
                                "1e-06 (the scheduler state was not carried)",)

    grad = _judge_full(_full([4.0, 3.5, 3.0], [1.0, 0.9, 0.81], [1e-3, 9e-4, 8e-4], [16, 18, 20]))
    assert grad.reasons == ("grad norm differs at step 9: target 0.81 baseline 0.8, relative 0.0125 > grad_norm_rtol "
                            "0.0001",)

    counter = _judge_full(_full([4.0, 3.5, 3.0], [1.0, 0.9, 0.8], [1e-3, 9e-4, 8e-4], [8, 10, 12]))
    assert counter.reasons == ("consumed samples differ at step 7: target 8 baseline 16",)


def test_same_layout_requires_a_bit_identical_grad_norm():
    v = _judge_full(_full([4.0, 3.5, 3.0], [1.0, 0.9 * (1 + 1e-9), 0.8], [1e-3, 9e-4, 8e-4], [16, 18, 20]), same_layout=True)
    assert len(v.reasons) == 1 and v.reasons[0].startswith("grad norm differs at step 8 at the same layout (must be bit-identical)")
