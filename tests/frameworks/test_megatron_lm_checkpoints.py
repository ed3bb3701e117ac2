"""Checkpoints as Megatron-LM writes them, converted with no extra flags, judged by Megatron-LM's load decisions.

Sources are written by `tests/megatron_lm_fixtures.py` following `megatron/training/checkpointing.py` for
`--ckpt-format torch_dist` and for the legacy `torch` format (args
Namespace, content_metadata, opt_param_scheduler, NumPy RNG state, fully parallel save, tracker file; no entry
of ours). Each conversion is loaded at the target layout the way `load_checkpoint` does it (tracker, args, the
sharding type from content_metadata, RNG only at the saved TP/PP) and every weight, fp32 main param, both Adam
moments (Megatron-Core's own `load_plain_tensors` of the loaded state) must equal the source's bit for bit; the
iteration, Adam step, scheduler, consumed samples and FLOP count must be carried, and the args the target
loader reads must describe the target layout.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import CheckpointError, PlanError
from checkpoint.index import Kind
from checkpoint.materialize import iter_tensors
from checkpoint.plan import summarize
from tests.cli_process import run_migrate
from tests.megatron_lm_fixtures import (FLOPS_SO_FAR, MegatronLMRun, load_megatron_lm, megatron_logits, plain_state,
                                       save_megatron_lm)

pytestmark = pytest.mark.slow

DP2 = MegatronLMRun(dp=2)
TP2_BF16 = MegatronLMRun(tp=2, precision="bf16")
PP2_FULLY = MegatronLMRun(pp=2, sharding="fully_reshardable")
EP2_MOE = MegatronLMRun(dp=2, ep=2, moe=True)
BUCKETS = MegatronLMRun(tp=2, dp=2, bucket_size=6000)  # --overlap-grad-reduce --ddp-bucket-size 6000
PLAIN = MegatronLMRun(dp=2, distributed_optimizer=False)
GPT_TP2 = MegatronLMRun(tp=2, gpt=True)  # GELU + LayerNorm
LEGACY_DP2 = MegatronLMRun(dp=2, ckpt_format="torch")  # --ckpt-format torch: mp_rank_* dirs, distrib_optim.pt
LEGACY_TP2_BF16 = MegatronLMRun(tp=2, precision="bf16", ckpt_format="torch")
LEGACY_EP2_MOE = MegatronLMRun(dp=2, ep=2, moe=True, ckpt_format="torch")

# (source, target layout (tp, pp, dp, ep), target format): every axis grown and shrunk, world sizes 1 to 4, both
# sharding types, both checkpoint formats each way
CASES = [
    (DP2, (2, 1, 1, 1), "megatron"),
    (DP2, (1, 2, 2, 1), "megatron"),
    (TP2_BF16, (1, 2, 1, 1), "megatron"),
    (PP2_FULLY, (2, 1, 2, 1), "megatron"),
    (EP2_MOE, (1, 1, 1, 1), "megatron"),
    (TP2_BF16, (1, 1, 2, 1), "megatron-legacy"),
    (LEGACY_DP2, (2, 1, 1, 1), "megatron-legacy"),
    (LEGACY_TP2_BF16, (1, 2, 2, 1), "megatron"),
    (LEGACY_EP2_MOE, (1, 1, 1, 1), "megatron-legacy"),
]


@pytest.fixture(scope="session")
def megatron_lm_checkpoint(tmp_path_factory):
    """`get(run)` -> (save dir written as Megatron-LM does, per-rank save results); once per run per session."""
    cache: dict[MegatronLMRun, tuple[Path, list]] = {}

    def get(run: MegatronLMRun) -> tuple[Path, list]:
        if run not in cache:
            save_dir = tmp_path_factory.mktemp(f"mlm_{run.name}")
            cache[run] = save_dir, save_megatron_lm(run, save_dir)
        return cache[run]

    return get


@pytest.fixture(scope="session")
def source_truth(megatron_lm_checkpoint):
    cache: dict[MegatronLMRun, dict[str, torch.Tensor]] = {}

    def get(run: MegatronLMRun) -> dict[str, torch.Tensor]:
        if run not in cache:
            cache[run] = plain_state(megatron_lm_checkpoint(run)[0] / "reference")
        return cache[run]

    return get


def _name(case) -> str:
    run, (tp, pp, dp, ep), to = case
    return f"{run.name}-to-{to}-tp{tp}pp{pp}dp{dp}ep{ep}"


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_megatron_lm_loads_the_conversion_with_every_state_equal(megatron_lm_checkpoint, source_truth, tmp_path,
                                                                 case):
    run, (tp, pp, dp, ep), to = case
    src, saved = megatron_lm_checkpoint(run)
    dst = tmp_path / "converted"
    convert(src, dst, to=to, target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep))
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == str(run.steps)
    legacy = to == "megatron-legacy"
    target = MegatronLMRun(tp=tp, pp=pp, dp=dp, ep=ep, moe=run.moe, precision=run.precision, steps=run.steps,
                           ckpt_format="torch" if legacy else "torch_dist")
    loaded = load_megatron_lm(target, dst, tmp_path / "loaded")
    first = loaded[0]
    assert first["sharding"] == ("legacy" if legacy else "fully_reshardable")
    assert first["ckpt_args_layout"] == (tp, pp, dp, tp * pp * dp)  # what Megatron-LM compares with its run
    assert all(r["rng_loaded"] for r in loaded)  # args name the target's TP/PP, so the RNG state is restored
    for r in loaded:
        assert (r["iteration"], r["tracker_iteration"]) == (run.steps, run.steps)
        assert r["consumed_train_samples"] == run.steps * run.global_batch_size
        assert r["flops"] == FLOPS_SO_FAR
        assert r["adam_steps"] == saved[0]["adam_steps"] == [float(run.steps)]
        assert r["scheduler_num_steps"] == saved[0]["scheduler_num_steps"]
    truth, got = source_truth(run), plain_state(tmp_path / "loaded")
    assert sorted(got) == sorted(truth)
    unequal = [k for k in truth if truth[k].dtype != got[k].dtype or not torch.equal(truth[k], got[k])]
    assert not unequal, f"differ from the source after Megatron-LM's load at the target: {unequal}"


def test_several_grad_buckets_are_read_and_loaded_by_megatron_lm(megatron_lm_checkpoint, tmp_path):
    """--overlap-grad-reduce with a small --ddp-bucket-size: six buckets per grad buffer. Megatron-Core 0.16.1's own
    fully reshardable save of such a bucketed optimizer is wrong ("param range exceeds unpadded buffer ... data
    corruption"), so the source's truth here is its model weights (Megatron-Core's `load_plain_tensors`) and the
    optimizer invariant fp32 main param == fp32 weight after a step; Adam's moments sit at the offsets the
    params prove and must survive Megatron-LM's load of the conversion bit for bit."""
    src, _ = megatron_lm_checkpoint(BUCKETS)
    index = read_index(src)
    assert index.meta["bucket_size"] == 6000 and index.meta["sharding"] == "dp_reshardable"
    ours = {(e.key.name, e.key.kind): t for e, t in iter_tensors(index)}
    params = {name for name, kind in ours if kind is Kind.PARAM}
    assert all(torch.equal(ours[(n, Kind.MASTER)], ours[(n, Kind.PARAM)]) for n in params)
    truth = plain_state(src / "iter_0000002")
    assert torch.equal(ours[("embed_tokens.weight", Kind.PARAM)], truth["embedding.word_embeddings.weight"])
    dst = tmp_path / "converted"
    convert(src, dst, to="megatron", target=LayoutRequest(dp=2, tp=1))
    loaded = load_megatron_lm(MegatronLMRun(tp=1, dp=2), dst, tmp_path / "loaded")
    assert all(r["rng_loaded"] for r in loaded) and loaded[0]["adam_steps"] == [2.0]
    got = plain_state(tmp_path / "loaded")
    back = {(e.key.name, e.key.kind): t for e, t in iter_tensors(read_index(dst))}
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert torch.equal(got["optimizer.state.exp_avg.embedding.word_embeddings.weight"],
                       ours[("embed_tokens.weight", Kind.EXP_AVG)])
    assert torch.equal(got["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"][1],
                       ours[("layers.1.mlp.down_proj.weight", Kind.EXP_AVG_SQ)])
    assert torch.equal(got["optimizer.state.param.output_layer.weight"], truth["output_layer.weight"])


def test_plain_optimizer_becomes_a_distributed_one_megatron_lm_loads(megatron_lm_checkpoint, source_truth, tmp_path):
    """Without --use-distributed-optimizer Megatron-Core saves Adam's moments per model key and the step as
    `common_step`; the conversion is a distributed-optimizer checkpoint (fp32 main params = the fp32 weights)."""
    src, _ = megatron_lm_checkpoint(PLAIN)
    dst = tmp_path / "converted"
    convert(src, dst, to="megatron", target=LayoutRequest(dp=1, tp=2))
    loaded = load_megatron_lm(MegatronLMRun(tp=2), dst, tmp_path / "loaded")
    assert all(r["adam_steps"] == [2.0] and r["rng_loaded"] for r in loaded)
    truth, got = source_truth(PLAIN), plain_state(tmp_path / "loaded")
    shared = set(truth) - {"optimizer.state.common_step"}
    assert shared <= set(got) and all(torch.equal(truth[k], got[k]) for k in shared)
    mains = [k for k in got if k.startswith("optimizer.state.param.")]
    assert mains and all(torch.equal(got[k], truth[k.removeprefix("optimizer.state.param.")]) for k in mains)


def test_megatron_lm_refuses_the_source_at_another_tp_but_not_the_conversion(megatron_lm_checkpoint, tmp_path):
    """Why the target must be rewritten: a dp_reshardable source at another TP is refused by Megatron-LM."""
    src, _ = megatron_lm_checkpoint(DP2)
    with pytest.raises(Exception, match="not supported for DistributedOptimizer with sharding type dp_reshardable"):
        load_megatron_lm(MegatronLMRun(tp=2), src, tmp_path / "never")


@pytest.mark.parametrize("run,fmt,sharding", [(TP2_BF16, "megatron", "dp_reshardable"),
                                              (LEGACY_TP2_BF16, "megatron-legacy", "dp_zero")])
def test_inspect_shows_architecture_and_layout_from_args(megatron_lm_checkpoint, run, fmt, sharding):
    src, _ = megatron_lm_checkpoint(run)
    out = run_migrate(["inspect", str(src), "--json"], check=True)
    info = json.loads(out.stdout)
    assert info["format"] == fmt and info["layout"]["tp"] == 2 and info["layout"]["dp"] == 1
    assert info["global_step"] == 2 and info["model_dtype"] == "bfloat16"
    assert info["optimizer_sharding"] == sharding
    args = info["megatron_args"]
    assert args["num_layers"] == 2 and args["num_query_groups"] == 2 and args["normalization"] == "RMSNorm"
    assert args["params_dtype"] == "bfloat16" and args["consumed_train_samples"] == 16
    assert info["architecture"]["architecture"] == "llama" and info["architecture"]["vocab_size"] == 128
    text = run_migrate(["inspect", str(src)], check=True).stdout
    assert "megatron-lm" in text and "num_query_groups=2" in text and sharding in text


@pytest.mark.parametrize("run", [TP2_BF16, LEGACY_TP2_BF16], ids=["torch_dist", "legacy"])
def test_args_are_read_without_importing_megatron_and_written_as_its_own_classes(megatron_lm_checkpoint, run,
                                                                                  tmp_path):
    """Megatron-LM's args hold Megatron-Core's enums (and may hold its optimizer config): read and converted
    through stand-ins, in a process that never imports megatron (Megatron-Core's package imports its layers,
    ~5 s of `migrate inspect`), and written back as Megatron-Core's own classes, the same members."""
    import enum

    src, _ = megatron_lm_checkpoint(run)
    dst = tmp_path / "tp1"
    code = ("import sys; from checkpoint.api import LayoutRequest, convert, read_index; read_index(sys.argv[1]); "
            "convert(sys.argv[1], sys.argv[2], to='megatron', target=LayoutRequest(tp=1, dp=2)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')))")
    out = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-3000:]
    source_file = src / "iter_0000002" / ("common.pt" if run is TP2_BF16 else "mp_rank_00/model_optim_rng.pt")
    source_args = torch.load(source_file, weights_only=False)["args"]
    written = torch.load(dst / "iter_0000002" / "common.pt", weights_only=False)["args"]
    members = {k: v for k, v in vars(source_args).items() if isinstance(v, enum.Enum)}
    assert {type(v).__module__.split(".")[0] for v in members.values()} >= {"megatron"}, members
    assert {k: getattr(written, k) for k in members} == members


