"""Megatron-LM's `args` (the run's argparse.Namespace its checkpoints hold): architecture, layout, rewrite.

Megatron-LM's `generate_state_dict` stores the whole Namespace under `args` in `common.pt` (torch_dist) and in
each `model_optim_rng.pt` (legacy). It is the source of truth for what the run was: the rules' architecture
(`arch_from_args`), the saved layout (`layout_from_args`), and what `inspect` shows (`args_summary`). A
converted checkpoint carries the source's Namespace with the layout fields rewritten for the target
(`target_args`), which is what Megatron-LM's `load_checkpoint` reads back (TP/PP to decide whether RNG and
the optimizer sharding fit, `consumed_train_samples` to resume the data position). Pure functions.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

from checkpoint.errors import CheckpointFormatError
from checkpoint.formats.hf_config import ModelFields
from checkpoint.layout import ParallelLayout
from checkpoint.model_shape import MLA_TENSOR_FIELDS, TENSOR_FIELDS, ModelShape
from checkpoint.rules.megatron import SWIGLU_ARCHITECTURES, family_of_args, first_k_dense, mla_fields_of_args

# What `inspect` shows of a Megatron-LM run, in this order (fields the Namespace lacks are left out)
SUMMARY_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "swiglu", "normalization", "norm_epsilon", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size",
    "make_vocab_size_divisible_by", "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved",
    "use_rope_scaling", "apply_layernorm_1p", "layernorm_zero_centered_gamma", "squared_relu", "openai_gelu", "seq_length",
    "max_position_embeddings", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "context_parallel_size", "data_parallel_size", "world_size",
    "use_distributed_optimizer", "overlap_grad_reduce", "ddp_bucket_size", "ckpt_format", "params_dtype",
    "micro_batch_size", "global_batch_size",
    "consumed_train_samples", "iteration", "train_iters",
)
# The layout's first/last pipeline stage layer counts and Megatron-LM's arguments for them
PIPELINE_STAGE_ARGS = {"first_pipeline_stage_layers": "decoder_first_pipeline_num_layers",
              "last_pipeline_stage_layers": "decoder_last_pipeline_num_layers"}
# Pipeline splits Megatron-LM offers that the rules do not place yet (refused by name when set)
UNPLACED_PIPELINE_FIELDS = ("pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                            "account_for_loss_in_pipeline_split")
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
             "tensor_model_parallel_size", "pipeline_model_parallel_size")


def as_mapping(args: Any) -> dict[str, Any] | None:
    """The fields of a saved `args` (a Namespace, or a plain dict of one); None when it is neither."""
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, Mapping):
        return dict(args)
    return None


def _unsupported(a: Mapping[str, Any]) -> list[str]:
    """The features of the run the tensor rules do not map yet, each with its field and value."""
    heads, hidden = int(a["num_attention_heads"]), int(a["hidden_size"])
    out = []
    swiglu, experts = bool(a.get("swiglu", False)), bool(a.get("num_experts"))
    qkv_bias, qk_norm = bool(a.get("add_qkv_bias", False)), bool(a.get("qk_layernorm", False))
    mla = bool(a.get("multi_latent_attention", False))
    checks = (
        ("add_bias_linear", bool(a.get("add_bias_linear", True)), "linear-layer biases"),
        ("add_qkv_bias", qkv_bias and (not swiglu or experts or qk_norm or mla),
         "QKV biases outside a dense SwiGLU model without QK layernorm (the rules map them as Qwen2)"),
        ("qk_layernorm", qk_norm and not swiglu,
         "QK layernorm outside a SwiGLU model (the rules map it as Qwen3 and Qwen3-MoE)"),
        ("multi_latent_attention", mla and not (swiglu and experts),
         "multi-latent attention outside a SwiGLU MoE model (the rules map it as DeepSeek-V3)"),
        ("qk_layernorm", mla and not qk_norm,
         "multi-latent attention without its q/kv layernorms (the rules map DeepSeek-V3's, --qk-layernorm)"),
        ("moe_router_enable_expert_bias", mla and not a.get("moe_router_enable_expert_bias"),
         "multi-latent attention without the router's expert bias (the rules map DeepSeek-V3's aux-loss-free "
         "router, --moe-router-enable-expert-bias)"),
        ("moe_router_pre_softmax", experts and bool(a.get("moe_router_pre_softmax", False)),
         "softmax over every expert before top-k (HF's norm_topk_prob=false); the rules map normalised top-k"),
        ("mtp_num_layers", bool(a.get("mtp_num_layers")),
         "multi-token-prediction layers (mtp.layers.*: not carried; train without them or drop them first)"),
        ("moe_shared_expert_intermediate_size", bool(a.get("moe_shared_expert_intermediate_size")) and not mla,
         "shared experts outside a DeepSeek-V3 (multi-latent attention) model"),
        ("position_embedding_type", a.get("position_embedding_type", "learned_absolute") == "learned_absolute",
         "learned absolute position embeddings (embedding.position_embeddings.weight)"),
        ("context_parallel_size", int(a.get("context_parallel_size") or 1) > 1, "context parallelism"),
    )
    out += [f"{field}={a.get(field)!r} ({what})" for field, bad, what in checks if bad]
    kv = a.get("kv_channels")
    if kv is not None and int(kv) * heads != hidden and not mla:
        out.append(f"kv_channels={kv} with num_attention_heads={heads} and hidden_size={hidden} (a head size other "
                   f"than hidden_size / heads)")
    if a.get("num_experts"):
        freq = a.get("moe_layer_freq", 1)
        try:
            dense = first_k_dense(freq, int(a["num_layers"]))
        except ValueError:
            dense = None
        if dense is None or (dense and not mla):
            out.append(f"moe_layer_freq={freq!r} (dense layers between MoE layers; the rules map DeepSeek-V3's "
                       f"first-k dense layers, [0]*k + [1]*(num_layers-k), with multi-latent attention)")
        etp = a.get("expert_tensor_parallel_size")
        if etp is not None and int(etp) != int(a["tensor_model_parallel_size"]):
            out.append(f"expert_tensor_parallel_size={etp} != tensor_model_parallel_size="
                       f"{a['tensor_model_parallel_size']}")
    return out


def arch_from_args(args: Any, *, where: str) -> ModelShape:
    """The rules' architecture of a Megatron-LM run from its saved `args`.

    SwiGLU + RMSNorm is the llama family (mixtral with `num_experts`; qwen2, qwen3 and qwen3_moe with QKV biases
    or QK layernorm: `family_of_args`), GELU + LayerNorm the gpt family, both
    with rotary positions and no linear biases. The vocabulary is `vocab_size` when the run set it, else the
    padded size (the padding rows are then carried as rows). Raises CheckpointFormatError naming `where` and
    every missing field, or every feature the rules do not map yet."""
    a = as_mapping(args)
    if a is None:
        raise CheckpointFormatError(f"{where}: args is {type(args).__name__}, not Megatron-LM's argparse.Namespace")
    missing = [f for f in _REQUIRED if a.get(f) is None]
    if missing:
        raise CheckpointFormatError(f"{where}: Megatron-LM args lack {', '.join(missing)}; the architecture and "
                                    f"layout are read from them (or pass --model-config)")
    unsupported = _unsupported(a)
    norm = str(a.get("normalization", "LayerNorm"))
    swiglu = bool(a.get("swiglu", False))
    if (swiglu, norm) not in ((True, "RMSNorm"), (False, "LayerNorm")):
        unsupported.append(f"swiglu={swiglu} with normalization={norm!r} (the rules know SwiGLU + RMSNorm and "
                           f"GELU + LayerNorm)")
    if unsupported:
        raise CheckpointFormatError(f"{where}: the run uses {'; '.join(unsupported)}: no tensor rules for it yet")
    heads = int(a["num_attention_heads"])
    experts = int(a.get("num_experts") or 0)
    family = family_of_args(a)
    if family == "gpt" and experts:
        raise CheckpointFormatError(f"{where}: num_experts={experts} with GELU + LayerNorm: no rules for a GPT MoE")
    groups = int(a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    mla: dict[str, Any] = {}
    if family == "deepseek_v3":
        groups, mla = heads, mla_fields_of_args(a)
    try:
        return ModelShape(architecture=family, num_layers=int(a["num_layers"]), hidden_size=int(a["hidden_size"]),
                        ffn_hidden_size=int(a["ffn_hidden_size"]), num_attention_heads=heads, num_query_groups=groups,
                        vocab_size=int(a.get("vocab_size") or a["padded_vocab_size"]), num_experts=experts,
                        moe_ffn_hidden_size=int(a.get("moe_ffn_hidden_size") or 0) if experts else 0,
                        make_vocab_size_divisible_by=int(a.get("make_vocab_size_divisible_by") or 128),
                        tied_embeddings=not bool(a.get("untie_embeddings_and_output_weights", False)), **mla)
    except (TypeError, ValueError) as err:
        raise CheckpointFormatError(f"{where}: args: {err}") from None


def vocab_is_padded(args: Any) -> bool:
    """Whether the rules' vocabulary is the padded size because the run did not record `vocab_size`."""
    a = as_mapping(args) or {}
    return not a.get("vocab_size")


