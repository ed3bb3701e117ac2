"""Error metrics of a tensor against its float64 reference, and per-dtype thresholds.

Thresholds follow the accuracy checkers of accelerator vendors: cosine similarity,
maximum absolute error (scaled by the reference's RMS), maximum relative error on the
elements that are not small (|reference| >= RMS; below it cancellation makes relative
error meaningless), and mean error in units in the last place (ULP) of the dtype
under test. Limits are multiples of the dtype's epsilon; the PyTorch CPU kernels pass
them with a margin of at least 2x (see tests/unit/test_ops_numerics.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}
MIN_EXPONENT = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14, torch.float64: -1022}


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """Limits for one dtype; the error limits are in units of the dtype's epsilon."""

    cosine_min: float
    max_abs_eps: float
    """max |error| / rms(reference) <= max_abs_eps * eps."""
    max_rel_eps: float
    """max |error| / |reference| over elements with |reference| >= rms(reference) <= max_rel_eps * eps."""
    mean_ulp: float
    """mean |error| in ULPs of the dtype over elements with |reference| >= rms / 1000."""


EPS = {d: 2.0 ** -m for d, m in MANTISSA_BITS.items()}
THRESHOLDS: dict[torch.dtype, Thresholds] = {
    torch.float32: Thresholds(cosine_min=0.999999, max_abs_eps=256.0, max_rel_eps=128.0, mean_ulp=128.0),
    torch.float16: Thresholds(cosine_min=0.9999, max_abs_eps=32.0, max_rel_eps=16.0, mean_ulp=8.0),
    torch.bfloat16: Thresholds(cosine_min=0.999, max_abs_eps=32.0, max_rel_eps=16.0, mean_ulp=8.0),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorError:
    """Error of one tensor (an output or an input gradient) against float64."""

    name: str
    numel: int
    cosine: float
    max_abs: float
    max_abs_over_rms: float
    max_rel: float
    mean_ulp: float
    max_ulp: float
    nonfinite: int
    passed: bool
    reasons: tuple[str, ...]


def ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |reference| (float64 result; subnormal spacing below the normal range)."""
    _, exponent = torch.frexp(reference.abs())
    e = torch.clamp(exponent.to(torch.float64) - 1, min=MIN_EXPONENT[dtype])
    return torch.exp2(e - MANTISSA_BITS[dtype])


def tensor_error(name: str, actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                 thresholds: Thresholds | None = None) -> TensorError:
    """Compare ``actual`` (any device, ``dtype``) with ``reference`` (float64 CPU), by ``thresholds``
    (default: the dtype's)."""
    th = thresholds or THRESHOLDS[dtype]
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    r = reference.detach().to("cpu", torch.float64).reshape(-1)
    if a.shape != r.shape:
        raise ValueError(f"{name}: shape {tuple(actual.shape)} vs reference {tuple(reference.shape)}")
    reference_finite = torch.isfinite(r)
    same_nonfinite = (torch.isnan(a) & torch.isnan(r)) | (a == r)  # NaN where the reference is NaN, the same Inf
    nonfinite = int((~torch.isfinite(a) & reference_finite).sum()) + int((~reference_finite & ~same_nonfinite).sum())
    a, r = a[reference_finite], r[reference_finite]  # the rest is measured where the reference is finite
    err = (a - r).abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    rms = max(float(r.pow(2).mean().sqrt()) if r.numel() else 0.0, 1e-300)
    denom = float(a.norm() * r.norm())
    max_abs = float(err.max()) if err.numel() else 0.0
    cosine = float((a * r).sum() / denom) if denom > 0 else (1.0 if max_abs == 0 else 0.0)
    big = r.abs() >= rms
    max_rel = float((err[big] / r[big].abs()).max()) if big.any() else 0.0
    counted = r.abs() >= rms * 1e-3
    ulps = err[counted] / ulp(r[counted], dtype) if counted.any() else torch.zeros(1, dtype=torch.float64)
    mean_ulp, max_ulp = float(ulps.mean()), float(ulps.max())
    eps = EPS[dtype]
    reasons = []
    if nonfinite:
        reasons.append(f"{nonfinite} values non-finite where the reference is finite, or differing where it is not")
    if not cosine >= th.cosine_min:
        reasons.append(f"cosine {cosine:.7f} < {th.cosine_min}")
    if not max_abs / rms <= th.max_abs_eps * eps:
        reasons.append(f"max abs error {max_abs:.3e} = {max_abs / rms / eps:.1f} eps x rms > {th.max_abs_eps:g} eps")
    if not max_rel <= th.max_rel_eps * eps:
        reasons.append(f"max relative error {max_rel:.3e} = {max_rel / eps:.1f} eps > {th.max_rel_eps:g} eps")
    if not mean_ulp <= th.mean_ulp:
        reasons.append(f"mean ULP error {mean_ulp:.2f} > {th.mean_ulp:g}")
    return TensorError(name=name, numel=actual.numel(), cosine=cosine, max_abs=max_abs, max_abs_over_rms=max_abs / rms,
                       max_rel=max_rel, mean_ulp=mean_ulp, max_ulp=max_ulp,
                       nonfinite=nonfinite, passed=not reasons, reasons=tuple(reasons))


def finite_or_str(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