def test_unknown_unpadded_vocab_refuses_a_tp_that_pads_differently(megatron_lm_checkpoint, tmp_path):
    src, _ = megatron_lm_checkpoint(DP2)
    with pytest.raises(PlanError, match=r"padded_vocab_size=128 but not the unpadded vocab size; at tp=4"):
        convert(src, tmp_path / "tp4", to="megatron", target=LayoutRequest(dp=1, tp=4))
    assert not (tmp_path / "tp4").exists()


def test_model_config_overrides_args_and_names_each_field(megatron_lm_checkpoint):
    src, _ = megatron_lm_checkpoint(DP2)
    hf = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
    index = read_index(src, model_config=hf)
    assert index.meta["arch_overrides"] == ["vocab_size: 128 -> 100"]
    assert index.by_key()  # the tensors are indexed with the unpadded vocabulary
    assert {e.shape for e in index.entries if e.key.name == "embed_tokens.weight"} == {(100, 64)}


def _with_args(src: Path, dst: Path, **changes) -> Path:
    """A copy of `src`'s iteration directory whose args have `changes` (the source is never touched)."""
    shutil.copytree(src / "iter_0000002", dst)
    common = torch.load(dst / "common.pt", weights_only=False)
    for field, value in changes.items():
        setattr(common["args"], field, value)
    torch.save(common, dst / "common.pt")
    return dst


