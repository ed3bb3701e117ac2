"""Long-run stability of one run: memory growth, step-time tails and periodic slowdowns, loss health,
and recovery from failures; pure.

A run comes in segments: a failure and its recovery start a new segment (fresh processes, whose memory
starts over, resumed from an older step). Trends are fitted with one slope common to all segments and a
level of their own each, so a restart is neither growth nor shrinkage. Every check returns a
`convergence.checks.CheckResult` whose reason prints every number it used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergence.checks import CheckResult, check_nonfinite, check_restart_continuity, spike_steps
from convergence.series import resolve_restarts
from convergence.tolerances import NonFiniteTolerance, Tolerances

PER = 1000  # trends are stated per this many steps


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Per-step values of one segment of a run (steps strictly increasing)."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise ValueError(f"Segment: {len(self.steps)} steps but {len(self.values)} values")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError(f"Segment: steps not strictly increasing: {self.steps[:10]}...")

    def after_warmup(self, warmup: int) -> Segment:
        """The segment without its first `warmup` steps."""
        return Segment(steps=self.steps[warmup:], values=self.values[warmup:])


@dataclass(frozen=True, kw_only=True, slots=True)
class Trend:
    """A slope per `PER` steps common to every segment (each with its own level) and its two-sided
    `confidence` interval, from Newey-West (heteroskedasticity and autocorrelation consistent) errors
    with Bartlett weights up to `lag`, Student-t with `points - segments - 1` degrees of freedom."""

    slope: float
    lower: float
    upper: float
    points: int
    segments: int
    confidence: float
    lag: int


def newey_west_lag(points: int) -> int:
    """Newey and West's (1994) automatic lag for the Bartlett kernel: floor(4 (n/100)^(2/9))."""
    return int(math.floor(4 * (points / 100) ** (2 / 9)))


def fit_trend(segments: Sequence[Segment], *, confidence: float) -> Trend | None:
    """The common slope of `segments` per `PER` steps, or None when fewer than 3 finite points (or one
    step per segment) leave nothing to fit."""
    from scipy import stats

    xs, ys = [], []
    for seg in segments:
        x = np.asarray(seg.steps, dtype=np.float64)
        y = np.asarray(seg.values, dtype=np.float64)
        keep = np.isfinite(y)
        x, y = x[keep], y[keep]
        if len(x) >= 2:
            xs.append(x - x.mean())
            ys.append(y - y.mean())
    points = sum(len(x) for x in xs)
    sxx = sum(float(x @ x) for x in xs)
    dof = points - len(xs) - 1
    if points < 3 or sxx == 0 or dof < 1:
        return None
    beta = sum(float(x @ y) for x, y in zip(xs, ys)) / sxx
    lag = newey_west_lag(points)
    s = 0.0
    for x, y in zip(xs, ys):
        u = x * (y - beta * x)
        s += float(u @ u)
        for k in range(1, min(lag, len(u) - 1) + 1):
            s += 2 * (1 - k / (lag + 1)) * float(u[k:] @ u[:-k])
    se = math.sqrt(max(s, 0.0)) / sxx
    half = float(stats.t.ppf(0.5 + confidence / 2, dof)) * se
    return Trend(slope=beta * PER, lower=(beta - half) * PER, upper=(beta + half) * PER, points=points,
                 segments=len(xs), confidence=confidence, lag=lag)


