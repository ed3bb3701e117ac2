"""The demo's custom operator, as a team registers its own: a fused rotary embedding (`demo::fused_rope`,
a torch.library custom operator with its own backward, standing in for the source cluster's fused kernel),
its mathematics as the reference, and the composition the team substitutes on the target's CPUs."""
from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@torch.library.custom_op("demo::fused_rope", mutates_args=())
def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@fused_rope.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, grad: torch.Tensor):
    cos, sin = ctx.saved_tensors
    u1, u2 = (grad * sin).chunk(2, dim=-1)
    return grad * cos + torch.cat((u2, -u1), dim=-1), None, None


fused_rope.register_autograd(_backward, setup_context=_setup)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: x * cos + rotate_half(x) * sin."""
    return x * cos + _rotate_half(x) * sin


def rope_composed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The target's substitute: the two halves rotated with standard operators."""
    x1, x2 = x.chunk(2, dim=-1)
    c1, c2 = cos.chunk(2, dim=-1)
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def rope_inputs(gen: torch.Generator, case: str) -> dict[str, torch.Tensor]:
    """(batch, heads, seq, head_dim) with the rotary tables of the positions; edge cases: an odd sequence
    length and head dim, an empty batch, large activations."""
    batch, heads, seq, dim = {"typical": (2, 4, 32, 16), "odd": (1, 3, 7, 10), "empty": (0, 4, 32, 16),
                              "large": (2, 4, 32, 16)}[case]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    emb = torch.outer(torch.arange(seq, dtype=torch.float64), inv).repeat(1, 2)
    scale = 300.0 if case == "large" else 1.0
    return {"x": torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64) * scale,
            "cos": emb.cos(), "sin": emb.sin()}
