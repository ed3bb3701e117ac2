"""HF-Trainer + DeepSpeed `checkpoint-N/` folders, as `transformers.Trainer` writes them, converted with no flags.

Sources are real Trainer runs of a `LlamaForCausalLM` (module names as transformers names them) under DeepSpeed
ZeRO-3 (fp32) and ZeRO-2 (bf16) at 2 processes. Judges are the frameworks' own loads: `Trainer.train(
resume_from_checkpoint=...)` at 3 processes (every fp32 master and Adam moment gathered by DeepSpeed equal to what
the source run held when it saved, its global step, scheduler position and Adam step), transformers'
`from_pretrained` (logits of DeepSpeed's own `zero_to_fp32` weights), Megatron-Core's load at TP2 and DCP's load into
an FSDP2-wrapped transformers model at 3 ranks.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.plan import summarize
from tests.hf_trainer_fixtures import CONFIG, SEQ, VOCAB, TrainerRun, save_trainer_checkpoint, trainer_resume

pytestmark = pytest.mark.slow

TIED_CONFIG = {"model_type": "llama", **CONFIG, "tie_word_embeddings": True}  # as Llama-3.2-1B and Qwen2.5-0.5B
RUNS = [TrainerRun(), TrainerRun(zero_stage=2, precision="bf16", trainer_scheduler=True)]
TIED = TrainerRun(config=json.dumps(TIED_CONFIG))


def _config(run: TrainerRun) -> dict:
    return {k: v for k, v in (json.loads(run.config) if run.config else CONFIG).items() if k != "model_type"}
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="session")
def trainer_checkpoint(tmp_path_factory):
    """run -> (checkpoint-N folder, the state DeepSpeed held at the save); each run trained once per session."""
    made: dict[TrainerRun, tuple] = {}

    def get(run: TrainerRun):
        if run not in made:
            made[run] = save_trainer_checkpoint(run, tmp_path_factory.mktemp(run.name))
        return made[run]

    return get


def _unequal(want: dict, got: dict) -> list:
    return [k for k in want if k not in got or want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]


RESUMES = [(RUNS[0], 3), (RUNS[1], 2), (RUNS[0], 2)]  # (source run, ZeRO stage of the resumed run)
# ZeRO-3 fp32 with DeepSpeed's WarmupLR; ZeRO-2 bf16 with the Trainer's own (torch) scheduler, which DeepSpeed holds


@pytest.mark.parametrize("run,stage", RESUMES, ids=[f"{r.name}-to-z{s}" for r, s in RESUMES])
def test_trainer_resumes_the_conversion_at_another_world_size(trainer_checkpoint, tmp_path, run, stage):
    """checkpoint-N at 2 processes -> DeepSpeed at 3 (ZeRO stage kept, or ZeRO-3 -> 2) with no other flag: the output
    is a checkpoint-N folder (engine files, trainer_state.json, config.json, an RNG file per process) that
    `Trainer.train(resume_from_checkpoint=...)` at 3 processes takes, restoring every master and moment bit for bit,
    step 3, the scheduler's position, and trains on."""
    src, reference = trainer_checkpoint(run)
    dst = tmp_path / "checkpoint-3"
    outcome = convert(src, dst, to="deepspeed", target=LayoutRequest(dp=3, zero_stage=None if stage == run.zero_stage else stage))
    names = sorted(p.name for p in dst.iterdir())
    for f in ("config.json", "generation_config.json", "trainer_state.json", "latest", "global_step3",
              "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"):
        assert f in names
    assert json.loads((dst / "trainer_state.json").read_text()) == json.loads((src / "trainer_state.json").read_text())
    # processes 0 and 1 keep theirs; process 2 takes the one state every source process holds (the Trainer seeds
    # them alike)
    assert [d["policy"] for d in outcome.plan.target.index.meta["trainer_rng"]] == ["carry", "carry", "replicate"]
    got = trainer_resume(dataclasses.replace(run, zero_stage=stage), dst, 3, tmp_path / "resumed")
    # DeepSpeed's WarmupLR counts from -1, the Trainer's own (torch) scheduler from 0
    assert (got["global_step"], got["scheduler"], got["adam_steps"]) == (3, 3 if run.trainer_scheduler else 2, [3.0])
    assert (dst / "scheduler.pt").is_file() == (src / "scheduler.pt").is_file()  # DeepSpeed keeps either in its own
    assert not _unequal(reference["state"], got["state"])
    assert len(got["loss"]) == 4 and all(torch.isfinite(torch.tensor(got["loss"])))


