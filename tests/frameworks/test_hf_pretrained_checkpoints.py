"""Folders written by transformers' own `save_pretrained` (sharded, with index, config.json and
generation_config.json), converted with no extra flags, judged by `from_pretrained` on the output.

Models are built from small configs (no download). Each output must load with `AutoModelForCausalLM` and give
the source model's logits; config.json and generation_config.json are carried as they were.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import PlanError
from tests.cli_process import run_migrate

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rms_norm_eps=1e-6, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0})),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(use_bias=False, tie_word_embeddings=False,
                                                                      hidden_act="gelu", norm_epsilon=1e-5)),
}


def _save_pretrained(name: str, path, *, dtype=torch.float32, max_shard_size="40KB"):
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**BASE, **extra)).to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_folder_reshards_and_loads_with_the_same_logits(tmp_path, name):
    from transformers import AutoModelForCausalLM

    src, dst = tmp_path / "src", tmp_path / "dst"
    model = _save_pretrained(name, src)
    assert (src / "model.safetensors.index.json").is_file()
    index = read_index(src)
    assert index.meta["hf_config"]["model_type"] == MODELS[name][1].removesuffix("ForCausalLM").lower()
    convert(src, dst, to="hf")  # one file at the default shard size
    assert (dst / "model.safetensors").is_file() and not (dst / "model.safetensors.index.json").exists()
    assert json.loads((dst / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    if (src / "generation_config.json").is_file():
        assert json.loads((dst / "generation_config.json").read_text()) == json.loads(
            (src / "generation_config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(dst)
    torch.testing.assert_close(_logits(loaded, TOKENS), _logits(model, TOKENS), rtol=0, atol=0)


def test_llama_through_deepspeed_and_back_keeps_config_and_logits(tmp_path):
    """HF -> DeepSpeed ZeRO-3 at dp 2 (weights only) -> HF in shards: the config.json travels with the weights."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    model = _save_pretrained("llama", src)
    convert(src, tmp_path / "ds", to="deepspeed", target=LayoutRequest(dp=2, zero_stage=3))
    convert(tmp_path / "ds", tmp_path / "hf", to="hf", max_shard_size="30KB")
    out = tmp_path / "hf"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(loaded, TOKENS), _logits(model, TOKENS), rtol=0, atol=0)


def test_bf16_folder_reshards_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    _save_pretrained("mixtral", src, dtype=torch.bfloat16, max_shard_size="100KB")
    convert(src, tmp_path / "hf", to="hf", max_shard_size="20KB")
    model = AutoModelForCausalLM.from_pretrained(src)  # the source as transformers loads it (bf16 RoPE tables too)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    torch.testing.assert_close(_logits(loaded, TOKENS), _logits(model, TOKENS), rtol=0, atol=0)


def test_config_that_disagrees_with_the_weights_is_refused_naming_fields(tmp_path):
    src = tmp_path / "src"
    _save_pretrained("llama", src)
    wrong = {**json.loads((src / "config.json").read_text()), "num_hidden_layers": 3, "vocab_size": 100}
    with pytest.raises(PlanError, match=r"num_hidden_layers=3 \(the weights have 2\).*vocab_size=100 \(the weights "
                                        r"have 96\)"):
        convert(src, tmp_path / "dst", to="hf", model_config=wrong)
    assert not (tmp_path / "dst").exists()


def test_bad_max_shard_size_is_one_line_naming_it(tmp_path):

    src = tmp_path / "src"
    _save_pretrained("llama", src)
    out = run_migrate(["convert", str(src), str(tmp_path / "dst"), "--to", "hf", "--max-shard-size", "lots"])
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--max-shard-size 'lots'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_hf_model_becomes_a_megatron_pretrained_start_with_the_same_logits(tmp_path):
    """HF -> Megatron torch_dist at TP2 x DP2 with no flags: weights only, iteration 0, said in the plan; Megatron-LM's
    --finetune load (model only) at that layout gives transformers' logits, the padded vocabulary rows zero."""
    import transformers

    from checkpoint.plan import summarize
    from tests.megatron_lm_fixtures import LLAMA, MegatronLMRun, finetune_logits

    config = transformers.LlamaConfig(vocab_size=LLAMA.vocab_size, hidden_size=LLAMA.hidden_size,
                                      intermediate_size=LLAMA.ffn_hidden_size, num_hidden_layers=LLAMA.num_layers,
                                      num_attention_heads=LLAMA.num_attention_heads,
                                      num_key_value_heads=LLAMA.num_query_groups, rms_norm_eps=LLAMA.norm_eps,
                                      max_position_embeddings=LLAMA.seq_length,
                                      rope_parameters={"rope_type": "default", "rope_theta": LLAMA.rotary_base})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    src, dst = tmp_path / "hf", tmp_path / "megatron"
    model.save_pretrained(src, max_shard_size="100KB")
    outcome = convert(src, dst, to="megatron", target=LayoutRequest(dp=2, tp=2))
    assert "pretrained start" in summarize(outcome.plan) and "--finetune" in summarize(outcome.plan)
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "0"
    run = MegatronLMRun(tp=2, dp=2, model=dataclasses.replace(LLAMA, make_vocab_size_divisible_by=128))
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    got = finetune_logits(run, dst, tokens)
    assert got.shape[-1] == 256  # 128 rows padded to a multiple of 128 * tp, as Megatron-LM pads by default
    torch.testing.assert_close(got[..., :LLAMA.vocab_size], _logits(model, tokens), rtol=1e-4, atol=1e-4)
    assert torch.equal(got[..., LLAMA.vocab_size:], torch.zeros_like(got[..., LLAMA.vocab_size:]))


