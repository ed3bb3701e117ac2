"""Pure checks: arrays, bands and tolerances in, one :class:`CheckResult` out.

Every result carries a stable ``code`` (what failed, for machines and tests), a
sentence ``reason`` with every number involved (for people), and ``details``.
Diagnostic reading of the codes: a candidate whose *first* step matches the
baseline loaded weights, data position and RNG correctly; a divergence that starts
only after it points at optimizer or scheduler state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergence.calibration import Bands
from convergence.series import MetricSeries
from convergence.tolerances import Tolerances

CODES: tuple[str, ...] = (
    "coverage", "nonfinite", "first_step", "resume_continuity", "loss_step", "loss_window",
    "loss_mean", "grad_norm_band", "grad_norm_mean", "lr_mismatch", "spikes", "restart_continuity",
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


def check_coverage(aligned_steps: np.ndarray, candidate: MetricSeries, baselines: Sequence[MetricSeries],
                   tol: Tolerances) -> CheckResult:
    """Enough aligned steps, and every key step present in the candidate and all baselines."""
    n = len(aligned_steps)
    missing: dict[str, list[int]] = {}
    for run in (candidate, *baselines):
        absent = [s for s in tol.coverage.key_steps if run.value_at(s) is None]
        if absent:
            missing[run.source or run.name] = absent
    details = {"aligned_steps": n, "candidate_steps": len(candidate), "min_steps": tol.coverage.min_steps,
               "missing_key_steps": missing}
    if n < tol.coverage.min_steps:
        span = f"{candidate.steps[0]}..{candidate.steps[-1]}" if len(candidate) else "none"
        return CheckResult(code="coverage", passed=False, details=details, reason=(
            f"only {n} aligned steps (candidate has {len(candidate)} steps, span {span}); "
            f"at least {tol.coverage.min_steps} needed"))
    if missing:
        return CheckResult(code="coverage", passed=False, details=details,
                           reason=f"key steps missing: {missing}")
    return CheckResult(code="coverage", passed=True, details=details,
                       reason=f"{n} aligned steps ({n / max(1, len(candidate)):.0%} of the candidate's)")


def check_nonfinite(candidate: Sequence[MetricSeries], baselines: Sequence[Sequence[MetricSeries]],
                    tol: Tolerances) -> CheckResult:
    """NaN/Inf steps in the candidate's loss and grad norm beyond the worst baseline's count."""
    def bad_steps(series: Sequence[MetricSeries]) -> np.ndarray:
        steps: set[int] = set()
        for s in series:
            steps.update(int(x) for x in s.x[~np.isfinite(s.y)])
        return np.asarray(sorted(steps), dtype=np.int64)

    cand = bad_steps(candidate)
    base = max((len(bad_steps(b)) for b in baselines), default=0)
    allowed = base + tol.nonfinite.max_steps
    details: dict[str, Any] = {"candidate_nonfinite_steps": [int(s) for s in cand[:50]],
                               "candidate_count": len(cand), "baseline_max_count": base, "allowed": allowed}
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
                       reason=f"{kind}; {len(cand)} non-finite steps > allowed {allowed} "
                              f"(baseline worst {base} + tolerance {tol.nonfinite.max_steps})")


def _deviation_text(step: int, value: float, band: Bands, i: int) -> str:
    return (f"step {step}: {band.metric} {value:.6g} outside [{band.lower[i]:.6g}, {band.upper[i]:.6g}] "
            f"(baseline {band.center[i]:.6g}, {band.source[i]} band)")


def check_first_step(candidate: np.ndarray, band: Bands, tol: Tolerances) -> CheckResult:
    """The candidate's first aligned step: weights, data position and RNG reproduce the baseline."""
    mask = _finite(candidate, band.center)
    if not mask.any():
        return _skip("first_step", "no finite aligned step")
    i = int(np.argmax(mask))
    step, value, ref = int(band.steps[i]), float(candidate[i]), float(band.center[i])
    rel = abs(value - ref) / max(abs(ref), 1e-12)
    if band.calibrated:
        ok, limit = bool(band.lower[i] <= value <= band.upper[i]), f"{band.source[i]} band [{band.lower[i]:.6g}, {band.upper[i]:.6g}]"
    else:
        ok, limit = rel <= tol.loss.first_step_rel, f"first_step_rel {tol.loss.first_step_rel:g}"
    details = {"step": step, "candidate": value, "baseline": ref, "rel_error": rel}
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


