"""A user converts a Megatron-Core checkpoint to another DP / TP / PP split and resumes: the loss curve,
the global sample order and every rank's RNG state (Python, NumPy, torch, the model-parallel tracker
streams, saved as Megatron-LM's `rng_state` objects) continue as in the baseline's own continuation;
a shifted dataloader and a reset RNG are caught with the right reason. Real Megatron-Core on Gloo (slow)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoint.api import LayoutRequest, convert
from checkpoint.state.data_position import DataPositionError
from checkpoint.state.faults import inject_fault
from checkpoint.state.training_state import STATE_REPORT_FILE
from migrate.stages.resume import Continuation, compare_continuations, rng_decisions
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec, TrainSpec

pytestmark = pytest.mark.slow

SAVED_AT, K, GBS = 3, 3, 12  # gbs 12: divisible by dp 2, 3 and 4


def _spec(layout, load_dir, steps=SAVED_AT + K):
    tp, pp, _ = layout
    return RunSpec(engine="megatron", model=TINY_LLAMA, steps=steps, tp=tp, pp=pp, distributed_optimizer=True,
                   load_dir=str(load_dir), train=TrainSpec(global_batch_size=GBS))


def _world(layout):
    return layout[0] * layout[1] * layout[2]


@pytest.fixture(scope="module")
def sources(megatron_checkpoint):
    """Per source (tp, pp, dp): (checkpoint saved at step SAVED_AT, the baseline's continuation to SAVED_AT + K)."""
    cache = {}

    def get(layout):
        if layout not in cache:
            tp, pp, dp = layout
            ckpt = megatron_checkpoint(tp, pp, dp, steps=SAVED_AT, global_batch_size=GBS)
            baseline = launch(_spec(layout, ckpt.path), _world(layout))
            cache[layout] = (ckpt.path, Continuation.from_results(f"tp{tp}pp{pp}dp{dp}", baseline))
        return cache[layout]

    return get


def _resume(sources, tmp_path, src, dst, fault=None):
    path, baseline = sources(src)
    out = tmp_path / "converted"
    convert(path, out, to="megatron", target=LayoutRequest(dp=dst[2], tp=dst[0], pp=dst[1]))
    if fault:
        inject_fault(out, fault)
    report = json.loads((out / STATE_REPORT_FILE).read_text())
    target = Continuation.from_results(str(dst), launch(_spec(dst, out), _world(dst)))
    verdict = compare_continuations(target, baseline, same_layout=src == dst, rng_decisions=rng_decisions(report),
                                    rtol=1e-5, atol=1e-6)
    print(f"\n[megatron resume tp{src[0]}pp{src[1]}dp{src[2]}->tp{dst[0]}pp{dst[1]}dp{dst[2]}"
          f"{' ' + fault if fault else ''}] max |loss diff| over {K} steps: {verdict.max_loss_diff:.3g}; "
          f"data order: {verdict.data_order}; rng: {verdict.rng}; reasons: {verdict.reasons}")
    return verdict, report, target, baseline


CASES = {
    "dp4-to-dp2": ((1, 1, 4), (1, 1, 2), {0: "carry", 1: "carry"}),
    "dp4-to-dp3": ((1, 1, 4), (1, 1, 3), {0: "carry", 1: "carry", 2: "carry"}),
    "dp2-to-dp4": ((1, 1, 2), (1, 1, 4), {0: "carry", 1: "carry", 2: "replicate", 3: "replicate"}),
    "tp2-to-tp1": ((2, 1, 1), (1, 1, 1), {0: "derive"}),
    "pp2-to-pp1": ((1, 2, 1), (1, 1, 1), {0: "derive"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_change_continues_loss_data_order_and_rng(sources, tmp_path, case):
    src, dst, policies = CASES[case]
    verdict, report, target, baseline = _resume(sources, tmp_path, src, dst)
    assert verdict.passed, verdict.reasons
    assert len(target.records) == K and target.start_step == SAVED_AT
    assert target.samples == baseline.samples and len(target.samples[0]) == GBS
    assert verdict.data_order.startswith("identical")
    assert verdict.rng.startswith(f"every rank ({len(policies)})"), verdict.rng
    assert 0 <= verdict.max_loss_diff <= 1e-5
    assert {d["target_rank"]: d["policy"] for d in rng_decisions(report)} == policies
    states = {e["state"]: e for e in report["states"]}
    assert states["data position"]["policy"] == "global order continued"
    assert states["iteration"]["policy"] == "carry" and states["migrate.consumed_tokens"]["policy"] == "carry"


def test_dataloader_shifted_by_one_batch_is_caught(sources, tmp_path):
    verdict, *_ = _resume(sources, tmp_path, (1, 1, 4), (1, 1, 2), fault="shift_data")
    assert not verdict.passed
    assert any(r.startswith(f"data order differs from step {SAVED_AT + 1}: target consumed [") for r in verdict.reasons)
    assert not any(r.startswith("RNG state") for r in verdict.reasons)


def test_reset_rng_is_caught_naming_the_ranks(sources, tmp_path):
    verdict, *_ = _resume(sources, tmp_path, (1, 1, 4), (1, 1, 2), fault="reset_rng")
    assert not verdict.passed
    rng = [r for r in verdict.reasons if r.startswith("RNG state of rank")]
    assert [r.split(" at ")[0] for r in rng] == ["RNG state of rank 0", "RNG state of rank 1"]
    assert all("not what the checkpoint should carry" in r for r in rng)
    assert verdict.data_order.startswith("identical")


def test_inconsistent_per_rank_data_position_is_refused(sources, tmp_path):
    path, _ = sources((1, 1, 2))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    common = torch.load(broken / "common.pt", weights_only=True)
    common["migrate"]["data"]["consumed_samples_per_rank"] = [SAVED_AT * GBS, (SAVED_AT + 1) * GBS]
    torch.save(common, broken / "common.pt")
    with pytest.raises(DataPositionError, match=r"ranks \[0\] at 36; ranks \[1\] at 48"):
        convert(broken, tmp_path / "out", to="megatron", target=LayoutRequest(dp=4))
