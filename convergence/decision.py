"""The gate's statistical rule: a false-alarm rate per run that is stated up front, whatever the run's length.

The residual r_t is the candidate minus the baselines' centre on the aligned steps (loss; for the gradient
norm, log values: ratios). A good run's residual is a level (its whole-run offset: another seed settles a
little higher or lower), slow wander, and step-to-step noise; a fault is a step change, a drift, an outlier
or a divergence. Each part has its own test, and the run's false-alarm budget `alpha` is split between the
loss (`loss_share`), the gradient norm (`grad_norm_share`) and the spike-rate test (`spike_share`); each
metric's share B between its tests:

* **level** (`level_share`): the mean residual after the warm-up, against the spread of good runs' levels;
  one comparison at level `B * level_share`;
* **per step** (`step_share`, outliers): r_t minus the residual's running median, against the per-step
  noise, beyond the two-sided Student-t quantile at level `B * step_share / N` for N steps (Bonferroni): a
  correct run trips it with probability at most `B * step_share`, for 100 steps as for 100,000;
* **drift** (the rest, split over the window lengths `windows`): the mean residual over each window of W
  steps minus its mean over every step before the window (a change inside the run, which cancels the run's
  level), against the noise of that difference, beyond the quantile at the window's share divided by the
  `SCAN_FACTOR` x ceil(N / W) (a window slid over every position tests more than the disjoint ones).

Noise (`NoiseModel`). Per-step noise is always measured: from the baselines' deviations from their centre
(two or more, each high-pass filtered by its running median), or from one baseline's own step-to-step
roughness (the candidate has as much again). Level and wander cannot be measured from one run: documented
priors stand in (`level_rel`, `window_rel` of the tolerances: published migration practice and the
seed-to-seed spread of the built-in workloads), never above `prior_noise_ratio` times the measured per-step
noise (runs that agree to 1e-7 per step do not differ by 0.5 % in level). With two or more baselines the
measured level spread and wander are pooled with the priors, which weigh as `prior_dof` runs or windows, so
many baselines or long runs let the measurement win. Tails: Student-t with the degrees of freedom of the
noise's kurtosis. Every scale is floored (`floor_abs`, `floor_rel`). Pure functions over NumPy arrays;
`scripts/bench_gate.py` measures the operating characteristics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import ndimage, stats


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
    level_share: float = 0.2
    """Shares of a metric's budget for its per-step and level tests; the rest goes to its drift tests."""
    windows: tuple[int, ...] = (20, 50, 200)
    """Window lengths (steps) of the drift tests."""
    min_reference: int = 50
    """Steps a drift window needs before it (at least its own length too), so the reference is a level."""
    pool: int = 100
    """Steps around each step whose noise is pooled into its per-step scale."""
    smooth: int = 21
    """Width (steps) of the running median that separates step-to-step noise from the slower residual."""
    prior_dof: float = 8.0
    """Weight of the level and wander priors, in baselines (level) or windows (wander), against the
    spread measured from two or more baselines."""
    prior_noise_ratio: float = 1.0
    """The priors never exceed this multiple of the measured per-step noise."""
    floor_abs: float = 1e-6
    floor_rel: float = 1e-5
    """Scale floors, absolute and relative to |centre| (bit-identical baselines still leave room)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"rule.alpha must be in (0, 1), got {self.alpha}")
        if not (0 < self.step_share < 1 and 0 < self.level_share < 1 and self.step_share + self.level_share < 1):
            raise ValueError(f"rule.step_share and rule.level_share must be in (0, 1) with a sum < 1, got "
                             f"{self.step_share} + {self.level_share}")
        shares = (self.loss_share, self.grad_norm_share, self.spike_share)
        if min(shares) < 0 or sum(shares) > 1 + 1e-9:
            raise ValueError(f"rule.loss_share + grad_norm_share + spike_share must be shares summing to <= 1, got "
                             f"{' + '.join(f'{x:g}' for x in shares)} = {sum(shares):g}")
        if not self.windows or any(w < 2 for w in self.windows):
            raise ValueError(f"rule.windows must be window lengths >= 2, got {list(self.windows)}")
        if self.min_reference < 1 or self.pool < 1 or self.smooth < 3 or self.floor_abs < 0 or self.floor_rel < 0:
            raise ValueError(f"rule.pool must be >= 1, rule.smooth >= 3 and the floors >= 0, got pool={self.pool} "
                             f"smooth={self.smooth} floor_abs={self.floor_abs} floor_rel={self.floor_rel}")
        if self.prior_dof <= 0 or self.prior_noise_ratio <= 0:
            raise ValueError(f"rule.prior_dof and rule.prior_noise_ratio must be > 0, got {self.prior_dof} and "
                             f"{self.prior_noise_ratio}")

    @property
    def drift_share(self) -> float:
        return 1.0 - self.step_share - self.level_share


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Priors:
    """One metric's documented noise where the baselines cannot measure it, in the metric's units."""

    level: float
    """Standard deviation of one good run's level (whole-run mean) about the true centre."""
    window: float | np.ndarray
    """Standard deviation of one good run's wander about its own level (for all steps, or per step: a relative
    prior follows the metric's level along the run)."""
    step: float | np.ndarray = 0.0
    """One baseline: the least step noise the residual is given (per step or for all), so that a stretch where
    the baseline alone looks smooth (a steep start) does not demand a candidate equal to it."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class NoiseModel:
    """The residual's noise: per step (after the running median), its level, its wander per window length.
    Every scale is that of the residual (candidate minus centre), so the centre's own noise is included."""

    step_scale: np.ndarray
    phi: float
    """Lag-1 autocorrelation of the step-to-step noise."""
    level_scale: float
    wander: dict[int, np.ndarray]
    """Standard deviation of one run's wander in a mean over each window length, per step of the run."""
    wander_dof: dict[int, float]
    """Degrees of freedom of each wander estimate (the prior's and the measured windows')."""
    step_dof: float
    source: str  # "calibrated" (from n >= 2 baselines) or "prior" (one baseline: level and wander assumed)
    baselines: int
    level_source: str
    level_dof: float
    """Degrees of freedom of the level scale: the prior's weight plus the baselines' (infinite for a prior alone)."""
    inflate: float
    """Variance of the residual over one run's: 1 + 1/n against n baselines, 2 against one."""
    tail_dof: float = math.inf  # the noise's own tail (Student-t dof from its kurtosis)


