"""The built-in decoder in plain PyTorch (for DeepSpeed and FSDP2): GPT/Llama with GQA,
rotary, SwiGLU, tied or untied embeddings, a Mixtral-style top-k MoE FFN, Qwen2's q/k/v biases and
Qwen3's q/k norms.

Parameter names follow Hugging Face Llama/Mixtral (`model.layers.N.self_attn.q_proj.weight`,
`lm_head.weight`) so converted checkpoints map by name. Dropout is absent: a step is a pure
function of (weights, batch), which makes CPU runs bit-reproducible.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.model_shape import ModelShape, ModelShapeError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def norm_layer(spec: ModelShape) -> nn.Module:
    return RMSNorm(spec.hidden_size, spec.norm_eps) if spec.gated_ffn else nn.LayerNorm(spec.hidden_size, spec.norm_eps)


def rotary_tables(spec: ModelShape, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim) in the rotate-half convention."""
    inv_freq = 1.0 / (spec.rotary_base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelShape) -> None:
        super().__init__()
        self.spec = spec
        kv = spec.num_query_groups * spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=False)
        if spec.qk_norm:  # Qwen3: each head's q and k normalised over head_dim, before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.spec
        b, t, _ = x.shape
        # Head counts come from the projections' widths (-1), so under DTensor tensor parallelism
        # (column-split q/k/v, see tensor_parallel.py) each rank runs its own heads/tp heads.
        q = self.q_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = s.num_attention_heads // s.num_query_groups
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU (gate/up/down) for the llama family, GELU (up/down) for gpt; `width` the inner width."""

    def __init__(self, spec: ModelShape, width: int | None = None) -> None:
        super().__init__()
        self.gated = spec.gated_ffn
        width = width or spec.ffn_hidden_size
        if self.gated:
            self.gate_proj = nn.Linear(spec.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x) if self.gated else F.gelu(self.up_proj(x))
        return self.down_proj(hidden)


class MoE(nn.Module):
    """Top-k softmax router over `num_experts` SwiGLU experts (Mixtral: renormalised top-k weights)."""

    def __init__(self, spec: ModelShape) -> None:
        super().__init__()
        self.top_k = spec.moe_top_k
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(spec, spec.expert_ffn_hidden_size) for _ in range(spec.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            # Every expert runs (on zero tokens when unrouted) so all parameters get gradients.
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelShape) -> None:
        super().__init__()
        self.input_layernorm = norm_layer(spec)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = norm_layer(spec)
        self.mlp = MoE(spec) if spec.is_moe else MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Causal LM; `forward(tokens, labels)` returns the mean token cross-entropy."""

    def __init__(self, spec: ModelShape) -> None:
        super().__init__()
        if spec.is_mla:
            raise ModelShapeError(f"model.architecture={spec.architecture!r}: the fsdp and deepspeed engines' decoder "
                                  f"has no multi-latent attention; train it with the megatron engine")
        self.spec = spec
        vocab = spec.padded_vocab_size()
        self.embed_tokens = nn.Embedding(vocab, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = norm_layer(spec)
        self.lm_head = nn.Linear(spec.hidden_size, vocab, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(self.spec, tokens.shape[1])
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic init from `seed`, independent of the global RNG: normal(0, std) for matrices and for the
    projections' biases (Qwen2's q/k/v); norms keep their ones and zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def build_decoder(spec: ModelShape, seed: int) -> Decoder:
    """A freshly initialised decoder on the CPU in fp32; same seed, same weights."""
    model = Decoder(spec)
    init_weights(model, seed)
    return model
