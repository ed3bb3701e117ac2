"""Converting DeepSpeed ZeRO and FSDP2/DCP checkpoints into Megatron-Core torch_dist at TP2 and PP2.

The architecture comes from the checkpoint when the built-in engines wrote it (their client state /
DCP extra state holds the model shape), else from `--model-config` (an HF config.json or the job YAML's
model section); without either the conversion stops and names the option. Checks on real checkpoints:
the converted weights and Adam moments re-read equal to the source's (fp32 master from the fp32 params
where the source keeps none), Adam's step is the source's (per parameter there, per param group in
Megatron), Megatron-Core loads the result at the target layout and its loss on the next batch equals
the source framework's own resumed loss (fp32, rel <= 1e-6), and training continues.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.index import CheckpointIndex, Kind
from checkpoint.materialize import iter_tensors
from checkpoint.formats.megatron import source_arch
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import arch_from_config
from checkpoint.verify import compare_indexes
from migrate.cli import main as cli
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec

TINY_ARCH = ModelShape.from_dict(TINY_LLAMA.tensor_fields())  # what a checkpoint records
HF_TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": False}


def test_model_config_from_hf_and_job_yaml_sections():
    assert arch_from_config(HF_TINY_LLAMA) == TINY_ARCH
    job = {k: v for k, v in dataclasses.asdict(TINY_LLAMA).items() if k != "num_query_groups"} | {"query_groups": 2}
    assert arch_from_config(job) == TINY_LLAMA  # a job's model section is the whole shape
    assert arch_from_config({k: v for k, v in job.items() if k != "make_vocab_size_divisible_by"}) == \
        dataclasses.replace(TINY_LLAMA, make_vocab_size_divisible_by=128)  # the job schema's default
    mixtral = arch_from_config({**HF_TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 4})
    assert (mixtral.architecture, mixtral.num_experts) == ("mixtral", 4)
    starcoder2 = {"model_type": "starcoder2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 128, "use_bias": False}
    gpt = arch_from_config(starcoder2)
    assert (gpt.architecture, gpt.ffn_hidden_size, gpt.num_query_groups, gpt.tied_embeddings) == ("gpt", 256, 2, True)
    with pytest.raises(CheckpointFormatError, match="use_bias=True"):  # Starcoder2's default: linear biases
        arch_from_config({k: v for k, v in starcoder2.items() if k != "use_bias"})
    with pytest.raises(CheckpointFormatError, match="'gpt2' has no Megatron rules"):  # learned positions, Conv1D
        arch_from_config({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128})


def test_model_config_file_is_an_hf_config_or_a_job_yaml(tmp_path):
    from pathlib import Path

    from migrate.commands.convert import read_model_config

    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(HF_TINY_LLAMA))
    assert arch_from_config(read_model_config(hf)) == TINY_ARCH
    demo = arch_from_config(read_model_config(Path(__file__).parents[2] / "configs" / "demo_cpu.yaml"))
    assert demo == dataclasses.replace(TINY_LLAMA, make_vocab_size_divisible_by=8)  # the job's model section


def test_missing_architecture_names_the_option():
    index = CheckpointIndex(format="deepspeed", root="/ckpt/global_step2", entries=(), files=(),
                            meta={"train_state": {"step": 2, "client": {}}})
    with pytest.raises(PlanError, match="--model-config FILE"):
        source_arch(index)
    assert source_arch(index, HF_TINY_LLAMA) == TINY_ARCH
    saved = CheckpointIndex(format="deepspeed", root="/ckpt", entries=(), files=(),
                            meta={"train_state": {"client": {"migrate": {"model": dataclasses.asdict(TINY_LLAMA)}}}})
    assert source_arch(saved) == TINY_LLAMA  # the engine saves the whole shape
    with pytest.raises(PlanError, match="disagrees"):
        source_arch(saved, {**HF_TINY_LLAMA, "num_hidden_layers": 4})


def _source(kind, deepspeed_checkpoint, fsdp_checkpoint):
    return deepspeed_checkpoint(2, 1) if kind == "deepspeed" else fsdp_checkpoint(2)


def _source_steps(index: CheckpointIndex) -> set[float]:
    return {t.item() for e, t in iter_tensors(index) if e.key.kind is Kind.STEP} or {float(index.meta["global_steps"])}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepspeed", "fsdp"])
def test_frameworks_convert_to_megatron_and_megatron_resumes(deepspeed_checkpoint, fsdp_checkpoint,
                                                            workload_extensions_dir, tmp_path, kind):
    ck = _source(kind, deepspeed_checkpoint, fsdp_checkpoint)
    load = ck.path
    want = launch(dataclasses.replace(ck.spec, load_dir=str(load), save_dir=None, steps=4), ck.world_size)[0].losses
    source = read_index(load)
    for tp, pp in ((2, 1), (1, 2)):
        dst = tmp_path / f"tp{tp}pp{pp}" / "iter_0000002"
        outcome = convert(load, dst, to="megatron", target=LayoutRequest(dp=1, tp=tp, pp=pp))
        back = read_index(dst)
        assert (back.meta["tp"], back.meta["pp"], ModelShape.from_dict(back.meta["arch"])) == (tp, pp, TINY_ARCH)
        assert compare_indexes(outcome.plan.source, back) == [], (kind, tp, pp)
        assert {Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ} <= {e.key.kind for e in back.entries}
        group_steps = {pg["step"] for g in back.meta["optimizer_groups"] for pg in g["param_groups"]}
        assert group_steps == _source_steps(source) == {2.0}, (group_steps, kind)
        spec = RunSpec(engine="megatron", model=ck.spec.model, train=ck.spec.train, steps=4, tp=tp, pp=pp,
                       distributed_optimizer=True, load_dir=str(dst))
        losses = launch(spec, tp * pp)[0].losses
        assert len(losses) == 2, losses
        assert abs(losses[0] - want[0]) / abs(want[0]) <= 1e-6, (kind, tp, pp, losses, want)
        assert abs(losses[1] - want[1]) / abs(want[1]) <= 1e-5, (kind, tp, pp, losses, want)


@pytest.mark.slow
def test_cli_model_config_is_checked_against_the_checkpoint(deepspeed_checkpoint, tmp_path):
    ck = deepspeed_checkpoint(2, 1)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_TINY_LLAMA))
    ok = CliRunner().invoke(cli, ["convert", str(ck.path), str(tmp_path / "out"), "--to", "megatron", "--tp", "2",
                                  "--model-config", str(config), "--verify"])
    assert ok.exit_code == 0, ok.output
    assert "every tensor equals the source" in ok.output
    config.write_text(json.dumps({**HF_TINY_LLAMA, "num_hidden_layers": 4}))
    bad = CliRunner().invoke(cli, ["convert", str(ck.path), str(tmp_path / "bad"), "--to", "megatron",
                                   "--model-config", str(config)])
    assert bad.exit_code == 2 and "disagrees" in bad.output, bad.output
