"""Converting a Megatron-Core checkpoint of a model with tied input/output embeddings across layouts.

Megatron-Core keeps one embedding on the first pipeline stage and, at PP > 1, a copy for the output
layer on the last stage (its grads all-reduced with the embedding's, so equal weights and Adam state);
the checkpoint stores the copy under the embedding's key. Canonically the model has one tensor
(`embed_tokens.weight`, as DeepSpeed/HF store it). Checks on a real PP2 checkpoint: the reader finds the
copy in the last stage's optimizer bucket and gives one embedding (fp32 master == weights); converted to
TP2, to PP1 x DP2 and (fully reshardable) to PP2 it re-reads equal, Megatron-Core loads it, and its
losses continue the source's (fp32, first step rel <= 1e-6, second <= 1e-5).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.index import Kind, TensorKey
from checkpoint.materialize import iter_tensors
from checkpoint.verify import compare_indexes
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.megatron.state import iteration_dir
from migrate.workload.run_spec import RunSpec, TrainSpec

TIED = dataclasses.replace(TINY_LLAMA, tied_embeddings=True)
SOURCE = (1, 2)  # tp, pp


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """(checkpoint dir, spec, losses of steps 3-4 resumed at the source layout)."""
    tp, pp = SOURCE
    save = tmp_path_factory.mktemp("mcore_tied")
    spec = RunSpec(engine="megatron", model=TIED, train=TrainSpec(global_batch_size=8), steps=2, tp=tp, pp=pp,
                   distributed_optimizer=True, save_dir=str(save))
    launch(spec, tp * pp)
    path = iteration_dir(str(save), 2)
    want = launch(dataclasses.replace(spec, load_dir=path, save_dir=None, steps=4), tp * pp)[0].losses
    return path, spec, want


@pytest.mark.slow
def test_reader_gives_one_embedding(tied_checkpoint):
    path, _, _ = tied_checkpoint
    index = read_index(path)
    assert (index.meta["tp"], index.meta["pp"], index.meta["sharding"]) == (*SOURCE, "dp_reshardable")
    tensors = {e.key: t for e, t in iter_tensors(index)}
    names = {k.name for k in tensors}
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names
    for k in [k for k in tensors if k.kind is Kind.PARAM]:
        assert torch.equal(tensors[k], tensors[TensorKey(name=k.name, kind=Kind.MASTER)]), k


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 1, 2), (1, 2, 1)], ids=["tp2", "pp1dp2", "pp2"])
def test_tied_converts_and_megatron_resumes(tied_checkpoint, tmp_path, tp, pp, dp):
    path, spec, want = tied_checkpoint
    dst = tmp_path / "iter_0000002"
    outcome = convert(path, dst, to="megatron", target=LayoutRequest(dp=dp, tp=tp, pp=pp))
    back = read_index(dst)
    assert compare_indexes(outcome.plan.source, back) == []
    assert "lm_head.weight" not in {e.key.name for e in back.entries}
    losses = launch(dataclasses.replace(spec, tp=tp, pp=pp, load_dir=str(dst), save_dir=None, steps=4),
                    tp * pp * dp)[0].losses
    assert len(losses) == 2, losses
    assert abs(losses[0] - want[0]) / abs(want[0]) <= 1e-6, (losses, want)
    assert abs(losses[1] - want[1]) / abs(want[1]) <= 1e-5, (losses, want)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["deepspeed", "dcp"])
def test_untied_only_writers_refuse_a_tied_source_and_leave_nothing(tied_checkpoint, tmp_path, fmt):
    """DeepSpeed and DCP targets are written for untied models: a tied source is refused at plan time
    with the reason (not written with the output weight missing), and the destination stays absent."""
    from checkpoint.errors import PlanError

    path, _, _ = tied_checkpoint
    with pytest.raises(PlanError, match=rf"ties its input and output embeddings; the {fmt} writer writes untied"):
        convert(path, tmp_path / fmt, to=fmt)
    assert not (tmp_path / fmt).exists()


@pytest.mark.slow
def test_tied_source_becomes_a_tied_hf_model(tied_checkpoint, tmp_path):
    """HF holds tied models: one embedding, tie_word_embeddings in config.json; transformers ties lm_head to it."""
    import json

    from transformers import AutoModelForCausalLM

    path, _, _ = tied_checkpoint
    convert(path, tmp_path / "hf", to="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    embed = next(t for e, t in iter_tensors(read_index(path)) if e.key == TensorKey(name="embed_tokens.weight",
                                                                                      kind=Kind.PARAM))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, embed)