def megatron_layout(state: dict[tuple[str, str], torch.Tensor], *, heads: int, groups: int, tied: bool = False
                    ) -> dict[str, torch.Tensor]:
    """transformers-named (name, kind) tensors laid out as Megatron-Core's GPTModel keys them in a fully reshardable
    save (`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, layers stacked): QKV fused per query group (its
    heads' q rows, then k, then v), gate and up stacked into linear_fc1, the norms inside the linears they feed."""
    kinds = {"fp32_master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    layers = CONFIG["num_hidden_layers"]
    out = {}
    for kind, prefix in kinds.items():
        def t(name, kind=kind):
            return state[(name, kind)]

        def stacked(fn):
            return torch.stack([fn(f"model.layers.{i}.") for i in range(layers)])

        def qkv(p):
            q, k, v = t(p + "self_attn.q_proj.weight"), t(p + "self_attn.k_proj.weight"), t(p + "self_attn.v_proj.weight")
            hd = q.shape[0] // heads
            per = heads // groups
            return torch.cat([torch.cat([q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd],
                                         v[g * hd:(g + 1) * hd]]) for g in range(groups)])

        keys = {
            "embedding.word_embeddings.weight": t("model.embed_tokens.weight"),
            "output_layer.weight": None if tied else t("lm_head.weight"),
            "decoder.final_layernorm.weight": t("model.norm.weight"),
            "decoder.layers.self_attention.linear_qkv.weight": stacked(qkv),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked(lambda p: t(p + "input_layernorm.weight")),
            "decoder.layers.self_attention.linear_proj.weight": stacked(lambda p: t(p + "self_attn.o_proj.weight")),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": stacked(lambda p: t(p + "post_attention_layernorm.weight")),
            "decoder.layers.mlp.linear_fc1.weight": stacked(lambda p: torch.cat([t(p + "mlp.gate_proj.weight"),
                                                                                t(p + "mlp.up_proj.weight")])),
            "decoder.layers.mlp.linear_fc2.weight": stacked(lambda p: t(p + "mlp.down_proj.weight")),
        }
        if tied:  # Megatron-Core's output layer is the embedding at PP 1: no key of its own
            del keys["output_layer.weight"]
        out |= {f"optimizer.state.{prefix}.{k}": v for k, v in keys.items()}
    return out


def _hf_logits(state: dict[str, torch.Tensor], run: TrainerRun = RUNS[0]) -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**_config(run))).eval()
    model.load_state_dict(state, strict=not LlamaConfig(**_config(run)).tie_word_embeddings)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("run", [*RUNS, TIED], ids=[r.name for r in RUNS] + ["tied"])
def test_transformers_loads_the_hf_conversion_with_zero_to_fp32s_weights(trainer_checkpoint, tmp_path, run):
    """checkpoint-N -> HF with no flags: config.json from the folder, transformers' names; `from_pretrained` gives the
    logits of the weights DeepSpeed's own zero_to_fp32 recovers, every tensor equal to that recovery (in the model
    dtype: a bf16 run's weights are its masters cast, as the Trainer's own save_model would write them)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src, _ = trainer_checkpoint(run)
    dst = tmp_path / "hf"
    convert(src, dst, to="hf")
    fp32 = {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(src)).items()}
    saved = load_file(dst / "model.safetensors")
    dtype = torch.bfloat16 if run.precision == "bf16" else torch.float32
    if run is TIED:  # zero_to_fp32 gives the tied head under both names; save_pretrained writes the embedding only
        assert torch.equal(fp32.pop("lm_head.weight"), fp32["model.embed_tokens.weight"])
    assert sorted(saved) == sorted(fp32)
    assert not [k for k in fp32 if not torch.equal(saved[k], fp32[k].to(dtype))]
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(TOKENS).logits
    torch.testing.assert_close(got, _hf_logits({k: v.to(dtype).float() for k, v in fp32.items()}, run), rtol=0,
                               atol=0)


@pytest.mark.parametrize("run", [RUNS[0], TIED], ids=["untied", "tied"])
def test_megatron_core_loads_the_conversion_at_tp2(trainer_checkpoint, tmp_path, run):
    """checkpoint-N -> Megatron torch_dist at TP2 with no flags (architecture from config.json, names through the
    llama table): Megatron-LM's load at TP2 (its args checks, optimizer, scheduler) restores iteration 3, Adam's step
    3, the 12 samples consumed and every fp32 master and moment the Trainer run held (padded vocabulary rows zero),
    takes no RNG (none crosses frameworks), and its logits are transformers' for the same weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from checkpoint.model_shape import ModelShape
    from tests.megatron_lm_fixtures import MegatronLMRun, finetune_logits, load_megatron_lm, plain_state

    src, reference = trainer_checkpoint(run)
    dst = tmp_path / "megatron"
    outcome = convert(src, dst, to="megatron", target=LayoutRequest(tp=2))
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "3"
    plan = summarize(outcome.plan)
    assert "parameter names: hf -> canonical" in plan and "--override-opt_param-scheduler" in plan
    assert read_index(dst).meta["train_state"]["step"] == 3
    spec = ModelShape(architecture="llama", num_layers=CONFIG["num_hidden_layers"], hidden_size=CONFIG["hidden_size"],
                     ffn_hidden_size=CONFIG["intermediate_size"], num_attention_heads=CONFIG["num_attention_heads"],
                     num_query_groups=CONFIG["num_key_value_heads"], vocab_size=VOCAB,
                     seq_length=CONFIG["max_position_embeddings"],
                     make_vocab_size_divisible_by=128, norm_eps=CONFIG["rms_norm_eps"], rotary_base=10000.0,
                     tied_embeddings=run is TIED)
    # the user's own Megatron-LM schedule from the samples consumed (--override-opt_param-scheduler)
    megatron = MegatronLMRun(tp=2, model=spec, steps=3, global_batch_size=4, override_opt_param_scheduler=True)
    loaded = load_megatron_lm(megatron, dst, tmp_path / "loaded")
    assert {(r["iteration"], tuple(r["adam_steps"]), r["consumed_train_samples"], r["rng_loaded"])
            for r in loaded} == {(3, (3.0,), 12, False)}  # 3 steps of 2 processes x micro batch 2; no RNG crosses
    got = plain_state(tmp_path / "loaded")
    want = megatron_layout(reference["state"], heads=CONFIG["num_attention_heads"],
                           groups=CONFIG["num_key_value_heads"], tied=run is TIED)
    assert len(want) == 3 * (8 if run is TIED else 9) and set(want) <= set(got)
    rows = {k: got[k][:VOCAB] if k.endswith(("word_embeddings.weight", "output_layer.weight")) else got[k] for k in want}
    assert not _unequal(want, rows)
    assert all(not got[k][VOCAB:].any() for k in want if k.endswith(("word_embeddings.weight", "output_layer.weight")))
    logits = finetune_logits(megatron, dst, TOKENS)
    assert logits.shape[-1] == 256  # 97 rows padded to a multiple of 128 * tp
    want = _hf_logits(get_fp32_state_dict_from_zero_checkpoint(str(src)), run)
    torch.testing.assert_close(logits[..., :VOCAB], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[..., VOCAB:], torch.zeros_like(logits[..., VOCAB:]))


