"""Converting Megatron-Core torch_dist checkpoints (written by the real engine) to other TP/PP layouts.

Checks: the reader's flat dp_reshardable optimizer layout reproduces the model weights bit for bit
(fp32 master == param); the converted checkpoint re-reads equal to the source, tensor by tensor
(optimizer state included); Megatron-Core loads it at the target layout and training continues with
the losses the source layout gives (fp32, relative error <= 1e-6 on the first resumed step).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, detect_format, read_index
from checkpoint.index import Kind, TensorKey
from checkpoint.materialize import iter_tensors
from checkpoint.plan import ValueRole, summarize
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import launch

GBS = 12  # divisible by every target DP size (1, 2, 3, 4)
# Sources (tp, pp, dp, ep, moe) written by the engine, and the layouts each is converted to and resumed at:
# every source to another split of the set and to plain DP, world sizes 1 to 4 and 3 among the targets, each
# axis grown and shrunk (tp 2<->1, pp 2<->1, tp<->pp, ep 2->1 and 2->4). MoE sources use the Mixtral-style model.
CASES = {
    (2, 1, 1, 1, False): [(1, 2, 1, 1), (1, 1, 3, 1)],
    (1, 2, 1, 1, False): [(2, 1, 1, 1), (2, 2, 1, 1), (1, 1, 2, 1)],
    (2, 2, 1, 1, False): [(1, 1, 1, 1), (2, 1, 1, 1)],
    # MoE with TP > 1 needs sequence parallelism (tests/frameworks/test_workload_megatron.py covers EP2 x TP2 + SP)
    (1, 1, 2, 2, True): [(1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 3, 1), (1, 1, 4, 4)],
}
PAIRS = [(src, dst) for src, dsts in CASES.items() for dst in dsts]


def _name(layout) -> str:
    tp, pp, dp, ep = layout[:4]
    return f"tp{tp}pp{pp}dp{dp}" + (f"ep{ep}" if ep > 1 else "") + ("moe" if len(layout) > 4 and layout[4] else "")


def _checkpoint(megatron_checkpoint, src):
    tp, pp, dp, ep, moe = src
    return megatron_checkpoint(tp, pp, dp, ep=ep, moe=moe, global_batch_size=GBS)


def _resume(ck, load_dir, tp: int, pp: int, dp: int, ep: int, steps: int) -> list[float]:
    spec = dataclasses.replace(ck.spec, tp=tp, pp=pp, ep=ep, load_dir=str(load_dir), save_dir=None, steps=steps)
    return launch(spec, tp * pp * dp)[0].losses


@pytest.fixture(scope="module")
def source_losses(megatron_checkpoint):
    """Losses of steps 3-4 resumed from each source checkpoint at its own layout (one launch per source)."""
    cache: dict[tuple, list[float]] = {}

    def get(src) -> list[float]:
        if src not in cache:
            cache[src] = _resume(_checkpoint(megatron_checkpoint, src), _checkpoint(megatron_checkpoint, src).path,
                                 *src[:4], steps=4)
        return cache[src]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("src", list(CASES), ids=_name)
def test_reader_master_equals_weights(megatron_checkpoint, src):
    ck = _checkpoint(megatron_checkpoint, src)
    index = read_index(ck.path)
    assert detect_format(ck.path) == "megatron"
    assert (index.meta["tp"], index.meta["pp"], index.meta["ep"], index.meta["sharding"]) == (
        src[0], src[1], src[3], "dp_reshardable")
    tensors = {e.key: t for e, t in iter_tensors(index)}
    params = [k for k in tensors if k.kind is Kind.PARAM]
    # llama, 2 layers: embed, lm_head, norm + 2 x (2 norms, q, k, v, o, gate, up, down); mixtral: router and
    # 4 experts x (gate, up, down) instead of the dense MLP
    assert len(params) == (3 + 2 * (6 + 1 + 4 * 3) if src[4] else 21)
    for k in params:
        assert torch.equal(tensors[k], tensors[TensorKey(name=k.name, kind=Kind.MASTER)]), k


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{_name(s)}-to-{_name(d)}" for s, d in PAIRS])
def test_convert_loads_in_megatron_at_other_layouts(megatron_checkpoint, source_losses, tmp_path, src, dst):
    ck = _checkpoint(megatron_checkpoint, src)
    want = source_losses(src)
    tp, pp, dp, ep = dst
    target = tmp_path / _name(dst)  # a save dir: iter_0000002/ and Megatron-LM's tracker beside it
    outcome = convert(ck.path, target, to="megatron", target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep))
    written = {f.path for f in outcome.result.files}
    assert len([p for p in written if p.endswith(".distcp")]) == tp * pp * dp  # one .distcp per target rank
    assert {"iter_0000002/.metadata", "iter_0000002/common.pt", "iter_0000002/metadata.json",
            "latest_checkpointed_iteration.txt"} <= written
    assert (target / "latest_checkpointed_iteration.txt").read_text() == "2"
    back = read_index(target)
    assert (back.meta["tp"], back.meta["pp"], back.meta["dp"], back.meta["ep"]) == (tp, pp, dp, ep)
    assert compare_indexes(outcome.plan.source, back) == []
    losses = _resume(ck, target, tp, pp, dp, ep, steps=4)
    assert len(losses) == 2
    rel = abs(losses[0] - want[0]) / abs(want[0])
    assert rel <= 1e-6, (src, dst, losses, want)
    assert losses[1] == pytest.approx(want[1], rel=1e-5), (src, dst, losses, want)


@pytest.mark.slow
def test_dry_run_plans_from_metadata(megatron_checkpoint, tmp_path):
    ck = megatron_checkpoint(2, 1, 1, global_batch_size=GBS)
    start = time.perf_counter()
    outcome = convert(ck.path, tmp_path / "dst", to="megatron", target=LayoutRequest(tp=1), dry_run=True)
    assert outcome.result is None and time.perf_counter() - start < 5
    assert {e.key.kind for e in outcome.plan.target.index.entries} == {Kind.PARAM, Kind.MASTER, Kind.EXP_AVG,
                                                                        Kind.EXP_AVG_SQ}
    # what is not a tensor chunk is planned too: the source's ShardedObjects copied byte for byte from its
    # files and one rng_state object per target (pp, tp) rank, in the first rank's file; common.pt's state
    files = outcome.plan.target.files
    assert [f.path for f in files if f.values] == [files[0].path]
    copied = [v.copy for v in files[0].values if v.copy is not None]
    root = Path(outcome.plan.source.root)
    assert copied and all(Path(c.path).parent == root and c.path.endswith(".distcp") and c.length > 0 for c in copied)
    assert [v.key for v in files[0].values if v.role is ValueRole.RNG] == [("rng_state/shard_0.0_1.1",)]
    (common,) = next(f for f in outcome.plan.target.described if f.path == "iter_0000002/common.pt").values
    assert common.role is ValueRole.COMMON and common.value["iteration"] == 2
    assert common.value["migrate"]["layout"]["tp"] == 1 and "optimizer" in common.value
    assert "values beside the tensors" in summarize(outcome.plan)
