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


def gpt_block_spec(config: Any, *, num_experts: int | None, normalization: str, vp_stage: int | None,
                   qk_layernorm: bool = False) -> Any:
    """The decoder block of one (virtual) pipeline stage: local-spec layers and final norm, every
    norm a `SequenceParallelTorchNorm` (the per-head q/k norms of `qk_layernorm`: `HeadTorchNorm`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization,
                                     qk_layernorm=qk_layernorm)
    sub = layer.submodules
    replaced: dict[str, Any] = {"input_layernorm": SequenceParallelTorchNorm}
    if sub.pre_mlp_layernorm is not None and getattr(sub.pre_mlp_layernorm, "__name__", "") != "IdentityOp":
        replaced["pre_mlp_layernorm"] = SequenceParallelTorchNorm
    if qk_layernorm:
        attention = sub.self_attention
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=HeadTorchNorm, k_layernorm=HeadTorchNorm))
        replaced["self_attention"] = attention
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(sub, **replaced))
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)
