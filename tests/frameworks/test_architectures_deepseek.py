"""DeepSeek-V3-class checkpoints (multi-latent attention, first-k dense layers, routed + shared experts, the router's
expert bias) as Megatron-LM writes them, across layouts and to and from transformers.

The model is Megatron-Core's own GPTModel built from an `MLATransformerConfig` (q/kv low-rank projections with their
layernorms, `moe_layer_freq` with a dense first layer, `moe_shared_expert_intermediate_size`,
`moe_router_enable_expert_bias` with sigmoid scores), trained on Gloo ranks and saved the way Megatron-LM's
`checkpointing.py` does (tests/megatron_lm_fixtures.py). Its layers differ, so Megatron-Core stores one key per layer
(`decoder.layers.{i}...`). Converted across TP, PP, EP and DP, the result is loaded by Megatron-LM's load path at the
target layout with every weight, expert bias, fp32 master and Adam state equal to the source's (also from and to
Megatron-LM's legacy per-rank files, `--ckpt-format torch`); converted to HF,
transformers' `DeepseekV3ForCausalLM` takes the folder and gives Megatron-Core's logits; a transformers-saved
DeepSeek-V3 converts to Megatron and Megatron-Core's forward at TP 2 and at EP 2 gives transformers' logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import CheckpointFormatError
from checkpoint.model_shape import ModelShape
from tests.cli_process import run_migrate
from tests.megatron_lm_fixtures import (DEEPSEEK, MegatronLMRun, assert_loads_with_every_state_equal,
                                      assert_megatron_gives_hf_logits, megatron_logits, saved_runs)

RUNS = {"dp2ep2": MegatronLMRun(dp=2, ep=2, model=DEEPSEEK), "tp2": MegatronLMRun(tp=2, model=DEEPSEEK),
        "dp2ep2_legacy": MegatronLMRun(dp=2, ep=2, model=DEEPSEEK, ckpt_format="torch")}
# (source run, target layout (tp, pp, dp, ep)): EP and TP shrunk, PP grown with EP kept, TP grown, EP grown from TP 2
CASES = [("dp2ep2", (1, 1, 1, 1)), ("dp2ep2", (1, 2, 2, 2)), ("dp2ep2", (2, 1, 2, 1)),
         ("tp2", (1, 1, 2, 2)), ("tp2", (1, 2, 1, 1))]


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory):
    """`get(run)` -> (save dir written as Megatron-LM does, save results, the source's truth); once per run."""
    return saved_runs(tmp_path_factory, RUNS, "mlm_deepseek_")


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-to-tp{a}pp{b}dp{c}ep{d}" for n, (a, b, c, d) in CASES])
def test_megatron_lm_loads_the_deepseek_conversion_with_every_state_equal(deepseek_checkpoint, tmp_path, name, layout):
    src, saved, truth = deepseek_checkpoint(name)
    index = read_index(src)
    assert index.meta["arch"] == DEEPSEEK.tensor_fields()  # from Megatron-LM's args alone
    assert index.meta["per_layer_keys"]
    names = {e.key.name: e.shape for e in index.entries}
    assert names["layers.0.mlp.gate_proj.weight"] == (128, 64) and "layers.0.mlp.gate.weight" not in names
    assert names["layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (16 + 8, 64)
    assert names["layers.1.self_attn.q_b_proj.weight"] == (4 * (16 + 8), 32)
    assert names["layers.3.mlp.shared_experts.down_proj.weight"] == (64, 32)
    assert names["layers.3.mlp.experts.3.up_proj.weight"] == (32, 64)
    assert names["layers.2.mlp.gate.e_score_correction_bias"] == (4,)
    biases = [v for k, v in truth.items() if k.endswith("router.expert_bias")]
    assert len(biases) == 3 and all(b.abs().sum() > 0 for b in biases)  # moved by training: a wrong copy shows
    tp, pp, dp, ep = layout
    dst = tmp_path / "converted"
    convert(src, dst, to="megatron", target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep))
    run = RUNS[name]
    assert saved[0]["adam_steps"] == [float(run.steps)]
    assert_loads_with_every_state_equal(dataclasses.replace(run, tp=tp, pp=pp, dp=dp, ep=ep), dst, tmp_path / "loaded",
                                        truth, what=f"the {name} source")


# (source run, target format, target layout (tp, pp, dp, ep)): Megatron-LM's legacy files (--ckpt-format torch) of a
# DeepSeek-V3 run, read and written; the expert bias is a persistent buffer in each rank's model state dict
LEGACY_CASES = [("dp2ep2_legacy", "megatron", (1, 2, 1, 1)), ("dp2ep2", "megatron-legacy", (2, 1, 2, 1)),
                ("dp2ep2_legacy", "megatron-legacy", (1, 1, 2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("name,to,layout", LEGACY_CASES,
                         ids=[f"{n}-to-{t}-tp{a}pp{b}dp{c}ep{d}" for n, t, (a, b, c, d) in LEGACY_CASES])
def test_megatron_lm_legacy_deepseek_files_convert_with_every_state_equal(deepseek_checkpoint, tmp_path, name, to,
                                                                          layout):
    src, _, truth = deepseek_checkpoint(name)
    assert read_index(src).meta["arch"] == DEEPSEEK.tensor_fields()
    tp, pp, dp, ep = layout
    dst = tmp_path / "converted"
    convert(src, dst, to=to, target=LayoutRequest(dp=dp, tp=tp, pp=pp, ep=ep))
    run = dataclasses.replace(RUNS[name], tp=tp, pp=pp, dp=dp, ep=ep,
                              ckpt_format="torch" if to == "megatron-legacy" else "torch_dist")
    assert_loads_with_every_state_equal(run, dst, tmp_path / "loaded", truth, what=f"the {name} source")


@pytest.mark.slow
def test_transformers_loads_the_deepseek_conversion_and_gives_megatron_logits(deepseek_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    src, _, _ = deepseek_checkpoint("dp2ep2")
    dst = tmp_path / "hf"
    convert(src, dst, to="hf")
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["q_lora_rank"],
            config["num_nextn_predict_layers"]) == (1, 1, 32, 0)
    model, info = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens).logits
    want = megatron_logits(RUNS["dp2ep2"], src, tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _transformers_deepseek(path, m: ModelShape):
    """A DeepSeek-V3 saved by transformers' `save_pretrained`, its norms, biases and expert bias away from their
    init so that a wrong mapping shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        moe_intermediate_size=m.moe_ffn_hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
        n_routed_experts=m.num_experts, n_shared_experts=m.shared_expert_ffn_hidden_size // m.moe_ffn_hidden_size,
        num_experts_per_tok=m.moe_top_k, first_k_dense_replace=m.first_k_dense, q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        rms_norm_eps=m.norm_eps, tie_word_embeddings=False, max_position_embeddings=m.seq_length,
        num_nextn_predict_layers=0, rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 1, "ep": 2, "dp": 2}], ids=["tp2", "ep2"])
def test_a_transformers_deepseek_model_converts_to_megatron_and_gives_its_logits(tmp_path, layout):
    m = dataclasses.replace(DEEPSEEK, make_vocab_size_divisible_by=128)  # Megatron-LM's default padding
    hf = _transformers_deepseek(tmp_path / "hf", m)
    assert_megatron_gives_hf_logits(hf, tmp_path / "hf", tmp_path / "mcore", m, layout)


def test_deepseek_formats_not_mapped_yet_are_refused_in_one_line(tmp_path):
    """A DeepSeek-V3 source to a format whose writer has no MLA rules (DeepSpeed, DCP): one line naming the
    architecture and the formats it converts to, exit 2, nothing written."""
    _transformers_deepseek(tmp_path / "hf", DEEPSEEK)
    for to in ("deepspeed", "dcp"):
        out = run_migrate(["convert", str(tmp_path / "hf"), str(tmp_path / to), "--to", to])
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        line = out.stderr.strip().splitlines()[-1]
        assert "deepseek_v3" in line and "megatron" in line and to in line, line
        assert not (tmp_path / to).exists()


def _args(**changes) -> argparse.Namespace:
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, padded_vocab_size=128,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, swiglu=True, normalization="RMSNorm",
                add_bias_linear=False, position_embedding_type="rope", num_experts=4, moe_ffn_hidden_size=32,
                multi_latent_attention=True, qk_layernorm=True, moe_router_enable_expert_bias=True, q_lora_rank=32,
                kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, moe_layer_freq=[0, 1, 1, 1],
                moe_shared_expert_intermediate_size=32, untie_embeddings_and_output_weights=True)
    return argparse.Namespace(**(base | changes))


@pytest.mark.parametrize("changes,field", [
    ({"mtp_num_layers": 1}, "mtp_num_layers=1"),
    ({"moe_layer_freq": [1, 0, 1, 1]}, "moe_layer_freq=[1, 0, 1, 1]"),
    ({"qk_layernorm": False}, "qk_layernorm"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
    ({"num_experts": None, "moe_layer_freq": 1}, "multi_latent_attention=True"),
])
def test_megatron_lm_args_of_a_deepseek_run_say_what_is_not_mapped(changes, field):
    """The architecture is read from Megatron-LM's args; MTP layers, dense layers between MoE layers, MLA without its
    q/kv norms or without the expert bias are refused naming the field."""
    from checkpoint.formats.megatron_args import arch_from_args

    assert arch_from_args(_args(), where="args") == ModelShape(
        architecture="deepseek_v3", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=4, vocab_size=128, num_experts=4, moe_ffn_hidden_size=32, q_lora_rank=32, kv_lora_rank=16,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, first_k_dense=1, shared_expert_ffn_hidden_size=32,
        make_vocab_size_divisible_by=128)
    with pytest.raises(CheckpointFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        arch_from_args(_args(**changes), where="args")


@pytest.mark.slow
def test_synthesized_deepseek_metadata_matches_what_megatron_core_wrote(deepseek_checkpoint):
    """The metadata-only planner's synthesized checkpoint (the 671B plan's source) has the same per-layer DCP keys,
    global sizes and dtypes as Megatron-Core's own save, and reads into the same index."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from checkpoint.formats.megatron_synth import synthesize_metadata, synthetic_index
    from checkpoint.layout import OptimizerSharding, ParallelLayout

    src, _, _ = deepseek_checkpoint("dp2ep2")
    layout = ParallelLayout(dp=2, ep=2, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER)
    md, _ = synthesize_metadata(DEEPSEEK, layout, model_dtype="float32")
    real = FileSystemReader(str(read_index(src).root)).read_metadata()

    def tensors(m):
        return {k: (tuple(v.size), v.properties.dtype) for k, v in m.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}

    assert tensors(md) == tensors(real)
    assert "decoder.layers.2.mlp.router.expert_bias" in tensors(md)
    synth = synthetic_index(DEEPSEEK, layout, model_dtype="float32")
    assert {(e.key, e.shape, e.dtype) for e in synth.entries} == {(e.key, e.shape, e.dtype)
                                                                 for e in read_index(src).entries}


@pytest.mark.slow
def test_searched_megatron_arguments_build_the_deepseek_model_in_megatron_lm(tmp_path):
    """The search's emitted Megatron-LM arguments for a DeepSeek-V3 job go through Megatron-LM's own `parse_args`
    and `validate_args`, which read back its MLA, dense-first-layer, shared-expert and router switches."""
    from checkpoint.layout import OptimizerSharding, ParallelLayout
    from parallel_search.emit import megatron_args
    from parallel_search.space import Candidate
    from parallel_search.spec import TrainingShape
    from tests.frameworks.test_search_emitted_configs import _megatron_lm_judge

    cand = Candidate(framework="megatron", layout=ParallelLayout(
        dp=2, ep=2, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER), micro_batch_size=1)
    argv = megatron_args(DEEPSEEK, TrainingShape(global_batch_size=8, precision="bf16"), cand)
    (result,) = _megatron_lm_judge([{"argv": argv, "world_size": 2, "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}])
    assert "error" not in result, result
    a = result["args"]
    got = {k: a[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                             "qk_pos_emb_head_dim", "v_head_dim", "moe_layer_freq",
                             "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias",
                             "moe_router_score_function", "qk_layernorm", "num_experts", "moe_ffn_hidden_size")}
    assert got == {"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16,
                   "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "moe_layer_freq": [0, 1, 1, 1],
                   "moe_shared_expert_intermediate_size": 32, "moe_router_enable_expert_bias": True,
                   "moe_router_score_function": "sigmoid", "qk_layernorm": True, "num_experts": 4,
                   "moe_ffn_hidden_size": 32}
    from checkpoint.formats.megatron_args import arch_from_args
    assert arch_from_args(argparse.Namespace(**{**a, "padded_vocab_size": 128, "vocab_size": 128}),
                          where="emitted") == dataclasses.replace(DEEPSEEK, seq_length=0, norm_eps=1e-5,
                                                                  make_vocab_size_divisible_by=64)