def _torchtitan_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's `Llama3StateDictAdapter._reverse_permute` (torchtitan/models/llama3/model/state_dict_adapter.py):
    transformers' wq/wk rows into torchtitan's interleaved RoPE order."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def test_torchtitan_names_and_rope_rows_both_ways(tmp_path):
    """HF -> DCP with --dcp-layout torchtitan --param-names torchtitan: torchtitan's names, its wq/wk in its RoPE row
    order exactly as its state-dict adapter's from_hf makes them; that folder -> HF with no flags (the names say
    torchtitan) gives `from_pretrained` the source model's logits, every weight bit for bit."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    model = _save_pretrained("llama", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "tt", to="dcp", dcp_layout="torchtitan", param_names="torchtitan")
    dcp_to_torch_save(tmp_path / "tt", tmp_path / "tt.pt")
    import io

    with torch.serialization.safe_globals([io.BytesIO]):  # torchtitan's train_state keeps BytesIO histories
        saved = torch.load(tmp_path / "tt.pt", weights_only=True)
    hf = model.state_dict()
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    q, k = hf["model.layers.1.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(saved["layers.1.attention.wq.weight"], _torchtitan_from_hf(q, heads))
    assert torch.equal(saved["layers.0.attention.wk.weight"], _torchtitan_from_hf(k, kv))
    assert torch.equal(saved["layers.0.feed_forward.w3.weight"], hf["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(saved["output.weight"], hf["lm_head.weight"]) and "tok_embeddings.weight" in saved
    convert(tmp_path / "tt", tmp_path / "back", to="hf")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(hf) and not [k for k in hf if not torch.equal(back[k], hf[k])]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert torch.equal(_logits(loaded, TOKENS), _logits(model, TOKENS))


def test_param_names_is_refused_where_the_target_cannot_rename(tmp_path):
    _save_pretrained("llama", tmp_path / "hf")
    with pytest.raises(PlanError, match="--param-names hf: megatron targets map canonical names themselves"):
        convert(tmp_path / "hf", tmp_path / "mc", to="megatron", param_names="hf")
    with pytest.raises(PlanError, match="--param-names torchtitan: a DeepSpeed target is written in canonical or hf"):
        convert(tmp_path / "hf", tmp_path / "ds", to="deepspeed", param_names="torchtitan")
    assert not (tmp_path / "mc").exists() and not (tmp_path / "ds").exists()


# torchtitan v0.2.2 `Qwen3StateDictAdapter.from_hf_map` (torchtitan/models/qwen3/model/state_dict_adapter.py), dense rows
TORCHTITAN_QWEN3_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def _torchtitan_qwen3_from_hf(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the adapter's `from_hf` makes of a dense Qwen3 state dict: its names, the tensors as they are (torchtitan's
    Qwen3 rotates halves, as transformers does, so nothing is permuted)."""
    import re

    out = {}
    for name, value in hf.items():
        layer = re.search(r"\d+", name)
        out[TORCHTITAN_QWEN3_FROM_HF[re.sub(r"\d+", "{}", name, count=1)].format(layer.group(0) if layer else "")] = value
    return out


def _qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**BASE, head_dim=8, tie_word_embeddings=False, rms_norm_eps=1e-6))
    model.save_pretrained(path, max_shard_size="40KB")
    return model.eval()


def test_torchtitan_qwen3_both_ways(tmp_path):
    """torchtitan's Qwen3 names. A DCP folder as torchtitan's `convert_from_hf.py` writes it (`dcp.save` of the adapter's
    `from_hf` state dict) converts to HF with the model's config: `from_pretrained` gives the source model's logits,
    every weight bit for bit. And HF -> DCP --param-names torchtitan gives exactly the adapter's state dict."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    model = _qwen3(tmp_path / "hf")
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = _torchtitan_qwen3_from_hf(hf)
    dcp.save(expected, checkpoint_id=str(tmp_path / "tt"))
    convert(tmp_path / "tt", tmp_path / "back", to="hf", model_config=model.config.to_dict())
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(hf) and not [k for k in hf if not torch.equal(back[k], hf[k])]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(_logits(loaded, TOKENS), _logits(model, TOKENS))

    convert(tmp_path / "hf", tmp_path / "tt2", to="dcp", dcp_layout="torchtitan", param_names="torchtitan")
    dcp_to_torch_save(tmp_path / "tt2", tmp_path / "tt2.pt")
    import io

    with torch.serialization.safe_globals([io.BytesIO]):  # torchtitan's train_state keeps BytesIO histories
        saved = torch.load(tmp_path / "tt2.pt", weights_only=True)
    model_keys = {k: v for k, v in saved.items() if k in expected}
    assert sorted(model_keys) == sorted(expected)
    assert not [k for k in expected if not torch.equal(model_keys[k], expected[k])]
