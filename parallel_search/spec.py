"""What the search plans for: the model's shape, the training recipe and the cluster.

These are the library's own frozen values (the orchestrator maps its job sections onto
them); every field is checked on construction and errors print every number involved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


class SpecError(ValueError):
    """A model, training or cluster description whose numbers do not fit together."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A GPT/Llama decoder (``gated_ffn``: SwiGLU, three FFN matrices) with optional top-k MoE FFN; ``qkv_bias``
    (Qwen2) and ``qk_layernorm`` (Qwen3) change what a launch must build, not the memory or cost model."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    gated_ffn: bool = True
    tied_embeddings: bool = False
    num_experts: int = 0
    moe_top_k: int = 2
    make_vocab_size_divisible_by: int = 128
    qkv_bias: bool = False
    qk_layernorm: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise SpecError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise SpecError(f"model.hidden_size({self.hidden_size}) is not divisible by "
                            f"num_attention_heads({self.num_attention_heads})")
        if self.num_attention_heads % self.num_query_groups:
            raise SpecError(f"model.num_attention_heads({self.num_attention_heads}) is not divisible by "
                            f"num_query_groups({self.num_query_groups})")
        if self.num_experts == 1 or self.num_experts < 0:
            raise SpecError(f"model.num_experts={self.num_experts}: use 0 (dense) or >= 2")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise SpecError(f"model.moe_top_k={self.moe_top_k} outside 1..num_experts({self.num_experts})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        return h * (h + 2 * self.kv_size) + h * h

    @property
    def ffn_params_per_expert(self) -> int:
        return (3 if self.gated_ffn else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size

    def layer_params(self) -> int:
        """Parameters of one transformer layer (all experts; router included)."""
        experts = max(self.num_experts, 1)
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        return self.attention_params_per_layer + experts * self.ffn_params_per_expert + self.norm_params_per_layer + router

    def total_params(self) -> int:
        """All parameters (unpadded vocab, embeddings counted once when tied)."""
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params() + embed * (1 if self.tied_embeddings else 2) + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token passes through (top-k experts only)."""
        experts = self.moe_top_k if self.is_moe else 1
        per_layer = self.attention_params_per_layer + experts * self.ffn_params_per_expert + self.norm_params_per_layer
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention scores,
        attention counted causal (half the s x s products), as MFU is usually defined."""
        h, s = self.hidden_size, self.seq_length
        experts = self.moe_top_k if self.is_moe else 1
        per_layer = 2 * (self.attention_params_per_layer + experts * self.ffn_params_per_expert) + 2 * s * h
        return 3.0 * (self.num_layers * per_layer + 2 * h * self.vocab_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingShape:
    """Batch sizes and precision; the micro batch is part of each candidate."""

    global_batch_size: int
    precision: Precision = "bf16"

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise SpecError(f"training.global_batch_size={self.global_batch_size} must be >= 1")
        if self.precision not in BYTES_PER_ELEMENT:
            raise SpecError(f"training.precision={self.precision!r}: expected one of {sorted(BYTES_PER_ELEMENT)}")

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterShape:
    """How many devices, how many per node (links inside a node are faster)."""

    device_count: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.device_count < 1 or self.devices_per_node < 1:
            raise SpecError(f"cluster: device_count({self.device_count}) and devices_per_node({self.devices_per_node}) "
                            "must be >= 1")
        if self.device_count % self.devices_per_node and self.devices_per_node < self.device_count:
            raise SpecError(f"cluster: device_count({self.device_count}) is not a multiple of "
                            f"devices_per_node({self.devices_per_node})")

    @property
    def per_node(self) -> int:
        return min(self.devices_per_node, self.device_count)