def layout_from_args(args: Any, *, where: str) -> dict[str, Any]:
    """tp, pp, vpp, ep, dp and the first/last pipeline stage layers of the run that saved `args` (dp from
    data_parallel_size, else the world size over tp * pp * cp); raises CheckpointFormatError naming a missing or
    inconsistent field, or a pipeline split the rules do not place (an explicit layout string, embedding or loss
    counted as a layer)."""
    a = as_mapping(args) or {}
    unplaced = {f: a[f] for f in UNPLACED_PIPELINE_FIELDS if a.get(f)}
    if unplaced:
        raise CheckpointFormatError(f"{where}: {unplaced}: that pipeline split is not read yet; even splits and "
                                    f"--decoder-first/last-pipeline-num-layers are")
    try:
        tp, pp = int(a["tensor_model_parallel_size"]), int(a["pipeline_model_parallel_size"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointFormatError(f"{where}: no tensor_model_parallel_size / pipeline_model_parallel_size "
                                    f"(have {a.get('tensor_model_parallel_size')!r}, "
                                    f"{a.get('pipeline_model_parallel_size')!r})") from None
    vpp = a.get("virtual_pipeline_model_parallel_size")
    per_stage = a.get("num_layers_per_virtual_pipeline_stage")
    if not vpp and per_stage:
        vpp = int(a["num_layers"]) // pp // int(per_stage)
    cp = int(a.get("context_parallel_size") or 1)
    dp = a.get("data_parallel_size")
    world = a.get("world_size")
    if dp is None and world:
        dp = int(world) // (tp * pp * cp)
    if dp is not None and world and int(dp) * tp * pp * cp != int(world):
        raise CheckpointFormatError(f"{where}: data_parallel_size={dp} but world_size={world} / "
                                    f"(tp={tp} * pp={pp} * cp={cp}) = {int(world) / (tp * pp * cp):g}")
    ends = {field: None if a.get(arg) is None else int(a[arg]) for field, arg in PIPELINE_STAGE_ARGS.items()}
    return {"tp": tp, "pp": pp, "vpp": int(vpp or 1), "ep": int(a.get("expert_model_parallel_size") or 1),
            "dp": None if dp is None else int(dp), **ends}


def grad_bucket_size(args: Any, *, dp: int, where: str) -> int | None:
    """The DDP grad-bucket size (elements) of the run's first model chunk on pipeline rank 0, as Megatron-LM's
    `resolve_ddp_bucket_size` sets it: None (one bucket per grad buffer) without --overlap-grad-reduce, else
    --ddp-bucket-size or max(40M, 1M * dp). Other chunks and pipeline ranks are never bucketed."""
    a = as_mapping(args) or {}
    if not a.get("overlap_grad_reduce") or a.get("overlap_param_gather_with_optimizer_step"):
        return None
    if a.get("ddp_num_buckets"):
        raise CheckpointFormatError(f"{where}: ddp_num_buckets={a['ddp_num_buckets']} (buckets sized from the "
                                    f"parameter count) is not read yet; --ddp-bucket-size is")
    return int(a.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))


def args_summary(args: Any) -> dict[str, Any]:
    """The fields `inspect` shows, as plain values (dtypes and enums by name)."""
    a = as_mapping(args) or {}
    return {f: _plain(a[f]) for f in SUMMARY_FIELDS if f in a}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "name", None) or str(value)