@dataclass(frozen=True, kw_only=True, slots=True)
class Excursion:
    """One standardized statistic beyond its threshold (a step, the level, or a window ending at `step`)."""

    step: int
    window: int  # 1 for the per-step test, 0 for the level test
    residual: float  # the statistic in metric units: loss, or log grad norm
    scale: float
    z: float
    threshold: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The outcome of one test: comparisons made, the level spent, the excursions found."""

    test: str  # "step", "level" or f"window{W}"
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


def running_median(x: np.ndarray, width: int) -> np.ndarray:
    """Centred running median over `width` steps (NaN steps are bridged by interpolation first)."""
    finite = np.isfinite(x)
    if not finite.any():
        return np.full_like(x, np.nan, dtype=float)
    idx = np.arange(len(x))
    filled = np.interp(idx, idx[finite], x[finite]) if not finite.all() else x.astype(float)
    return ndimage.median_filter(filled, size=min(width, len(x)) | 1, mode="nearest")


WANDER_PHI = 0.99
"""Wander is modelled as a slow AR(1) with this lag-1 correlation (a time constant of 100 steps): the prior's
variance for a mean over L steps is `window`^2 x ar1_window_factor(WANDER_PHI, L)."""
SCAN_FACTOR = 3
"""A window slid over every position makes about this many times more effective comparisons than the
disjoint windows it spans, at the thresholds used (a scan statistic; measured by scripts/bench_gate.py)."""
MIN_TAIL_POINTS = 40
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


def _lag1(dev: np.ndarray) -> float:
    """Lag-1 autocorrelation of deviations (runs x steps), pooled over runs and steps (clipped to [0, 0.99])."""
    x0, x1 = dev[:, :-1], dev[:, 1:]
    ok = np.isfinite(x0) & np.isfinite(x1)
    if ok.sum() < 3:
        return 0.0
    den = float(np.sum(x0[ok] ** 2))
    return float(np.clip(np.sum(x0[ok] * x1[ok]) / den, 0.0, 0.99)) if den > 0 else 0.0


def ar1_window_factor(phi: float, w: int | np.ndarray) -> float | np.ndarray:
    """Var(mean of w consecutive values) / Var(one value) for an AR(1) process with lag-1 correlation phi
    (closed form; `w` may be an array)."""
    n = np.maximum(np.asarray(w, dtype=float), 1.0)
    if phi <= 0:
        out = np.asarray(1.0 / n)
    else:
        out = np.asarray(((1 + phi) / (1 - phi) - 2 * phi * (1 - phi ** n) / (n * (1 - phi) ** 2)) / n)
    return float(out) if out.ndim == 0 else out


def adjacent_covariance(phi: float, a: int, b: int | np.ndarray) -> float | np.ndarray:
    """Cov(mean of a block of a values, mean of the b values just before it) / Var(one value) for an AR(1)
    process with lag-1 correlation phi."""
    n = np.maximum(np.asarray(b, dtype=float), 1.0)
    if phi <= 0:
        return np.zeros_like(n) if n.ndim else 0.0
    out = np.asarray(phi * (1 - phi ** a) * (1 - phi ** n) / ((1 - phi) ** 2 * a * n))
    return float(out) if out.ndim == 0 else out


def _pool_prior(prior_var: float, prior_dof: float, measured_var: float, measured_dof: float) -> float:
    """The prior and the measurement, each weighted by its degrees of freedom (a scaled inverse-chi2 update)."""
    return (prior_dof * prior_var + measured_dof * measured_var) / (prior_dof + measured_dof)


def noise_model(baselines: np.ndarray, centre: np.ndarray, rule: DecisionRule, priors: Priors, *,
                warmup: int = 0) -> NoiseModel:
    """The residual's noise for a candidate compared with `centre`, the mean of `baselines` (runs x steps).
    `priors` are in the metric's units (the caller scales relative priors by the baseline's level)."""
    n, steps = baselines.shape
    ref = float(np.nanmean(np.abs(centre))) if np.isfinite(centre).any() else 0.0
    floor = max(rule.floor_abs, rule.floor_rel * ref)
    windows = sorted(w for w in rule.windows if w + max(w, rule.min_reference) <= steps)
    own = baselines - np.stack([running_median(b, rule.smooth) for b in baselines])  # each run's own step noise
    if n >= 2:
        dev = baselines - centre
        high = np.stack([d - running_median(d, rule.smooth) for d in dev])
        with np.errstate(invalid="ignore"):
            var_t = np.nansum(high ** 2, axis=0) / (n - 1)  # one run's step noise about the centre
        inflate = 1.0 + 1.0 / n  # the candidate's own noise plus the centre's
    else:
        dev = None
        high = own
        var_t = high[0] ** 2
        inflate = 2.0  # the candidate is as noisy as the baseline, and nothing averages the baseline's out
    pooled = np.nan_to_num(_pooled(var_t, rule.pool), nan=0.0)
    if n < 2:
        pooled = np.maximum(pooled, np.broadcast_to(np.nan_to_num(priors.step, nan=0.0), pooled.shape) ** 2 / inflate)
    step_scale = np.sqrt(np.maximum(pooled * inflate, floor ** 2))
    phi = _lag1(high)
    step_dof = max(1.0, max(1, n - 1) * min(rule.pool, steps) * (1 - phi) / (1 + phi))
    run_var = float(np.mean(pooled[warmup:])) if steps > warmup else float(np.mean(pooled))
    cap = rule.prior_noise_ratio ** 2 * run_var  # priors never above this multiple of the measured noise
    level_prior = min(priors.level ** 2, cap)
    wander_prior = np.minimum(np.broadcast_to(np.asarray(priors.window, dtype=float) ** 2, (steps,)),
                              rule.prior_noise_ratio ** 2 * pooled)
    within = run_var * float(ar1_window_factor(phi, max(1, steps - warmup)))  # the level's own step noise
    if dev is not None:
        levels = np.nanmean(dev[:, warmup:], axis=1) if steps > warmup else np.nanmean(dev, axis=1)
        spread = float(np.sum(levels ** 2) / (n - 1))
        level_var = _pool_prior(level_prior, rule.prior_dof, max(0.0, spread - within), n - 1)
        level_source = f"{n} baselines' levels pooled with the prior"
    else:
        level_var = level_prior
        level_source = "prior (one baseline)"
    level_scale = math.sqrt(max((level_var + within) * inflate, floor ** 2))
    wander: dict[int, np.ndarray] = {}
    wander_dof: dict[int, float] = {}
    body = None if dev is None else dev[:, warmup:] - np.nanmean(dev[:, warmup:], axis=1, keepdims=True)
    for w in windows:
        if body is not None:
            blocks = body.shape[1] // w
            means = np.nanmean(body[:, :blocks * w].reshape(n, blocks, w), axis=2) if blocks else np.zeros((n, 0))
            measured = float(np.nansum(means ** 2) / ((n - 1) * max(blocks, 1)))
            excess = max(0.0, measured - run_var * float(ar1_window_factor(phi, w)))
            prior_w = wander_prior * ar1_window_factor(WANDER_PHI, w)
            wander[w] = np.sqrt(_pool_prior(prior_w, rule.prior_dof, excess, (n - 1) * blocks))
            wander_dof[w] = rule.prior_dof + (n - 1) * blocks
        else:
            wander[w] = np.sqrt(wander_prior * ar1_window_factor(WANDER_PHI, w))
            wander_dof[w] = math.inf  # a prior taken as known
    # tails: each baseline's own step-to-step noise, as the candidate has it (deviations from a mean of a few
    # runs average the tails away)
    own_var = np.nan_to_num(_pooled(np.nanmean(own ** 2, axis=0), rule.pool), nan=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        standardized = (own / np.sqrt(np.maximum(own_var, floor ** 2))).ravel()
    return NoiseModel(step_scale=step_scale, phi=phi, level_scale=level_scale, wander=wander, wander_dof=wander_dof,
                      step_dof=step_dof, source="calibrated" if n >= 2 else "prior", baselines=n,
                      level_source=level_source,
                      level_dof=rule.prior_dof + n - 1 if n >= 2 else math.inf,
                      inflate=inflate, tail_dof=tail_dof(standardized))


def quantile(level: float, dof: float) -> float:
    """Two-sided threshold: P(|T| > q) = level for Student-t with `dof` (normal for infinite dof)."""
    level = min(max(level, 1e-300), 1.0)
    if math.isinf(dof):
        return float(stats.norm.isf(level / 2))
    return float(stats.t.isf(level / 2, dof))


def _cumulative(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    finite = np.isfinite(x)
    return (np.concatenate([[0.0], np.cumsum(np.where(finite, x, 0.0))]),
            np.concatenate([[0], np.cumsum(finite)]))


def decide(steps: np.ndarray, residual: np.ndarray, model: NoiseModel, rule: DecisionRule, budget: float,
           *, warmup: int = 0, limit: int = 8) -> list[Decision]:
    """The per-step, level and drift tests over the finite residuals, spending `budget` (this metric's share
    of the run's false-alarm rate) between them (pure)."""
    finite = np.isfinite(residual)
    n = int(finite.sum())
    step_level = budget * rule.step_share
    if n == 0:
        return [Decision(test="step", comparisons=0, level=step_level, threshold=math.nan,
                         skipped="no finite residual")]
    tail = min(model.step_dof, model.tail_dof)
    out: list[Decision] = []
    q = quantile(step_level / n, tail)
    local = running_median(residual, rule.smooth)
    z = np.where(finite, (residual - local) / model.step_scale, 0.0)
    bad = np.flatnonzero(np.abs(z) > q)
    exc = [Excursion(step=int(steps[i]), window=1, residual=float(residual[i] - local[i]),
                     scale=float(model.step_scale[i]), z=float(z[i]), threshold=q) for i in bad]
    out.append(Decision(test="step", comparisons=n, level=step_level, threshold=q, failures=len(exc),
                        excursions=tuple(exc[:limit]), worst=max(exc, key=lambda e: abs(e.z)) if exc else None))

    body = residual[warmup:] if len(residual) > warmup else residual
    level_level = budget * rule.level_share
    ql = quantile(level_level, model.level_dof)
    mean = float(np.nanmean(body)) if np.isfinite(body).any() else 0.0
    zl = mean / model.level_scale
    lexc = Excursion(step=int(steps[-1]), window=0, residual=mean, scale=model.level_scale, z=zl, threshold=ql)
    out.append(Decision(test="level", comparisons=1, level=level_level, threshold=ql, failures=int(abs(zl) > ql),
                        excursions=(lexc,) if abs(zl) > ql else (), worst=lexc))

    windows = [w for w in rule.windows if w in model.wander]
    drift_level = budget * rule.drift_share / max(1, len(windows))
    sums = _cumulative(residual)
    variances = _cumulative(np.where(finite, model.step_scale ** 2, np.nan))[0]
    for w in rule.windows:
        out.append(_drift(w, steps, residual, sums, variances, model, rule, drift_level, warmup=warmup, limit=limit))
    return out


def _drift(w: int, steps: np.ndarray, residual: np.ndarray, sums: tuple[np.ndarray, np.ndarray],
           variances: np.ndarray, model: NoiseModel, rule: DecisionRule, level: float, *, warmup: int,
           limit: int) -> Decision:
    """The drift test of one window length: the mean over each window of `w` steps minus the mean over every
    step before it (from `warmup`), against its noise; `sums` and `variances` are cumulative sums (counts) of
    the residual and of its per-step variance."""
    reach = max(w, rule.min_reference)
    if w not in model.wander:
        return Decision(test=f"window{w}", comparisons=0, level=0.0, threshold=math.nan,
                        skipped=f"{len(residual)} steps < the window {w} and the {reach} steps before it")
    ends = np.arange(warmup + reach + w - 1, len(residual))  # window [e - w + 1, e], reference [warmup, e - w]
    if not len(ends):
        return Decision(test=f"window{w}", comparisons=0, level=0.0, threshold=math.nan,
                        skipped=f"{len(residual) - warmup} steps after the warm-up < the window {w} and the "
                                f"{reach} steps before it")
    c, k = sums
    win_n = k[ends + 1] - k[ends + 1 - w]
    ref_n = k[ends + 1 - w] - k[warmup]
    ok = (win_n >= max(2, w // 2)) & (ref_n >= max(2, reach // 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        win = (c[ends + 1] - c[ends + 1 - w]) / win_n
        ref = (c[ends + 1 - w] - c[warmup]) / ref_n
        var_w = (variances[ends + 1] - variances[ends + 1 - w]) / win_n
        var_r = (variances[ends + 1 - w] - variances[warmup]) / ref_n
    # wander: the same slow AR(1) over the window and over the reference just before it (at the level of the
    # reference's middle), which move together: Var(mean_w - mean_r) = Var_w + Var_r - 2 Cov
    at_window = model.wander[w][ends]
    sd_w = at_window / math.sqrt(ar1_window_factor(WANDER_PHI, w))  # the process's own sd, at each level
    sd_r = model.wander[w][(warmup + ends + 1 - w) // 2] / math.sqrt(ar1_window_factor(WANDER_PHI, w))
    wander_var = (at_window ** 2 + sd_r ** 2 * ar1_window_factor(WANDER_PHI, ref_n)
                  - 2 * sd_w * sd_r * adjacent_covariance(WANDER_PHI, w, ref_n))
    var = (var_w * ar1_window_factor(model.phi, w) + var_r * ar1_window_factor(model.phi, ref_n)
           + model.inflate * np.maximum(wander_var, 0.0))
    scale = np.sqrt(np.maximum(var, 1e-300))
    diff = np.where(ok, win - ref, 0.0)
    z = np.where(ok, diff / scale, 0.0)
    comparisons = SCAN_FACTOR * max(1, math.ceil((len(residual) - warmup - reach) / w))
    # a mean of w steps has 1/w of the steps' excess kurtosis: its Student-t dof grow with w
    window_tail = math.inf if model.tail_dof >= 100 else 4 + (model.tail_dof - 4) * w
    q = quantile(level / comparisons, min(model.step_dof, window_tail, model.wander_dof[w]))
    exc = [Excursion(step=int(steps[ends[i]]), window=w, residual=float(diff[i]), scale=float(scale[i]),
                     z=float(z[i]), threshold=q) for i in np.flatnonzero(np.abs(z) > q)]
    return Decision(test=f"window{w}", comparisons=comparisons, level=level, threshold=q, failures=len(exc),
                    excursions=tuple(_first_per_run(exc, steps)[:limit]),
                    worst=max(exc, key=lambda e: abs(e.z)) if exc else None)


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
             budget: float, units: str) -> str:
    """One paragraph: the rule, the level and the number of comparisons of each test, where the scales came from."""
    parts = []
    for d in decisions:
        if d.skipped:
            parts.append(f"{d.test}: skipped ({d.skipped})")
        elif d.test == "step":
            parts.append(f"per step (minus the running median of {rule.smooth}): {d.comparisons} comparisons at "
                         f"level {d.level:.2%}, |z| <= {d.threshold:.2f}")
        elif d.test == "level":
            parts.append(f"level (mean after the warm-up): 1 comparison at level {d.level:.2%}, |z| <= "
                         f"{d.threshold:.2f} with scale {model.level_scale:.3g} {units} ({model.level_source})")
        else:
            parts.append(f"drift over {d.test.removeprefix('window')} steps against every step before: "
                         f"{d.comparisons} windows at level {d.level:.2%}, |z| <= {d.threshold:.2f}")
    scale = (f"per-step noise from the spread of {model.baselines} baselines" if model.source == "calibrated" else
             "per-step noise from the baseline's own step-to-step noise (the candidate's counted as equal); level "
             "and wander from the documented priors")
    tails = f"Student-t tails with {model.tail_dof:.1f} degrees of freedom (from the noise's kurtosis)" \
        if math.isfinite(model.tail_dof) and model.tail_dof < 100 else "normal tails"
    return (f"{metric}: false-alarm rate <= {budget:.2%} per run of the gate's {rule.alpha:.2%}, whatever the run's "
            f"length; {scale}; {tails}; " + "; ".join(parts))
