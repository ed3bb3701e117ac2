"""Converting Megatron-Core torch_dist checkpoints (written by the real engine) to other TP/PP layouts.

Checks: the reader's flat dp_reshardable optimizer layout reproduces the model weights bit for bit
(fp32 master == param); the converted checkpoint re-reads equal to the source, tensor by tensor
(optimizer state included); Megatron-Core loads it at the target layout and training continues with
the losses the source layout gives (fp32, relative error <= 1e-6 on the first resumed step).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from checkpoint.api import convert, detect_format, read_index
from checkpoint.index import Kind, TensorKey
from checkpoint.materialize import iter_tensors
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import launch

SOURCES = [(2, 1, 1), (1, 2, 1)]  # (tp, pp, dp) written by the engine
TARGETS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # dp3 needs a global batch divisible by 3


def _resume(ck, load_dir, tp: int, pp: int, dp: int, steps: int) -> list[float]:
    spec = dataclasses.replace(ck.spec, tp=tp, pp=pp, load_dir=str(load_dir), save_dir=None, steps=steps)
    return launch(spec, tp * pp * dp)[0].losses


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=lambda s: f"tp{s[0]}pp{s[1]}dp{s[2]}")
def test_reader_master_equals_weights(megatron_checkpoint, src):
    ck = megatron_checkpoint(*src)
    index = read_index(ck.path)
    assert detect_format(ck.path) == "megatron"
    assert (index.meta["tp"], index.meta["pp"], index.meta["sharding"]) == (src[0], src[1], "dp_reshardable")
    tensors = {e.key: t for e, t in iter_tensors(index)}
    params = [k for k in tensors if k.kind is Kind.PARAM]
    assert len(params) == 21  # llama, 2 layers: embed, lm_head, norm + 2 x (2 norms, q, k, v, o, gate, up, down)
    for k in params:
        assert torch.equal(tensors[k], tensors[TensorKey(name=k.name, kind=Kind.MASTER)]), k


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=lambda s: f"tp{s[0]}pp{s[1]}dp{s[2]}")
def test_convert_loads_in_megatron_at_other_layouts(megatron_checkpoint, tmp_path, src):
    ck = megatron_checkpoint(*src)
    source_losses = _resume(ck, ck.path, *src, steps=4)
    for tp, pp, dp in [t for t in TARGETS if t != src]:
        dst = tmp_path / f"tp{tp}pp{pp}dp{dp}" / "iter_0000002"
        outcome = convert(ck.path, dst, to="megatron", tp=tp)
        assert compare_indexes(outcome.plan.source, read_index(dst)) == []
        losses = _resume(ck, dst, tp, pp, dp, steps=4)
        assert len(losses) == 2
        rel = abs(losses[0] - source_losses[0]) / abs(source_losses[0])
        assert rel <= 1e-6, (src, (tp, pp, dp), losses, source_losses)
        assert losses[1] == pytest.approx(source_losses[1], rel=1e-5), (src, (tp, pp, dp), losses, source_losses)


@pytest.mark.slow
def test_dry_run_plans_from_metadata(megatron_checkpoint, tmp_path):
    ck = megatron_checkpoint(2, 1, 1)
    start = time.perf_counter()
    outcome = convert(ck.path, tmp_path / "dst", to="megatron", tp=1, dry_run=True)
    assert outcome.result is None and time.perf_counter() - start < 5
    assert {e.key.kind for e in outcome.plan.target.index.entries} == {Kind.PARAM, Kind.MASTER, Kind.EXP_AVG,
                                                                        Kind.EXP_AVG_SQ}
