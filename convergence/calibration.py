"""Per-step acceptance bands for the candidate, and where each band came from.

The bands draw the decision rule (:mod:`convergence.decision`) as intervals: where one step of a good
run may lie about the baselines' centre (its step noise, level and wander), times the per-step test's
Bonferroni-corrected Student-t quantile. One baseline: level and wander from the priors (``source =
"prior"``); two or more: scales from their spread (``"calibrated"``), never below the floors
(``"floor"``). Loss bands are additive; grad-norm bands are multiplicative (log grad norm).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from convergence.decision import Decision, DecisionRule, NoiseModel, Priors, decide, describe, noise_model


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
        return any(s != "prior" for s in self.source)

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
          budget: float, level_rel: float, window_rel: float, step_rel: float, warmup: int = 0, log: bool = False
          ) -> MetricJudgement:
    """Judge `candidate` against `baselines` (runs x steps) on `steps` with the decision rule. `log`: compare
    log values (grad norm: ratios), the bands then being multiplicative around the geometric mean; the priors
    `level_rel` and `window_rel` are fractions of the baseline's level, `step_rel` of its value at each step
    (of 1 for log values)."""
    with np.errstate(all="ignore"):
        rows = np.log(np.where(baselines > 0, baselines, np.nan)) if log else baselines
        cand = np.log(np.where(candidate > 0, candidate, np.nan)) if log else candidate
    centre = _centre(rows)
    warmup = min(warmup, max(0, len(steps) - 1))
    if log:  # log values: the priors are fractions of 1
        priors = Priors(level=level_rel, window=window_rel, step=step_rel)
    else:  # fractions of the loss: its mean after the warm-up (level), its value at each step (wander, step)
        local = np.abs(centre)
        unit = float(np.nanmean(local[warmup:])) if np.isfinite(local[warmup:]).any() else 0.0
        local = np.nan_to_num(local, nan=unit)
        priors = Priors(level=level_rel * unit, window=window_rel * local, step=step_rel * local)
    model = noise_model(rows, centre, rule, priors, warmup=warmup)
    residual = cand - centre
    decisions = tuple(decide(steps, residual, model, rule, budget, warmup=warmup))
    q = decisions[0].threshold if math.isfinite(decisions[0].threshold) else 0.0
    smallest = model.wander[min(model.wander)] if model.wander else 0.0
    # one step of a good run about the centre: its step noise, its level and its wander
    half = q * np.sqrt(model.step_scale ** 2 + model.level_scale ** 2 + model.inflate * smallest ** 2)
    with np.errstate(all="ignore"):
        floor = np.maximum(rule.floor_abs, rule.floor_rel * np.abs(np.ones_like(centre) if log else centre))
    at_floor = model.step_scale <= floor * (1 + 1e-9)
    source = tuple("prior" if model.source == "prior" else ("floor" if f else "calibrated") for f in at_floor)
    text = describe(rule, model, decisions, metric, budget=budget, units="log" if log else metric)
    if log:
        bands = Bands(metric=metric, steps=steps, center=np.exp(centre), lower=np.exp(centre - half),
                      upper=np.exp(centre + half), source=source, rule=text)
    else:
        bands = Bands(metric=metric, steps=steps, center=centre, lower=centre - half, upper=centre + half,
                      source=source, rule=text)
    return MetricJudgement(bands=bands, model=model, residual=residual, decisions=decisions, text=text)