def target_args(args: Any, arch: ModelShape, layout: ParallelLayout, *, ckpt_format: str,
                fully_reshardable: bool) -> argparse.Namespace:
    """The source run's Namespace for a checkpoint at `layout`: every field kept but the parallel sizes, world
    size, padded vocabulary, checkpoint format and optimizer-sharding flags (the distributed optimizer is on:
    the writers emit its state); `consumed_train_samples` and the schedule are the source's."""
    a = as_mapping(args) or {}
    a |= {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
          "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
          "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
          **{arg: layout.pipeline_split[field] for field, arg in PIPELINE_STAGE_ARGS.items()},
          "expert_model_parallel_size": layout.ep,
          "expert_tensor_parallel_size": layout.tp, "data_parallel_size": layout.dp, "world_size": layout.world_size,
          "padded_vocab_size": arch.padded_vocab_size(layout.tp), "use_distributed_optimizer": True,
          "ckpt_format": ckpt_format, "use_dist_ckpt": ckpt_format != "torch",
          "dist_ckpt_optim_fully_reshardable": fully_reshardable}
    if layout.tp == 1:
        a["sequence_parallel"] = False  # Megatron-LM turns it off at tp 1 itself
    return argparse.Namespace(**a)


def overrides(args_arch: ModelShape, given: ModelShape) -> list[str]:
    """`field: args value -> given value` for each field a --model-config changes (empty when they agree)."""
    fields = TENSOR_FIELDS + (MLA_TENSOR_FIELDS if args_arch.is_mla or given.is_mla else ())
    return [f"{f}: {getattr(args_arch, f)!r} -> {getattr(given, f)!r}" for f in fields
            if getattr(args_arch, f) != getattr(given, f)]


