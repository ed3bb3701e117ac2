"""The convergence gate: baselines + candidate + tolerances -> :class:`Verdict`.

Pure: callers read the runs (``convergence.readers`` or migrate's W&B source) and
write the report (``convergence.report``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from convergence import checks
from convergence.calibration import judge
from convergence.series import MetricSeries, RunMetrics, SeriesError, align, rekey_by
from convergence.tolerances import Tolerances, tolerances_to_mapping
from convergence.verdict import Verdict


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricKeys:
    """Series names to use instead of the alias lookup (None: look the canonical names up)."""

    loss: str | None = None
    grad_norm: str | None = None
    lr: str | None = None
    position: str | None = None
    """With align.by == 'tokens': the series holding consumed tokens (or samples) per step."""


@overload
def _rekey(run: RunMetrics, series: MetricSeries, keys: MetricKeys) -> MetricSeries: ...
@overload
def _rekey(run: RunMetrics, series: None, keys: MetricKeys) -> None: ...
def _rekey(run: RunMetrics, series: MetricSeries | None, keys: MetricKeys) -> MetricSeries | None:
    if series is None:
        return None
    position = run.find("tokens", keys.position) or run.find("samples")
    if position is None:
        raise SeriesError(f"{run.source}: align.by is 'tokens' but the source logs no consumed tokens "
                          f"or samples series; it holds {sorted(run.series)}")
    return rekey_by(series, position)


def _aligned_rows(series: Sequence[MetricSeries], steps: np.ndarray, interpolate: bool) -> np.ndarray:
    if interpolate:
        return np.stack([np.interp(steps, s.x, s.y) for s in series])
    rows = []
    for s in series:
        idx = np.searchsorted(s.x, steps)
        idx = np.clip(idx, 0, len(s) - 1)
        rows.append(np.where(s.x[idx] == steps, s.y[idx], math.nan))
    return np.stack(rows)


def evaluate(baselines: Sequence[RunMetrics], candidate: RunMetrics, tol: Tolerances,
             keys: MetricKeys = MetricKeys()) -> Verdict:
    """Run every check; raises SeriesError when a required series (loss) is missing."""
    if not baselines:
        raise SeriesError("gate: at least one baseline run is needed")
    by_tokens = tol.align.by == "tokens"
    base_loss = [b.require("loss", keys.loss) for b in baselines]
    cand_loss = candidate.require("loss", keys.loss)
    base_gn = [b.find("grad_norm", keys.grad_norm) for b in baselines]
    cand_gn = candidate.find("grad_norm", keys.grad_norm)
    have_gn = cand_gn is not None and all(g is not None for g in base_gn)
    for series in (*base_loss, *(base_gn if have_gn else ())):
        checks.refuse_unhealthy_baseline(series)
    raw_cand_loss = cand_loss
    if by_tokens:
        base_loss = [_rekey(b, s, keys) for b, s in zip(baselines, base_loss)]
        cand_loss = _rekey(candidate, cand_loss, keys)
        if have_gn:
            base_gn = [_rekey(b, s, keys) for b, s in zip(baselines, base_gn)]
            cand_gn = _rekey(candidate, cand_gn, keys)

    aligned = align(base_loss, cand_loss, interpolate=by_tokens)
    loss = judge("loss", aligned.steps, aligned.baselines, aligned.candidate, tol.rule,
                 budget=tol.rule.alpha * tol.rule.loss_share, level_rel=tol.loss.level_rel,
                 window_rel=tol.loss.window_rel, step_rel=tol.loss.step_rel, warmup=tol.loss.warmup_steps)
    lb = loss.bands
    results: list[checks.CheckResult] = [
        checks.check_coverage(aligned.steps, cand_loss, base_loss, tol, interpolated=by_tokens),
        checks.check_nonfinite([s for s in (cand_loss, cand_gn) if s is not None],
                               [[s for s in (bl, bg) if s is not None] for bl, bg in zip(base_loss, base_gn)], tol),
    ]
    first = checks.check_first_step(aligned.candidate, lb)
    results += [
        first,
        checks.check_band("resume_continuity", aligned.candidate, lb, 0, limit=tol.restart.window + 1,
                          first_ok=first.passed and not first.skipped),
        checks.check_steps("loss_step", loss, tol.loss.allowed_failures),
        checks.check_windows("loss_window", loss),
        checks.check_level("loss_mean", loss),
    ]
    gb = None
    cand_gn_row = base_gn_rows = None
    rules = [loss.text]
    if have_gn:
        assert cand_gn is not None
        gsteps = aligned.steps
        base_gn_rows = _aligned_rows([g for g in base_gn if g is not None], gsteps, by_tokens)
        cand_gn_row = _aligned_rows([cand_gn], gsteps, by_tokens)[0]
        gn = judge("grad_norm", gsteps, base_gn_rows, cand_gn_row, tol.rule, log=True,
                   budget=tol.rule.alpha * tol.rule.grad_norm_share, level_rel=tol.grad_norm.level_rel,
                   window_rel=tol.grad_norm.window_rel, step_rel=tol.grad_norm.step_rel, warmup=tol.grad_norm.warmup_steps)
        gb = gn.bands
        rules.append(gn.text)
        results += [
            checks.check_steps("grad_norm_band", gn, tol.grad_norm.allowed_failures, log=True),
            checks.check_windows("grad_norm_window", gn, log=True),
            checks.check_level("grad_norm_mean", gn, log=True),
        ]
    else:
        missing = "the candidate" if cand_gn is None else "a baseline"
        results.append(checks.CheckResult(code="grad_norm_band", passed=True, skipped=True,
                                          reason=f"skipped: no grad-norm series in {missing}"))
    results.append(checks.check_lr(candidate.find("lr", keys.lr), baselines[0].find("lr", keys.lr), tol))
    spike_level = tol.rule.alpha * tol.rule.spike_share / (2 if have_gn else 1)
    results.append(checks.check_spikes("loss", cand_loss, base_loss, tol, spike_level))
    if have_gn and cand_gn is not None:
        results.append(checks.check_spikes("grad_norm", cand_gn, [g for g in base_gn if g is not None], tol,
                                           spike_level))
    results.append(checks.check_restart_continuity(raw_cand_loss, tol))
    return Verdict(
        passed=all(r.passed for r in results),
        checks=tuple(results),
        candidate=candidate.source,
        baselines=tuple(b.source for b in baselines),
        align_by=tol.align.by,
        loss_bands=lb,
        grad_norm_bands=gb,
        candidate_loss=aligned.candidate,
        candidate_grad_norm=cand_gn_row,
        baseline_loss=aligned.baselines,
        baseline_grad_norm=base_gn_rows,
        tolerances=tolerances_to_mapping(tol),
        rule=tuple(rules),
        alignment=tuple(alignment_lines([*base_loss, cand_loss], raw_cand_loss, tol)),
    )


def alignment_lines(series: Sequence[MetricSeries], raw_candidate: MetricSeries, tol: Tolerances) -> list[str]:
    """How each run's loss log was read: points, span, logging interval, restarts (replayed steps, duplicated
    steps) and the policy applied to them, and the alignment used."""
    out = [f"aligned by {tol.align.by}" + (" (baselines interpolated onto the candidate's positions)"
                                           if tol.align.by == "tokens" else " (steps every run logged)")
           + f"; restart policy '{tol.align.restart_policy}' (" + {
               "last": "the resumed attempt's values replace the replayed steps",
               "first": "the first attempt's values are kept",
               "error": "a replayed step is an error"}[tol.align.restart_policy] + ")"]
    for s in series:
        if not len(s):
            continue
        interval = int(np.median(np.diff(s.x))) if len(s) > 1 else 0
        line = f"{s.source or s.name}: {len(s)} points, steps {s.steps[0]}..{s.steps[-1]}, logged every {interval}"
        if s.restarts:
            dup = sum(1 for r in s.restarts if r.to_step == r.from_step)
            replays = [r for r in s.restarts if r.to_step < r.from_step]
            parts = []
            if replays:
                parts.append(f"{len(replays)} resume(s) from an older checkpoint ("
                             + ", ".join(f"{r.from_step}->{r.to_step}" for r in replays[:4]) + ")")
            if dup:
                parts.append(f"{dup} step(s) logged twice")
            line += f"; {'; '.join(parts)}; {len(s.superseded)} superseded point(s)"
        out.append(line)
    return out
