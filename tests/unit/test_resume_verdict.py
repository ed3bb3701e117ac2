"""The resume stage's judgement (pure): bit-identical losses at the same layout, the fp32 tolerance at
another, data order compared directly, and each rank's RNG state against the baseline rank with its role."""
from __future__ import annotations

import pytest

from checkpoint.state.fingerprint import StatePrint, TensorPrint
from migrate.stages.resume import Continuation, compare_continuations

DECISIONS = [{"target_rank": 0, "policy": "carry", "source_rank": 0, "fingerprint": "aa"},
             {"target_rank": 1, "policy": "replicate", "source_rank": 0, "fingerprint": "aa"},
             {"target_rank": 2, "policy": "derive", "source_rank": None, "fingerprint": "dd"}]


def _print(hash_=0x1234, step=6.0, norm_sq=4.0):
    weight = TensorPrint(shape=(4, 2), dtype="float32", count=8, hash=hash_, sum_sq=norm_sq, abs_max=1.0, nonfinite=0)
    return StatePrint(tensors={"model.w": weight}, values={"optimizer.step": [step], "iteration": 6})


STATE = _print()


def _run(losses, samples, rng, state=STATE):
    return Continuation(layout="x", start_step=6, records=tuple({"step": 7 + i, "loss": v} for i, v in enumerate(losses)),
                        samples=tuple(tuple(s) for s in samples), rng=tuple(tuple(r) for r in rng), state=state)


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
    return Continuation(layout="x", start_step=6, records=records, samples=BASE.samples, rng=(("aa",) * 3, ("aa",) * 3),
                        state=STATE)


FULL = _full([4.0, 3.5, 3.0], [1.0, 0.9, 0.8], [1e-3, 9e-4, 8e-4], [16, 18, 20])


def _judge_full(target, same_layout=False):
    return compare_continuations(target, FULL, same_layout=same_layout, rng_decisions=DECISIONS[:2], rtol=1e-5,
                                 atol=1e-6, grad_norm_rtol=1e-4, lr_rtol=1e-6)


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
    assert len(v.reasons) == 1
    assert v.reasons[0].startswith("grad norm differs at step 8 at the same layout (must be bit-identical)")


def test_a_loaded_state_that_differs_fails_before_any_step_naming_the_tensor_and_its_numbers():
    v = _judge(_run([4.0, 3.5, 3.0], BASE.samples, [["aa"], ["aa"], ["dd"]], state=_print(hash_=0x99, norm_sq=4.0004)))
    assert not v.passed and len(v.reasons) == 1
    assert v.reasons[0].startswith("loaded state differs from the baseline's before step 7 (1 difference(s)): model.w "
                                   "[4, 2] float32: values or their positions differ: norm target 2.0001 baseline 2 "
                                   "(relative 5e-05)"), v.reasons
    assert v.state == "1 of 1 tensors and 2 values differ at load"
    reset = _judge(_run([4.0, 3.5, 3.0], BASE.samples, [["aa"], ["aa"], ["dd"]], state=_print(step=0.0)))
    assert reset.state_differences == ("optimizer.step: target [0.0] baseline [6.0]",)


def test_nothing_unchecked_passes_unless_the_user_accepts_it():
    unprinted = _run([4.0, 3.5, 3.0], BASE.samples, [["aa"], ["aa"], ["dd"]], state=None)
    v = _judge(unprinted)
    assert not v.passed and v.unchecked == ("state",)
    assert v.reasons == ("state: not checked: the target run printed no loaded state (nothing unchecked passes; "
                         "--accept-unchecked state accepts it)",)
    accepted = compare_continuations(unprinted, BASE, same_layout=False, rng_decisions=DECISIONS, rtol=1e-5, atol=1e-6,
                                     accept_unchecked=["state"])
    assert accepted.passed and accepted.accepted == ("state: not checked: the target run printed no loaded state",)

    no_rng = compare_continuations(FULL, FULL, same_layout=True, rng_decisions=[], rtol=1e-5, atol=1e-6)
    assert not no_rng.passed and no_rng.unchecked == ("rng",)
    absent = compare_continuations(FULL, FULL, same_layout=True, rng_decisions=[], rtol=1e-5, atol=1e-6, rng_absent=True)
    assert absent.passed and absent.rng.startswith("absent in the source checkpoint")
    with pytest.raises(ValueError, match="accept_unchecked"):
        compare_continuations(FULL, FULL, same_layout=True, rng_decisions=[], rtol=1e-5, atol=1e-6,
                              accept_unchecked=["weights"])


def test_every_fault_hook_is_an_option_of_the_resume_stage():
    from checkpoint.state.faults import FAULTS
    from migrate.stages.resume import ResumeOptions

    assert [ResumeOptions(fault=f).fault for f in FAULTS] == list(FAULTS)
