"""The shape of a decoder model: the one definition the checkpoint rules, the search's memory and cost model, the
built-in workloads and the job schema all use.

A `ModelShape` is a GPT/Llama-style decoder with rotary position embeddings and grouped-query attention:
gpt is LayerNorm + GELU FFN; llama, mixtral, qwen2, qwen3 and qwen3_moe are RMSNorm + SwiGLU FFN; qwen2 adds
q/k/v biases, qwen3 a per-head RMSNorm of q and k before RoPE; mixtral and qwen3_moe make every FFN a top-k
routed MoE (each expert `moe_ffn_hidden_size` wide). Every field is checked on construction and errors print
every number involved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from checkpoint.errors import CheckpointFormatError

Architecture = Literal["gpt", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")  # routed-expert FFNs
QKV_BIAS_ARCHITECTURES = ("qwen2",)  # q/k/v projections with biases
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")  # per-head q/k RMSNorm

TENSOR_FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size", "num_experts", "make_vocab_size_divisible_by", "tied_embeddings",
                 "moe_ffn_hidden_size")
"""The fields that decide a checkpoint's tensor names and shapes (what a converter reads and records)."""


class ModelShapeError(CheckpointFormatError, ValueError):
    """A model whose numbers do not fit together (a ValueError to the job and the search, a checkpoint format error
    to a converter reading it from a checkpoint)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder's architecture and sizes. `seq_length` is the tokens per sample (0 where the source does not say,
    as a checkpoint's config); `make_vocab_size_divisible_by` is Megatron's vocab padding (1: none)."""

    architecture: Architecture
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int = 0
    tied_embeddings: bool = False
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_hidden_size: int = 0  # each expert's inner width (Megatron's --moe-ffn-hidden-size); 0: ffn_hidden_size
    make_vocab_size_divisible_by: int = 1
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelShapeError(f"model.architecture={self.architecture!r}: expected one of "
                                  f"{', '.join(ARCHITECTURES)}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ModelShapeError(f"model.{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_length", "moe_ffn_hidden_size"):
            if getattr(self, name) < 0:
                raise ModelShapeError(f"model.{name}={getattr(self, name)} must be >= 0")
        if self.hidden_size % self.num_attention_heads:
            raise ModelShapeError(f"model.hidden_size({self.hidden_size}) is not divisible by "
                                  f"num_attention_heads({self.num_attention_heads})")
        if self.num_attention_heads % self.num_query_groups:
            raise ModelShapeError(f"model.num_attention_heads({self.num_attention_heads}) is not divisible by "
                                  f"num_query_groups({self.num_query_groups})")
        if self.head_dim % 2:
            raise ModelShapeError(f"head dim {self.hidden_size}//{self.num_attention_heads} must be even for rotary")
        if self.architecture in MOE_ARCHITECTURES:
            if self.num_experts < 2:
                raise ModelShapeError(f"architecture {self.architecture!r} needs num_experts >= 2, got "
                                      f"{self.num_experts}")
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise ModelShapeError(f"model.moe_top_k={self.moe_top_k} must be in [1, num_experts"
                                      f"({self.num_experts})]")
        elif self.num_experts not in (0, 1):
            raise ModelShapeError(f"model.num_experts={self.num_experts} needs architecture "
                                  f"{' or '.join(map(repr, MOE_ARCHITECTURES))}, got {self.architecture!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Every FFN is a routed MoE."""
        return self.architecture in MOE_ARCHITECTURES

    @property
    def gated_ffn(self) -> bool:
        """SwiGLU FFN (three matrices: gate, up, down)."""
        return self.architecture != "gpt"

    @property
    def qkv_bias(self) -> bool:
        """q/k/v projections with biases (Qwen2; Megatron's add_qkv_bias)."""
        return self.architecture in QKV_BIAS_ARCHITECTURES

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3; Megatron's qk_layernorm)."""
        return self.architecture in QK_NORM_ARCHITECTURES

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def layer_ffn_hidden_size(self) -> int:
        """The inner width of a layer's FFN: each expert's in an MoE model (every layer routed), else the dense one."""
        return self.expert_ffn_hidden_size if self.is_moe else self.ffn_hidden_size

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocab padded to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def attention_params_per_layer(self) -> int:
        """The q/k/v and output projections' matrices (biases and q/k norms are not counted)."""
        h = self.hidden_size
        return h * (h + 2 * self.kv_size) + h * h

    @property
    def ffn_params_per_expert(self) -> int:
        """One FFN's matrices (one expert's in an MoE model)."""
        return (3 if self.gated_ffn else 2) * self.hidden_size * self.layer_ffn_hidden_size

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size

    def layer_params(self) -> int:
        """Parameters of one transformer layer (all experts; router included)."""
        experts = self.num_experts if self.is_moe else 1
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

    def tensor_fields(self) -> dict[str, Any]:
        """The fields that decide tensor names and shapes (`TENSOR_FIELDS`), as a checkpoint records them."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "model") -> ModelShape:
        """The shape of a recorded dict (a checkpoint's saved model, a job's model section): unknown keys are
        ignored; a missing or wrong one raises ModelShapeError naming `where`."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as err:
            raise ModelShapeError(f"{where}: {err} (have: {sorted(d)})") from None
