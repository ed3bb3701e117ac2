"""Megatron-Core GPTModel rules (gpt, llama, mixtral, qwen2, qwen3, qwen3_moe, deepseek_v3) as data, and the pure box
arithmetic they drive.

A Megatron-Core dist checkpoint stores each parameter under a *key* stacked over layers (and
experts): e.g. `decoder.layers.self_attention.linear_qkv.weight` has global shape (L, R, C). (A model whose
layers differ, as DeepSeek-V3's first dense then MoE layers, stores one key per layer instead,
`decoder.layers.{i}.self_attention...`; the rules still speak of the stacked key, of which a layer's key is the slice
at layer i, and a rule's `layers` says which layers hold it.) A rule says, per key: its module parameter name, its
scope (model / layer / expert), the tensor dim
split over TP (or None: replicated), how its fused row dim splits into canonical tensors (QKV grouped
per query group, GLU gate|up) and whether its rows are the (TP-padded) vocab. Canonical names are
the HF-style names of `migrate/workload/torch_model.py` (`layers.{i}.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from checkpoint.errors import CheckpointFormatError
from checkpoint.model_shape import (ARCHITECTURES, MLA_ARCHITECTURES, MLA_TENSOR_FIELDS, MOE_ARCHITECTURES, QK_NORM_ARCHITECTURES,
                                    QKV_BIAS_ARCHITECTURES, Architecture, ModelShape)

Scope = Literal["model", "layer", "expert"]
Fuse = Literal["none", "qkv", "glu"]
Layers = Literal["all", "dense", "moe"]


# HF model_type -> the rules' architecture (the HF classes whose modules these rules map: rotary; Qwen2's QKV
# biases, Qwen3's per-head q/k RMSNorm)
HF_MODEL_TYPES: dict[str, Architecture] = {"llama": "llama", "mistral": "llama", "mixtral": "mixtral", "starcoder2": "gpt",
                                            "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                                            "deepseek_v3": "deepseek_v3"}


def _check_hf_attention(c: Mapping[str, Any], kind: str, where: str) -> None:
    """Refuse, naming the field, an HF attention the rules do not map: a head_dim other than hidden/heads, Qwen3's
    optional linear biases."""
    heads = int(c["num_attention_heads"])
    head_dim = c.get("head_dim")
    if head_dim is not None and int(head_dim) != int(c["hidden_size"]) // heads:
        raise CheckpointFormatError(f"{where}: head_dim={head_dim} differs from hidden_size({c['hidden_size']}) / "
                                    f"num_attention_heads({heads}) = {int(c['hidden_size']) // heads}; the rules map "
                                    f"models whose head_dim is hidden_size / num_attention_heads")
    if kind in ("llama", "qwen3", "qwen3_moe") and c.get("attention_bias"):
        raise CheckpointFormatError(f"{where}: {c.get('model_type')} with attention_bias=True (q/k/v/o biases): the "
                                    f"rules map it without biases; qwen2 has q/k/v biases")


def _check_qwen3_moe(c: Mapping[str, Any], where: str) -> None:
    """Refuse, naming the field, a Qwen3-MoE config with dense layers among its MoE layers or un-normalised top-k
    weights (Megatron-Core's router normalises the top-k probabilities)."""
    step, dense = int(c.get("decoder_sparse_step", 1) or 1), list(c.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise CheckpointFormatError(f"{where}: qwen3_moe with decoder_sparse_step={step} mlp_only_layers={dense} "
                                    f"(dense layers between MoE layers): the rules map models whose every layer is MoE")
    if not c.get("norm_topk_prob", False):
        raise CheckpointFormatError(f"{where}: qwen3_moe with norm_topk_prob={c.get('norm_topk_prob', False)!r}: "
                                    f"Megatron-Core's router normalises the top-k weights (norm_topk_prob=true)")


def _deepseek_v3_from_hf(c: Mapping[str, Any], where: str) -> ModelShape:
    """The shape of an HF DeepSeek-V3 `config.json`; refuses, naming the field, what Megatron-Core's model of it does
    not compute the same way: grouped routing (n_group/topk_group other than 1), a routed scaling factor other than
    1, un-normalised top-k weights, attention biases, and multi-token-prediction layers (not carried)."""
    odd = [f"{f}={c.get(f)!r}" for f, ok in (("n_group", lambda v: int(v or 1) == 1),
                                             ("topk_group", lambda v: int(v or 1) == 1),
                                             ("routed_scaling_factor", lambda v: float(v or 1.0) == 1.0),
                                             ("norm_topk_prob", lambda v: v is None or bool(v)),
                                             ("attention_bias", lambda v: not v),
                                             ("num_nextn_predict_layers", lambda v: not v))
           if not ok(c.get(f))]
    if odd:
        raise CheckpointFormatError(f"{where}: deepseek_v3 with {', '.join(odd)}: the rules map DeepSeek-V3 models with "
                                    f"one routing group, unscaled normalised top-k weights, no attention biases and no "
                                    f"MTP layers")
    moe_width = int(c["moe_intermediate_size"])
    heads = int(c["num_attention_heads"])
    return ModelShape(architecture="deepseek_v3", num_layers=int(c["num_hidden_layers"]),
                      hidden_size=int(c["hidden_size"]), ffn_hidden_size=int(c["intermediate_size"]),
                      num_attention_heads=heads, num_query_groups=heads, vocab_size=int(c["vocab_size"]),
                      num_experts=int(c["n_routed_experts"]), moe_top_k=int(c.get("num_experts_per_tok") or 8),
                      moe_ffn_hidden_size=moe_width, q_lora_rank=int(c.get("q_lora_rank") or 0),
                      kv_lora_rank=int(c["kv_lora_rank"]), qk_head_dim=int(c["qk_nope_head_dim"]),
                      qk_pos_emb_head_dim=int(c["qk_rope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
                      first_k_dense=int(c.get("first_k_dense_replace") or 0),
                      shared_expert_ffn_hidden_size=moe_width * int(c.get("n_shared_experts") or 0),
                      tied_embeddings=bool(c.get("tie_word_embeddings", False)))


def family_of_args(args: Mapping[str, Any]) -> Architecture:
    """The rules' architecture of a Megatron-LM run from its args: GELU + LayerNorm is gpt; SwiGLU + RMSNorm is
    llama, with routed experts mixtral, with QKV biases (add_qkv_bias) qwen2, with QK layernorm qwen3; with
    multi-latent attention deepseek_v3."""
    if not args.get("swiglu"):
        return "gpt"
    if args.get("multi_latent_attention"):
        return "deepseek_v3"
    if int(args.get("num_experts") or 0):
        return "qwen3_moe" if args.get("qk_layernorm") else "mixtral"
    if args.get("qk_layernorm"):
        return "qwen3"
    return "qwen2" if args.get("add_qkv_bias") else "llama"


def first_k_dense(moe_layer_freq: Any, num_layers: int) -> int | None:
    """k where Megatron-LM's --moe-layer-freq makes the first k layers dense and the rest MoE (1 or None: every
    layer MoE, k = 0); None for any other pattern. Raises ValueError for a list of the wrong length."""
    if moe_layer_freq in (1, None):
        return 0
    if isinstance(moe_layer_freq, int):
        return None
    pattern = [int(x) for x in moe_layer_freq]
    if len(pattern) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {num_layers} layers")
    k = pattern.index(1) if 1 in pattern else num_layers
    return k if pattern == [0] * k + [1] * (num_layers - k) else None


def mla_fields_of_args(args: Mapping[str, Any]) -> dict[str, int]:
    """The DeepSeek-V3 (MLA) model-shape fields of a Megatron-LM run's args (0 where unset); first_k_dense from
    --moe-layer-freq (0 for any other pattern, which the args reader refuses by name)."""
    out = {f: int(args.get(f) or 0) for f in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                             "v_head_dim")}
    return out | {"first_k_dense": first_k_dense(args.get("moe_layer_freq", 1), int(args["num_layers"])) or 0,
                  "shared_expert_ffn_hidden_size": int(args.get("moe_shared_expert_intermediate_size") or 0)}


def arch_from_config(config: Mapping[str, Any], *, where: str = "model config") -> ModelShape:
    """The ModelShape of a model config: an HF `config.json` (llama/mistral/mixtral/starcoder2 keys, told
    apart by `model_type`) or ModelShape fields (the built-in engines' saved spec, the job YAML's
    `model` section: `query_groups`/`num_query_groups` default to the heads, the vocab padding to the
    job schema's 128). Raises CheckpointFormatError naming `where` and the missing or unknown keys."""
    c = dict(config)
    try:
        if "model_type" in c:
            kind = HF_MODEL_TYPES.get(str(c["model_type"]))
            if kind is None:
                raise CheckpointFormatError(f"{where}: HF model_type {c['model_type']!r} has no Megatron rules; "
                                            f"known: {sorted(HF_MODEL_TYPES)}")
            if kind == "deepseek_v3":
                return _deepseek_v3_from_hf(c, where)
            _check_hf_attention(c, kind, where)
            if kind == "gpt" and c.get("use_bias", True):
                raise CheckpointFormatError(f"{where}: starcoder2 with use_bias={c.get('use_bias', True)} (linear "
                                            f"biases): the rules map bias-free models only")
            heads = int(c["num_attention_heads"])
            # Qwen3-MoE's own configs say num_experts, transformers 5 writes num_local_experts (its attribute_map)
            experts = {"mixtral": int(c.get("num_local_experts", 0)),
                       "qwen3_moe": int(c.get("num_local_experts") or c.get("num_experts") or 0)}
            if kind == "qwen3_moe":
                _check_qwen3_moe(c, where)
            moe = {"moe_top_k": int(c.get("num_experts_per_tok") or 2)} if kind in MOE_ARCHITECTURES else {}
            return ModelShape(architecture=kind, num_layers=int(c["num_hidden_layers"]),
                              hidden_size=int(c["hidden_size"]),
                              ffn_hidden_size=int(c["intermediate_size"]), num_attention_heads=heads,
                              num_query_groups=int(c.get("num_key_value_heads") or heads),
                              vocab_size=int(c["vocab_size"]), num_experts=experts.get(kind, 0),
                              moe_ffn_hidden_size=int(c.get("moe_intermediate_size") or 0) if kind == "qwen3_moe" else 0,
                              tied_embeddings=bool(c.get("tie_word_embeddings", kind == "gpt")), **moe)  # HF's defaults
        heads = int(c["num_attention_heads"])
        groups = c.get("num_query_groups", c.get("query_groups")) or heads
        recipe = {k: c[k] for k in ("seq_length", "moe_top_k", "rotary_base", "norm_eps") if c.get(k) is not None}
        recipe |= {k: int(c[k]) for k in MLA_TENSOR_FIELDS if c.get(k)}
        return ModelShape(architecture=str(c["architecture"]), num_layers=int(c["num_layers"]),  # type: ignore[arg-type]
                          hidden_size=int(c["hidden_size"]), ffn_hidden_size=int(c["ffn_hidden_size"]),
                          num_attention_heads=heads, num_query_groups=int(groups), vocab_size=int(c["vocab_size"]),
                          num_experts=int(c.get("num_experts") or 0),
                          moe_ffn_hidden_size=int(c.get("moe_ffn_hidden_size") or 0),
                          make_vocab_size_divisible_by=int(c.get("make_vocab_size_divisible_by", 128)),
                          tied_embeddings=bool(c.get("tied_embeddings", False)), **recipe)
    except KeyError as err:
        raise CheckpointFormatError(f"{where}: missing key {err.args[0]!r} (have: {sorted(c)})") from None
    except (TypeError, ValueError) as err:
        raise CheckpointFormatError(f"{where}: {err}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorRule:
    """One Megatron-Core checkpoint key. `tp_dim` indexes the per-layer (per-expert) tensor."""

    key: str
    param: str  # parameter name inside the layer / expert / model module (named_parameters order)
    scope: Scope
    canonical: str  # template with {layer}, {expert}, {part}
    tp_dim: int | None = None
    fuse: Fuse = "none"
    vocab: bool = False
    stage: Literal["first", "last", "all"] = "all"  # model scope: which pipeline stage holds it
    layers: Layers = "all"  # layer/expert scope: every layer, the dense ones or the MoE ones (ModelShape.is_moe_layer)
    buffer: bool = False  # a persistent buffer, not a parameter: no grad buffer, no optimizer state (expert_bias)


_LN = "decoder.layers.self_attention.linear_qkv.layer_norm_"
QKV_BIAS_KEY = "decoder.layers.self_attention.linear_qkv.bias"
Q_NORM_KEY = "decoder.layers.self_attention.q_layernorm.weight"
_MLN = "decoder.layers.mlp.linear_fc1.layer_norm_"


def _layer_rules(bias: bool, moe: bool, qkv_bias: bool = False, qk_norm: bool = False) -> tuple[TensorRule, ...]:
    """One layer's rules in Megatron-Core's named_parameters order: `bias` for LayerNorm biases, `moe` for routed
    experts, `qkv_bias` for the fused QKV's bias (add_qkv_bias), `qk_norm` for the per-head q/k norms
    (qk_layernorm), which Megatron-Core builds after linear_qkv."""
    norms = ("weight", "bias") if bias else ("weight",)
    rules = [TensorRule(key=f"{_LN}{n}", param=f"input_layernorm.{n}", scope="layer",
                        canonical=f"layers.{{layer}}.input_layernorm.{n}") for n in norms]
    rules += [
        TensorRule(key="decoder.layers.self_attention.linear_proj.weight", param="self_attention.linear_proj.weight",
                   scope="layer", canonical="layers.{layer}.self_attn.o_proj.weight", tp_dim=1),
        TensorRule(key="decoder.layers.self_attention.linear_qkv.weight", param="self_attention.linear_qkv.weight",
                   scope="layer", canonical="layers.{layer}.self_attn.{part}_proj.weight", tp_dim=0, fuse="qkv"),
    ]
    if qkv_bias:
        rules.append(TensorRule(key=QKV_BIAS_KEY, param="self_attention.linear_qkv.bias", scope="layer",
                                canonical="layers.{layer}.self_attn.{part}_proj.bias", tp_dim=0, fuse="qkv"))
    if qk_norm:
        rules += [TensorRule(key=f"decoder.layers.self_attention.{q}_layernorm.weight",
                             param=f"self_attention.{q}_layernorm.weight", scope="layer",
                             canonical=f"layers.{{layer}}.self_attn.{q}_norm.weight") for q in ("q", "k")]
    rules += [TensorRule(key=f"{_MLN}{n}", param=f"pre_mlp_layernorm.{n}", scope="layer",
                         canonical=f"layers.{{layer}}.post_attention_layernorm.{n}") for n in norms]
    if moe:
        rules += [
            TensorRule(key="decoder.layers.mlp.router.weight", param="mlp.router.weight", scope="layer",
                       canonical="layers.{layer}.mlp.gate.weight"),
            TensorRule(key="decoder.layers.mlp.experts.experts.linear_fc1.weight", param="linear_fc1.weight",
                       scope="expert", canonical="layers.{layer}.mlp.experts.{expert}.{part}_proj.weight",
                       tp_dim=0, fuse="glu"),
            TensorRule(key="decoder.layers.mlp.experts.experts.linear_fc2.weight", param="linear_fc2.weight",
                       scope="expert", canonical="layers.{layer}.mlp.experts.{expert}.down_proj.weight", tp_dim=1),
        ]
    else:
        rules += [
            TensorRule(key="decoder.layers.mlp.linear_fc1.weight", param="mlp.linear_fc1.weight", scope="layer",
                       canonical="layers.{layer}.mlp.{part}_proj.weight", tp_dim=0, fuse="glu" if not bias else "none"),
            TensorRule(key="decoder.layers.mlp.linear_fc2.weight", param="mlp.linear_fc2.weight", scope="layer",
                       canonical="layers.{layer}.mlp.down_proj.weight", tp_dim=1),
        ]
    return tuple(rules)


def _mla_layer_rules() -> tuple[TensorRule, ...]:
    """A DeepSeek-V3 layer's rules in Megatron-Core's named_parameters order (the local spec's MLASelfAttention:
    every projection column-parallel, the output row-parallel; its norms keep their module names): attention, then
    a dense SwiGLU FFN (the first-k layers) or the router (with its expert bias), the routed experts and the shared
    experts. A model without q_lora_rank has `linear_q_proj` in place of the q down/up projections and norm."""
    att = "decoder.layers.self_attention."
    canon = "layers.{layer}.self_attn."

    def linear(name: str, hf: str, tp_dim: int = 0) -> TensorRule:
        return TensorRule(key=f"{att}{name}.weight", param=f"self_attention.{name}.weight", scope="layer",
                          canonical=f"{canon}{hf}.weight", tp_dim=tp_dim)

    def norm(key: str, param: str, canonical: str) -> TensorRule:
        return TensorRule(key=key, param=param, scope="layer", canonical=canonical)

    mlp = "decoder.layers.mlp."
    return (
        norm("decoder.layers.input_layernorm.weight", "input_layernorm.weight", "layers.{layer}.input_layernorm.weight"),
        linear("linear_proj", "o_proj", tp_dim=1),
        linear("linear_q_proj", "q_proj"),
        linear("linear_q_down_proj", "q_a_proj"),
        linear("linear_q_up_proj", "q_b_proj"),
        linear("linear_kv_down_proj", "kv_a_proj_with_mqa"),
        linear("linear_kv_up_proj", "kv_b_proj"),
        norm(f"{att}q_layernorm.weight", "self_attention.q_layernorm.weight", f"{canon}q_a_layernorm.weight"),
        norm(f"{att}kv_layernorm.weight", "self_attention.kv_layernorm.weight", f"{canon}kv_a_layernorm.weight"),
        norm("decoder.layers.pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight",
             "layers.{layer}.post_attention_layernorm.weight"),
        TensorRule(key=f"{mlp}linear_fc1.weight", param="mlp.linear_fc1.weight", scope="layer", layers="dense",
                   canonical="layers.{layer}.mlp.{part}_proj.weight", tp_dim=0, fuse="glu"),
        TensorRule(key=f"{mlp}linear_fc2.weight", param="mlp.linear_fc2.weight", scope="layer", layers="dense",
                   canonical="layers.{layer}.mlp.down_proj.weight", tp_dim=1),
        TensorRule(key=f"{mlp}router.weight", param="mlp.router.weight", scope="layer", layers="moe",
                   canonical="layers.{layer}.mlp.gate.weight"),
        TensorRule(key=EXPERT_BIAS_KEY, param="mlp.router.expert_bias", scope="layer", layers="moe", buffer=True,
                   canonical="layers.{layer}.mlp.gate.e_score_correction_bias"),
        TensorRule(key=f"{mlp}experts.experts.linear_fc1.weight", param="linear_fc1.weight", scope="expert",
                   layers="moe", canonical="layers.{layer}.mlp.experts.{expert}.{part}_proj.weight", tp_dim=0,
                   fuse="glu"),
        TensorRule(key=f"{mlp}experts.experts.linear_fc2.weight", param="linear_fc2.weight", scope="expert",
                   layers="moe", canonical="layers.{layer}.mlp.experts.{expert}.down_proj.weight", tp_dim=1),
        TensorRule(key=f"{mlp}shared_experts.linear_fc1.weight", param="mlp.shared_experts.linear_fc1.weight",
                   scope="layer", layers="moe", canonical="layers.{layer}.mlp.shared_experts.{part}_proj.weight",
                   tp_dim=0, fuse="glu"),
        TensorRule(key=f"{mlp}shared_experts.linear_fc2.weight", param="mlp.shared_experts.linear_fc2.weight",
                   scope="layer", layers="moe", canonical="layers.{layer}.mlp.shared_experts.down_proj.weight",
                   tp_dim=1),
    )


EXPERT_BIAS_KEY = "decoder.layers.mlp.router.expert_bias"


def _model_rules(bias: bool) -> tuple[TensorRule, ...]:
    norms = ("weight", "bias") if bias else ("weight",)
    return (
        TensorRule(key="embedding.word_embeddings.weight", param="embedding.word_embeddings.weight", scope="model",
                   canonical="embed_tokens.weight", tp_dim=0, vocab=True, stage="first"),
        *(TensorRule(key=f"decoder.final_layernorm.{n}", param=f"decoder.final_layernorm.{n}", scope="model",
                     canonical=f"norm.{n}", stage="last") for n in norms),
        TensorRule(key="output_layer.weight", param="output_layer.weight", scope="model", canonical="lm_head.weight",
                   tp_dim=0, vocab=True, stage="last"),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchRules:
    """Rules of one architecture: model-scope rules and per-layer rules, in named_parameters order."""

    name: str
    layer: tuple[TensorRule, ...]
    model: tuple[TensorRule, ...]

    def all(self) -> tuple[TensorRule, ...]:
        return (self.model[0], *self.layer, *self.model[1:])

    def by_key(self) -> dict[str, TensorRule]:
        return {r.key: r for r in self.all()}


# gpt: LayerNorm (weight + bias), GELU FFN; llama: RMSNorm, SwiGLU; mixtral: llama attention + routed experts;
# qwen2: llama with QKV biases; qwen3: llama with per-head q/k RMSNorm (QK layernorm); deepseek_v3: MLA, first-k
# dense layers, routed + shared experts, the router's expert bias.
RULES: dict[str, ArchRules] = {
    name: ArchRules(name=name, layer=_mla_layer_rules() if name in MLA_ARCHITECTURES else
                    _layer_rules(bias=name == "gpt", moe=name in MOE_ARCHITECTURES,
                                 qkv_bias=name in QKV_BIAS_ARCHITECTURES, qk_norm=name in QK_NORM_ARCHITECTURES),
                    model=_model_rules(bias=name == "gpt"))
    for name in ARCHITECTURES
}
SWIGLU_ARCHITECTURES = tuple(name for name in ARCHITECTURES if name != "gpt")


def ffn_width(arch: ModelShape, rule: TensorRule) -> int:
    """The inner FFN width of `rule`'s tensor: an expert's, the shared experts' or the dense FFN's."""
    if rule.scope == "expert":
        return arch.expert_ffn_hidden_size
    return arch.shared_expert_ffn_hidden_size if ".shared_experts." in rule.key else arch.ffn_hidden_size


def held_layers(rule: TensorRule, arch: ModelShape) -> range:
    """The global layers that hold `rule`'s key (all of them; a deepseek_v3's dense or MoE ones)."""
    if rule.layers == "dense":
        return range(0, arch.first_k_dense)
    if rule.layers == "moe":
        return range(arch.first_k_dense, arch.num_layers)
    return range(arch.num_layers)


OUTPUT_KEY = "output_layer.weight"


def stored_rules(arch: ModelShape) -> tuple[TensorRule, ...]:
    """The rules of the keys a checkpoint of `arch` stores, in named_parameters order. Tied input/output
    embeddings are one tensor, the embedding: Megatron-Core gives the output layer no weight where it
    holds the embedding (PP 1) and stores the last stage's copy (PP > 1) under the embedding's key."""
    rules = RULES[arch.architecture].all()
    return tuple(r for r in rules if not (arch.tied_embeddings and r.key == OUTPUT_KEY) and _stored(r, arch))


_Q_LORA_KEYS = frozenset({"decoder.layers.self_attention.linear_q_down_proj.weight",
                          "decoder.layers.self_attention.linear_q_up_proj.weight",
                          "decoder.layers.self_attention.q_layernorm.weight"})


def _stored(rule: TensorRule, arch: ModelShape) -> bool:
    """Whether a model of `arch` has `rule`'s key at all: MLA's q down/up projections and norm with a q_lora_rank,
    its full q projection without; dense-FFN keys with first-k dense layers; shared-expert keys with shared
    experts."""
    if arch.is_mla:
        if rule.key == "decoder.layers.self_attention.linear_q_proj.weight":
            return not arch.q_lora_rank
        if rule.key in _Q_LORA_KEYS:
            return bool(arch.q_lora_rank)
        if ".shared_experts." in rule.key:
            return bool(arch.shared_expert_ffn_hidden_size)
    return len(held_layers(rule, arch)) > 0 if rule.scope != "model" else True


def holds_output_copy(arch: ModelShape, pp: int, vpp: int) -> bool:
    """Whether the last (virtual) stage holds its own output-layer weight: always when untied; when tied
    only if it is not also the first stage (Megatron-Core then keeps a copy, its grads all-reduced with
    the embedding's, so its optimizer state equals the embedding's)."""
    return not arch.tied_embeddings or pp * vpp > 1


_LAYER_KEY_RE = re.compile(r"^(.*?\bdecoder\.layers\.)(\d+)\.(.+)$")


def split_layer_key(key: str) -> tuple[str, int | None]:
    """A per-layer key (`...decoder.layers.3.mlp...`, also inside an optimizer key) as its stacked key and layer;
    any other key as itself and None."""
    m = _LAYER_KEY_RE.match(key)
    return (f"{m.group(1)}{m.group(3)}", int(m.group(2))) if m else (key, None)


def layer_key(key: str, layer: int) -> str:
    """The per-layer key of stacked key `key` at global layer `layer` (Megatron-Core's non-homogeneous layers)."""
    return key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)


def per_layer_keys(arch: ModelShape) -> bool:
    """Whether Megatron-Core stores `arch`'s layers one key each (its layers differ: a --moe-layer-freq list)."""
    return arch.is_mla


# ---------------------------------------------------------------- shapes and segments (pure)

@functools.cache  # pure in frozen values; planning a 70B model calls it ~10^5 times
def matrix_shape(rule: TensorRule, arch: ModelShape, tp: int = 1) -> tuple[int, ...]:
    """Global shape of one layer's (expert's) tensor, vocab padded for `tp`."""
    h, f = arch.hidden_size, ffn_width(arch, rule)
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    if arch.is_mla:
        heads, qk = arch.num_attention_heads, arch.qk_head_dim + arch.qk_pos_emb_head_dim
        att = "decoder.layers.self_attention."
        mla = {f"{att}linear_proj.weight": (h, heads * arch.v_head_dim),
               f"{att}linear_q_proj.weight": (heads * qk, h),
               f"{att}linear_q_down_proj.weight": (arch.q_lora_rank, h),
               f"{att}linear_q_up_proj.weight": (heads * qk, arch.q_lora_rank),
               f"{att}linear_kv_down_proj.weight": (arch.kv_lora_rank + arch.qk_pos_emb_head_dim, h),
               f"{att}linear_kv_up_proj.weight": (heads * (arch.qk_head_dim + arch.v_head_dim), arch.kv_lora_rank),
               f"{att}q_layernorm.weight": (arch.q_lora_rank,), f"{att}kv_layernorm.weight": (arch.kv_lora_rank,),
               EXPERT_BIAS_KEY: (arch.num_experts,)}
        if rule.key in mla:
            return mla[rule.key]
    table = {
        "embedding.word_embeddings.weight": (arch.padded_vocab_size(tp), h),
        "output_layer.weight": (arch.padded_vocab_size(tp), h),
        "decoder.layers.self_attention.linear_proj.weight": (h, arch.num_attention_heads * arch.head_dim),
        "decoder.layers.self_attention.linear_qkv.weight": (qkv_rows, h),
        "decoder.layers.self_attention.linear_qkv.bias": (qkv_rows,),
        "decoder.layers.self_attention.q_layernorm.weight": (arch.head_dim,),
        "decoder.layers.self_attention.k_layernorm.weight": (arch.head_dim,),
        "decoder.layers.mlp.router.weight": (arch.num_experts, h),
    }
    if rule.key in table:
        return table[rule.key]
    if rule.key.endswith("linear_fc1.weight"):
        return (2 * f if rule.fuse == "glu" else f, h)
    if rule.key.endswith("linear_fc2.weight"):
        return (h, f)
    return (h,)  # norms


def stacked_shape(rule: TensorRule, arch: ModelShape, tp: int = 1) -> tuple[int, ...]:
    """Global shape under the checkpoint key: (L, [E,] *matrix) for layer/expert scope (a per-layer key: without L)."""
    lead = {"model": (), "layer": (arch.num_layers,), "expert": (arch.num_layers, arch.num_experts)}[rule.scope]
    return (*lead, *matrix_shape(rule, arch, tp))


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Rows [start, start+length) of a fused tensor are rows [dst, dst+length) of canonical part `part`."""

    part: str
    start: int
    length: int
    dst: int


@functools.cache  # pure in frozen values; planning a 70B model calls it ~10^5 times
def segments(rule: TensorRule, arch: ModelShape) -> tuple[Segment, ...]:
    """How the fused row dim (dim 0 of the matrix) splits into canonical tensors; vocab rows clipped."""
    rows = matrix_shape(rule, arch)[0]
    if rule.fuse == "qkv":
        hd, per = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
        out, pos = [], 0
        for g in range(arch.num_query_groups):
            out += [Segment(part="q", start=pos, length=per * hd, dst=g * per * hd),
                    Segment(part="k", start=pos + per * hd, length=hd, dst=g * hd),
                    Segment(part="v", start=pos + (per + 1) * hd, length=hd, dst=g * hd)]
            pos += (per + 2) * hd
        return tuple(out)
    if rule.fuse == "glu":
        f = ffn_width(arch, rule)
        return (Segment(part="gate", start=0, length=f, dst=0), Segment(part="up", start=f, length=f, dst=0))
    if rule.vocab:
        return (Segment(part="", start=0, length=arch.vocab_size, dst=0),)
    part = "up" if rule.key.endswith("linear_fc1.weight") else ""
    return (Segment(part=part, start=0, length=rows, dst=0),)


@functools.cache  # pure in frozen values; planning a 70B model calls it ~10^5 times
def canonical_shape(rule: TensorRule, arch: ModelShape, seg: Segment) -> tuple[int, ...]:
    m = matrix_shape(rule, arch)
    if len(m) == 1 and rule.fuse == "none":
        return m
    total = sum(s.length for s in segments(rule, arch) if s.part == seg.part)
    return (total, *m[1:])


def canonical_name(rule: TensorRule, seg: Segment, layer: int | None = None, expert: int | None = None) -> str:
    return rule.canonical.format(layer=layer, expert=expert, part=seg.part)


def canonical_tensors(arch: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every canonical tensor name and shape of the model, in Megatron's rule order."""
    out = []
    for rule in stored_rules(arch):
        layers = held_layers(rule, arch) if rule.scope != "model" else [None]
        experts = range(arch.num_experts) if rule.scope == "expert" else [None]
        seen = set()
        for layer in layers:
            for expert in experts:
                for seg in segments(rule, arch):
                    name = canonical_name(rule, seg, layer, expert)
                    if name not in seen:
                        seen.add(name)
                        out.append((name, canonical_shape(rule, arch, seg)))
    return out


def hf_order(arch: ModelShape) -> list[str]:
    """Canonical names in the HF module order (`named_parameters()` of the plain torch model): embedding,
    then per layer input norm, q, k, v, o, post-attention norm, MLP (router, then per expert gate, up,
    down), then final norm and LM head. Frameworks that flatten parameters (DeepSpeed ZeRO) use this order."""
    known = dict(canonical_tensors(arch))
    if arch.is_mla:
        return _mla_hf_order(arch, known)
    norms = ("weight", "bias") if arch.architecture == "gpt" else ("weight",)
    mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if arch.num_experts:
        mlp = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(arch.num_experts)
                                     for p in ("gate", "up", "down")]
    out = ["embed_tokens.weight"]
    for i in range(arch.num_layers):
        out += [f"layers.{i}.input_layernorm.{n}" for n in norms]
        out += [f"layers.{i}.self_attn.{p}_proj.{n}" for p in ("q", "k", "v") for n in ("weight", "bias")]
        out += [f"layers.{i}.self_attn.o_proj.weight"] + [f"layers.{i}.self_attn.{q}_norm.weight" for q in ("q", "k")]
        out += [f"layers.{i}.post_attention_layernorm.{n}" for n in norms]
        out += [f"layers.{i}.{m}" for m in mlp]
    out += [f"norm.{n}" for n in norms] + ["lm_head.weight"]
    out = [n for n in out if n in known]
    if sorted(out) != sorted(known):
        raise CheckpointFormatError(f"{arch.architecture}: HF order misses {sorted(set(known) - set(out))}")
    return out


def _mla_hf_order(arch: ModelShape, known: Mapping[str, Any]) -> list[str]:
    """transformers' DeepseekV3 module order: per layer input norm, attention (q a/b or q, kv a/b, o), the
    post-attention norm, then a dense MLP or the MoE (its experts, gate, shared experts)."""
    glu = ("gate", "up", "down")
    out = ["embed_tokens.weight"]
    for i in range(arch.num_layers):
        a = f"layers.{i}.self_attn."
        out += [f"layers.{i}.input_layernorm.weight", f"{a}q_proj.weight", f"{a}q_a_proj.weight",
                f"{a}q_a_layernorm.weight", f"{a}q_b_proj.weight", f"{a}kv_a_proj_with_mqa.weight",
                f"{a}kv_a_layernorm.weight", f"{a}kv_b_proj.weight", f"{a}o_proj.weight",
                f"layers.{i}.post_attention_layernorm.weight"]
        if arch.is_moe_layer(i):
            out += [f"layers.{i}.mlp.experts.{e}.{p}_proj.weight" for e in range(arch.num_experts) for p in glu]
            out += [f"layers.{i}.mlp.gate.weight", f"layers.{i}.mlp.gate.e_score_correction_bias"]
            out += [f"layers.{i}.mlp.shared_experts.{p}_proj.weight" for p in glu]
        else:
            out += [f"layers.{i}.mlp.{p}_proj.weight" for p in glu]
    out += ["norm.weight", "lm_head.weight"]
    out = [n for n in out if n in known]
    if sorted(out) != sorted(known):
        raise CheckpointFormatError(f"{arch.architecture}: HF order misses {sorted(set(known) - set(out))}")
    return out


# ---------------------------------------------------------------- TP / PP / EP ownership (pure)

def tp_local_rows(rule: TensorRule, arch: ModelShape, tp: int, tp_rank: int) -> tuple[tuple[int, int], ...]:
    """Global row runs (start, length) of the matrix that TP rank `tp_rank` holds, in local order.

    Column-parallel fused tensors keep their grouping per rank: QKV holds whole query groups, GLU
    holds its slice of gate followed by its slice of up.
    """
    rows = matrix_shape(rule, arch, tp)[0]
    if rule.tp_dim != 0 or tp == 1:
        return ((0, rows),)
    if rule.fuse == "glu":
        f = ffn_width(arch, rule)
        if f % tp:
            raise CheckpointFormatError(f"{rule.key}: FFN width {f} is not divisible by tp({tp})")
        n = f // tp
        return ((tp_rank * n, n), (f + tp_rank * n, n))
    if rule.fuse == "qkv" and arch.num_query_groups % tp:
        raise CheckpointFormatError(f"{rule.key}: num_query_groups({arch.num_query_groups}) not divisible by tp({tp})")
    if rows % tp:
        raise CheckpointFormatError(f"{rule.key}: {rows} rows not divisible by tp({tp})")
    n = rows // tp
    return ((tp_rank * n, n),)


def tp_local_cols(rule: TensorRule, arch: ModelShape, tp: int, tp_rank: int) -> tuple[int, int]:
    """(start, length) of the columns TP rank `tp_rank` holds (all columns unless split on dim 1)."""
    m = matrix_shape(rule, arch, tp)
    cols = m[-1]
    if rule.tp_dim != 1 or tp == 1 or len(m) == 1:
        return (0, cols)
    if cols % tp:
        raise CheckpointFormatError(f"{rule.key}: {cols} columns not divisible by tp({tp})")
    return (tp_rank * (cols // tp), cols // tp)


def pipeline_stage_layer_counts(num_layers: int, pp: int, vpp: int, first_pipeline_stage_layers: int | None = None,
                       last_pipeline_stage_layers: int | None = None) -> tuple[int, ...]:
    """Layers in each model chunk of pipeline ranks 0..pp-1, as Megatron-Core splits them: evenly, or with
    `first_pipeline_stage_layers` / `last_pipeline_stage_layers` on the first / last pipeline rank (Megatron-LM's
    --decoder-first/last-pipeline-num-layers) and the rest evenly over the middle ranks; each rank's layers
    split evenly over its `vpp` chunks. Raises CheckpointFormatError with every number when they do not fit
    (the checks of Megatron-Core's TransformerConfig)."""
    split = f"num_layers({num_layers}) over pp({pp}) x vpp({vpp})"
    if first_pipeline_stage_layers is None and last_pipeline_stage_layers is None:
        if num_layers % (pp * vpp):
            raise CheckpointFormatError(f"num_layers({num_layers}) is not divisible by pp({pp}) * vpp({vpp}); an "
                                        f"uneven split needs first/last pipeline stage layer counts")
        return (num_layers // (pp * vpp),) * pp
    split += (f" with first_pipeline_stage_layers({first_pipeline_stage_layers}), "
              f"last_pipeline_stage_layers({last_pipeline_stage_layers})")
    if pp < 2:
        raise CheckpointFormatError(f"{split}: first/last pipeline stage layer counts need pp > 1")
    ends = [n for n in (first_pipeline_stage_layers, last_pipeline_stage_layers) if n is not None]
    if any(n < 1 or n % vpp for n in ends):
        raise CheckpointFormatError(f"{split}: each given stage count must be >= 1 and divisible by vpp({vpp})")
    middle_ranks, middle_layers = pp - len(ends), num_layers - sum(ends)
    if middle_layers < 0 or (middle_ranks == 0) != (middle_layers == 0) or \
            middle_ranks and middle_layers % (middle_ranks * vpp):
        raise CheckpointFormatError(f"{split}: the {middle_layers} remaining layer(s) do not split evenly over "
                                    f"{middle_ranks} middle pipeline rank(s) x vpp({vpp})")
    if vpp > 1 and middle_ranks == 0:  # Megatron-Core's layer offset divides by the middle stage count
        raise CheckpointFormatError(f"{split}: virtual stages with both ends given need a middle pipeline rank")
    middle = middle_layers // (middle_ranks * vpp) if middle_ranks else 0
    counts = [middle] * pp
    if first_pipeline_stage_layers is not None:
        counts[0] = first_pipeline_stage_layers // vpp
    if last_pipeline_stage_layers is not None:
        counts[-1] = last_pipeline_stage_layers // vpp
    return tuple(counts)


def pipeline_stage_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, vp_stage: int, *,
                 first_pipeline_stage_layers: int | None = None, last_pipeline_stage_layers: int | None = None) -> range:
    """Global layers of virtual stage `vp_stage` on pipeline rank `pp_rank` (Megatron-Core's
    get_transformer_layer_offset and get_num_layers_to_build; see `pipeline_stage_layer_counts`)."""
    counts = pipeline_stage_layer_counts(num_layers, pp, vpp, first_pipeline_stage_layers, last_pipeline_stage_layers)
    start = vp_stage * sum(counts) + sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def holds_model_tensor(rule: TensorRule, pp: int, vpp: int, pp_rank: int, vp_stage: int) -> bool:
    """Embedding on the first (virtual) stage, final norm and output layer on the last."""
    if rule.stage == "first":
        return pp_rank == 0 and vp_stage == 0
    if rule.stage == "last":
        return pp_rank == pp - 1 and vp_stage == vpp - 1
    return True


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global expert indices held by EP rank `ep_rank` (local expert i is global ep_rank*E/ep + i)."""
    if num_experts % ep:
        raise CheckpointFormatError(f"num_experts({num_experts}) is not divisible by ep({ep})")
    n = num_experts // ep
    return range(ep_rank * n, ep_rank * n + n)


# ---------------------------------------------------------------- box arithmetic (pure)

def flat_run_boxes(lengths: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split elements [lo, hi) of a row-major box of `lengths` into sub-boxes (offsets, lengths, first element)."""
    if lo >= hi:
        return []
    if len(lengths) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(lengths[1:])
    out = []
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [((first, *o), (1, *n), first * inner + s) for o, n, s in
                flat_run_boxes(lengths[1:], lo - first * inner, hi - first * inner)]
    if lo % inner:
        out += [((first, *o), (1, *n), first * inner + s) for o, n, s in
                flat_run_boxes(lengths[1:], lo - first * inner, inner)]
        first += 1
    full_end = hi // inner
    if full_end > first:
        out.append(((first, *(0,) * (len(lengths) - 1)), (full_end - first, *lengths[1:]), first * inner))
    if hi % inner and full_end >= first:
        out += [((full_end, *o), (1, *n), full_end * inner + s) for o, n, s in
                flat_run_boxes(lengths[1:], 0, hi - full_end * inner)]
    return out