def check_loss_window(candidate: np.ndarray, band: Bands, tol: Tolerances) -> CheckResult:
    """Mean signed deviation over every window of ``loss.window`` aligned steps (systematic drift)."""
    mask = _finite(candidate, band.center)
    w = tol.loss.window
    idx = np.flatnonzero(mask)
    if len(idx) < w:
        return _skip("loss_window", f"{len(idx)} finite aligned steps < window {w}")
    dev = candidate[idx] - band.center[idx]
    if band.calibrated:
        limit = (band.upper[idx] - band.center[idx])
        what = "mean calibrated half-width"
    else:
        limit = tol.loss.window_rel * np.abs(band.center[idx])
        what = f"window_rel {tol.loss.window_rel:g} x |baseline|"
    kernel = np.ones(w) / w
    mean_dev = np.convolve(dev, kernel, mode="valid")
    mean_lim = np.convolve(limit, kernel, mode="valid")
    bad = np.flatnonzero(np.abs(mean_dev) > mean_lim)
    details = {"window": w, "windows": len(mean_dev), "failing_windows": len(bad)}
    if not len(bad):
        return CheckResult(code="loss_window", passed=True, details=details,
                           reason=f"all {len(mean_dev)} windows of {w} steps within {what}")
    j = int(bad[0])
    return CheckResult(code="loss_window", passed=False, details=details, reason=(
        f"{len(bad)} of {len(mean_dev)} windows of {w} steps drift: steps {int(band.steps[idx[j]])}.."
        f"{int(band.steps[idx[j + w - 1]])} mean deviation {mean_dev[j]:+.4g} beyond {mean_lim[j]:.4g} ({what})"))


def check_mean_error(code: str, candidate: np.ndarray, band: Bands, rel_tol: float, warmup: int) -> CheckResult:
    """|mean relative error| after the first ``warmup`` aligned steps."""
    mask = _finite(candidate, band.center) & (np.abs(band.center) > 0)
    idx = np.flatnonzero(mask)[warmup:]
    if not len(idx):
        return _skip(code, f"no finite {band.metric} step after {warmup} warm-up steps")
    rel = (candidate[idx] - band.center[idx]) / np.abs(band.center[idx])
    mean = float(np.mean(rel))
    details = {"mean_rel_error": mean, "tolerance": rel_tol, "steps": len(idx), "warmup_steps": warmup}
    text = (f"{band.metric} mean relative error {mean:+.3%} over {len(idx)} steps after {warmup} warm-up "
            f"steps (tolerance {rel_tol:.2%})")
    return CheckResult(code=code, passed=abs(mean) <= rel_tol, details=details, reason=text)


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
    out = []
    for i in range(window, len(y)):
        ref = y[i - window:i]
        med = np.median(ref)
        mad = 1.4826 * np.median(np.abs(ref - med))
        scale = max(mad, 1e-12 * max(abs(med), 1.0))
        if abs(y[i] - med) / scale > z:
            out.append(x[i])
    return np.asarray(out, dtype=np.int64)


def check_spikes(metric: str, candidate: MetricSeries, baselines: Sequence[MetricSeries], tol: Tolerances) -> CheckResult:
    """Candidate spike rate against the baselines' own spike rate."""
    t = tol.spikes
    code = "spikes"
    if len(candidate) <= t.window:
        return _skip(code, f"{metric}: {len(candidate)} steps <= spike window {t.window}")
    cand = spike_steps(candidate, t.window, t.z)
    rate = len(cand) / (len(candidate) - t.window)
    base_rates = [len(spike_steps(b, t.window, t.z)) / max(1, len(b) - t.window) for b in baselines]
    base = max(base_rates, default=0.0)
    details = {"metric": metric, "candidate_spikes": [int(s) for s in cand[:50]], "candidate_rate": rate,
               "baseline_rates": base_rates, "max_excess_rate": t.max_excess_rate}
    text = (f"{metric}: {len(cand)} spikes (rate {rate:.2%}) vs baseline rate {base:.2%} "
            f"(allowed excess {t.max_excess_rate:.2%}, z > {t.z:g} over a rolling median of {t.window})")
    if rate > base + t.max_excess_rate:
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
