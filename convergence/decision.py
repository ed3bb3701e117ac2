"""The gate's statistical rule: a false-alarm rate per run that is stated up front, whatever the run's length.

Residuals are the candidate minus the baselines' centre on the aligned steps: loss differences, and for the
gradient norm differences of log values (ratios). The run's false-alarm budget `alpha` is split between the
loss (`loss_share`), the gradient norm (`grad_norm_share`) and the spike-rate test (`spike_share`); each
metric's share B between two tests:

* **per step** (outliers): |r_t| / s_t beyond the two-sided Student-t quantile at level
  `B * step_share / N`, N the number of steps compared (Bonferroni): a correct run trips it with
  probability at most `B * step_share`, for 100 steps as for 100,000;
* **sustained drift**: for each window of W steps (`windows`), the moving mean of r over W consecutive steps,
  divided by its own scale, beyond the quantile at `B * (1 - step_share) / (len(windows) * ceil(N / W))`
  (the windows of one scale overlap; ceil(N / W) of them are independent).

Noise has heavier tails than a normal distribution (loss spikes): the quantiles are Student-t with the
smaller of the scales' degrees of freedom and the tail's, estimated from the kurtosis of the baselines'
standardized deviations (two or more baselines) or of one baseline's step-to-step changes.

Scales (`NoiseModel`), with two or more baselines: s_t from the baselines' deviations from their mean at
each step, pooled over `pool` steps around it (each step gives n - 1 degrees of freedom, fewer when
neighbours correlate) and scaled by sqrt(1 + 1/n) for a candidate compared with an n-run mean; the window
scale from the baselines' own W-step moving means of those deviations, so noise that persists over many
steps (seed-to-seed differences do) widens the window test exactly as much as it should, and at least what
the per-step noise gives through its lag-1 correlation (AR(1)). Where the run holds too few independent
windows to measure persistent noise (fewer than `MIN_WINDOW_DOF` degrees of freedom), the documented
one-baseline window scale stands in as its floor. Both are floored (`floor_abs`, `floor_rel`), so
bit-identical baselines do not demand a bit-identical candidate. With one baseline there is no noise to
measure: fixed relative scales stand in (`fixed_step_rel`, `fixed_window_rel`, documented defaults from
published migration practice), and the stated rate holds only as far as they match the real noise.
Pure functions over NumPy arrays; `scripts/bench_gate.py` measures the operating characteristics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionRule:
    """How residuals are judged; every field is a tolerance-file key (`rule:`)."""

    alpha: float = 0.01
    """False-alarm probability per run that every statistical test may spend together."""
    loss_share: float = 0.5
    grad_norm_share: float = 0.35
    spike_share: float = 0.15
    """Shares of `alpha` for the loss tests, the gradient-norm tests and the spike-rate test (sum <= 1)."""
    step_share: float = 0.3
    """Share of a metric's budget spent on its per-step test; the rest goes to its window tests."""
    windows: tuple[int, ...] = (10, 50, 200)
    """Window lengths (steps) of the sustained-drift tests; windows longer than the run are skipped."""
    pool: int = 100
    """Steps around each step whose baseline deviations are pooled into its per-step scale."""
    floor_abs: float = 1e-6
    floor_rel: float = 1e-5
    """Scale floors, absolute and relative to |centre| (bit-identical baselines still leave room)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"rule.alpha must be in (0, 1), got {self.alpha}")
        if not 0 < self.step_share < 1:
            raise ValueError(f"rule.step_share must be in (0, 1), got {self.step_share}")
        shares = (self.loss_share, self.grad_norm_share, self.spike_share)
        if min(shares) < 0 or sum(shares) > 1 + 1e-9:
            raise ValueError(f"rule.loss_share + grad_norm_share + spike_share must be shares summing to <= 1, got "
                             f"{' + '.join(f'{x:g}' for x in shares)} = {sum(shares):g}")
        if not self.windows or any(w < 2 for w in self.windows):
            raise ValueError(f"rule.windows must be window lengths >= 2, got {list(self.windows)}")
        if self.pool < 1 or self.floor_abs < 0 or self.floor_rel < 0:
            raise ValueError(f"rule.pool must be >= 1 and the floors >= 0, got pool={self.pool} "
                             f"floor_abs={self.floor_abs} floor_rel={self.floor_rel}")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class NoiseModel:
    """Per-step scale, window scales per window length, degrees of freedom and where they came from."""

    step_scale: np.ndarray
    window_scales: dict[int, np.ndarray]
    step_dof: float
    window_dof: dict[int, float]
    source: str  # "calibrated" (from n >= 2 baselines) or "fixed"
    baselines: int
    tail_dof: float = math.inf  # the noise's own tail (Student-t dof from its kurtosis)


@dataclass(frozen=True, kw_only=True, slots=True)
class Excursion:
    """One standardized residual beyond its threshold (a step, or a window ending at `step`)."""

    step: int
    window: int  # 1 for the per-step test
    residual: float  # the mean residual over the window (metric units: loss, or log grad norm)
    scale: float
    z: float
    threshold: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The outcome of one test: comparisons made, the level spent, the excursions found."""

    test: str  # "step" or f"window{W}"
    comparisons: int
    level: float  # the false-alarm probability this test spends per run
    threshold: float
    failures: int = 0  # steps (window positions) beyond the threshold
    excursions: tuple[Excursion, ...] = ()  # the first few (one per run of consecutive windows)
    worst: Excursion | None = None
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return self.failures == 0


