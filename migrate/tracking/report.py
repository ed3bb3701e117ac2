"""The job summary: one Markdown page and one JSON file over every stage's artifact."""

from __future__ import annotations

import json
from datetime import datetime, UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from migrate.pipeline.records import write_text_atomic

if TYPE_CHECKING:
    from migrate.job.job import Job
    from migrate.pipeline.records import StageRecord

_STATUS_MARK = {"succeeded": "ok", "skipped": "ok (unchanged)", "failed": "FAILED", "blocked": "blocked"}


def _format_metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def target_layout_line(job: Job, records: Sequence[StageRecord]) -> str:
    """The target layout as the job states it, else as the search stage chose it, else still open."""
    from migrate.stages._target import target_layout

    upstream = {r.artifact.stage: r.artifact for r in records if r.artifact.status.ok}
    try:
        layout, where = target_layout(job, upstream)
    except (ValueError, OSError, KeyError):
        return "layout to be chosen by search"
    if where.startswith("target.layout ("):  # fixed by the job, against the search's choice
        return f"layout {layout.describe()} from target.layout, not the search's choice (see the search stage)"
    return f"layout {layout.describe()}" + ("" if where == "target.layout" else " (chosen by the search stage)")


def verdict_line(job: Job, records: Sequence[StageRecord], summary_path: Any) -> str:
    """One line that ends a run: passed or not (and the first stage that did not, with its reason), the
    target layout, and where the report is."""
    bad = [r.artifact for r in records if not r.artifact.status.ok]
    if not bad:
        head = f"PASSED: {len(records)} stage(s) of job {job.name}"
    else:
        first = next((a for a in bad if a.status.value == "failed"), bad[0])
        why = "; ".join(first.reasons)[:300] or first.status.value
        head = f"NOT PASSED: stage {first.stage} {first.status.value}: {why}" + (
            f" (and {len(bad) - 1} more stage(s) not passed)" if len(bad) > 1 else "")
    return f"{head}; target {target_layout_line(job, records)}; report {summary_path}"


def render_summary(job: Job, records: Sequence[StageRecord], *, wandb_dir: str | None = None) -> str:
    """Markdown: the job, a table of stages (status, verdict, time, reasons), then each stage's own summary."""
    spec = job.spec
    ok = all(r.artifact.status.ok for r in records)
    src, tgt = spec.source, spec.target
    lines = [
        f"# Migration job `{spec.name}`: {'all stages passed' if ok else 'NOT PASSED'}",
        "",
        f"- job file: `{job.path}`",
        f"- written: {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"- source: {src.cluster.device_count} x {src.cluster.device_type} ({src.cluster.resolved_backend}), "
        f"layout {src.layout.to_layout().describe()}",
        f"- target: {tgt.device_count} x {tgt.device_type} ({tgt.resolved_backend}), "
        + target_layout_line(job, records)
        + f", Ray {tgt.ray.address}",
        f"- model: {spec.model.architecture}, {spec.model.num_layers} layers, hidden {spec.model.hidden_size}",
    ]
    if wandb_dir:
        lines.append(f"- W&B run: `{wandb_dir}`")
    lines += ["", "| stage | status | verdict | time (s) | key metrics | reasons |", "|---|---|---|---|---|---|"]
    for rec in records:
        art = rec.artifact
        metrics = ", ".join(f"{k}={_format_metric(v)}" for k, v in list(art.metrics.items())[:4])
        reasons = "; ".join(art.reasons).replace("|", "\\|")
        lines.append(
            f"| {art.stage} | {_STATUS_MARK[art.status.value]} | {art.verdict or ''} | {art.duration_s:.1f} | {metrics} "
            f"| {reasons} |"
        )
    for rec in records:
        if rec.summary_md.strip():
            lines += ["", f"## {rec.artifact.stage}", "", rec.summary_md.strip()]
    return "\n".join(lines) + "\n"


def write_job_summary(job: Job, records: Sequence[StageRecord], *, wandb_dir: str | None = None) -> Path:
    """Write ``summary.md`` and ``summary.json`` into the job's work dir; return the Markdown path."""

    md_path = job.work_dir / "summary.md"
    write_text_atomic(md_path, render_summary(job, records, wandb_dir=wandb_dir))
    data = {
        "job": job.spec.name,
        "ok": all(r.artifact.status.ok for r in records),
        "stages": [
            {"stage": r.artifact.stage, "status": r.artifact.status.value, "verdict": r.artifact.verdict,
             "decision": r.decision.action, "decision_reason": r.decision.reason,
             "duration_s": r.artifact.duration_s, "reasons": list(r.artifact.reasons),
             "artifact": str(job.work_dir / r.artifact.stage / "result.json")}
            for r in records
        ],
        "wandb_dir": wandb_dir,
    }
    write_text_atomic(job.work_dir / "summary.json", json.dumps(data, indent=2))
    return md_path
