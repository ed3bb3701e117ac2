"""Per-step acceptance bands for the candidate, and where each band came from.

The bands are the per-step test of the decision rule (:mod:`convergence.decision`) drawn as
intervals: centre +- threshold x per-step noise scale, the threshold being the Bonferroni-corrected
Student-t quantile for the steps compared. One baseline: fixed scales (``source = "fixed"``);
two or more: scales from their spread (``"calibrated"``), never below the floors
(``"floor"``). Loss bands are additive; grad-norm bands are multiplicative (log grad norm).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from convergence.decision import Decision, DecisionRule, NoiseModel, decide, describe, noise_model


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


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MetricJudgement:
    """One metric judged by the decision rule: its bands (for the checks and the plots), the noise model,
    the residuals and each test's decision, and the rule in words."""

    bands: Bands
    model: NoiseModel
    residual: np.ndarray
    decisions: tuple[Decision, ...]
    text: str


def _centre(rows: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        masked = np.where(np.isfinite(rows), rows, np.nan)
        valid = np.isfinite(masked).any(axis=0)
        centre = np.full(rows.shape[1], np.nan)
        if valid.any():
            centre[valid] = np.nanmean(masked[:, valid], axis=0)
    return centre


def judge(metric: str, steps: np.ndarray, baselines: np.ndarray, candidate: np.ndarray, rule: DecisionRule, *,
          budget: float, fixed_step_rel: float, fixed_window_rel: float, log: bool = False) -> MetricJudgement:
    """Judge `candidate` against `baselines` (runs x steps) on `steps` with the decision rule. `log`: compare
    log values (grad norm: ratios), the bands then being multiplicative around the geometric mean."""
    with np.errstate(all="ignore"):
        rows = np.log(np.where(baselines > 0, baselines, np.nan)) if log else baselines
        cand = np.log(np.where(candidate > 0, candidate, np.nan)) if log else candidate
    centre = _centre(rows)
    model = noise_model(rows, centre, rule, fixed_step_rel=fixed_step_rel, fixed_window_rel=fixed_window_rel,
                        relative_to=np.ones_like(centre) if log else None)
    residual = cand - centre
    decisions = tuple(decide(steps, residual, model, rule, budget))
    q = decisions[0].threshold if math.isfinite(decisions[0].threshold) else 0.0
    half = q * model.step_scale
    with np.errstate(all="ignore"):
        floor = np.maximum(rule.floor_abs, rule.floor_rel * np.abs(np.ones_like(centre) if log else centre))
    at_floor = model.step_scale <= floor * (1 + 1e-9)
    source = tuple("fixed" if model.source == "fixed" else ("floor" if f else "calibrated") for f in at_floor)
    text = describe(rule, model, decisions, metric, fixed_step_rel=fixed_step_rel, fixed_window_rel=fixed_window_rel,
                    budget=budget)
    if log:
        bands = Bands(metric=metric, steps=steps, center=np.exp(centre), lower=np.exp(centre - half),
                      upper=np.exp(centre + half), source=source, rule=text)
    else:
        bands = Bands(metric=metric, steps=steps, center=centre, lower=centre - half, upper=centre + half,
                      source=source, rule=text)
    return MetricJudgement(bands=bands, model=model, residual=residual, decisions=decisions, text=text)
