"""Training Megatron-Core's GPTModel on Gloo through the CPU device adapter: TP, PP, TP x DP,
EP with MoE, DistributedOptimizer, torch_dist checkpoints Megatron-Core reloads, bit-identical resume."""
import dataclasses
import json
import os

import pytest

from checkpoint.model_shape import ModelShape
from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL, launch
from migrate.workload.megatron.engine import check_sequence_parallel, transformer_config
from migrate.workload.megatron.state import resolve_load_dir, saved_adam_steps
from migrate.workload.run_spec import RunSpec, TrainSpec


def _spec(model=TINY_LLAMA, **kw):
    return RunSpec(engine="megatron", model=model, train=TrainSpec(), **kw)


def test_transformer_config_maps_the_model_spec():
    config = transformer_config(TINY_MIXTRAL, _spec(TINY_MIXTRAL, steps=1, tp=2, ep=2, sequence_parallel=True), 4)
    assert (config.num_layers, config.hidden_size, config.num_query_groups) == (2, 64, 2)
    assert config.gated_linear_unit and config.normalization == "RMSNorm"
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    assert config.sequence_parallel and config.tensor_model_parallel_size == 2
    assert config.hidden_dropout == 0.0 and config.use_cpu_initialization


def test_saved_adam_steps_are_found_in_nested_optimizer_states():
    state = {"0": {"optimizer": {"param_groups": [{"step": 3}, {"step": 3}]}}, "1": {"param_groups": [{"step": 3}]}}
    assert saved_adam_steps(state) == {3}
    assert saved_adam_steps({"param_groups": [{"lr": 1.0}]}) == set()


def test_load_dir_resolution_names_what_is_missing(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    assert resolve_load_dir(str(tmp_path)).endswith("iter_0000006")
    with pytest.raises(FileNotFoundError, match="not a Megatron-Core dist checkpoint"):
        resolve_load_dir(str(tmp_path / "iter_0000006"))


def test_layout_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(ValueError, match=r"dp\(3\) = world_size\(6\) / \(tp\(2\) \* pp\(1\)\) is not divisible by ep\(2\)"):
        _spec(steps=1, tp=2, ep=2).data_parallel_size(6)


def test_sequence_parallel_layouts_are_checked_before_megatron_starts():
    check_sequence_parallel(_spec(steps=1, tp=2, sequence_parallel=True), "cpu")  # runs on the CPU now
    odd = dataclasses.replace(TINY_LLAMA, seq_length=30)
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide model.seq_length\(30\)"):
        check_sequence_parallel(_spec(model=odd, steps=1, tp=4, sequence_parallel=True), "cpu")
    with pytest.raises(ValueError, match=r"MoE with ep\(2\) and tp\(2\) needs sequence_parallel"):
        check_sequence_parallel(_spec(model=TINY_MIXTRAL, steps=1, tp=2, ep=2), "cuda")


def test_norms_are_torch_norms_marked_for_sequence_parallel():
    import torch

    from migrate.workload.megatron_norm import SequenceParallelTorchNorm

    config = transformer_config(TINY_LLAMA, _spec(steps=1, tp=2, sequence_parallel=True), 2)
    norm = SequenceParallelTorchNorm(config, 64, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    gpt = dataclasses.replace(TINY_LLAMA, architecture="gpt")
    plain = SequenceParallelTorchNorm(transformer_config(gpt, _spec(steps=1, tp=2), 2), 64)
    assert isinstance(plain, torch.nn.LayerNorm) and not any(p.sequence_parallel for p in plain.parameters())


def _tensor_layout(path):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), sorted(tuple(c.offsets) for c in v.chunks))
            for k, v in md.items() if hasattr(v, "chunks")}


