"""Training Megatron-Core's GPTModel on Gloo through the CPU device adapter: TP, PP, TP x DP,
EP with MoE, DistributedOptimizer, torch_dist checkpoints Megatron-Core reloads, bit-identical resume."""
import json
import os

import pytest

from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL, launch
from migrate.workload.megatron_engine import check_sequence_parallel, resolve_load_dir, saved_adam_steps, transformer_config
from migrate.workload.model_spec import ModelSpec, RunSpec, TrainSpec


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


def test_sequence_parallel_is_refused_on_the_cpu_with_the_reason():
    spec = _spec(steps=1, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel with tp\(2\) on the CPU.*Transformer Engine or Apex"):
        check_sequence_parallel(spec, "cpu")
    check_sequence_parallel(spec, "cuda")


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
def test_virtual_pipeline_stages_run_the_interleaved_schedule(tmp_path):
    model = ModelSpec(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      vocab_size=128, seq_length=32)
    first = launch(_spec(model=model, steps=3, pp=2, vpp=2, save_dir=str(tmp_path)), 2)
    second = launch(_spec(model=model, steps=3, pp=2, vpp=2), 2)
    assert first[0].losses == second[0].losses and first[0].losses[-1] < first[0].losses[0]
    assert (tmp_path / "iter_0000003" / "metadata.json").is_file()