def check_growth(code: str, what: str, trend: Trend | None, limit: float, unit: str) -> CheckResult:
    """Fails when the whole confidence interval of the growth lies above `limit` (per `PER` steps):
    significantly more than allowed. An interval that reaches above the limit without lying above it
    passes and says that the run was too short to tell."""
    if trend is None:
        return CheckResult(code=code, passed=True, skipped=True,
                           reason=f"skipped: {what}: too few steps after warm-up to fit a trend")
    interval = (f"{what} grows {trend.slope:+.3g} {unit} per {PER} steps ({trend.confidence:.0%} interval "
                f"[{trend.lower:+.3g}, {trend.upper:+.3g}] over {trend.points} steps in {trend.segments} "
                f"segment(s), Newey-West lag {trend.lag})")
    details = {"slope": trend.slope, "lower": trend.lower, "upper": trend.upper, "limit": limit, "unit": unit,
               "points": trend.points, "segments": trend.segments, "confidence": trend.confidence}
    if trend.lower > limit:
        return CheckResult(code=code, passed=False, details=details,
                           reason=f"{interval}: significantly above the limit of {limit:g} {unit} per {PER} steps")
    tail = ("" if trend.upper <= limit else
            "; not significantly above it, but the interval reaches past it: a longer run would tell")
    return CheckResult(code=code, passed=True, details=details,
                       reason=f"{interval}: within the limit of {limit:g} {unit} per {PER} steps{tail}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """Step-time percentiles (seconds) and jitter (P99 / P50)."""

    p50: float
    p95: float
    p99: float
    mean: float
    points: int

    @property
    def jitter(self) -> float:
        return self.p99 / self.p50 if self.p50 > 0 else math.inf


def step_times(times: Sequence[float]) -> StepTimes | None:
    """Percentiles of the finite `times`; None when there are none."""
    t = np.asarray(times, dtype=np.float64)
    t = t[np.isfinite(t)]
    if not len(t):
        return None
    p50, p95, p99 = (float(v) for v in np.percentile(t, [50, 95, 99]))
    return StepTimes(p50=p50, p95=p95, p99=p99, mean=float(t.mean()), points=len(t))


def check_tails(stats_: StepTimes | None, limit: float) -> CheckResult:
    """Fails when P99 / P50 of the step time exceeds `limit`."""
    if stats_ is None:
        return CheckResult(code="step_time_tail", passed=True, skipped=True, reason="skipped: no step times")
    details = {"p50_s": stats_.p50, "p95_s": stats_.p95, "p99_s": stats_.p99, "jitter": stats_.jitter,
               "limit": limit, "points": stats_.points}
    text = (f"step time P50 {stats_.p50 * 1e3:.4g} ms, P95 {stats_.p95 * 1e3:.4g} ms, P99 {stats_.p99 * 1e3:.4g} ms "
            f"over {stats_.points} steps: jitter P99/P50 {stats_.jitter:.3g}")
    if stats_.jitter > limit:
        return CheckResult(code="step_time_tail", passed=False, details=details, reason=f"{text} > limit {limit:g}")
    return CheckResult(code="step_time_tail", passed=True, details=details, reason=f"{text} <= limit {limit:g}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Periodicity:
    """The most significant slow phase: steps with `step % period == phase` against all the others, their
    median excess over the others' median (seconds, and relative to it), and the one-sided rank-sum
    (Mann-Whitney) p-value, Bonferroni-corrected over the `tests` (period, phase) pairs tested."""

    period: int
    phase: int
    excess_s: float
    excess_ratio: float
    p_value: float
    tests: int


def periodic_slowdown(steps: Sequence[int], times: Sequence[float], *, max_period: int) -> Periodicity | None:
    """Test every phase of every period 2..`max_period` that leaves each phase 3 steps or more; None when
    no period can be tested. One ranking of all step times serves every test (normal approximation of
    the rank sum, with the tie correction)."""
    from scipy import stats

    s = np.asarray(steps, dtype=np.int64)
    t = np.asarray(times, dtype=np.float64)
    keep = np.isfinite(t)
    s, t = s[keep], t[keep]
    n = len(t)
    periods = [p for p in range(2, max_period + 1) if n >= 3 * p]
    if not periods:
        return None
    ranks = stats.rankdata(t)
    _, ties = np.unique(t, return_counts=True)
    tie_term = float((ties ** 3 - ties).sum()) / (n * (n - 1))
    best: tuple[float, int, int] | None = None
    tests = 0
    for period in periods:
        phase_of = s % period
        n1 = np.bincount(phase_of, minlength=period).astype(np.float64)
        rank_sum = np.bincount(phase_of, weights=ranks, minlength=period)
        n2 = n - n1
        u = rank_sum - n1 * (n1 + 1) / 2
        var = n1 * n2 / 12 * ((n + 1) - tie_term)
        valid = (n1 >= 3) & (n2 >= 3) & (var > 0)
        tests += int(valid.sum())
        z = np.where(valid, (u - n1 * n2 / 2 - 0.5) / np.sqrt(np.where(var > 0, var, 1.0)), -np.inf)
        phase = int(np.argmax(z))
        p_value = float(stats.norm.sf(z[phase]))
        if valid[phase] and (best is None or p_value < best[0]):
            best = (p_value, period, phase)
    if best is None:
        return None
    p_value, period, phase = best
    mask = s % period == phase
    rest = float(np.median(t[~mask]))
    excess = float(np.median(t[mask])) - rest
    return Periodicity(period=period, phase=phase, excess_s=excess, excess_ratio=excess / rest if rest > 0 else 0.0,
                       p_value=min(1.0, p_value * tests), tests=tests)


def check_periodic(found: Periodicity | None, *, alpha: float, limit: float) -> CheckResult:
    """Fails when step time depends on the step's phase (p < `alpha`) and the slowest phase is more than
    `limit` (a fraction of the median) slower."""
    code = "periodic_slowdown"
    if found is None:
        return CheckResult(code=code, passed=True, skipped=True,
                           reason="skipped: too few steps to test a period (3 per period at least)")
    details = {"period": found.period, "phase": found.phase, "excess_s": found.excess_s,
               "excess_ratio": found.excess_ratio, "p_value": found.p_value, "tests": found.tests,
               "alpha": alpha, "limit": limit}
    text = (f"slowest phase: every {found.period} steps (step % {found.period} == {found.phase}) the median step "
            f"takes {found.excess_s * 1e3:+.4g} ms ({found.excess_ratio:+.1%}) against the other steps; rank-sum "
            f"p = {found.p_value:.2g} after {found.tests} (period, phase) tests (Bonferroni)")
    if found.p_value < alpha and found.excess_ratio > limit:
        return CheckResult(code=code, passed=False, details=details,
                           reason=f"periodic slowdown: {text} < {alpha:g}, and {found.excess_ratio:.1%} > limit "
                                  f"{limit:.1%}")
    why = (f"p >= {alpha:g}: no significant period" if found.p_value >= alpha
           else f"significant, but {found.excess_ratio:.1%} <= limit {limit:.1%}")
    return CheckResult(code=code, passed=True, details=details, reason=f"{text}: {why}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """One failure and the recovery from it: the step reached before the failure, the checkpoint step
    the next attempt resumed from, and the seconds from detection to the first step completed after."""

    failed_at_step: int
    resumed_from_step: int
    seconds_to_recover: float | None
    cause: str

    @property
    def steps_lost(self) -> int:
        return max(0, self.failed_at_step - self.resumed_from_step)


def compare_steps(code: str, what: str, ours: Mapping[int, Mapping[str, float]],
                  reference: Mapping[int, Mapping[str, float]], *, keys: Sequence[str], rtol: float) -> CheckResult:
    """Every step both hold agrees in every `keys` value: bit for bit when `rtol` is 0, else within it."""
    common = sorted(set(ours) & set(reference))
    if not common:
        return CheckResult(code=code, passed=True, skipped=True, reason=f"skipped: {what}: no step in common")
    worst = 0.0
    for step in common:
        for key in keys:
            a, b = ours[step].get(key), reference[step].get(key)
            if a is None or b is None:
                continue
            same = a == b or (math.isnan(a) and math.isnan(b))
            rel = 0.0 if same else abs(a - b) / max(abs(b), 1e-30)
            worst = max(worst, rel)
            if (rtol == 0 and not same) or rel > rtol:
                return CheckResult(code=code, passed=False,
                                   details={"step": step, "key": key, "value": a, "reference": b, "rel": rel,
                                            "rtol": rtol, "steps_compared": len(common)},
                                   reason=f"{what}: {key} at step {step} is {a!r} but {b!r} in the reference "
                                          f"(relative {rel:.3g} > rtol {rtol:g}); {len(common)} steps compared")
    exact = "bit for bit" if rtol == 0 else f"within rtol {rtol:g} (worst {worst:.3g})"
    return CheckResult(code=code, passed=True, details={"steps_compared": len(common), "worst_rel": worst},
                       reason=f"{what}: {len(common)} steps ({common[0]}..{common[-1]}) agree {exact} in "
                              f"{', '.join(keys)}")


@dataclass(frozen=True, kw_only=True)
class HealthLimits:
    """Limits of the loss and grad-norm health checks (the gate's rules, without a baseline)."""

    max_nonfinite_steps: int = 0
    max_skipped_fraction: float = 0.01
    spike_window: int = 20
    spike_z: float = 6.0
    max_loss_spikes: int = 0


def check_health(points: Sequence[Mapping[str, Any]], limits: HealthLimits) -> list[CheckResult]:
    """The gate's rules on a run's own records in log order (a resumed attempt repeats steps): NaN/Inf in
    loss or grad norm, loss spikes, skipped (overflow) steps, and continuity across each restart."""
    loss = resolve_restarts("loss", [(int(p["step"]), float(p["loss"])) for p in points], source="stability run")
    norms = resolve_restarts("grad_norm", [(int(p["step"]), float(p.get("grad_norm", math.nan))) for p in points],
                             source="stability run")
    tol = dataclasses.replace(Tolerances(), nonfinite=NonFiniteTolerance(max_steps=limits.max_nonfinite_steps))
    results = [check_nonfinite([loss, norms], [], tol)]
    spikes = spike_steps(loss, limits.spike_window, limits.spike_z)
    text = (f"loss: {len(spikes)} spike(s) in {max(0, len(loss) - limits.spike_window)} steps (> {limits.spike_z:g} "
            f"robust sd from the median of the previous {limits.spike_window}); allowed {limits.max_loss_spikes}")
    results.append(CheckResult(code="spikes", passed=len(spikes) <= limits.max_loss_spikes,
                               details={"spikes": [int(s) for s in spikes[:50]], "allowed": limits.max_loss_spikes},
                               reason=text + (f"; at steps {', '.join(str(int(s)) for s in spikes[:8])}" if len(spikes) else "")))
    skipped = sorted({int(p["step"]) for p in points if p.get("skipped")})
    fraction = len(skipped) / max(1, len(loss))
    results.append(CheckResult(
        code="skipped_steps", passed=fraction <= limits.max_skipped_fraction,
        details={"skipped": skipped[:50], "fraction": fraction, "limit": limits.max_skipped_fraction},
        reason=f"{len(skipped)} of {len(loss)} steps skipped by the optimizer (overflow): {fraction:.2%}, limit "
               f"{limits.max_skipped_fraction:.2%}" + (f"; first at step {skipped[0]}" if skipped else "")))
    results.append(check_restart_continuity(loss, tol))
    return results


@dataclass(frozen=True, kw_only=True)
class StabilityVerdict:
    """Every check of a stability run; passed when all passed."""

    checks: tuple[CheckResult, ...]
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(c.reason for c in self.checks if not c.passed)