SP_TOL = 1e-5  # fp32: sequence parallel reorders no reduction of the loss, but norm-grad sums differ in order


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2", "ep2xtp2-moe"])
def test_sequence_parallel_trains_like_tp_alone_and_resumes_bit_identically(tmp_path, megatron_checkpoint, case):
    """SP on Gloo: losses match the same layout without SP, the checkpoint has the same tensors and
    chunks, and a same-layout resume continues bit for bit."""
    world_size, layout, reference = {
        "tp2": (2, dict(tp=2), dict(tp=2, pp=1, dp=1)),
        "ep2xtp2-moe": (4, dict(tp=2, ep=2, model=TINY_MIXTRAL), dict(tp=1, pp=1, dp=2, ep=2, moe=True)),
    }[case]
    full = launch(_spec(steps=4, sequence_parallel=True, distributed_optimizer=True, save_dir=str(tmp_path),
                        save_every=2, **layout), world_size)
    losses = full[0].losses
    assert all(r.losses == losses for r in full) and losses[-1] < losses[0], losses
    without_sp = megatron_checkpoint(**reference)
    assert max(abs(a - b) for a, b in zip(losses, without_sp.losses)) < SP_TOL, (losses, without_sp.losses)
    if case == "tp2":
        assert _tensor_layout(tmp_path / "iter_0000002") == _tensor_layout(without_sp.path)

    resumed = launch(_spec(steps=4, sequence_parallel=True, distributed_optimizer=True,
                           load_dir=str(tmp_path / "iter_0000002"), **layout), world_size)
    assert resumed[0].start_step == 2 and resumed[0].losses == losses[2:]
    assert [m.grad_norm for m in resumed[0].metrics] == [m.grad_norm for m in full[0].metrics[2:]]


CASES = {
    "tp2": (2, dict(tp=2)),
    "pp2-1f1b": (2, dict(pp=2)),
    "tp2xdp2-distopt": (4, dict(tp=2, distributed_optimizer=True)),
    "ep2-moe-distopt": (2, dict(ep=2, distributed_optimizer=True, model=TINY_MIXTRAL)),
    "dp1": (1, dict(distributed_optimizer=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_trains_saves_torch_dist_and_resumes_bit_identically(tmp_path, case):
    world_size, layout = CASES[case]
    full = launch(_spec(steps=4, save_dir=str(tmp_path), save_every=2, **layout), world_size)
    losses = full[0].losses
    assert len(losses) == 4 and all(r.losses == losses for r in full)
    assert losses[-1] < losses[0], losses
    ckpt = tmp_path / "iter_0000002"
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (ckpt / "common.pt").is_file() and (ckpt / ".metadata").is_file()
    assert any(name.endswith(".distcp") for name in os.listdir(ckpt))
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4"

    resumed = launch(_spec(steps=4, load_dir=str(ckpt), **layout), world_size)
    assert resumed[0].start_step == 2
    assert resumed[0].losses == losses[2:]
    assert [m.grad_norm for m in resumed[0].metrics] == [m.grad_norm for m in full[0].metrics[2:]]


@pytest.mark.slow
def test_virtual_pipeline_stages_resume_bit_identically(tmp_path):
    """PP2 x vPP2 (interleaved 1F1B): both model chunks per rank saved in torch_dist, reloaded by dist_checkpointing."""
    model = ModelShape(architecture="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128, seq_length=32)
    full = launch(_spec(model=model, steps=4, pp=2, vpp=2, save_dir=str(tmp_path), save_every=2), 2)
    losses = full[0].losses
    assert all(r.losses == losses for r in full) and losses[-1] < losses[0], losses
    layout = _tensor_layout(tmp_path / "iter_0000002")
    fc2 = next(v for k, v in layout.items() if k.endswith("decoder.layers.mlp.linear_fc2.weight"))
    # Layers stacked on dim 0: each of the 2 x 2 (stage, virtual stage) chunks saved its own layer.
    assert fc2[0][0] == 4 and sorted({offsets[0] for offsets in fc2[1]}) == [0, 1, 2, 3], fc2
    resumed = launch(_spec(model=model, steps=4, pp=2, vpp=2, load_dir=str(tmp_path / "iter_0000002")), 2)
    assert resumed[0].start_step == 2 and resumed[0].losses == losses[2:]
    assert [m.grad_norm for m in resumed[0].metrics] == [m.grad_norm for m in full[0].metrics[2:]]