def synthesized_args(arch: ModelShape, fields: ModelFields | None, *, iteration: int,
                     global_batch_size: int | None, weights_only: bool, hf_tokenizer: bool) -> argparse.Namespace:
    """The `args` a checkpoint converted from another framework carries, as Megatron-LM's `parse_args` would
    have built them for that model: the architecture (from the rules and, where the source records them, the
    norm epsilon, RoPE base and positions of `fields`), the iteration and the samples consumed (iteration x
    global batch, when the source records its global batch), `no_save_rng` (no RNG state crosses frameworks)
    and, for a weights-only start, `no_save_optim`. `tokenizer_type` is said only for sources with an HF
    config (their tokenizer is transformers'); the layout fields come from `target_args`."""
    swiglu = arch.architecture in SWIGLU_ARCHITECTURES
    a: dict[str, Any] = {
        "num_layers": arch.num_layers, "hidden_size": arch.hidden_size, "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "group_query_attention": arch.num_query_groups != arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups, "kv_channels": arch.head_dim, "swiglu": swiglu,
        "normalization": "RMSNorm" if swiglu else "LayerNorm", "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias, "qk_layernorm": arch.qk_norm,
        "untie_embeddings_and_output_weights": not arch.tied_embeddings,
        "vocab_size": arch.vocab_size, "make_vocab_size_divisible_by": arch.make_vocab_size_divisible_by,
        "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_interleaved": False,
        "use_rope_scaling": False, "apply_layernorm_1p": False, "squared_relu": False, "openai_gelu": False,
        "num_experts": arch.num_experts or None,
        "moe_ffn_hidden_size": arch.expert_ffn_hidden_size if arch.num_experts else None,
        "iteration": iteration, "no_save_rng": True,
        "no_save_optim": True if weights_only else None, "consumed_valid_samples": 0, "skipped_train_samples": 0}
    if arch.is_mla:  # Megatron-LM's DeepSeek-V3 switches (--multi-latent-attention --qk-layernorm ...)
        a |= {"multi_latent_attention": True, "qk_layernorm": True, "kv_channels": None,
              "q_lora_rank": arch.q_lora_rank or None, "kv_lora_rank": arch.kv_lora_rank, "qk_head_dim": arch.qk_head_dim,
              "qk_pos_emb_head_dim": arch.qk_pos_emb_head_dim, "v_head_dim": arch.v_head_dim,
              "moe_layer_freq": arch.moe_layer_freq,
              "moe_shared_expert_intermediate_size": arch.shared_expert_ffn_hidden_size or None,
              "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid", "rope_type": "rope"}
    if fields is not None:
        a |= {"norm_epsilon": fields.shape.norm_eps, "rotary_base": fields.shape.rotary_base,
              "max_position_embeddings": fields.max_position_embeddings,
              "moe_router_topk": fields.shape.moe_top_k if arch.num_experts else None}
    if global_batch_size:
        a |= {"global_batch_size": int(global_batch_size), "consumed_train_samples": iteration * int(global_batch_size)}
    if hf_tokenizer:
        a["tokenizer_type"] = "HuggingFaceTokenizer"
    return argparse.Namespace(**a)
