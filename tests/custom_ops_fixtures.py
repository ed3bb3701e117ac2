"""Custom operators as a team writes them: a fused RoPE and a fused SwiGLU registered with
`torch.library.custom_op` and their own autograd (the "source cluster's kernels"), the compositions a team
writes as substitutes on the target, and one substitute whose backward forgets a term of SiLU's derivative."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.library.custom_op("migrate_tests::fused_rope", mutates_args=())
def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@fused_rope.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, grad: torch.Tensor):
    cos, sin = ctx.saved_tensors
    u1, u2 = (grad * sin).chunk(2, dim=-1)
    return grad * cos + torch.cat((u2, -u1), dim=-1), None, None


fused_rope.register_autograd(_rope_backward, setup_context=_rope_setup)


@torch.library.custom_op("migrate_tests::fused_swiglu", mutates_args=())
def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


@fused_swiglu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    a, b = x.chunk(2, dim=-1)
    s = torch.sigmoid(a)
    return torch.cat((grad * b * s * (1 + a * (1 - s)), grad * a * s), dim=-1)


fused_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# References: the operators' mathematics, plain torch (run in float64 and in the dtype under test).
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


# Substitutes on the target: compositions of standard operators.
def rope_composed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def swiglu_composed(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


class _SwigluForgotTheDerivative(torch.autograd.Function):
    """Forward right; backward uses sigmoid(a) for SiLU's derivative (the a * s * (1 - s) term is missing)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        s = torch.sigmoid(a)
        return torch.cat((grad * b * s, grad * a * s), dim=-1)


def swiglu_buggy_backward(x: torch.Tensor) -> torch.Tensor:
    return _SwigluForgotTheDerivative.apply(x)


def rope_inputs(gen: torch.Generator, case: str) -> dict[str, torch.Tensor]:
    """(batch, heads, seq, head_dim) queries with the rotary tables of their positions; edge cases: an odd
    sequence length, an empty batch, large activations."""
    batch, heads, seq, dim = {"typical": (2, 4, 16, 32), "odd": (1, 3, 7, 10), "empty": (0, 4, 16, 32),
                              "large": (2, 4, 16, 32)}[case]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat((angles, angles), dim=-1)
    scale = 300.0 if case == "large" else 1.0
    return {"x": torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64) * scale,
            "cos": emb.cos(), "sin": emb.sin()}


def build_model() -> dict:
    """A small model whose forward calls both custom operators (for the coverage scan)."""
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 64)
            self.out = torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            h = fused_rope(x, cos, sin)
            return self.out(fused_swiglu(self.proj(h)))

    torch.manual_seed(0)
    model = Block()
    inputs = rope_inputs(torch.Generator().manual_seed(1), "typical")
    batch = (inputs["x"].float(), inputs["cos"].float(), inputs["sin"].float())
    return {"model_factory": lambda: Block(), "batch": batch, "loss_fn": lambda m, b: m(*b).pow(2).mean(),
            "_model": model}


def rope_flipped_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A substitute rotating the wrong way (the sign of sin flipped): wrong in the forward."""
    return x * cos - _rotate_half(x) * sin


def rope_through_float8(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A kernel that keeps its result in float8 (3 mantissa bits) before returning the input's dtype."""
    return (x * cos + _rotate_half(x) * sin).to(torch.float8_e4m3fn).to(x.dtype)


def masked_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with masked positions (mask False) excluded."""
    return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1)


def _decoder():
    from checkpoint.model_shape import ModelShape
    from migrate.workload.torch_model import build_decoder

    spec = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=128, seq_length=32)
    tokens = torch.randint(0, spec.vocab_size, (4, spec.seq_length + 1), generator=torch.Generator().manual_seed(5))
    return spec, lambda: build_decoder(spec, 1234), (tokens[:, :-1], tokens[:, 1:])


def decoder() -> dict:
    """The built-in decoder on a batch of 4 (for the model dump and compare)."""
    _, factory, batch = _decoder()
    return {"model_factory": factory, "batch": batch, "loss_fn": lambda m, b: m(*b)}


def decoder_with_drifting_mlp() -> dict:
    """The same decoder whose second layer's down projection multiplies by a weight 1 % off (a kernel that
    drifts inside the same aten call)."""
    _, factory, batch = _decoder()

    def make():
        model = factory()
        proj = model.layers[1].mlp.down_proj
        proj.forward = lambda x, proj=proj: F.linear(x, proj.weight * 1.01)
        return model

    return {"model_factory": make, "batch": batch, "loss_fn": lambda m, b: m(*b)}


def custom_model() -> dict:
    """`build_model` in the shape the ops stage's model_factory takes."""
    made = build_model()
    return {k: made[k] for k in ("model_factory", "batch", "loss_fn")}
