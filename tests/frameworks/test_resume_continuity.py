"""A user converts a DeepSpeed checkpoint to another DP size and resumes: the loss curve, the global
sample order and every rank's RNG state continue as in the baseline's own continuation; a shifted
dataloader and a reset RNG are caught with the right reason. Real DeepSpeed runs on Gloo (slow)."""
from __future__ import annotations

import json

import pytest

from checkpoint.api import LayoutRequest, convert
from checkpoint.state.faults import inject_fault
from checkpoint.state.training_state import STATE_REPORT_FILE
from migrate.stages.resume import Continuation, compare_continuations, rng_decisions
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec, TrainSpec

pytestmark = pytest.mark.slow

SAVED_AT, K, GBS = 3, 3, 12  # gbs 12: divisible by dp 2, 3 and 4


def _spec(save_dir=None, load_dir=None, steps=SAVED_AT):
    return RunSpec(engine="deepspeed", model=TINY_LLAMA, steps=steps, zero_stage=1, save_dir=save_dir,
                   load_dir=load_dir, train=TrainSpec(global_batch_size=GBS))


@pytest.fixture(scope="module")
def sources(tmp_path_factory, workload_extensions_dir):
    """Per source dp: (checkpoint dir saved at step SAVED_AT, the baseline's continuation to SAVED_AT + K)."""
    cache = {}

    def get(dp):
        if dp not in cache:
            root = tmp_path_factory.mktemp(f"resume_src_dp{dp}")
            launch(_spec(save_dir=str(root / "ckpt")), dp)
            baseline = launch(_spec(load_dir=str(root / "ckpt"), steps=SAVED_AT + K), dp)
            cache[dp] = (root / "ckpt", Continuation.from_results(f"dp{dp}", baseline))
        return cache[dp]

    return get


def _resume(sources, tmp_path, src_dp, dst_dp, fault=None):
    src, baseline = sources(src_dp)
    dst = tmp_path / "converted"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dst_dp, zero_stage=1))
    if fault:
        inject_fault(dst, fault)
    report = json.loads((dst / STATE_REPORT_FILE).read_text())
    target = Continuation.from_results(f"dp{dst_dp}", launch(_spec(load_dir=str(dst), steps=SAVED_AT + K), dst_dp))
    verdict = compare_continuations(target, baseline, same_layout=src_dp == dst_dp, rng_decisions=rng_decisions(report),
                                    rtol=1e-5, atol=1e-6)
    print(f"\n[resume dp{src_dp}->dp{dst_dp}{' ' + fault if fault else ''}] max |loss diff| over {K} steps: "
          f"{verdict.max_loss_diff:.3g}; max grad norm rel diff {verdict.max_grad_norm_rel_diff:.3g}; "
          f"data order: {verdict.data_order}; rng: {verdict.rng}; reasons: {verdict.reasons}")
    return verdict, report, target, baseline


@pytest.mark.parametrize("src_dp,dst_dp", [(4, 2), (4, 3), (2, 4)])
def test_dp_change_continues_loss_data_order_and_rng(sources, tmp_path, src_dp, dst_dp):
    verdict, report, target, baseline = _resume(sources, tmp_path, src_dp, dst_dp)
    assert verdict.passed, verdict.reasons
    assert len(target.records) == K and target.start_step == SAVED_AT
    assert target.samples == baseline.samples and len(target.samples[0]) == GBS
    assert 0 <= verdict.max_loss_diff <= 1e-5
    policies = {d["target_rank"]: d["policy"] for d in rng_decisions(report)}
    assert policies == {r: "carry" if r < src_dp else "replicate" for r in range(dst_dp)}


def test_same_layout_resume_is_bit_identical(sources, tmp_path):
    verdict, _, target, baseline = _resume(sources, tmp_path, 2, 2)
    assert verdict.passed, verdict.reasons
    assert [r["loss"] for r in target.records] == [r["loss"] for r in baseline.records]
    assert verdict.max_loss_diff == 0.0


def test_dataloader_shifted_by_one_batch_is_caught(sources, tmp_path):
    verdict, *_ = _resume(sources, tmp_path, 4, 2, fault="shift_data")
    assert not verdict.passed
    assert any(r.startswith(f"data order differs from step {SAVED_AT + 1}: target consumed [") for r in verdict.reasons)
    assert not any(r.startswith("RNG state") for r in verdict.reasons)


def test_reset_rng_is_caught(sources, tmp_path):
    verdict, *_ = _resume(sources, tmp_path, 4, 2, fault="reset_rng")
    assert not verdict.passed
    rng = [r for r in verdict.reasons if r.startswith("RNG state of rank")]
    assert len(rng) == 2 and all("not what the checkpoint should carry" in r for r in rng)
    assert verdict.data_order.startswith("identical")