@pytest.mark.parametrize("field,value,named", [
    ("add_bias_linear", True, "add_bias_linear=True (linear-layer biases)"),
    ("position_embedding_type", "learned_absolute", "position_embedding_type='learned_absolute'"),
    ("multi_latent_attention", True, "multi_latent_attention=True (multi-latent attention outside a SwiGLU MoE model"),
    ("num_layers", None, "Megatron-LM args lack num_layers"),
    ("world_size", 3, "data_parallel_size=2 but world_size=3 / (tp=1 * pp=1 * cp=1) = 3"),
])
def test_args_the_rules_do_not_map_are_named(megatron_lm_checkpoint, tmp_path, field, value, named):
    src, _ = megatron_lm_checkpoint(DP2)
    copy = _with_args(src, tmp_path / "copy", **{field: value})
    with pytest.raises(CheckpointError, match=re.escape(named)):
        read_index(copy)


def test_cli_names_the_unmapped_field_in_one_line(megatron_lm_checkpoint, tmp_path):
    src, _ = megatron_lm_checkpoint(DP2)
    copy = _with_args(src, tmp_path / "copy", add_bias_linear=True)
    out = run_migrate(["convert", str(copy), str(tmp_path / "out"), "--to", "hf"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "add_bias_linear=True" in out.stderr and str(copy / "common.pt") in out.stderr
    assert not (tmp_path / "out").exists()


# (source, target format, target layout): DeepSpeed ZeRO 1 and 3 and DCP at world sizes 2 and 3, fp32 and bf16,
# torch_dist and legacy sources
OTHER_CASES = [(DP2, "deepspeed", {"dp": 2, "zero_stage": 1}), (TP2_BF16, "deepspeed", {"dp": 3, "zero_stage": 3}),
               (LEGACY_TP2_BF16, "dcp", {"dp": 2}), (PP2_FULLY, "dcp", {"dp": 3})]


@pytest.mark.parametrize("run,to,options", OTHER_CASES, ids=[f"{r.name}-to-{t}-{'-'.join(f'{k}{v}' for k, v in o.items())}"
                                                             for r, t, o in OTHER_CASES])
def test_deepspeed_and_dcp_load_the_conversion_with_every_state_equal(megatron_lm_checkpoint, tmp_path, run, to,
                                                                      options):
    """Megatron-LM's checkpoint -> DeepSpeed / DCP with no flags: DeepSpeed's `load_checkpoint` (or DCP's load into
    FSDP2 + AdamW) at the target world size restores every weight, fp32 master, both Adam moments and the step of
    the source (as its reader gives them; the reader is Megatron-Core-exact by the tests above) bit for bit."""
    from tests.framework_loads import dcp_loaded, deepspeed_loaded

    src, _ = megatron_lm_checkpoint(run)
    dst = tmp_path / to
    convert(src, dst, to=to, target=LayoutRequest(**options))
    truth = {(e.key.name, str(e.key.kind)): t for e, t in iter_tensors(read_index(src))}
    model = run.spec().model
    if to == "deepspeed":
        loaded, steps = deepspeed_loaded(model, dst, precision=run.precision, **options)
    else:
        loaded, steps = dcp_loaded(model, dst, precision=run.precision, **options)
    assert steps == [float(run.steps)]
    names = {n for n, k in truth if k == "param"}
    assert {n for n, _ in loaded} == names
    # DeepSpeed's bf16 module holds every weight in bf16 (the source keeps its norms in fp32): its weights are the
    # source's in the module's dtype; masters and moments keep theirs
    want = {key: truth[key].to(tensor.dtype) if key[1] == "param" else truth[key] for key, tensor in loaded.items()}
    unequal = [key for key, tensor in loaded.items()
               if want[key].dtype != tensor.dtype or not torch.equal(want[key], tensor)]
    assert not unequal, f"{to} loads these unlike the source: {unequal}"


HF_CASES = [(DP2, "LlamaForCausalLM"), (TP2_BF16, "LlamaForCausalLM"), (EP2_MOE, "MixtralForCausalLM"),
            (GPT_TP2, "Starcoder2ForCausalLM"), (LEGACY_TP2_BF16, "LlamaForCausalLM")]


@pytest.mark.parametrize("run,model_class", HF_CASES, ids=[r.name for r, _ in HF_CASES])
def test_transformers_loads_the_hf_conversion_and_gives_megatron_logits(megatron_lm_checkpoint, tmp_path, run,
                                                                        model_class):
    """Megatron-LM's checkpoint -> HF with no flags: `from_pretrained` takes the folder (config.json from the run's
    args, shards with their index) and its logits are Megatron-Core's own for the same tokens; every weight is
    stored in its own dtype with its bits (bf16 too) and loaded as transformers casts it to config.json's dtype."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src, _ = megatron_lm_checkpoint(run)
    dst = tmp_path / "hf"
    convert(src, dst, to="hf", max_shard_size="60KB")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((dst / f).is_file() for f in shards)
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == [model_class] and config["dtype"] == {"fp32": "float32"}.get(
        run.precision, "bfloat16")
    args = read_index(src).meta["megatron_args"]
    eps_key = "norm_epsilon" if run.gpt else "rms_norm_eps"
    assert config[eps_key] == args["norm_epsilon"] and config["rope_parameters"]["rope_theta"] == args["rotary_base"]
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert type(model).__name__ == model_class
    stored = {k: v for f in shards for k, v in load_file(dst / f).items()}
    native = AutoModelForCausalLM.from_pretrained(dst)  # in the dtype config.json names
    for name, tensor in native.state_dict().items():
        if name in stored:
            assert torch.equal(tensor, stored[name].to(tensor.dtype)), name
    assert {str(t.dtype) for t in stored.values()} >= {f"torch.{config['dtype']}"}
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens).logits
    # the legacy files load only at their own TP: Megatron-Core's forward runs on the same state saved beside them
    want = megatron_logits(run, src / "reference" if run.ckpt_format == "torch" else src, tokens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_numpy_in_megatron_lm_files_loads_only_as_plain_arrays(megatron_lm_checkpoint, tmp_path):
    """NumPy's RNG state (what Megatron-LM's get_rng_state saves) loads with weights_only; an object array, which
    could carry any pickle, is refused naming the file and never runs."""
    import numpy as np

    from checkpoint.errors import UntrustedCheckpointError
    from tests.frameworks.test_security_payloads import Payload

    src, _ = megatron_lm_checkpoint(DP2)
    plain = _with_args(src, tmp_path / "plain", extra_rng=np.random.get_state(), ranks=np.arange(4, dtype=np.int64))
    assert read_index(plain).meta["megatron_args"]["num_layers"] == 2
    marker = tmp_path / "ran"
    planted = _with_args(src, tmp_path / "planted", extra=np.array([Payload(marker)], dtype=object))
    with pytest.raises(UntrustedCheckpointError, match=re.escape(str(planted / "common.pt"))):
        read_index(planted)
    out = run_migrate(["inspect", str(planted)])
    assert out.returncode == 2 and "Traceback" not in out.stderr and not marker.exists()
    objects = _with_args(src, tmp_path / "objects", extra=np.array([1, "a"], dtype=object))  # no global named
    with pytest.raises(UntrustedCheckpointError, match="ObjectDType"):
        read_index(objects)


@pytest.mark.parametrize("run", [DP2, TP2_BF16], ids=[DP2.name, TP2_BF16.name])
def test_megatron_lm_to_an_hf_trainer_checkpoint_that_trainer_resumes(megatron_lm_checkpoint, tmp_path, run):
    """Megatron-LM -> DeepSpeed ZeRO-3 at dp 2 with --param-names hf: transformers' names in LlamaForCausalLM's
    parameter order (ZeRO flattens in that order), config.json from the run's args and a trainer_state.json, so
    `Trainer.train(resume_from_checkpoint=...)` (its DeepSpeed integration, WarmupLR from the config) resumes from
    it: every fp32 master and both Adam moments the source holds, its step and the scheduler position."""
    from checkpoint.rules.names import rename
    from tests.hf_trainer_fixtures import TrainerRun, trainer_resume

    src, _ = megatron_lm_checkpoint(run)
    dst = tmp_path / f"checkpoint-{run.steps}"
    outcome = convert(src, dst, to="deepspeed", target=LayoutRequest(dp=2, zero_stage=3), param_names="hf")
    assert "parameter names: canonical -> hf" in summarize(outcome.plan)
    config = (dst / "config.json").read_text()
    assert json.loads(config)["model_type"] == "llama"
    assert json.loads((dst / "trainer_state.json").read_text())["global_step"] == run.steps
    truth = {(rename(e.key.name, "llama", src="canonical", dst="hf"), str(e.key.kind)): t
             for e, t in iter_tensors(read_index(src)) if e.key.kind in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)}
    got = trainer_resume(TrainerRun(steps=run.steps, config=config, precision=run.precision), dst, 2,
                         tmp_path / "resumed")
    assert (got["global_step"], got["scheduler"], got["adam_steps"]) == (run.steps, run.steps - 1, [float(run.steps)])
    assert sorted(got["state"]) == sorted(truth)
    unequal = [k for k in truth if not torch.equal(truth[k], got["state"][k])]
    assert not unequal, f"the Trainer resumes these unlike the Megatron-LM run: {unequal}"
