"""Pure checks: arrays, bands and tolerances in, one :class:`CheckResult` out.

Every result carries a stable ``code`` (what failed, for machines and tests), a
sentence ``reason`` with every number involved (for people), and ``details``.
Diagnostic reading of the codes: a candidate whose *first* step matches the
baseline loaded weights, data position and RNG correctly; a divergence that starts
only after it points at optimizer or scheduler state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergence.calibration import Bands, MetricJudgement
from convergence.decision import Excursion
from convergence.series import MetricSeries, SeriesError
from convergence.tolerances import Tolerances

CODES: tuple[str, ...] = (
    "coverage", "nonfinite", "first_step", "resume_continuity", "loss_step", "loss_window",
    "loss_mean", "grad_norm_band", "grad_norm_window", "grad_norm_mean", "lr_mismatch", "spikes",
    "restart_continuity",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """Outcome of one check. ``skipped`` checks pass and say why they could not run."""

    code: str
    passed: bool
    reason: str
    skipped: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "passed": self.passed, "skipped": self.skipped,
                "reason": self.reason, "details": dict(self.details)}


def pct(x: float) -> str:
    """A signed relative value as a percentage that never prints as -0.000 %: tiny values in scientific form."""
    if x == 0:
        return "0 %"
    if abs(x) < 1e-5:
        return f"{x * 100:+.2e} %"
    return f"{x * 100:+.3f} %"


def _skip(code: str, why: str) -> CheckResult:
    return CheckResult(code=code, passed=True, skipped=True, reason=f"skipped: {why}")


def _finite(*arrays: np.ndarray) -> np.ndarray:
    mask = np.ones(len(arrays[0]), dtype=bool)
    for a in arrays:
        mask &= np.isfinite(a)
    return mask


def _steps(steps: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(s)) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def _longest_gap(expected: np.ndarray, present: np.ndarray) -> tuple[int, int | None]:
    """(length, first step) of the longest run of `expected` steps absent from `present`."""
    missing = ~np.isin(expected, present)
    best, start, run, first = 0, None, 0, None
    for step, miss in zip(expected, missing):
        if miss:
            run, first = run + 1, first if run else int(step)
            if run > best:
                best, start = run, first
        else:
            run = 0
    return best, start


def check_coverage(aligned_steps: np.ndarray, candidate: MetricSeries, baselines: Sequence[MetricSeries],
                   tol: Tolerances, *, interpolated: bool = False) -> CheckResult:
    """Enough aligned steps; the candidate logged (nearly) every step the baselines logged over the compared
    range (from its first step to the baselines' last, or its own last with coverage.until = candidate), with
    no hole longer than coverage.max_gap; every key step present in the candidate and all baselines."""
    c = tol.coverage
    n = len(aligned_steps)
    missing: dict[str, list[int]] = {}
    for run in (candidate, *baselines):
        absent = [s for s in c.key_steps if run.value_at(s) is None]
        if absent:
            missing[run.source or run.name] = absent
    common = set(baselines[0].steps)
    for b in baselines[1:]:
        common &= set(b.steps)
    expected = np.asarray(sorted(common), dtype=np.int64)
    if len(candidate):
        end = int(expected[-1]) if c.until == "baseline" and len(expected) else int(candidate.steps[-1])
        expected = expected[(expected >= candidate.steps[0]) & (expected <= end)]
    if interpolated:  # positions (tokens) differ between runs: judge the span, and holes by the candidate's spacing
        lo = max(int(b.x[0]) for b in baselines)
        hi = min(int(b.x[-1]) for b in baselines)
        start = max(lo, int(candidate.steps[0])) if len(candidate) else lo
        end = hi if c.until == "baseline" else (int(candidate.steps[-1]) if len(candidate) else hi)
        covered = (min(end, int(aligned_steps[-1])) - start) if n else 0
        fraction = covered / (end - start) if end > start else (1.0 if n else 0.0)
        spacing = np.diff(aligned_steps)
        typical = float(np.median(spacing)) if len(spacing) else 0.0
        holes = np.flatnonzero(spacing > (c.max_gap + 1) * typical) if typical > 0 else np.asarray([], dtype=int)
        gap = int(round(spacing[holes].max() / typical)) - 1 if len(holes) else 0
        gap_at = int(aligned_steps[holes[np.argmax(spacing[holes])]]) if len(holes) else None
        expected = aligned_steps
    else:
        fraction = n / len(expected) if len(expected) else 0.0
        gap, gap_at = _longest_gap(expected, candidate.x)
    details = {"aligned_steps": n, "candidate_steps": len(candidate), "baseline_steps_in_range": len(expected),
               "fraction": fraction, "longest_gap": gap, "gap_at": gap_at, "min_steps": c.min_steps,
               "missing_key_steps": missing, "until": c.until}
    span = f"{candidate.steps[0]}..{candidate.steps[-1]}" if len(candidate) else "none"
    rng = f"{int(expected[0])}..{int(expected[-1])}" if len(expected) else "none"
    if n < c.min_steps:
        return CheckResult(code="coverage", passed=False, details=details, reason=(
            f"only {n} aligned steps (candidate has {len(candidate)} steps, span {span}); at least {c.min_steps} "
            f"needed"))
    problems = []
    if gap > c.max_gap:
        problems.append(f"the candidate's log has a hole of {gap} baseline steps from step {gap_at} (at most "
                        f"{c.max_gap} allowed)")
    if fraction < c.min_fraction:
        problems.append(f"the candidate covers {n} of the baselines' {len(expected)} steps in {rng} ({fraction:.1%} "
                        f"< {c.min_fraction:.0%}; candidate span {span})" + ("" if problems else
                                                                            ": it stopped early or lost part of its log"))
    if problems:
        return CheckResult(code="coverage", passed=False, details=details, reason="; ".join(problems))
    if missing:
        return CheckResult(code="coverage", passed=False, details=details,
                           reason=f"key steps missing: {missing}")
    return CheckResult(code="coverage", passed=True, details=details, reason=(
        f"{n} aligned steps: {fraction:.1%} of the baselines' {len(expected)} steps in {rng}, longest hole {gap}"))


def check_nonfinite(candidate: Sequence[MetricSeries], baselines: Sequence[Sequence[MetricSeries]],
                    tol: Tolerances) -> CheckResult:
    """NaN/Inf steps in the candidate's loss and grad norm beyond `nonfinite.max_steps` (0 by default): a
    baseline's own NaN never excuses the candidate's (a baseline with any is refused before, by the gate)."""
    steps: set[int] = set()
    for s in candidate:
        steps.update(int(x) for x in s.x[~np.isfinite(s.y)])
    cand = np.asarray(sorted(steps), dtype=np.int64)
    allowed = tol.nonfinite.max_steps
    details: dict[str, Any] = {"candidate_nonfinite_steps": [int(s) for s in cand[:50]],
                               "candidate_count": len(cand), "allowed": allowed}
    if len(cand) <= allowed:
        return CheckResult(code="nonfinite", passed=True, details=details,
                           reason=f"{len(cand)} non-finite steps (allowed {allowed})")
    loss = candidate[0]
    after = loss.y[loss.x >= cand[0]]
    persistent = bool(len(after)) and not np.isfinite(after).any()
    details["persistent"] = persistent
    kind = (f"non-finite from step {int(cand[0])} to the end ({len(after)} steps): the run diverged"
            if persistent else f"non-finite at step(s) {_steps(cand)}")
    return CheckResult(code="nonfinite", passed=False, details=details,
                       reason=f"{kind}; {len(cand)} non-finite steps > allowed {allowed}")


def refuse_unhealthy_baseline(series: MetricSeries) -> None:
    """A baseline must be healthy: NaN/Inf in its loss or gradient norm is an error naming it and the steps."""
    bad = series.x[~np.isfinite(series.y)]
    if len(bad):
        raise SeriesError(f"{series.source or series.name}: the baseline's {series.name!r} is NaN/Inf at step(s) "
                          f"{_steps(bad)} ({len(bad)} in all); a baseline must be a healthy run (drop these steps "
                          f"or choose another baseline)")


def _deviation_text(step: int, value: float, band: Bands, i: int) -> str:
    return (f"step {step}: {band.metric} {value:.6g} outside [{band.lower[i]:.6g}, {band.upper[i]:.6g}] "
            f"(baseline {band.center[i]:.6g}, {band.source[i]} band)")


def check_first_step(candidate: np.ndarray, band: Bands) -> CheckResult:
    """The candidate's first aligned step within its band: before any update the loss depends only on the
    weights, the data position and the RNG."""
    mask = _finite(candidate, band.center)
    if not mask.any():
        return _skip("first_step", "no finite aligned step")
    i = int(np.argmax(mask))
    step, value, ref = int(band.steps[i]), float(candidate[i]), float(band.center[i])
    rel = abs(value - ref) / max(abs(ref), 1e-12)
    ok = bool(band.lower[i] <= value <= band.upper[i])
    limit = f"the {band.source[i]} band [{band.lower[i]:.6g}, {band.upper[i]:.6g}]"
    details = {"step": step, "candidate": value, "baseline": ref, "rel_error": rel,
               "band": [float(band.lower[i]), float(band.upper[i])]}
    if ok:
        return CheckResult(code="first_step", passed=True, details=details,
                           reason=f"step {step}: loss {value:.6g} vs {ref:.6g} (rel {rel:.2e}) within {limit}")
    return CheckResult(code="first_step", passed=False, details=details, reason=(
        f"first step {step}: loss {value:.6g} vs baseline {ref:.6g} (rel {rel:.2e}) outside {limit}; "
        f"before any update the loss depends only on weights, data and RNG, so one of those differs"))


def check_band(code: str, candidate: np.ndarray, band: Bands, allowed: int, *, limit: int | None = None,
               first_ok: bool | None = None) -> CheckResult:
    """Per-step band check over the aligned steps (or the first ``limit`` of them)."""
    mask = _finite(candidate, band.center)
    idx = np.flatnonzero(mask)
    if limit is not None:
        idx = idx[:limit]
    if not len(idx):
        return _skip(code, f"no finite aligned {band.metric} step")
    inside = band.contains(candidate[idx], idx)
    bad = idx[~inside]
    details = {"checked": len(idx), "failures": len(bad), "allowed": allowed,
               "failing_steps": [int(band.steps[i]) for i in bad[:50]], "band": band.rule,
               "band_sources": band.provenance()}
    if len(bad) <= allowed:
        return CheckResult(code=code, passed=True, details=details,
                           reason=f"{len(bad)} of {len(idx)} {band.metric} steps outside the band (allowed {allowed})")
    worst = bad[np.argmax(np.abs(candidate[bad] - band.center[bad]))]
    text = (f"{len(bad)} of {len(idx)} {band.metric} steps outside the band (allowed {allowed}), first "
            f"{_deviation_text(int(band.steps[bad[0]]), float(candidate[bad[0]]), band, int(bad[0]))}; worst "
            f"{_deviation_text(int(band.steps[worst]), float(candidate[worst]), band, int(worst))}")
    if code == "resume_continuity" and first_ok:
        text += ("; the first step matched, so weights, data and RNG were carried and the divergence "
                 "comes from the update: optimizer state or LR schedule")
    return CheckResult(code=code, passed=False, details=details, reason=text)


def _excursion_text(e: Excursion, unit: str, log: bool) -> str:
    where = {0: "the whole run", 1: f"step {e.step}"}.get(e.window, f"the {e.window} steps to {e.step}")
    against = {0: "the baselines", 1: "the run's running median"}.get(e.window, "the steps before them")
    value = f"x{math.exp(e.residual):.4g}" if log else f"{e.residual:+.4g}{' ' + unit if unit else ''}"
    return f"{where}: {value} against {against} (z {e.z:+.2f}, |z| limit {e.threshold:.2f})"


def check_steps(code: str, judgement: MetricJudgement, allowed: int, *, unit: str = "", log: bool = False
                ) -> CheckResult:
    """The decision rule's per-step test: no standardized residual beyond its Bonferroni-corrected threshold
    (more than `allowed` fail it)."""
    d = judgement.decisions[0]
    metric = judgement.bands.metric
    if d.skipped:
        return _skip(code, f"{metric}: {d.skipped}")
    details = {"checked": d.comparisons, "failures": d.failures, "allowed": allowed, "threshold_z": d.threshold,
               "level": d.level, "failing_steps": [e.step for e in d.excursions], "band": judgement.bands.rule,
               "band_sources": judgement.bands.provenance()}
    head = (f"{d.failures} of {d.comparisons} {metric} steps beyond |z| {d.threshold:.2f} (false-alarm level "
            f"{d.level:.2%} per run, Bonferroni over {d.comparisons} steps; allowed {allowed})")
    if d.failures <= allowed:
        return CheckResult(code=code, passed=True, details=details, reason=head)
    first, worst = d.excursions[0], d.worst
    text = f"{head}: first {_excursion_text(first, unit, log)}"
    if worst is not None and worst != first:
        text += f"; worst {_excursion_text(worst, unit, log)}"
    return CheckResult(code=code, passed=False, details=details, reason=text)


def check_windows(code: str, judgement: MetricJudgement, *, unit: str = "", log: bool = False) -> CheckResult:
    """The decision rule's drift tests: the mean residual over every window of each length, minus its mean
    before the window, within its threshold (Bonferroni over the lengths and the scanned windows)."""
    metric = judgement.bands.metric
    drift = [d for d in judgement.decisions if d.test.startswith("window")]
    tests = [d for d in drift if not d.skipped]
    skipped = [d for d in drift if d.skipped]
    details = {"tests": {d.test: {"comparisons": d.comparisons, "level": d.level, "threshold_z": d.threshold,
                                  "failures": d.failures} for d in tests},
               "skipped": {d.test: d.skipped for d in skipped}}
    if not tests:
        return _skip(code, f"{metric}: {'; '.join(d.skipped for d in skipped) or 'no window'}")
    summary = ", ".join(f"{d.test.removeprefix('window')} steps ({d.comparisons} windows, |z| <= {d.threshold:.2f})"
                        for d in tests)
    failing = [d for d in tests if not d.passed]
    level = sum(d.level for d in tests)
    if not failing:
        return CheckResult(code=code, passed=True, details=details, reason=(
            f"no sustained {metric} drift over windows of {summary}; false-alarm level {level:.2%} per run"))
    parts = [f"{d.failures} window position(s) of {d.test.removeprefix('window')} steps drift, first "
             f"{_excursion_text(d.excursions[0], unit, log)}" for d in failing]
    return CheckResult(code=code, passed=False, details=details, reason=(
        f"sustained {metric} drift: {'; '.join(parts)} (windows of {summary}; false-alarm level {level:.2%} "
        f"per run)"))


def check_level(code: str, judgement: MetricJudgement, *, log: bool = False) -> CheckResult:
    """The decision rule's level test: the candidate's mean residual after the warm-up within the spread of
    good runs' levels."""
    d = next((d for d in judgement.decisions if d.test == "level"), judgement.decisions[0])
    metric = judgement.bands.metric
    if d.skipped:
        return _skip(code, f"{metric}: {d.skipped}")
    e = d.worst
    assert e is not None
    shown = f"x{math.exp(e.residual):.4g}" if log else f"{e.residual:+.4g}"
    centre = judgement.bands.center
    mean = float(np.nanmean(centre)) if np.isfinite(centre).any() else 0.0
    rel = f" ({pct(e.residual / abs(mean))})" if not log and mean else ""
    details = {"mean_residual": e.residual, "scale": e.scale, "z": e.z, "threshold_z": d.threshold,
               "level": d.level, "scale_source": judgement.model.level_source}
    text = (f"{metric} level over the run: {shown}{rel} against the baselines, z {e.z:+.2f} (|z| limit "
            f"{d.threshold:.2f}, scale {e.scale:.3g} from the {judgement.model.level_source}; false-alarm level "
            f"{d.level:.2%} per run)")
    return CheckResult(code=code, passed=d.passed, details=details, reason=text)


def check_lr(candidate: MetricSeries | None, baseline: MetricSeries | None, tol: Tolerances) -> CheckResult:
    """Learning rate identical (within ``lr.rel``) at every common step: a reset or shifted schedule fails."""
    if candidate is None or baseline is None:
        return _skip("lr_mismatch", "learning rate not logged by " + ("the candidate" if candidate is None else "the baseline"))
    common = np.intersect1d(candidate.x, baseline.x)
    if not len(common):
        return _skip("lr_mismatch", "no common step with a learning rate")
    c = candidate.y[np.searchsorted(candidate.x, common)]
    b = baseline.y[np.searchsorted(baseline.x, common)]
    rel = np.abs(c - b) / np.maximum(np.abs(b), 1e-30)
    bad = np.flatnonzero(rel > tol.lr.rel)
    details = {"checked": len(common), "failing_steps": [int(common[i]) for i in bad[:50]], "tolerance": tol.lr.rel}
    if not len(bad):
        return CheckResult(code="lr_mismatch", passed=True, details=details,
                           reason=f"learning rate matches at {len(common)} steps")
    i = int(bad[0])
    return CheckResult(code="lr_mismatch", passed=False, details=details, reason=(
        f"learning rate differs at {len(bad)} of {len(common)} steps, first at step {int(common[i])}: "
        f"{c[i]:.6g} vs baseline {b[i]:.6g} (rel {rel[i]:.2e} > {tol.lr.rel:g}); the LR schedule "
        f"was not carried (reset or shifted)"))


def spike_steps(series: MetricSeries, window: int, z: float) -> np.ndarray:
    """Steps whose value is > z robust standard deviations from the median of the previous window."""
    x, y = series.x, series.y
    keep = np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(y) <= window:
        return np.asarray([], dtype=np.int64)
    ref = np.lib.stride_tricks.sliding_window_view(y[:-1], window)  # ref[i] = y[i : i + window], before y[i+window]
    med = np.median(ref, axis=1)
    mad = 1.4826 * np.median(np.abs(ref - med[:, None]), axis=1)
    scale = np.maximum(mad, 1e-12 * np.maximum(np.abs(med), 1.0))
    hits = np.abs(y[window:] - med) / scale > z
    return x[window:][hits].astype(np.int64)


def check_spikes(metric: str, candidate: MetricSeries, baselines: Sequence[MetricSeries], tol: Tolerances,
                 level: float) -> CheckResult:
    """The candidate's spike count against the baselines' spike rate: the exact conditional test of two
    Poisson rates (given all spikes, the candidate's share is binomial under equal rates) at `level`."""
    from scipy import stats

    t = tol.spikes
    code = "spikes"
    if len(candidate) <= t.window:
        return _skip(code, f"{metric}: {len(candidate)} steps <= spike window {t.window}")
    cand = spike_steps(candidate, t.window, t.z)
    m = len(candidate) - t.window
    base_counts = [len(spike_steps(b, t.window, t.z)) for b in baselines]
    base_points = sum(max(0, len(b) - t.window) for b in baselines)
    total = len(cand) + sum(base_counts)
    share = m / (m + base_points) if base_points else 1.0
    p_value = float(stats.binom.sf(len(cand) - 1, total, share)) if len(cand) else 1.0
    details = {"metric": metric, "candidate_spikes": [int(s) for s in cand[:50]], "candidate_points": m,
               "baseline_spikes": base_counts, "baseline_points": base_points, "p_value": p_value, "level": level}
    text = (f"{metric}: {len(cand)} spikes in {m} steps vs {sum(base_counts)} in the baselines' {base_points} "
            f"(z > {t.z:g} over a rolling median of {t.window}); p = {p_value:.2g} for so many at equal rates "
            f"(false-alarm level {level:.2%} per run)")
    if p_value < level:
        return CheckResult(code=code, passed=False, details=details, reason=text + f"; spikes at {_steps(cand)}")
    return CheckResult(code=code, passed=True, details=details, reason=text)


def check_restart_continuity(series: MetricSeries, tol: Tolerances) -> CheckResult:
    """Restarts inside one log: repeated steps must reproduce, the loss must not jump across the resume."""
    if not series.restarts:
        return _skip("restart_continuity", f"no restart in {series.source or series.name}")
    problems: list[str] = []
    mismatched: list[str] = []
    compared = 0
    for step, old in series.superseded:
        new = series.value_at(step)
        if new is None or not (np.isfinite(old) and np.isfinite(new)):
            continue
        compared += 1
        rel = abs(new - old) / max(abs(old), 1e-12)
        if rel > tol.restart.repeat_rel:
            mismatched.append(f"step {step} logged {old:.6g} before and {new:.6g} after the resume "
                              f"(rel {rel:.2e} > {tol.restart.repeat_rel:g})")
    if mismatched:
        problems.append(f"{len(mismatched)} of {compared} repeated steps differ, first {mismatched[0]}")
    diffs = np.diff(series.y[np.isfinite(series.y)])
    scale = 1.4826 * float(np.median(np.abs(diffs - np.median(diffs)))) if len(diffs) > 3 else 0.0
    for r in series.restarts:
        i = int(np.searchsorted(series.x, r.to_step))
        if 0 < i < len(series) and scale > 0:
            jump = series.values[i] - series.values[i - 1]
            z = abs(jump) / scale
            if z > tol.restart.jump_z:
                problems.append(f"loss jumps by {jump:+.4g} from step {series.steps[i - 1]} to "
                                f"{series.steps[i]} across the resume (robust z {z:.1f} > {tol.restart.jump_z:g})")
    details = {"restarts": [{"from_step": r.from_step, "to_step": r.to_step} for r in series.restarts],
               "repeated_steps_compared": compared}
    where = ", ".join(f"{r.from_step}->{r.to_step}" for r in series.restarts)
    if problems:
        return CheckResult(code="restart_continuity", passed=False, details=details,
                           reason=f"restart(s) {where}: " + "; ".join(problems))
    return CheckResult(code="restart_continuity", passed=True, details=details,
                       reason=f"restart(s) {where}: {compared} repeated steps reproduce, no jump")