def _moving_mean(x: np.ndarray, w: int) -> np.ndarray:
    """Means of every run of w consecutive values (NaN where the run holds a NaN); length len(x) - w + 1."""
    if w <= 1:
        return x.copy()
    finite = np.isfinite(x)
    c = np.concatenate([[0.0], np.cumsum(np.where(finite, x, 0.0))])
    n = np.concatenate([[0], np.cumsum(finite)])
    sums, counts = c[w:] - c[:-w], n[w:] - n[:-w]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts == w, sums / np.maximum(counts, 1), np.nan)


def _pooled(sq: np.ndarray, width: int) -> np.ndarray:
    """Centred moving mean of squared deviations (NaN ignored) over `width` steps, same length as `sq`."""
    n = len(sq)
    if n == 0:
        return sq.copy()
    half = max(0, width // 2)
    finite = np.isfinite(sq)
    c = np.concatenate([[0.0], np.cumsum(np.where(finite, sq, 0.0))])
    k = np.concatenate([[0], np.cumsum(finite)])
    lo = np.clip(np.arange(n) - half, 0, n)
    hi = np.clip(np.arange(n) + half + 1, 0, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(k[hi] - k[lo] > 0, (c[hi] - c[lo]) / np.maximum(k[hi] - k[lo], 1), np.nan)


MIN_TAIL_POINTS = 40
MIN_WINDOW_DOF = 8  # independent windows x (baselines - 1) below which window noise is not measured but assumed
DEFAULT_TAIL_DOF = 8.0  # too few points to tell: moderately heavy tails, as loss noise has


def tail_dof(values: np.ndarray) -> float:
    """Student-t degrees of freedom matching the excess kurtosis of `values` (4 + 6 / k), clipped to [4.1, 100];
    `DEFAULT_TAIL_DOF` when fewer than `MIN_TAIL_POINTS` finite values are given."""
    v = values[np.isfinite(values)]
    if len(v) < MIN_TAIL_POINTS:
        return DEFAULT_TAIL_DOF
    v = v - v.mean()
    m2 = float(np.mean(v ** 2))
    if m2 <= 0:
        return 100.0
    k = float(np.mean(v ** 4)) / m2 ** 2 - 3.0
    return float(np.clip(4 + 6 / k, 4.1, 100.0)) if k > 0.06 else 100.0


def noise_model(baselines: np.ndarray, centre: np.ndarray, rule: DecisionRule, *, fixed_step_rel: float,
                fixed_window_rel: float, relative_to: np.ndarray | None = None) -> NoiseModel:
    """Scales for residuals against `centre` (the baselines' mean) from `baselines` (runs x steps); with one
    baseline the fixed fractions of |`relative_to`| (default |centre|; for log grad norms pass ones)."""
    n, steps = baselines.shape
    ref = np.abs(centre if relative_to is None else relative_to)
    floor = np.maximum(rule.floor_abs, rule.floor_rel * np.nan_to_num(ref, nan=0.0))
    windows = [w for w in rule.windows if w <= steps]
    if n < 2:
        step_scale = np.maximum(fixed_step_rel * np.nan_to_num(ref, nan=0.0), floor)
        return NoiseModel(step_scale=step_scale, source="fixed", baselines=n, step_dof=math.inf,
                          tail_dof=tail_dof(np.diff(baselines[0])) if n else DEFAULT_TAIL_DOF,
                          window_scales={w: np.maximum(fixed_window_rel * np.nan_to_num(_moving_mean(ref, w), nan=0.0),
                                                       floor[w - 1:]) for w in windows},
                          window_dof={w: math.inf for w in windows})
    dev = baselines - centre
    inflate = 1.0 + 1.0 / n  # a candidate against the mean of n runs
    with np.errstate(invalid="ignore"):
        per_step = np.nansum(dev ** 2, axis=0) / (n - 1)
    per_step = np.where(np.isfinite(dev).sum(axis=0) >= 2, per_step, np.nan)
    pooled = _pooled(per_step, rule.pool)
    step_scale = np.sqrt(np.maximum(np.nan_to_num(pooled * inflate, nan=0.0), floor ** 2))
    phi = _lag1(dev)
    # correlated neighbours carry less information: AR(1)'s effective sample size of the pooled window
    step_dof = max(1.0, (n - 1) * min(rule.pool, steps) * (1 - phi) / (1 + phi))
    window_scales, window_dof = {}, {}
    for w in windows:
        means = np.stack([_moving_mean(d, w) for d in dev])  # each baseline's window means of its deviation
        with np.errstate(invalid="ignore"):
            empirical = np.nanmean(np.nansum(means ** 2, axis=0) / (n - 1))  # pooled over every window position
        dof_empirical = max(1.0, (n - 1) * math.floor(steps / w))
        # short-memory noise seen through the per-step scale and its lag-1 correlation (many more degrees of
        # freedom); the empirical variance of the window means wins where the noise persists longer than AR(1)
        ar = _moving_mean(np.nan_to_num(pooled, nan=0.0), w) * ar1_window_factor(phi, w)
        emp = float(np.nan_to_num(empirical, nan=0.0))
        if dof_empirical >= MIN_WINDOW_DOF:
            var = np.maximum(emp, ar)
            window_dof[w] = dof_empirical if np.nanmedian(ar) < emp else step_dof
        else:  # too few windows to measure persistent noise: the documented one-baseline scale is its prior
            prior = (fixed_window_rel * np.nan_to_num(_moving_mean(ref, w), nan=0.0)) ** 2
            var = np.maximum(np.maximum(emp, ar), prior)
            window_dof[w] = step_dof
        window_scales[w] = np.sqrt(np.maximum(var * inflate, floor[w - 1:] ** 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        standardized = (dev / np.sqrt(np.maximum(pooled, floor ** 2) * (n - 1) / n)).ravel()
    return NoiseModel(step_scale=step_scale, window_scales=window_scales, step_dof=step_dof, window_dof=window_dof,
                      source="calibrated", baselines=n, tail_dof=tail_dof(standardized))


def _lag1(dev: np.ndarray) -> float:
    """Lag-1 autocorrelation of the baselines' deviations, pooled over runs and steps (clipped to [0, 0.99])."""
    x0, x1 = dev[:, :-1], dev[:, 1:]
    ok = np.isfinite(x0) & np.isfinite(x1)
    if ok.sum() < 3:
        return 0.0
    den = float(np.sum(x0[ok] ** 2))
    return float(np.clip(np.sum(x0[ok] * x1[ok]) / den, 0.0, 0.99)) if den > 0 else 0.0


def ar1_window_factor(phi: float, w: int) -> float:
    """Var(mean of w consecutive values) / Var(one value) for an AR(1) process with lag-1 correlation phi."""
    if phi <= 0:
        return 1.0 / w
    k = np.arange(1, w)
    return float((1 + 2 * np.sum((1 - k / w) * phi ** k)) / w)


def quantile(level: float, dof: float) -> float:
    """Two-sided threshold: P(|T| > q) = level for Student-t with `dof` (normal for infinite dof)."""
    level = min(max(level, 1e-300), 1.0)
    if math.isinf(dof):
        return float(stats.norm.isf(level / 2))
    return float(stats.t.isf(level / 2, dof))


def decide(steps: np.ndarray, residual: np.ndarray, model: NoiseModel, rule: DecisionRule, budget: float,
           *, limit: int = 8) -> list[Decision]:
    """The per-step test and one window test per window length over the finite residuals, spending `budget`
    (this metric's share of the run's false-alarm rate) between them (pure)."""
    finite = np.isfinite(residual)
    n = int(finite.sum())
    out: list[Decision] = []
    step_level = budget * rule.step_share
    if n == 0:
        return [Decision(test="step", comparisons=0, level=step_level, threshold=math.nan,
                         skipped="no finite residual")]
    q = quantile(step_level / n, min(model.step_dof, model.tail_dof))
    z = np.where(finite, residual / model.step_scale, 0.0)
    bad = np.flatnonzero(np.abs(z) > q)
    exc = [Excursion(step=int(steps[i]), window=1, residual=float(residual[i]), scale=float(model.step_scale[i]),
                     z=float(z[i]), threshold=q) for i in bad]
    worst = max(exc, key=lambda e: abs(e.z)) if exc else None
    out.append(Decision(test="step", comparisons=n, level=step_level, threshold=q, failures=len(exc),
                        excursions=tuple(exc[:limit]), worst=worst))
    windows = sorted(model.window_scales)
    window_level = budget * (1 - rule.step_share)
    for w in rule.windows:
        if w not in model.window_scales:
            out.append(Decision(test=f"window{w}", comparisons=0, level=0.0, threshold=math.nan,
                                skipped=f"{n} steps < window {w}"))
            continue
        means = _moving_mean(residual, w)
        scale = model.window_scales[w]
        independent = max(1, math.ceil(len(residual) / w))
        level = window_level / len(windows)
        qw = quantile(level / independent, min(model.window_dof[w], model.tail_dof))
        zw = np.where(np.isfinite(means), means / scale, 0.0)
        badw = np.flatnonzero(np.abs(zw) > qw)
        excw = [Excursion(step=int(steps[i + w - 1]), window=w, residual=float(means[i]), scale=float(scale[i]),
                          z=float(zw[i]), threshold=qw) for i in badw]
        worstw = max(excw, key=lambda e: abs(e.z)) if excw else None
        out.append(Decision(test=f"window{w}", comparisons=independent, level=level, threshold=qw,
                            failures=len(excw), excursions=tuple(_first_per_run(excw, steps)[:limit]),
                            worst=worstw))
    return out


def _first_per_run(excursions: Sequence[Excursion], steps: np.ndarray) -> list[Excursion]:
    """The first excursion of each run of consecutive failing window positions, so one drift is one entry."""
    position = {int(s): i for i, s in enumerate(steps)}
    out: list[Excursion] = []
    last = -2
    for e in excursions:
        i = position[e.step]
        if i != last + 1:
            out.append(e)
        last = i
    return out


def describe(rule: DecisionRule, model: NoiseModel, decisions: Sequence[Decision], metric: str, *,
             fixed_step_rel: float, fixed_window_rel: float, budget: float) -> str:
    """One paragraph: the rule, the level and the number of comparisons of each test."""
    parts = []
    for d in decisions:
        if d.skipped:
            parts.append(f"{d.test}: skipped ({d.skipped})")
            continue
        what = "per-step" if d.test == "step" else f"{d.test.removeprefix('window')}-step window means"
        parts.append(f"{what}: {d.comparisons} comparisons at level {d.level:.2%}, |z| <= {d.threshold:.2f}")
    scale = ("scales from the spread of {} baselines".format(model.baselines) if model.source == "calibrated" else
             f"fixed scales (one baseline): {fixed_step_rel:.2%} of the baseline per step, "
             f"{fixed_window_rel:.2%} per window mean")
    tails = f"Student-t tails with {model.tail_dof:.1f} degrees of freedom (from the noise's kurtosis)" \
        if math.isfinite(model.tail_dof) and model.tail_dof < 100 else "normal tails"
    return (f"{metric}: false-alarm rate <= {budget:.2%} per run of the gate's {rule.alpha:.2%}, whatever the run's "
            f"length; {scale}; {tails}; " + "; ".join(parts))
