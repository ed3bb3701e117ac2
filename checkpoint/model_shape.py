"""The shape of a decoder model: the one definition the checkpoint rules, the search's memory and cost model, the
built-in workloads and the job schema all use.

A `ModelShape` is a GPT/Llama-style decoder with rotary position embeddings and grouped-query attention:
gpt is LayerNorm + GELU FFN; llama, mixtral, qwen2, qwen3 and qwen3_moe are RMSNorm + SwiGLU FFN; qwen2 adds
q/k/v biases, qwen3 a per-head RMSNorm of q and k before RoPE; mixtral and qwen3_moe make every FFN a top-k
routed MoE (each expert `moe_ffn_hidden_size` wide). deepseek_v3 is DeepSeek-V3's class: multi-latent attention
(low-rank q and kv projections with their RMSNorms, a rotary part per head of `qk_pos_emb_head_dim`), the first
`first_k_dense` layers a dense SwiGLU FFN and the rest routed experts beside shared experts
(`shared_expert_ffn_hidden_size` wide), and a router with a per-expert bias (aux-loss-free balancing).
Every field is checked on construction and errors print every number involved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from checkpoint.errors import CheckpointFormatError

Architecture = Literal["gpt", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
ARCHITECTURES: tuple[str, ...] = get_args(Architecture)
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "deepseek_v3")  # routed-expert FFNs
MLA_ARCHITECTURES = ("deepseek_v3",)  # multi-latent attention, first-k dense layers, shared experts, expert bias
QKV_BIAS_ARCHITECTURES = ("qwen2",)  # q/k/v projections with biases
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")  # per-head q/k RMSNorm

TENSOR_FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size", "num_experts", "make_vocab_size_divisible_by", "tied_embeddings",
                 "moe_ffn_hidden_size")
"""The fields that decide a checkpoint's tensor names and shapes (what a converter reads and records)."""
MLA_TENSOR_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "first_k_dense", "shared_expert_ffn_hidden_size")
"""The further tensor fields of an MLA architecture (recorded only for one, so others' records are unchanged)."""


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
    q_lora_rank: int = 0  # MLA: the queries' low-rank width (Megatron's --q-lora-rank; 0: one full q projection)
    kv_lora_rank: int = 0  # MLA: the keys' and values' low-rank width (--kv-lora-rank)
    qk_head_dim: int = 0  # MLA: a head's q/k width without its rotary part (--qk-head-dim)
    qk_pos_emb_head_dim: int = 0  # MLA: a head's rotary q/k width (--qk-pos-emb-head-dim)
    v_head_dim: int = 0  # MLA: a head's value width (--v-head-dim)
    first_k_dense: int = 0  # deepseek_v3: the leading layers with a dense FFN (HF's first_k_dense_replace)
    shared_expert_ffn_hidden_size: int = 0  # deepseek_v3: the shared experts' width (0: none)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelShapeError(f"model.architecture={self.architecture!r}: expected one of "
                                  f"{', '.join(ARCHITECTURES)}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ModelShapeError(f"model.{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_length", "moe_ffn_hidden_size", *MLA_TENSOR_FIELDS):
            if getattr(self, name) < 0:
                raise ModelShapeError(f"model.{name}={getattr(self, name)} must be >= 0")
        if self.is_mla:
            self._check_mla()
        elif any(getattr(self, name) for name in MLA_TENSOR_FIELDS):
            given = {name: getattr(self, name) for name in MLA_TENSOR_FIELDS if getattr(self, name)}
            raise ModelShapeError(f"model fields {given} need architecture {' or '.join(map(repr, MLA_ARCHITECTURES))},"
                                  f" got {self.architecture!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelShapeError(f"model.hidden_size({self.hidden_size}) is not divisible by "
                                  f"num_attention_heads({self.num_attention_heads})")
        if self.num_attention_heads % self.num_query_groups:
            raise ModelShapeError(f"model.num_attention_heads({self.num_attention_heads}) is not divisible by "
                                  f"num_query_groups({self.num_query_groups})")
        if self.head_dim % 2 and not self.is_mla:
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

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ModelShapeError(f"model.{name}={getattr(self, name)} must be >= 1 for {self.architecture!r}")
        if self.qk_pos_emb_head_dim % 2:
            raise ModelShapeError(f"model.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even for rotary")
        if self.num_query_groups != self.num_attention_heads:
            raise ModelShapeError(f"model.num_query_groups({self.num_query_groups}) must equal num_attention_heads"
                                  f"({self.num_attention_heads}) for multi-latent attention")
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ModelShapeError(f"model.first_k_dense={self.first_k_dense} must be in [0, num_layers"
                                  f"({self.num_layers}))")

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention, first-k dense layers, shared experts and a router expert bias (DeepSeek-V3)."""
        return self.architecture in MLA_ARCHITECTURES

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has routed experts (every layer of mixtral/qwen3_moe; DeepSeek's after its
        first-k dense ones)."""
        return self.is_moe and layer >= self.first_k_dense

    @property
    def moe_layer_freq(self) -> list[int]:
        """Megatron's --moe-layer-freq as a list: 1 for a layer with routed experts, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): num_query_groups * head_dim."""
        return self.num_query_groups * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Its FFNs are routed MoEs (all of them, or those after deepseek_v3's first-k dense layers)."""
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
        """The q/k/v and output projections' matrices (biases and q/k norms are not counted; MLA: its down and up
        projections)."""
        h = self.hidden_size
        if self.is_mla:
            heads, qk = self.num_attention_heads, self.qk_head_dim + self.qk_pos_emb_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * heads * qk) if self.q_lora_rank else h * heads * qk
            kv = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + \
                self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        return h * (h + 2 * self.kv_size) + h * h

    @property
    def ffn_params_per_expert(self) -> int:
        """One FFN's matrices (one expert's in an MoE model)."""
        return (3 if self.gated_ffn else 2) * self.hidden_size * self.layer_ffn_hidden_size

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size

    @property
    def dense_ffn_params(self) -> int:
        """A dense layer's FFN matrices (`ffn_hidden_size` wide)."""
        return (3 if self.gated_ffn else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def shared_ffn_params(self) -> int:
        """The shared experts' matrices of an MoE layer (0 without shared experts)."""
        return 3 * self.hidden_size * self.shared_expert_ffn_hidden_size

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of transformer layer `layer` (None: an MoE layer where the model has them; all experts,
        router and shared experts included)."""
        moe = self.is_moe if layer is None else self.is_moe_layer(layer)
        if not moe:
            return self.attention_params_per_layer + self.dense_ffn_params + self.norm_params_per_layer
        router = self.hidden_size * self.num_experts
        return (self.attention_params_per_layer + self.num_experts * self.ffn_params_per_expert + self.shared_ffn_params
                + self.norm_params_per_layer + router)

    def total_params(self) -> int:
        """All parameters (unpadded vocab, embeddings counted once when tied)."""
        embed = self.vocab_size * self.hidden_size
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return layers + embed * (1 if self.tied_embeddings else 2) + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token passes through (top-k experts and the shared experts only)."""
        routed = self.moe_top_k * self.ffn_params_per_expert + self.shared_ffn_params
        per_layer = self.attention_params_per_layer + self.norm_params_per_layer
        ffns = sum(routed if self.is_moe_layer(i) else self.dense_ffn_params for i in range(self.num_layers))
        return self.num_layers * per_layer + ffns + 2 * self.vocab_size * self.hidden_size

    def tensor_fields(self) -> dict[str, Any]:
        """The fields that decide tensor names and shapes (`TENSOR_FIELDS`), as a checkpoint records them."""
        names = TENSOR_FIELDS + (MLA_TENSOR_FIELDS if self.is_mla else ())
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "model") -> ModelShape:
        """The shape of a recorded dict (a checkpoint's saved model, a job's model section): unknown keys are
        ignored; a missing or wrong one raises ModelShapeError naming `where`."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as err:
            raise ModelShapeError(f"{where}: {err} (have: {sorted(d)})") from None
