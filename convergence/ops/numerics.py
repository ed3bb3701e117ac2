"""Forward and backward of transformer operators in a low-precision dtype on a target
device, against the same (already rounded) inputs in float64 on the CPU.

Call sequence: ``check_operators(device, dtypes)`` -> one :class:`OpResult` per
(operator, dtype); ``check_dropout(device, dtypes)`` -> statistical dropout checks.
Inputs are drawn in float64, rounded to the dtype under test, and the reference runs
on exactly those rounded values, so the measured error is the operator's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from convergence.ops.metrics import TensorError, tensor_error

Status = Literal["pass", "fail", "unsupported"]
DTYPES: Mapping[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCase:
    """One operator: ``make(gen)`` draws float64 inputs, ``fn(**inputs)`` computes the output."""

    name: str
    make: Callable[[torch.Generator], dict[str, torch.Tensor]]
    fn: Callable[..., torch.Tensor]
    grad: tuple[str, ...]
    """Inputs whose gradients are compared."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OpResult:
    op: str
    dtype: str
    device: str
    status: Status
    tensors: tuple[TensorError, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict:
        return {"op": self.op, "dtype": self.dtype, "device": self.device, "status": self.status,
                "reason": self.reason,
                "tensors": [{k: getattr(t, k) for k in t.__slots__} for t in self.tensors]}  # type: ignore[attr-defined]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


B, S, H, HEADS, VOCAB = 2, 16, 64, 4, 96


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form (Llama / Megatron ``apply_rotary_pos_emb``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    d = H // HEADS
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return {"x": _randn(gen, B, HEADS, S, d), "cos": emb.cos(), "sin": emb.sin()}


CASES: tuple[OpCase, ...] = (
    OpCase(name="linear", grad=("x", "w", "b"), fn=lambda x, w, b: F.linear(x, w, b),
           make=lambda g: {"x": _randn(g, B, S, H), "w": _randn(g, 2 * H, H, scale=H ** -0.5), "b": _randn(g, 2 * H)}),
    OpCase(name="matmul", grad=("a", "b"), fn=lambda a, b: torch.matmul(a, b),
           make=lambda g: {"a": _randn(g, B, S, H), "b": _randn(g, H, H, scale=H ** -0.5)}),
    OpCase(name="bmm", grad=("a", "b"), fn=lambda a, b: torch.bmm(a, b),
           make=lambda g: {"a": _randn(g, B * HEADS, S, H // HEADS), "b": _randn(g, B * HEADS, H // HEADS, S)}),
    OpCase(name="softmax", grad=("x",), fn=lambda x: torch.softmax(x, dim=-1),
           make=lambda g: {"x": _randn(g, B, HEADS, S, S, scale=3.0)}),
    OpCase(name="log_softmax", grad=("x",), fn=lambda x: torch.log_softmax(x, dim=-1),
           make=lambda g: {"x": _randn(g, B, S, VOCAB, scale=3.0)}),
    OpCase(name="layer_norm", grad=("x", "w", "b"), fn=lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5),
           make=lambda g: {"x": _randn(g, B, S, H, scale=2.0) + 0.5, "w": 1 + 0.1 * _randn(g, H), "b": 0.1 * _randn(g, H)}),
    OpCase(name="rms_norm", grad=("x", "w"), fn=lambda x, w: F.rms_norm(x, (H,), w, 1e-5),
           make=lambda g: {"x": _randn(g, B, S, H, scale=2.0), "w": 1 + 0.1 * _randn(g, H)}),
    OpCase(name="gelu", grad=("x",), fn=lambda x: F.gelu(x), make=lambda g: {"x": _randn(g, B, S, H, scale=2.0)}),
    OpCase(name="silu", grad=("x",), fn=lambda x: F.silu(x), make=lambda g: {"x": _randn(g, B, S, H, scale=2.0)}),
    OpCase(name="swiglu", grad=("x", "w1", "w3"), fn=lambda x, w1, w3: F.silu(F.linear(x, w1)) * F.linear(x, w3),
           make=lambda g: {"x": _randn(g, B, S, H), "w1": _randn(g, 2 * H, H, scale=H ** -0.5),
                           "w3": _randn(g, 2 * H, H, scale=H ** -0.5)}),
    OpCase(name="rotary", grad=("x",), fn=_rope, make=_rope_inputs),
    OpCase(name="scaled_dot_product_attention", grad=("q", "k", "v"),
           fn=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           make=lambda g: {n: _randn(g, B, HEADS, S, H // HEADS) for n in ("q", "k", "v")}),
    OpCase(name="cross_entropy", grad=("logits",), fn=lambda logits, target: F.cross_entropy(logits, target),
           make=lambda g: {"logits": _randn(g, B * S, VOCAB, scale=2.0),
                           "target": torch.randint(0, VOCAB, (B * S,), generator=g)}),
    OpCase(name="embedding", grad=("weight",), fn=lambda weight, ids: F.embedding(ids, weight),
           make=lambda g: {"weight": _randn(g, VOCAB, H), "ids": torch.randint(0, VOCAB, (B, S), generator=g)}),
)
OPERATORS: tuple[str, ...] = tuple(c.name for c in CASES) + ("dropout",)


def is_unsupported(exc: Exception) -> bool:
    """Whether an exception says the device has no kernel for an operator or dtype."""
    text = str(exc)
    return (isinstance(exc, NotImplementedError) or "not implemented for" in text or "Could not run" in text
            or "not supported" in text)


def run_case(case: OpCase, device: str, dtype: torch.dtype, dtype_name: str, seed: int = 0) -> OpResult:
    """Forward + backward of one operator in ``dtype`` on ``device`` against float64 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    drawn = case.make(gen)
    low: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for k, v in drawn.items():
        if v.is_floating_point():
            rounded = v.to(dtype)
            low[k] = rounded.to(device).detach().clone().requires_grad_(k in case.grad)
            ref[k] = rounded.to(torch.float64).requires_grad_(k in case.grad)
        else:
            low[k], ref[k] = v.to(device), v
    try:
        out = case.fn(**low)
        expected = case.fn(**ref)
        grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(dtype)
        out.backward(grad_out.to(device))
        expected.backward(grad_out.to(torch.float64))
    except (RuntimeError, NotImplementedError) as exc:
        if is_unsupported(exc):
            return OpResult(op=case.name, dtype=dtype_name, device=device, status="unsupported",
                            reason=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        raise
    if out.dtype != dtype:
        return OpResult(op=case.name, dtype=dtype_name, device=device, status="fail",
                        reason=f"output dtype {out.dtype}, expected {dtype}")
    tensors = [tensor_error("out", out, expected, dtype)]
    for k in case.grad:
        low_grad, ref_grad = low[k].grad, ref[k].grad
        assert low_grad is not None and ref_grad is not None  # backward ran on every input the case differentiates
        tensors.append(tensor_error(f"grad.{k}", low_grad, ref_grad, dtype))
    bad = [f"{t.name}: {'; '.join(t.reasons)}" for t in tensors if not t.passed]
    return OpResult(op=case.name, dtype=dtype_name, device=device, status="fail" if bad else "pass",
                    tensors=tuple(tensors), reason=" | ".join(bad))


def check_dropout(device: str, dtype: torch.dtype, dtype_name: str, p: float = 0.1, n: int = 1 << 18,
                  seed: int = 0, z_max: float = 5.0,
                  dropout: Callable[..., torch.Tensor] = F.dropout) -> OpResult:
    """Dropout statistics: kept fraction (binomial z-score), kept scale 1/(1-p), backward uses the same mask.

    ``dropout`` is the implementation under test (the device's ``F.dropout`` by default).
    """
    torch.manual_seed(seed)
    x = torch.ones(n, dtype=dtype, device=device, requires_grad=True)
    try:
        y = dropout(x, p=p, training=True)
        y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError) as exc:
        if is_unsupported(exc):
            return OpResult(op="dropout", dtype=dtype_name, device=device, status="unsupported", reason=str(exc).splitlines()[0])
        raise
    assert x.grad is not None  # backward just ran
    yc, gc = y.detach().to("cpu", torch.float64), x.grad.to("cpu", torch.float64)
    kept = yc != 0
    k = int(kept.sum())
    z = (k - n * (1 - p)) / math.sqrt(n * p * (1 - p))
    scale = float(torch.tensor(1 / (1 - p), dtype=dtype).double())
    reasons = []
    if abs(z) > z_max:
        reasons.append(f"kept {k} of {n} (fraction {k / n:.5f}, expected {1 - p:.5f}, z {z:+.2f}, |z| > {z_max:g})")
    off = float((yc[kept] - scale).abs().max()) if k else 0.0
    if off > 0:
        reasons.append(f"kept values differ from 1/(1-p) = {scale:.6g} by up to {off:.3e}")
    if not torch.equal(gc, yc):
        reasons.append(f"backward mask differs from forward at {int((gc != yc).sum())} elements")
    return OpResult(op="dropout", dtype=dtype_name, device=device, status="fail" if reasons else "pass",
                    reason="; ".join(reasons) or f"kept fraction {k / n:.5f} (z {z:+.2f}), scale {scale:.6g}")


def check_operators(device: str = "cpu", dtypes: Sequence[str] = ("fp32", "bf16", "fp16"),
                    ops: Sequence[str] | None = None, seed: int = 0) -> tuple[OpResult, ...]:
    """Every selected operator in every dtype; unknown names raise listing the known ones."""
    wanted = tuple(ops) if ops else OPERATORS
    unknown = sorted(set(wanted) - set(OPERATORS))
    if unknown:
        raise ValueError(f"unknown operator(s) {unknown}; known: {', '.join(OPERATORS)}")
    bad_dtypes = sorted(set(dtypes) - set(DTYPES))
    if bad_dtypes:
        raise ValueError(f"unknown dtype(s) {bad_dtypes}; known: {', '.join(DTYPES)}")
    results = []
    for name in dtypes:
        for case in CASES:
            if case.name in wanted:
                results.append(run_case(case, device, DTYPES[name], name, seed))
        if "dropout" in wanted:
            results.append(check_dropout(device, DTYPES[name], name, seed=seed))
    return tuple(results)
