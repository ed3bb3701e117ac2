"""Converting Megatron-Core checkpoints (TP/PP/EP sharded, DistributedOptimizer) to DeepSpeed ZeRO and DCP.

Megatron's row-parallel pieces (column slices of o_proj / down_proj at TP > 1) are not contiguous in
the canonical tensor, while ZeRO shards are flat ranges: the planner meets them row by row. Checks: the
row split is exact (pure); the converted checkpoints re-read equal to the source, optimizer state
included (Megatron's per-group Adam step becomes torch Adam's per-parameter step); the frameworks' own
loaders resume from them and continue with the source's loss.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from checkpoint.api import convert, read_index
from checkpoint.formats.adam_step import split_derived_steps
from checkpoint.index import ChunkRef, Kind
from checkpoint.plan import contiguous_parts
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import launch
from migrate.workload.model_spec import RunSpec

GBS = 12  # shared with tests/test_megatron_convert.py (same session checkpoints)


@pytest.mark.parametrize("shape,offsets,lengths", [
    ((4, 6), (0, 3), (4, 3)),  # a TP2 column slice of a row-parallel weight
    ((2, 5, 6), (1, 1, 2), (1, 3, 2)),  # one layer, some rows, some columns
    ((3, 4, 5), (0, 0, 0), (3, 4, 5)),  # whole tensor: unchanged
    ((3, 4, 5), (1, 0, 0), (2, 4, 5)),  # contiguous already: unchanged
])
def test_noncontiguous_box_splits_into_exact_runs(shape, offsets, lengths):
    full = torch.arange(math.prod(shape)).reshape(shape)
    box = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    stored = torch.cat([torch.full((7,), -1), box.flatten()])  # the box stored after 7 other elements
    chunk = ChunkRef(file="f", key=("k",), offsets=offsets, lengths=lengths, storage_offset=7)
    parts = contiguous_parts(chunk, shape)
    assert sum(p.numel for p in parts) == math.prod(lengths)
    for p in parts:
        want = full[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.lengths))].flatten()
        assert torch.equal(stored[p.storage_offset:p.storage_offset + p.numel], want), p
    if lengths == shape or offsets[0] == 1 and lengths[1:] == shape[1:]:
        assert parts == (chunk,)


SOURCES = [(2, 2, 1, 1, False), (1, 1, 2, 2, True)]  # (tp, pp, dp, ep, moe)
TARGETS = [("deepspeed", {"dp": 2, "zero_stage": 1}), ("deepspeed", {"dp": 3, "zero_stage": 3}), ("dcp", {"dp": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("src", SOURCES, ids=lambda s: f"tp{s[0]}pp{s[1]}dp{s[2]}ep{s[3]}")
def test_megatron_converts_to_deepspeed_and_dcp_bit_exact(megatron_checkpoint, tmp_path, src):
    tp, pp, dp, ep, moe = src
    ck = megatron_checkpoint(tp, pp, dp, ep=ep, moe=moe, global_batch_size=GBS)
    for fmt, kw in TARGETS:
        dst = tmp_path / f"{fmt}_{'_'.join(f'{k}{v}' for k, v in kw.items())}"
        outcome = convert(ck.path, dst, to=fmt, **kw)
        written = read_index(dst)
        back, step_problems = split_derived_steps(outcome.plan.source, written)
        assert step_problems == [], (fmt, kw)  # Megatron's group step, per parameter as torch Adam keeps it
        assert compare_indexes(outcome.plan.source, written) == [], (fmt, kw)  # checks the derived steps too
        kinds = {e.key.kind for e in back.entries}
        assert {Kind.EXP_AVG, Kind.EXP_AVG_SQ} <= kinds, (fmt, kinds)
        moments = {e.key.name for e in back.entries if e.key.kind is Kind.EXP_AVG}
        assert moments == {e.key.name for e in outcome.plan.source.entries if e.key.kind is Kind.EXP_AVG}


@pytest.mark.slow
@pytest.mark.parametrize("engine,fmt,kw", [("deepspeed", "deepspeed", {"dp": 2, "zero_stage": 1}),
                                          ("fsdp", "dcp", {"dp": 2})], ids=["deepspeed", "fsdp-dcp"])
def test_frameworks_resume_from_converted_megatron(megatron_checkpoint, workload_extensions_dir, tmp_path, engine,
                                                   fmt, kw):
    ck = megatron_checkpoint(2, 1, 1, global_batch_size=GBS)
    dst = tmp_path / fmt / ("step-2" if fmt == "dcp" else "")
    convert(ck.path, dst, to=fmt, **kw)
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
