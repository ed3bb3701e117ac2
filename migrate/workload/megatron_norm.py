"""Megatron-Core layer specs whose norms are plain torch norms that take part in sequence parallel.

Without Transformer Engine or Apex, megatron-core 0.16.1 builds its norms with
`WrappedTorchNorm`, which asserts `not config.sequence_parallel`. Nothing in a torch
LayerNorm/RMSNorm depends on the sequence length, so the only thing sequence parallel asks of a
norm is what Apex's `FusedLayerNorm` does: mark its parameters `sequence_parallel = True`.
Each TP rank then normalises its own sequence slice (Megatron-Core's embedding scatters to the
sequence-parallel region, its column/row-parallel linears all-gather / reduce-scatter), and
`finalize_model_grads` all-reduces the grads of the marked params over the TP group, because
each rank saw only its slice.

`SequenceParallelTorchNorm` is that norm; `gpt_block_spec` is `get_gpt_layer_local_spec` with
it in every norm slot (input, pre-MLP, final), as a `TransformerBlockSubmodules` for one
(virtual) pipeline stage. Module classes, parameter names and sharded-state-dict keys are those
of the local spec, so checkpoints are the same with and without sequence parallel.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


class SequenceParallelTorchNorm:
    """Builds `torch.nn.LayerNorm` or `torch.nn.RMSNorm` (by `config.normalization`) like
    `WrappedTorchNorm`, marking each parameter `sequence_parallel = config.sequence_parallel`."""

    def __new__(  # type: ignore[misc]  # a factory: Megatron's spec builds it by calling the class
            cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
            zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError(f"SequenceParallelTorchNorm: zero_centered_gamma({config.layernorm_zero_centered_gamma}) "
                             f"persist_layer_norm({config.persist_layer_norm}) memory_efficient_layer_norm"
                             f"({config.memory_efficient_layer_norm}) need Transformer Engine or Apex")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"SequenceParallelTorchNorm: normalization {config.normalization!r} is not one of "
                             f"{sorted(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


class HeadTorchNorm:
    """Builds the torch norm of a per-head q/k layernorm (qk_layernorm) like `WrappedTorchNorm`, without its
    assertion against sequence parallel: it normalises heads after the sequence is gathered, so each TP rank sees
    every token and its parameters are not marked `sequence_parallel` (their grads need no TP all-reduce)."""

    def __new__(  # type: ignore[misc]  # a factory, as above
            cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        return kinds[config.normalization](normalized_shape=hidden_size, eps=eps)


class LatentAttentionCore(torch.nn.Module):
    """The core attention of multi-latent attention on the CPU: causal softmax attention whose q/k heads
    (`k_channels`) are wider than its value heads (`v_channels`), as Transformer Engine's
    DotProductAttention computes it (0.16.1's local DotProductAttention takes neither width). Inputs
    [s, b, heads, dim]; output [s, b, heads * v_channels]; dropout off, as the engine trains."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 **_: Any) -> None:
        super().__init__()
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(f"LatentAttentionCore: attention_dropout={config.attention_dropout}; the CPU MLA "
                             f"core attention has no dropout")
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, packed_seq_params: Any = None, **_: Any) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("LatentAttentionCore: packed sequences need Transformer Engine")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _layer_spec(*, num_experts: int | None, normalization: str, qk_layernorm: bool,
                multi_latent_attention: bool) -> Any:
    """One local-spec layer with the torch norms (and, for MLA, the CPU core attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization,
                                     qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention)
    sub = layer.submodules
    replaced: dict[str, Any] = {"input_layernorm": SequenceParallelTorchNorm}
    if sub.pre_mlp_layernorm is not None and getattr(sub.pre_mlp_layernorm, "__name__", "") != "IdentityOp":
        replaced["pre_mlp_layernorm"] = SequenceParallelTorchNorm
    attention = sub.self_attention
    if multi_latent_attention:  # q/kv norms act on the gathered latents: not sequence parallel
        norms = dict(q_layernorm=HeadTorchNorm, kv_layernorm=HeadTorchNorm) if qk_layernorm else {}
        replaced["self_attention"] = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, core_attention=LatentAttentionCore, **norms))
    elif qk_layernorm:
        replaced["self_attention"] = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=HeadTorchNorm, k_layernorm=HeadTorchNorm))
    return dataclasses.replace(layer, submodules=dataclasses.replace(sub, **replaced))


def gpt_block_spec(config: Any, *, num_experts: int | None, normalization: str, vp_stage: int | None,
                   qk_layernorm: bool = False, moe_layers: list[int] | None = None,
                   multi_latent_attention: bool = False) -> Any:
    """The decoder block of one (virtual) pipeline stage: local-spec layers and final norm, every
    norm a `SequenceParallelTorchNorm` (the per-head q/k norms of `qk_layernorm`, MLA's q/kv latent norms:
    `HeadTorchNorm`). `moe_layers` (1 per MoE layer, 0 per dense one, over all layers) gives layers with and
    without experts; MLA layers get the CPU `LatentAttentionCore`."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    def spec(moe: bool) -> Any:
        return _layer_spec(num_experts=num_experts if moe else None, normalization=normalization,
                           qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention)

    pattern = moe_layers or [int(bool(num_experts))] * config.num_layers
    specs = {moe: spec(bool(moe)) for moe in set(pattern)}
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[specs[m] for m in pattern[offset:offset + count]],
                                      layer_norm=SequenceParallelTorchNorm)
