"""What the stability stage leaves behind: ``stability.json`` (every record and check), the plots, the
Markdown summary and the headline metrics of its artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from convergence.stability import StabilityVerdict, step_times
from migrate.pipeline.stage import StageContext, StageOutcome

from migrate.stages._stability_model import (Attempt, RecoveryDecision, RunPlan, StabilityOptions, memory_segments,
                                             recoveries, worst_trend)

MIB = 2**20


def _plots(directory: Path, attempts: Sequence[Attempt], options: StabilityOptions,
           steps: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]] | None) -> dict[str, str]:
    from convergence.stability import periodic_slowdown
    from convergence.stability_report import plot_loss, plot_memory, plot_step_time, plot_timeline

    restarts = [a.loaded_step for a in attempts[1:]]
    images: dict[str, str] = {}
    ranks = sorted({r for a in attempts for r in a.records.ranks})
    for key, name, title, limit in (
            ("host_rss_bytes", "memory.png", "Host RSS per rank", options.host_memory_growth_mib),
            ("device_allocated_bytes", "device_memory.png", "Device memory allocated per rank",
             options.device_memory_growth_mib)):
        if not any(key in r for a in attempts for r in a.records.steps(0)):
            continue
        worst, trend, _ = worst_trend(attempts, ranks, key, options)
        per_rank = {r: memory_segments(attempts, r, key, 0) for r in ranks}
        plot_memory(per_rank, worst, trend, restarts, directory / name, title=title, limit=limit)
        images[name.removesuffix(".png")] = name
    timed = [(int(r["step"]), float(r["step_time_s"])) for a in attempts for r in a.records.steps(0)
             if "step_time_s" in r]
    judged = [(int(r["step"]), float(r["step_time_s"])) for a in attempts
              for r in a.records.steps(0)[options.warmup_steps:] if "step_time_s" in r]
    stats = step_times([t for _, t in judged])
    if stats is not None:
        found = periodic_slowdown([s for s, _ in judged], [t for _, t in judged], max_period=options.max_period)
        slow = (found.period, found.phase) if found is not None and found.p_value < options.periodic_alpha else None
        plot_step_time([s for s, _ in timed], [t for _, t in timed], stats.p50, stats.p99, restarts,
                       directory / "step_time.png", slow_period=slow)
        images["step_time"] = "step_time.png"
    if steps:
        ref = ([int(r["step"]) for r in reference], [float(r["loss"]) for r in reference]) if reference else None
        plot_loss([int(r["step"]) for r in steps], [float(r["loss"]) for r in steps],
                  [float(r.get("grad_norm", float("nan"))) for r in steps], restarts, directory / "loss.png",
                  reference=ref)
        images["loss"] = "loss.png"
    lines = [([float(r["wall_time"]) for r in a.records.steps(0)], [int(r["step"]) for r in a.records.steps(0)])
             for a in attempts]
    fails = [((a.last_step_at or a.ended_at), a.last_step, f"rank(s) {', '.join(map(str, a.failed_ranks))}")
             for a in attempts if a.failure]
    plot_timeline(lines, fails, directory / "timeline.png")
    images["timeline"] = "timeline.png"
    return images


def _rank_table(verdict: StabilityVerdict, attempts: Sequence[Attempt]) -> str:
    """Host RSS growth per rank as judged (the 8 largest lower bounds when there are more than 16 ranks)."""
    per_rank = {int(r): v["host_memory_growth"] for r, v in verdict.details.get("ranks", {}).items()
                if "host_memory_growth" in v}
    last = {r: rows[-1]["host_rss_bytes"] / MIB for r in per_rank
            if (rows := attempts[-1].records.steps(r)) and "host_rss_bytes" in rows[-1]}
    shown = sorted(per_rank, key=lambda r: per_rank[r]["lower"], reverse=True)[:8] if len(per_rank) > 16 else sorted(per_rank)
    if not shown:
        return ""
    return ("| rank | host RSS growth (MiB / 1,000 steps) | interval | last RSS (MiB) |\n|---|---|---|---|\n"
            + "".join(f"| {r} | {per_rank[r]['slope']:+.3g} | [{per_rank[r]['lower']:+.3g}, {per_rank[r]['upper']:+.3g}] | "
                      f"{last.get(r, float('nan')):.1f} |\n" for r in shown))


def write_outputs(ctx: StageContext, plan: RunPlan, options: StabilityOptions, attempts: Sequence[Attempt],
                  decisions: Sequence[RecoveryDecision], verdict: StabilityVerdict,
                  steps: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]] | None,
                  reference_from: int | None, *, layout_from: str) -> StageOutcome:

    directory = ctx.work_dir
    recovered = recoveries(attempts)
    last = int(steps[-1]["step"]) if steps else plan.start_step
    wall = (attempts[-1].ended_at - attempts[0].started_at) if attempts else 0.0
    images = _plots(directory, attempts, options, steps, reference)
    by_code = {c.code: c for c in verdict.checks}
    growth = by_code.get("host_memory_growth")
    stats = verdict.details.get("step_time", {})
    metrics: dict[str, Any] = {
        "passed": int(verdict.passed), "start_step": plan.start_step, "final_step": last,
        "steps": last - plan.start_step, "attempts": len(attempts), "failures": sum(1 for a in attempts if a.failure),
        "recovered": len(recovered), "steps_recomputed": sum(r.steps_lost for r in recovered),
        "max_seconds_to_recover": max((r.seconds_to_recover or 0.0 for r in recovered), default=0.0),
        "wall_s": round(wall, 1),
    }
    if growth is not None and growth.details:
        metrics["host_rss_growth_mib_per_1k_steps"] = growth.details["slope"]
    for key in ("p50_s", "p99_s"):
        if key in stats:
            metrics[f"step_time_{key.replace('_s', '_ms')}"] = stats[key] * 1e3
    if "jitter" in stats:
        metrics["step_time_jitter"] = stats["jitter"]
    report = {
        "engine": plan.engine, "layout": plan.layout.describe(), "layout_from": layout_from,
        "micro_batch_size": plan.micro_batch_size, "start_step": plan.start_step, "final_step": last,
        "planned_end_step": plan.end_step if plan.deadline is None else None, "minutes": options.minutes,
        "passed": verdict.passed, "reasons": list(verdict.reasons),
        "checks": [c.to_dict() for c in verdict.checks], "details": dict(verdict.details),
        "attempts": [{"attempt": a.index, "loaded_step": a.loaded_step, "loaded": a.loaded,
                      "last_step": a.last_step, "started_at": a.started_at, "ended_at": a.ended_at,
                      "failure": a.failure, "failed_ranks": list(a.failed_ranks), "stopped": a.stopped,
                      "checkpoints": [{"step": s, "path": p, "wall_time": t} for s, p, t in a.records.checkpoints]}
                     for a in attempts],
        "decisions": [{"action": d.action, "reason": d.reason} for d in decisions],
        "recoveries": [{"failed_at_step": r.failed_at_step, "resumed_from_step": r.resumed_from_step,
                        "steps_lost": r.steps_lost, "seconds_to_recover": r.seconds_to_recover, "cause": r.cause}
                       for r in recovered],
        "reference": {"from_step": reference_from, "steps": list(reference)} if reference is not None else None,
        "steps": list(steps), "images": images, "options": options.model_dump(mode="json"),
    }
    (directory / "stability.json").write_text(json.dumps(report, indent=1, default=str, allow_nan=True))
    check_rows = "\n".join(f"| {c.code} | {'skipped' if c.skipped else 'ok' if c.passed else 'FAILED'} | "
                           f"{c.reason.replace('|', '/')} |" for c in verdict.checks)
    failure_rows = "\n".join(
        f"| {i + 1} | {r.failed_at_step} | {r.cause.replace('|', '/')} | {r.resumed_from_step} | {r.steps_lost} | "
        f"{r.seconds_to_recover:.1f} |" if r.seconds_to_recover is not None else
        f"| {i + 1} | {r.failed_at_step} | {r.cause.replace('|', '/')} | {r.resumed_from_step} | {r.steps_lost} | - |"
        for i, r in enumerate(recovered))
    unrecovered = [a for a in attempts if a.failure][len(recovered):]
    summary = (
        f"Stability run at {plan.layout.describe()} ({layout_from}), engine {plan.engine}, micro batch "
        f"{plan.micro_batch_size}: from the converted checkpoint's step {plan.start_step} to step {last} "
        f"({last - plan.start_step} steps) in {wall:.1f} s, {len(attempts)} attempt(s). "
        f"**{'Passed' if verdict.passed else 'FAILED'}.**\n\n"
        "| check | result | detail |\n|---|---|---|\n" + check_rows + "\n\n")
    if recovered or unrecovered:
        summary += ("Failures and recoveries:\n\n| # | failed after step | cause | resumed from step | steps lost and "
                    "recomputed | time to recover (s) |\n|---|---|---|---|---|---|\n" + failure_rows + "\n")
        summary += "".join(f"| {a.index} | {a.last_step} | {a.failure.replace('|', '/')} | not recovered | - | - |\n"
                           for a in unrecovered) + "\n"
    table = _rank_table(verdict, attempts)
    if table:
        summary += "Host memory per rank, after the first " f"{options.warmup_steps} steps of each attempt:\n\n" + table + "\n"
    if stats:
        summary += (f"Step time: P50 {stats['p50_s'] * 1e3:.4g} ms, P95 {stats['p95_s'] * 1e3:.4g} ms, "
                    f"P99 {stats['p99_s'] * 1e3:.4g} ms, jitter {stats['jitter']:.3g}.\n\n")
    summary += "".join(f"![{name}]({file})\n" for name, file in images.items())
    return StageOutcome(verdict="pass" if verdict.passed else "fail", metrics=metrics, reasons=verdict.reasons,
                        outputs={"report": str(directory / "stability.json"),
                                 **{k: str(directory / v) for k, v in images.items()}},
                        summary_md=summary)
