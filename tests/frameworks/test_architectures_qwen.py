"""Qwen2 (QKV biases), Qwen3 (per-head QK RMSNorm) and Qwen3-MoE (Qwen3 attention, routed experts narrower than
the dense FFN) checkpoints, as Megatron-LM writes them, across layouts.

Each family is Megatron-Core's own GPTModel with the matching switches (`add_qkv_bias`, `qk_layernorm`,
`num_moe_experts` with `moe_ffn_hidden_size`), trained on
Gloo ranks and saved the way Megatron-LM's `checkpointing.py` does (tests/megatron_lm_fixtures.py). Its args alone
say the architecture. Converted across TP, PP, EP and DP (world sizes 1 to 4, both checkpoint formats), the result is
loaded by Megatron-LM's load path at the target layout with every weight, fp32 master and Adam state equal to the
source's; converted to HF, transformers' `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` takes the
folder and gives
Megatron-Core's own logits. A transformers-saved Qwen model converts the other way, and Megatron-Core's forward at
TP 2 gives transformers' logits.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from tests.cli_process import run_migrate
from tests.megatron_lm_fixtures import (LLAMA, MegatronLMRun, assert_megatron_gives_hf_logits, load_megatron_lm,
                                      megatron_logits, plain_state, saved_runs)

pytestmark = pytest.mark.slow

QWEN2 = dataclasses.replace(LLAMA, architecture="qwen2", rotary_base=1000000.0, norm_eps=1e-6)
QWEN3 = dataclasses.replace(LLAMA, architecture="qwen3", rotary_base=1000000.0, norm_eps=1e-6)
QWEN3_MOE = dataclasses.replace(QWEN3, architecture="qwen3_moe", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48)
MODELS = {"qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}
RUNS = {"qwen2": MegatronLMRun(tp=2, model=QWEN2), "qwen3": MegatronLMRun(tp=2, model=QWEN3),
        "qwen3_moe": MegatronLMRun(dp=2, ep=2, model=QWEN3_MOE)}
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# (family, target layout (tp, pp, dp, ep), target format): TP and EP shrunk, PP and DP grown, both Megatron formats
CASES = [("qwen2", (1, 2, 2, 1), "megatron"), ("qwen2", (1, 1, 2, 1), "megatron-legacy"),
         ("qwen3", (1, 2, 1, 1), "megatron"), ("qwen3", (1, 1, 2, 1), "megatron-legacy"),
         ("qwen3_moe", (1, 1, 1, 1), "megatron"), ("qwen3_moe", (1, 2, 2, 2), "megatron"),
         ("qwen3_moe", (1, 1, 1, 1), "megatron-legacy")]


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory):
    """`get(family)` -> (save dir written as Megatron-LM does, save results, the source's truth); once per family."""
    return saved_runs(tmp_path_factory, RUNS, "mlm_")


@pytest.mark.parametrize("family,layout,to", CASES,
                         ids=[f"{f}-to-{t}-tp{a}pp{b}dp{c}ep{d}" for f, (a, b, c, d), t in CASES])
def test_megatron_lm_loads_the_qwen_conversion_with_every_state_equal(qwen_checkpoint, tmp_path, family, layout, to):
    src, saved, truth = qwen_checkpoint(family)
    index = read_index(src)
    assert index.meta["arch"]["architecture"] == family  # from the args' add_qkv_bias / qk_layernorm alone
    extra = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight",
             "qwen3_moe": "mlp.experts.3.down_proj.weight"}[family]
    names = {e.key.name: e.shape for e in index.entries}
    assert f"layers.1.{extra}" in names
    if family == "qwen3_moe":  # the experts' own width, not the dense FFN's
        assert names["layers.1.mlp.experts.3.down_proj.weight"] == (64, 48)
    tp, pp, dp, ep = layout
    dst = tmp_path / "converted"
    convert(src, dst, to=to, target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep))
    run = RUNS[family]
    target = dataclasses.replace(run, tp=tp, pp=pp, dp=dp, ep=ep, ckpt_format="torch" if to == "megatron-legacy" else
                                 "torch_dist")
    loaded = load_megatron_lm(target, dst, tmp_path / "loaded")
    assert all(r["adam_steps"] == saved[0]["adam_steps"] == [float(run.steps)] for r in loaded)
    got = plain_state(tmp_path / "loaded")
    assert sorted(got) == sorted(truth)
    assert any("linear_qkv.bias" in k or "q_layernorm" in k for k in got)
    unequal = [k for k in truth if truth[k].dtype != got[k].dtype or not torch.equal(truth[k], got[k])]
    assert not unequal, f"differ from the {family} source after Megatron-LM's load at {layout}: {unequal}"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_transformers_loads_the_qwen_conversion_and_gives_megatron_logits(qwen_checkpoint, tmp_path, family):
    from transformers import AutoModelForCausalLM

    src, _, _ = qwen_checkpoint(family)
    dst = tmp_path / "hf"
    convert(src, dst, to="hf")
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == [CLASSES[family]] and config["model_type"] == family
    assert config["rms_norm_eps"] == 1e-6 and config["rope_parameters"]["rope_theta"] == 1000000.0
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert type(model).__name__ == CLASSES[family]
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens).logits
    want = megatron_logits(RUNS[family], src, tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_a_transformers_qwen_model_converts_to_megatron_and_gives_its_logits(tmp_path, family):
    """A `save_pretrained` Qwen folder -> Megatron at TP 2 (EP 2 for the MoE; a pretrained start): Megatron-Core's
    forward on it gives transformers' logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = MODELS[family]
    moe = dict(num_experts=m.num_experts, num_experts_per_tok=m.moe_top_k, moe_intermediate_size=m.moe_ffn_hidden_size,
               norm_topk_prob=True) if m.is_moe else {}
    config = AutoConfig.for_model(family, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                  intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                                  num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
                                  head_dim=m.head_dim, rms_norm_eps=m.norm_eps, tie_word_embeddings=False,
                                  max_position_embeddings=m.seq_length,
                                  rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base}, **moe)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the biases and q/k norms away from their init, so that a wrong mapping shows
        for name, p in hf.named_parameters():
            if name.endswith(("_proj.bias", "_norm.weight")):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    hf.save_pretrained(tmp_path / "hf")
    layout = {"tp": 1, "ep": 2, "dp": 2} if m.is_moe else {"tp": 2}
    assert_megatron_gives_hf_logits(hf, tmp_path / "hf", tmp_path / "mcore", m, layout)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_the_built_in_decoder_is_transformers_qwen(tmp_path, family):
    """The FSDP and DeepSpeed engines' decoder for a Qwen spec is transformers' model: its weights under the HF
    names, beside the config.json the HF writer renders, load with `from_pretrained` into Qwen2/Qwen3/Qwen3-Moe
    ForCausalLM with nothing missing or unexpected, and the logits agree."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from checkpoint.formats.hf_config import config_json, fields_from_model_shape
    from migrate.workload.torch_model import build_decoder, rotary_tables

    spec = MODELS[family]
    decoder = build_decoder(spec, seed=3)
    config = config_json(fields_from_model_shape(dataclasses.asdict(spec), origin="spec"), vocab_rows=spec.vocab_size,
                         dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v.contiguous() for k, v in decoder.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == CLASSES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x = decoder.embed_tokens(tokens)
        cos, sin = rotary_tables(spec, tokens.shape[1])
        for layer in decoder.layers:
            x = layer(x, cos, sin)
        want = decoder.lm_head(decoder.norm(x))
        torch.testing.assert_close(hf(tokens).logits, want, rtol=1e-5, atol=1e-5)


def test_searched_megatron_arguments_build_the_qwen_model():
    """The search's emitted Megatron-LM arguments carry the switches that build the job's Qwen model."""
    from checkpoint.layout import OptimizerSharding, ParallelLayout
    from checkpoint.model_shape import ModelShape
    from parallel_search.emit import megatron_args
    from parallel_search.space import Candidate
    from parallel_search.spec import TrainingShape

    shape = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128, seq_length=32)
    cand = Candidate(framework="megatron", layout=ParallelLayout(tp=2, dp=1, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER),
                     micro_batch_size=1)
    train = TrainingShape(global_batch_size=8, precision="fp32")
    for switches, want in (({}, set()), ({"architecture": "qwen2"}, {"--add-qkv-bias"}),
                           ({"architecture": "qwen3"}, {"--qk-layernorm"})):
        args = set(megatron_args(dataclasses.replace(shape, **switches), train, cand))
        assert args & {"--add-qkv-bias", "--qk-layernorm"} == want


@pytest.mark.parametrize("model_type", ["gemma", "gpt_oss"])
def test_other_families_are_refused_naming_what_is_supported(tmp_path, model_type):
    """A transformers-saved Gemma or GPT-OSS folder: `inspect` and `convert` refuse it in one line naming the model
    type and the supported ones, exit 2."""

    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    if model_type == "gpt_oss":
        sizes |= dict(num_local_experts=2, num_experts_per_tok=1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes)).save_pretrained(tmp_path / "hf")
    for argv in (["inspect", str(tmp_path / "hf")], ["convert", str(tmp_path / "hf"), str(tmp_path / "out"),
                                                     "--to", "megatron"]):
        out = run_migrate(argv)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        line = out.stderr.strip().splitlines()[-1]
        assert repr(model_type) in line and "qwen2" in line and "qwen3" in line and "llama" in line, line
    assert not (tmp_path / "out").exists()