def test_dcp_load_into_fsdp2_transformers_model_restores_the_trainers_state(trainer_checkpoint, tmp_path):
    """checkpoint-N -> DCP at 3 ranks with no flags: transformers' module names are kept, so DCP's load into an
    FSDP2-wrapped LlamaForCausalLM + AdamW restores every master and moment the Trainer run held, and step 3."""
    from tests.framework_loads import dcp_loaded

    src, reference = trainer_checkpoint(RUNS[0])
    dst = tmp_path / "dcp"
    convert(src, dst, to="dcp", target=LayoutRequest(dp=3))
    loaded, steps = dcp_loaded({"hf_config": CONFIG}, dst, dp=3, precision="fp32")
    assert steps == [3.0]
    assert not _unequal(reference["state"], loaded)


def test_inspect_and_plan_name_the_trainer_state(trainer_checkpoint, tmp_path):
    """The reader finds transformers' names, config.json and the Trainer's files; the plan says what each RNG file
    of the target processes is."""
    src, _ = trainer_checkpoint(RUNS[0])
    index = read_index(src)
    assert index.meta["hf_config"]["model_type"] == "llama"
    assert index.meta["hf_trainer"]["trainer_state"]["global_step"] == 3
    assert len(index.meta["hf_trainer"]["rng"]) == 2
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(index.files)
    from click.testing import CliRunner

    from migrate.cli import main as cli

    shown = CliRunner().invoke(cli, ["inspect", str(src)])
    assert shown.exit_code == 0 and "hf trainer  global_step 3, config.json model_type llama, 2 RNG file(s)" in \
        shown.output
    outcome = convert(src, tmp_path / "dry", to="deepspeed", target=LayoutRequest(dp=4), dry_run=True)
    assert "rng" in summarize(outcome.plan).lower()
    assert not (tmp_path / "dry").exists()


def test_bad_trainer_files_are_one_line_naming_the_file(trainer_checkpoint, tmp_path):
    """A truncated trainer_state.json or an RNG file that would run code when unpickled is refused before anything
    is written, naming the file; the source is left as it was."""
    import pickle
    import shutil

    from checkpoint.errors import CheckpointError

    src, _ = trainer_checkpoint(RUNS[0])
    bad = tmp_path / "checkpoint-3"
    shutil.copytree(src, bad)
    (bad / "trainer_state.json").write_text('{"global_step": 3, "log_hist')
    with pytest.raises(CheckpointError, match=r"trainer_state.json: not valid JSON"):
        convert(bad, tmp_path / "out1", to="hf")
    shutil.copy(src / "trainer_state.json", bad / "trainer_state.json")

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"python": Payload()}, bad / "rng_state_1.pth", pickle_module=pickle)
    with pytest.raises(CheckpointError, match=r"rng_state_1.pth"):
        convert(bad, tmp_path / "out2", to="deepspeed", target=LayoutRequest(dp=3))
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
