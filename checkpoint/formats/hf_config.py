"""The `config.json` of an HF output, from what the source records: pure functions over plain values.

transformers' `from_pretrained` starts from `config.json`; a converted folder without one does not load. The
model's numbers come from the first of: a given `--model-config`, the source's own `config.json` (an HF
source, carried as it is), Megatron-LM's `args` (`rotary_base`, `norm_epsilon`, `moe_router_topk`, ...), the
model shape the built-in engines save. A field none of them records (the norm epsilon, the RoPE base) is an
error naming it, never a guess. `config_json` renders the fields with transformers' own config class
(`LlamaConfig`, `MixtralConfig`, `Starcoder2Config`, `Qwen2Config`, `Qwen3Config`, `Qwen3MoeConfig`,
`DeepseekV3Config`) the way `save_pretrained` writes it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint.errors import PlanError
from checkpoint.model_shape import MLA_TENSOR_FIELDS, MOE_ARCHITECTURES, ModelShape
from checkpoint.rules.megatron import HF_MODEL_TYPES, arch_from_config, family_of_args, mla_fields_of_args

# architecture -> (transformers config class, model class, model_type)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "llama"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral"),
              "gpt": ("Starcoder2Config", "Starcoder2ForCausalLM", "starcoder2"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe"),
              "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek_v3")}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFields:
    """What a model config says of a decoder: its shape (the rotary base and norm epsilon included), the positions
    its rotary tables cover, and `origin`, where it was read."""

    shape: ModelShape
    max_position_embeddings: int
    origin: str


def _shape(origin: str, **fields: Any) -> ModelShape:
    """The shape of the fields a config gave, or PlanError naming `origin` and the numbers that do not fit."""
    try:
        return ModelShape(**fields)
    except ValueError as err:
        raise PlanError(f"{origin}: {err}") from None


def _need(d: Mapping[str, Any], field: str, origin: str) -> Any:
    if d.get(field) is None:
        raise PlanError(f"{origin}: no {field}; the HF config.json needs it (pass --model-config FILE: an HF "
                        f"config.json or the job YAML's model section)")
    return d[field]


def fields_from_model_shape(spec: Mapping[str, Any], *, origin: str) -> ModelFields:
    """From ModelShape-style fields (the built-in engines' saved spec, a job's `model` section)."""
    heads = int(_need(spec, "num_attention_heads", origin))
    seq_length = int(_need(spec, "seq_length", origin))
    shape = _shape(
        origin, architecture=str(_need(spec, "architecture", origin)), num_layers=int(_need(spec, "num_layers", origin)),
        hidden_size=int(_need(spec, "hidden_size", origin)), ffn_hidden_size=int(_need(spec, "ffn_hidden_size", origin)),
        num_attention_heads=heads, num_query_groups=int(spec.get("num_query_groups") or spec.get("query_groups") or heads),
        vocab_size=int(_need(spec, "vocab_size", origin)), tied_embeddings=bool(spec.get("tied_embeddings", False)),
        num_experts=int(spec.get("num_experts") or 0), moe_top_k=int(spec.get("moe_top_k") or 2),
        rotary_base=float(_need(spec, "rotary_base", origin)), norm_eps=float(_need(spec, "norm_eps", origin)),
        seq_length=seq_length, moe_ffn_hidden_size=int(spec.get("moe_ffn_hidden_size") or 0),
        **{f: int(spec.get(f) or 0) for f in MLA_TENSOR_FIELDS})
    return ModelFields(shape=shape, max_position_embeddings=seq_length, origin=origin)


def fields_from_hf_config(config: Mapping[str, Any], *, origin: str) -> ModelFields:
    """From an HF `config.json` (llama, mistral, mixtral, starcoder2), read through transformers' config class so
    that the entries `save_pretrained` leaves out (those at their defaults) take the class's defaults."""
    import transformers

    family = HF_MODEL_TYPES.get(str(config.get("model_type")))
    if family is None:
        raise PlanError(f"{origin}: model_type {config.get('model_type')!r}; known: {sorted(HF_MODEL_TYPES)}")
    try:
        c = transformers.AutoConfig.for_model(str(config["model_type"]),
                                              **{k: v for k, v in config.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as err:
        raise PlanError(f"{origin}: transformers does not take this config ({err})") from None
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    heads = int(c.num_attention_heads)
    moe = family in MOE_ARCHITECTURES
    if family == "deepseek_v3":  # its MLA, dense-layer and shared-expert fields as the rules read them
        mla = arch_from_config(config, where=origin)
        shape = _shape(origin, **(dataclasses.asdict(mla) | {
            "rotary_base": float(_need({"rope_theta": theta}, "rope_theta", origin)),
            "norm_eps": float(_need({"norm_eps": getattr(c, "rms_norm_eps", None)}, "norm_eps", origin))}))
        return ModelFields(shape=shape, max_position_embeddings=int(c.max_position_embeddings), origin=origin)
    shape = _shape(
        origin, architecture=family, num_layers=int(c.num_hidden_layers), hidden_size=int(c.hidden_size),
        ffn_hidden_size=int(c.intermediate_size), num_attention_heads=heads,
        num_query_groups=int(getattr(c, "num_key_value_heads", None) or heads), vocab_size=int(c.vocab_size),
        tied_embeddings=bool(c.tie_word_embeddings),
        num_experts=int(getattr(c, "num_local_experts", 0) or getattr(c, "num_experts", 0) or 0) if moe else 0,
        moe_ffn_hidden_size=int(getattr(c, "moe_intermediate_size", 0) or 0) if moe else 0,
        moe_top_k=int(getattr(c, "num_experts_per_tok", 2) or 2),
        rotary_base=float(_need({"rope_theta": theta}, "rope_theta", origin)),
        norm_eps=float(_need({"norm_eps": getattr(c, "rms_norm_eps", getattr(c, "norm_epsilon", None))}, "norm_eps",
                             origin)))
    return ModelFields(shape=shape, max_position_embeddings=int(c.max_position_embeddings), origin=origin)


def fields_from_megatron_args(args: Mapping[str, Any], *, origin: str) -> ModelFields:
    """From Megatron-LM's args (as `args_summary` keeps them). Refuses, naming the field, what an HF Llama,
    Mixtral or Starcoder2 cannot express: partial or interleaved rotary, RoPE scaling, zero-centred norms."""
    odd = [f"{f}={args[f]!r}" for f, ok in (("rotary_percent", lambda v: float(v) == 1.0),
                                             ("rotary_interleaved", lambda v: not v),
                                             ("use_rope_scaling", lambda v: not v),
                                             ("apply_layernorm_1p", lambda v: not v),
                                             ("layernorm_zero_centered_gamma", lambda v: not v),
                                             ("squared_relu", lambda v: not v),
                                             ("openai_gelu", lambda v: not v))
           if args.get(f) is not None and not ok(args[f])]
    if odd:
        raise PlanError(f"{origin}: the run uses {', '.join(odd)}; an HF config.json of "
                        f"{'/'.join(c for c, _, _ in HF_CLASSES.values())} cannot express it")
    heads = int(_need(args, "num_attention_heads", origin))
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention") else heads
    experts = int(args.get("num_experts") or 0)
    family = family_of_args(args)
    mla: dict[str, Any] = {}
    if family == "deepseek_v3":
        groups, mla = heads, mla_fields_of_args(args)
    shape = _shape(
        origin, architecture=family, num_layers=int(_need(args, "num_layers", origin)),
        hidden_size=int(_need(args, "hidden_size", origin)), ffn_hidden_size=int(_need(args, "ffn_hidden_size", origin)),
        num_attention_heads=heads, num_query_groups=groups,
        vocab_size=int(args.get("vocab_size") or _need(args, "padded_vocab_size", origin)),
        tied_embeddings=not bool(args.get("untie_embeddings_and_output_weights", False)), num_experts=experts,
        moe_top_k=int(args.get("moe_router_topk") or 2), rotary_base=float(args.get("rotary_base") or 10000),
        norm_eps=float(args.get("norm_epsilon") or 1e-5), seq_length=int(args.get("seq_length") or 0),
        moe_ffn_hidden_size=int(args.get("moe_ffn_hidden_size") or 0) if experts else 0, **mla)
    return ModelFields(shape=shape, origin=origin,
                       max_position_embeddings=int(args.get("max_position_embeddings")
                                                   or _need(args, "seq_length", origin)))


def config_json(fields: ModelFields, *, vocab_rows: int, dtype: str) -> dict[str, Any]:
    """The `config.json` transformers' config class writes for `fields` (only the non-default entries, as
    `save_pretrained` does), with the vocabulary the embedding really has (`vocab_rows`, padding included)."""
    import transformers

    m = fields.shape
    if m.architecture not in HF_CLASSES:
        raise PlanError(f"{fields.origin}: architecture {m.architecture!r} has no HF model class; known: "
                        f"{sorted(HF_CLASSES)}")
    config_cls, model_cls, _ = HF_CLASSES[m.architecture]
    common = dict(vocab_size=vocab_rows, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_query_groups, max_position_embeddings=fields.max_position_embeddings,
                  tie_word_embeddings=m.tied_embeddings, architectures=[model_cls], dtype=dtype,
                  rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base})
    if m.is_mla:
        common.pop("num_key_value_heads")
        return _deepseek_v3_config(m, common, fields.origin)
    if m.architecture == "gpt":
        extra = dict(norm_epsilon=m.norm_eps, hidden_act="gelu", use_bias=False, sliding_window=None,
                     bos_token_id=None, eos_token_id=None)
    else:
        extra = dict(rms_norm_eps=m.norm_eps, head_dim=m.hidden_size // m.num_attention_heads)
        if m.architecture == "mixtral":
            extra |= dict(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_top_k,
                          sliding_window=None)
        if m.architecture == "qwen3_moe":  # every layer MoE, Megatron-Core's normalised top-k weights
            extra |= dict(num_experts=m.num_experts, num_experts_per_tok=m.moe_top_k,
                          moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        if m.architecture in ("qwen2", "qwen3", "qwen3_moe"):  # full attention in every layer
            extra |= dict(use_sliding_window=False, sliding_window=None, hidden_act="silu", bos_token_id=None,
                          eos_token_id=None)
        if m.architecture in ("qwen2", "qwen3"):
            extra |= dict(max_window_layers=m.num_layers, layer_types=["full_attention"] * m.num_layers)
    config = getattr(transformers, config_cls)(**common, **extra)
    return json.loads(config.to_json_string(use_diff=True))


def _deepseek_v3_config(m: ModelShape, common: dict[str, Any], origin: str) -> dict[str, Any]:
    """DeepseekV3Config for a deepseek_v3 shape as Megatron-Core computes it: one routing group, unscaled
    normalised top-k sigmoid weights, rotary pairs in Megatron-Core MLA's order (rope_interleave), no MTP layers."""
    import transformers

    width = m.expert_ffn_hidden_size
    if m.shared_expert_ffn_hidden_size % width:
        raise PlanError(f"{origin}: shared experts {m.shared_expert_ffn_hidden_size} wide are not a whole number of "
                        f"experts {width} wide; DeepseekV3Config says n_shared_experts * moe_intermediate_size")
    config = transformers.DeepseekV3Config(
        **common, moe_intermediate_size=width, n_routed_experts=m.num_experts, num_experts_per_tok=m.moe_top_k,
        n_shared_experts=m.shared_expert_ffn_hidden_size // width, first_k_dense_replace=m.first_k_dense,
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, num_key_value_heads=m.num_attention_heads,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, rope_interleave=True,
        rms_norm_eps=m.norm_eps, attention_bias=False, hidden_act="silu", bos_token_id=None, eos_token_id=None,
        num_nextn_predict_layers=0)  # type: ignore[call-arg]  # a field the class takes as a keyword
    return json.loads(config.to_json_string(use_diff=True))


def check_config(config: Mapping[str, Any], *, arch: str, num_layers: int, hidden_size: int, vocab_rows: int,
                 where: str) -> None:
    """Raise PlanError when an HF `config` disagrees with the weights it is written beside (the model class,
    the layer count, the hidden size, the embedding rows), naming each field and both values."""
    wrong = []
    model_type = config.get("model_type")
    if HF_MODEL_TYPES.get(str(model_type)) != arch:
        wrong.append(f"model_type={model_type!r} (the weights are {arch}: "
                     f"{HF_CLASSES.get(arch, ('', '', '?'))[2]})")
    for field, have in (("num_hidden_layers", num_layers), ("hidden_size", hidden_size), ("vocab_size", vocab_rows)):
        if config.get(field) != have:
            wrong.append(f"{field}={config.get(field)!r} (the weights have {have})")
    if wrong:
        raise PlanError(f"{where}: the HF config disagrees with the weights: {'; '.join(wrong)}")
