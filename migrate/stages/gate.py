"""Gate stage: the target's metrics against the source run's (and any repeat baselines).

Baselines are the job's ``source.metrics`` entries; the candidate is the ``candidate``
option or, when absent, the ``metrics`` output of the ``resume`` stage's artifact.
Tolerances come from the ``tolerances`` option (same keys as the tolerances YAML) or
``tolerances_file``. Writes the verdict JSON, Markdown/HTML report and plots into the
stage folder and logs the headline numbers to the tracker (W&B when enabled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from convergence.gate import MetricKeys, evaluate
from convergence.report import write_report
from convergence.tolerances import load_tolerances, tolerances_from_mapping
from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


class GateOptions(StageOptions):
    candidate: str | None = Field(default=None, description="candidate source spec; default: the resume stage's metrics")
    extra_baselines: tuple[str, ...] = Field(default=(), description="more baseline runs (repeats) for calibration")
    tolerances: dict[str, Any] = Field(default_factory=dict, description="tolerance overrides (tolerances YAML keys)")
    tolerances_file: str | None = None
    """a tolerances YAML (see Gate tolerances below), relative to the job file; replaces tolerances"""
    loss_key: str | None = None
    """the loss series' name in the metrics when it is none of the usual ones (loss, lm loss, train/loss, ...)"""
    grad_norm_key: str | None = None
    """the gradient norm series' name when it is none of the usual ones (grad_norm, grad-norm, ...)"""
    lr_key: str | None = None
    """the learning rate series' name when it is none of the usual ones (lr, learning-rate, ...)"""

    @field_validator("tolerances")
    @classmethod
    def _valid_tolerances(cls, value: dict[str, Any]) -> dict[str, Any]:
        tolerances_from_mapping(value, "stages.gate.tolerances")
        return value


def _resolve_spec(job: Any, spec: str) -> str:
    """A spec with its path made relative to the job file (online W&B specs unchanged)."""
    from migrate.gate.sources import SOURCE_FORMATS

    fmt, sep, rest = spec.partition(":")
    if sep and fmt in SOURCE_FORMATS:
        resolved = job.resolve(rest)
        return f"{fmt}:{resolved}" if fmt != "wandb" or resolved.exists() else spec
    return str(job.resolve(spec))


def _candidate_spec(ctx: StageContext, options: GateOptions) -> str:
    if options.candidate:
        return _resolve_spec(ctx.job, options.candidate)
    from migrate.pipeline.records import read_artifact

    artifact = ctx.upstream.get("resume") or read_artifact(ctx.job, "resume")
    if artifact is None or "metrics" not in artifact.outputs:
        raise ValueError("stages.gate: no candidate: set stages.gate.candidate, or run the resume stage "
                         "(its artifact must list outputs.metrics)")
    path = Path(artifact.outputs["metrics"])
    return str(path if path.is_absolute() else ctx.job.work_dir / path)


def _baseline_from_runs(ctx: StageContext) -> list[str]:
    """Without ``source.metrics``: the baseline's own continuation that the resume stage ran at the
    source layout from the same checkpoint (the CPU demo makes its baseline this way)."""
    resume = ctx.upstream.get("resume")
    if resume is not None and "baseline_metrics" in resume.outputs:
        return [str(Path(resume.outputs["baseline_metrics"]))]
    raise ValueError("stages.gate: no baseline: list source.metrics in the job (the source run's metrics), "
                     "or run the resume stage, which records the baseline's continuation")


def _fingerprint(job: Any, options: Any) -> dict[str, Any]:
    files = {}
    for entry in job.spec.source.metrics:
        path = job.resolve(entry.path)
        for f in ([path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []):
            if f.is_file():
                st = f.stat()
                files[str(f)] = [st.st_size, st.st_mtime_ns]
    return {"metric_files": files}


def run(ctx: StageContext) -> StageOutcome:
    from migrate.gate.sources import labelled, load_run, spec_for

    options: GateOptions = ctx.options  # type: ignore[assignment]
    tol = load_tolerances(ctx.job.resolve(options.tolerances_file)) if options.tolerances_file else \
        tolerances_from_mapping(options.tolerances, "stages.gate.tolerances")
    specs = [(spec_for(str(ctx.job.resolve(m.path)), m.format), m.label) for m in ctx.job.spec.source.metrics]
    specs += [(_resolve_spec(ctx.job, s), None) for s in options.extra_baselines]
    if not specs:
        specs = [(s, None) for s in _baseline_from_runs(ctx)]
    policy = tol.align.restart_policy
    baselines = [labelled(load_run(s, policy=policy), label) for s, label in specs]
    candidate = load_run(_candidate_spec(ctx, options), policy=policy)
    verdict = evaluate(baselines, candidate, tol, MetricKeys(loss=options.loss_key, grad_norm=options.grad_norm_key,
                                                             lr=options.lr_key))
    paths = write_report(verdict, ctx.work_dir)
    metrics: dict[str, Any] = {"passed": int(verdict.passed), "failed_checks": len(verdict.failed_codes)}
    for check in verdict.checks:
        for key in ("z", "mean_residual", "failures", "candidate_count", "rel_error"):
            if key in check.details:
                metrics[f"{check.code}.{key}"] = check.details[key]
    ctx.log_metrics(0, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    summary = paths["markdown"].read_text(encoding="utf-8")
    return StageOutcome(verdict="pass" if verdict.passed else "fail", metrics=metrics,
                        outputs={k: str(v) for k, v in paths.items()}, reasons=verdict.reasons, summary_md=summary)


STAGE = StageDefinition(
    name="gate",
    description="loss and grad-norm of the target run against the baseline, calibrated tolerances, report",
    run=run,
    options=GateOptions,
    after=("resume",),
    reads=("source", "training"),
    fingerprint=_fingerprint,
)
