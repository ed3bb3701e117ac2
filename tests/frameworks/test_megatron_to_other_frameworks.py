"""Converting Megatron-Core checkpoints (TP/PP/EP sharded, DistributedOptimizer) to DeepSpeed ZeRO and DCP.

Megatron's row-parallel pieces (column slices of o_proj / down_proj at TP > 1) are not contiguous in
the canonical tensor, while ZeRO shards are flat ranges: the planner meets them as a few region items per
(slice, partition) pair. Checks: the copies are exact element for element; the converted checkpoints re-read
equal to the source, optimizer state
included (Megatron's per-group Adam step becomes torch Adam's per-parameter step); the frameworks' own
loaders resume from them and continue with the source's loss.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.formats.adam_step import derived_step, split_derived_steps
from checkpoint.copy_items import copy_item
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorEntry, TensorKey
from checkpoint.plan import TargetFile, TargetSpec, ValueRole, make_plan, summarize
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import launch
from migrate.workload.run_spec import RunSpec

GBS = 12  # shared with tests/frameworks/test_megatron_convert.py (same session checkpoints)


@pytest.mark.parametrize("shape,split_dim,tp", [
    ((4, 6), 1, 2),  # TP2 column slices of a row-parallel weight
    ((2, 5, 6), 2, 3),  # a stacked (layers, rows, columns) weight split on its last dim
    ((3, 4, 5), 0, 3),  # row slices: contiguous already
    ((6, 4), 1, 4),
])
@pytest.mark.parametrize("partitions", [1, 3, 5])
def test_tp_slices_meet_zero_partitions_element_for_element(shape, split_dim, tp, partitions):
    """Megatron's TP slices (boxes, not contiguous in the tensor when split on a later dim) planned into
    ZeRO-style flat partitions of the tensor and copied by the executor: every element lands where the
    global tensor has it, each (slice, partition) pair in at most 2 * ndim - 1 items."""
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    slices = full.chunk(tp, dim=split_dim)
    stored = torch.cat([torch.full((7,), -1.0), *(t.flatten() for t in slices)])
    chunks, at, offset = [], 7, 0
    for t in slices:
        offsets = tuple(offset if d == split_dim else 0 for d in range(len(shape)))
        chunks.append(ChunkRef(file="tp", key=("k",), offsets=offsets, lengths=tuple(t.shape), storage_offset=at))
        at, offset = at + t.numel(), offset + t.shape[split_dim]
    total = math.prod(shape)
    bounds = [total * i // partitions for i in range(partitions + 1)]
    parts = tuple(ChunkRef(file="zero", key=("f",), offsets=(0,) * len(shape), lengths=shape, flat_range=(lo, hi),
                           storage_offset=3 + lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo)
    key = TensorKey(name="w", kind=Kind.PARAM)
    source = CheckpointIndex(format="megatron", root="src", files=("tp",),
                             entries=(TensorEntry(key=key, shape=shape, dtype="float64", chunks=tuple(chunks)),))
    target = TargetSpec(index=CheckpointIndex(format="deepspeed", root="dst", files=("zero",), entries=(
        TensorEntry(key=key, shape=shape, dtype="float64", chunks=parts),)),
        files=(TargetFile(path="zero", role="optim", rank=0),))
    plan = make_plan(source, target)
    per_pair: dict = {}
    for item in plan.items:
        per_pair[(item.src.offsets, item.dst.flat_range)] = per_pair.get((item.src.offsets, item.dst.flat_range), 0) + 1
    assert max(per_pair.values()) <= 2 * len(shape) - 1
    assert any(item.region is not None for item in plan.items) == (split_dim > 0 and tp > 1)
    flat = torch.full((total + 3,), -2.0)
    for item in plan.items:
        copy_item(item, stored, flat, src_where="tp")
    assert torch.equal(flat[3:], full.flatten()) and (flat[:3] == -2).all()


SOURCES = [(2, 2, 1, 1, False), (1, 1, 2, 2, True)]  # (tp, pp, dp, ep, moe)
TARGETS = [("deepspeed", {"dp": 2, "zero_stage": 1}), ("deepspeed", {"dp": 3, "zero_stage": 3}), ("dcp", {"dp": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=lambda s: f"tp{s[0]}pp{s[1]}dp{s[2]}ep{s[3]}")
def test_megatron_converts_to_deepspeed_and_dcp_bit_exact(megatron_checkpoint, tmp_path, src):
    tp, pp, dp, ep, moe = src
    ck = megatron_checkpoint(tp, pp, dp, ep=ep, moe=moe, global_batch_size=GBS)
    for fmt, kw in TARGETS:
        dst = tmp_path / f"{fmt}_{'_'.join(f'{k}{v}' for k, v in kw.items())}"
        outcome = convert(ck.path, dst, to=fmt, target=LayoutRequest(**kw))
        written = read_index(dst)
        back, step_problems = split_derived_steps(outcome.plan.source, written)
        assert step_problems == [], (fmt, kw)  # Megatron's group step, per parameter as torch Adam keeps it
        assert compare_indexes(outcome.plan.source, written) == [], (fmt, kw)  # checks the derived steps too
        kinds = {e.key.kind for e in back.entries}
        assert {Kind.EXP_AVG, Kind.EXP_AVG_SQ} <= kinds, (fmt, kinds)
        moments = {e.key.name for e in back.entries if e.key.kind is Kind.EXP_AVG}
        assert moments == {e.key.name for e in outcome.plan.source.entries if e.key.kind is Kind.EXP_AVG}
        # the derived steps are planned values: DCP's one per parameter in rank 0's file, DeepSpeed's one per
        # flat group in every rank's file, each torch Adam's 0-d float32 step
        steps = [(f.path, v.value) for f in outcome.plan.target.files for v in f.values if v.role is ValueRole.STEP]
        per_file = collections.Counter(path for path, _ in steps)
        want = derived_step(outcome.plan.source)
        assert all(t.shape == () and t.dtype == torch.float32 and t.item() == want for _, t in steps)
        if fmt == "dcp":
            assert list(per_file.values()) == [len(moments)], per_file
        else:
            assert len(per_file) == kw["dp"] and len(set(per_file.values())) == 1, per_file
        values = sum(len(f.values) for f in outcome.plan.target.files)
        assert f"{values} values beside the tensors (" in summarize(outcome.plan)
        assert f"step {len(steps)}" in summarize(outcome.plan)


@pytest.mark.slow
@pytest.mark.parametrize("engine,fmt,kw", [("deepspeed", "deepspeed", {"dp": 2, "zero_stage": 1}),
                                          ("fsdp", "dcp", {"dp": 2})], ids=["deepspeed", "fsdp-dcp"])
def test_frameworks_resume_from_converted_megatron(megatron_checkpoint, workload_extensions_dir, tmp_path, engine,
                                                   fmt, kw):
    ck = megatron_checkpoint(2, 1, 1, global_batch_size=GBS)
    dst = tmp_path / fmt / ("step-2" if fmt == "dcp" else "")
    convert(ck.path, dst, to=fmt, target=LayoutRequest(**kw))
    spec = RunSpec(engine=engine, model=ck.spec.model, train=ck.spec.train, steps=4, zero_stage=kw.get("zero_stage", 0),
                   load_dir=str(dst))
    losses = launch(spec, kw["dp"])[0].losses
    want = launch(dataclasses.replace(ck.spec, load_dir=str(ck.path), save_dir=None, steps=4), ck.world_size)[0].losses
    assert abs(losses[0] - want[0]) / abs(want[0]) <= 1e-6, (losses, want)
    # the second step applies Adam with the converted moments and step (bias correction): a wrong step moves it
    # by far more than the frameworks' differences (Megatron exempts norms from weight decay)
    assert abs(losses[1] - want[1]) / abs(want[1]) <= 1e-5, (losses, want)


@pytest.mark.slow
def test_megatron_weights_to_hf_load_into_the_hf_named_model(megatron_checkpoint, tmp_path):
    """Megatron TP2 weights -> HF safetensors: every weight equals the source (merged over TP, QKV and GLU
    split back per HF's names), under LlamaForCausalLM's names, and the built-in decoder (HF names without
    the `model.` prefix) loads the file with nothing missing or unexpected."""
    from safetensors.torch import load_file

    from migrate.workload.torch_model import build_decoder

    ck = megatron_checkpoint(2, 1, 1, global_batch_size=GBS)
    outcome = convert(ck.path, tmp_path / "hf", to="hf")
    assert compare_indexes(outcome.plan.source, read_index(tmp_path / "hf")) == []
    tensors = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    model = build_decoder(ck.spec.model, seed=0)
    vocab = ck.spec.model.vocab_size
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in tensors)  # HF LlamaForCausalLM's names
    state = {k.removeprefix("model."): v[:vocab] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v
             for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("inv_freq")], (missing, unexpected)
