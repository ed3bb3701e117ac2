"""Per-step acceptance bands for the candidate, and where each band came from.

One baseline: the fixed tolerances (``source = "fixed"``). Two or more baselines
(seeds, or repeats of a nondeterministic run): half-width = ``factor`` x rolling max
of the baselines' spread at that step (``"calibrated"``), never below the floors
``min_abs`` / ``min_rel`` x |centre| (``"floor"``). Loss bands are additive; grad-norm
bands are multiplicative (computed on log grad norm).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from convergence.series import Aligned
from convergence.tolerances import Tolerances


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Bands:
    """Acceptance interval [lower, upper] per aligned step around ``center``."""

    metric: str
    steps: np.ndarray
    center: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    source: tuple[str, ...]
    rule: str
    """One sentence saying how the bands were derived (for the report)."""

    @property
    def calibrated(self) -> bool:
        return any(s != "fixed" for s in self.source)

    def provenance(self) -> dict[str, int]:
        """Steps per band source, e.g. {'calibrated': 57, 'floor': 3}."""
        return dict(Counter(self.source))

    def contains(self, values: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """values[i] inside the band of aligned step idx[i] (all steps when idx is None)."""
        lower = self.lower if idx is None else self.lower[idx]
        upper = self.upper if idx is None else self.upper[idx]
        return (values >= lower) & (values <= upper)

    def index_of(self, step: int) -> int | None:
        i = int(np.searchsorted(self.steps, step))
        return i if i < len(self.steps) and int(self.steps[i]) == step else None


def rolling_max(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling maximum (NaN ignored; all-NaN windows give NaN)."""
    n = len(values)
    if n == 0 or window <= 1:
        return values.copy()
    half = window // 2
    out = np.empty(n)
    for i in range(n):
        chunk = values[max(0, i - half): i + half + 1]
        finite = chunk[np.isfinite(chunk)]
        out[i] = finite.max() if finite.size else np.nan
    return out


def _center(rows: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        masked = np.where(np.isfinite(rows), rows, np.nan)
        valid = np.isfinite(masked).any(axis=0)
        center = np.full(rows.shape[1], np.nan)
        if valid.any():
            center[valid] = np.nanmean(masked[:, valid], axis=0)
    return center


def _spread(rows: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        masked = np.where(np.isfinite(rows), rows, np.nan)
        valid = np.isfinite(masked).sum(axis=0) >= 2
        spread = np.full(rows.shape[1], np.nan)
        if valid.any():
            spread[valid] = np.nanmax(masked[:, valid], axis=0) - np.nanmin(masked[:, valid], axis=0)
    return spread


def loss_bands(aligned: Aligned, tol: Tolerances) -> Bands:
    """Additive loss bands on the aligned steps."""
    rows = aligned.baselines
    center = _center(rows)
    if rows.shape[0] >= 2:
        cal = tol.calibration
        noise = cal.factor * rolling_max(_spread(rows), cal.window)
        floor = np.maximum(cal.min_abs, cal.min_rel * np.abs(center))
        noise = np.where(np.isfinite(noise), noise, floor)
        half = np.maximum(noise, floor)
        source = tuple("calibrated" if n >= f else "floor" for n, f in zip(noise, floor))
        rule = (f"calibrated from {rows.shape[0]} baselines: {cal.factor:g} x rolling max (window "
                f"{cal.window}) of their spread, floor max({cal.min_abs:g}, {cal.min_rel:g} x |loss|)")
    else:
        half = np.maximum(tol.loss.step_abs, tol.loss.step_rel * np.abs(center))
        source = ("fixed",) * len(center)
        rule = f"fixed: max({tol.loss.step_abs:g}, {tol.loss.step_rel:g} x |baseline loss|) per step"
    return Bands(metric="loss", steps=aligned.steps, center=center, lower=center - half,
                 upper=center + half, source=source, rule=rule)


def grad_norm_bands(aligned: Aligned, tol: Tolerances) -> Bands:
    """Multiplicative grad-norm bands (ratio to the geometric-mean baseline)."""
    with np.errstate(all="ignore"):
        logs = np.log(np.where(aligned.baselines > 0, aligned.baselines, np.nan))
    center_log = _center(logs)
    center = np.exp(center_log)
    if logs.shape[0] >= 2:
        cal = tol.calibration
        noise = cal.factor * rolling_max(_spread(logs), cal.window)
        floor = np.full(len(center), np.log1p(max(cal.min_rel, 1e-12)))
        noise = np.where(np.isfinite(noise), noise, floor)
        half = np.maximum(noise, floor)
        source = tuple("calibrated" if n >= f else "floor" for n, f in zip(noise, floor))
        lower, upper = center * np.exp(-half), center * np.exp(half)
        rule = (f"calibrated from {logs.shape[0]} baselines: ratio band exp(+-{cal.factor:g} x rolling "
                f"max (window {cal.window}) of the spread of log grad norm), floor {cal.min_rel:g}")
    else:
        lower, upper = center * tol.grad_norm.ratio_low, center * tol.grad_norm.ratio_high
        source = ("fixed",) * len(center)
        rule = f"fixed: candidate / baseline in [{tol.grad_norm.ratio_low:g}, {tol.grad_norm.ratio_high:g}]"
    return Bands(metric="grad_norm", steps=aligned.steps, center=center, lower=lower, upper=upper,
                 source=source, rule=rule)
