"""Run a job's stages in dependency order, skipping what is unchanged.

Call sequence: ``run_pipeline(job, stages=None, force=False)`` orders the stages
(``migrate.stages.execution_order``), and for each one computes its input hash, asks
the pure ``decide`` whether to run, skip or block it, runs it with a ``StageContext``,
and writes its artifact atomically. A stage that fails blocks its dependents, each of
which records why. The job summary (``summary.md``, ``summary.json``) is written last.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import traceback
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from migrate.job.job import Job
from migrate.progress import LiveStatus
from migrate.pipeline.records import (ARTIFACT_NAME, Decision, PipelineResult, StageRecord, artifact_path,
                                      read_artifact, write_text_atomic)
from migrate.pipeline.stage import StageArtifact, StageContext, StageDefinition, StageOutcome, StageStatus
from migrate.stages import STAGES, execution_order

__all__ = ["ARTIFACT_NAME", "Decision", "PipelineResult", "StageRecord", "artifact_path", "decide", "input_hash",
           "read_artifact", "run_pipeline", "write_text_atomic"]

_BLOCKED_BY = re.compile(r"^dependency '[^']+' blocked: ")


def decide(
    *, stage: str, input_hash: str, previous: StageArtifact | None, force: bool,
    upstream: Mapping[str, StageArtifact | None],
) -> Decision:
    """Pure skip rule: block on a missing or failed dependency; skip an unchanged success."""
    for dep, artifact in upstream.items():
        if artifact is None:
            return Decision("block", f"needs stage {dep!r}, which has no result yet: run it first or include it")
        if not artifact.status.ok:
            why = "; ".join(artifact.reasons) or artifact.status.value
            if artifact.status is StageStatus.BLOCKED:  # its reason names the root cause: keep that, once
                why = _BLOCKED_BY.sub("", why, count=1) if _BLOCKED_BY.match(why) else why
            return Decision("block", f"dependency {dep!r} {artifact.status.value}: {why}")
    if force:
        return Decision("run", "forced")
    if previous is None:
        return Decision("run", "no previous result")
    if not previous.status.ok:
        return Decision("run", f"previous run {previous.status.value}")
    if previous.input_hash != input_hash:
        return Decision("run", "inputs changed")
    return Decision("skip", "inputs unchanged since " + previous.finished_at)


def input_hash(stage: StageDefinition, job: Job, upstream: Mapping[str, StageArtifact]) -> tuple[str, dict[str, Any]]:
    """Hash of everything the stage's result depends on; also returns the hashed inputs."""
    options = job.stage_options.get(stage.name)
    inputs: dict[str, Any] = {
        "stage_version": stage.version,
        "options": options.model_dump(mode="json") if options is not None else {},
        "job_sections": job.section_digest(*stage.reads),
        "upstream": {name: art.result_digest for name, art in sorted(upstream.items())},
    }
    if stage.fingerprint is not None and options is not None:
        inputs["external"] = dict(stage.fingerprint(job, options))
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return digest, inputs


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run_stage(stage: StageDefinition, ctx: StageContext) -> tuple[StageOutcome | None, str]:
    try:
        outcome = stage.run(ctx)
        if not isinstance(outcome, StageOutcome):
            raise TypeError(f"stage {stage.name!r} returned {type(outcome).__name__}, expected StageOutcome")
        return outcome, ""
    except Exception:  # noqa: BLE001 - recorded in the artifact, blocks dependents
        return None, traceback.format_exc(limit=30)


def run_pipeline(
    job: Job,
    *,
    stages: Sequence[str] | None = None,
    force: bool = False,
    tracker: Any,
    start_group: Callable[..., Any],
    echo: Callable[[str], None] = lambda line: None,
) -> PipelineResult:
    """Run the job's stages (or ``stages``) in order; return every stage's record."""
    listed = tuple(job.stage_options)
    selected = tuple(stages) if stages else listed
    unknown = [s for s in selected if s not in listed]
    if unknown:
        raise ValueError(f"stages {unknown} are not in the job {job.path} (it lists: {', '.join(listed) or 'none'})")
    records: list[StageRecord] = []
    this_run: dict[str, StageArtifact] = {}
    for name in execution_order(selected):
        stage = STAGES[name]
        upstream = {dep: this_run.get(dep) or read_artifact(job, dep)
                    for dep in stage.upstream_in(listed, job.stage_options.get(name))}
        digest, inputs = input_hash(stage, job, {k: v for k, v in upstream.items() if v is not None})
        key = stage.key(job.stage_options.get(name))
        previous = read_artifact(job, key)
        decision = decide(stage=name, input_hash=digest, previous=previous, force=force, upstream=upstream)
        stage_dir = job.work_dir / name
        result_dir = job.work_dir / key
        if decision.action == "skip":
            assert previous is not None
            artifact = previous
            summary = (result_dir / "summary.md").read_text() if (result_dir / "summary.md").exists() else ""
            echo(f"[{name}] skipped: {decision.reason}")
        elif decision.action == "block":
            stamp = _now()
            artifact = StageArtifact(
                stage=name, status=StageStatus.BLOCKED, verdict=None, input_hash=digest, inputs=inputs, outputs={},
                metrics={}, reasons=(decision.reason,), started_at=stamp, finished_at=stamp, duration_s=0.0,
            )
            summary = f"Blocked: {decision.reason}\n"
            write_text_atomic(artifact_path(job, key), artifact.to_json())
            echo(f"[{name}] blocked: {decision.reason}")
        else:
            echo(f"[{name}] running ({decision.reason})")
            stage_dir.mkdir(parents=True, exist_ok=True)
            live = LiveStatus(name)
            live("running")
            ctx = StageContext(
                job=job, options=job.stage_options[name], work_dir=stage_dir,
                upstream={k: v for k, v in upstream.items() if v is not None}, tracker=tracker,
                start_group=start_group, stage=name, status=live,
            )
            started, t0 = _now(), time.monotonic()
            try:
                outcome, error = _run_stage(stage, ctx)
            finally:
                live.close(last="")
            duration = round(time.monotonic() - t0, 3)
            if outcome is None:
                status, verdict = StageStatus.FAILED, None
                last = error.strip().splitlines()[-1] if error.strip() else "unknown error"
                reasons: tuple[str, ...] = (last,)
                outcome = StageOutcome(reasons=reasons, summary_md=f"Failed:\n\n```\n{error}\n```\n")
            else:
                verdict = outcome.verdict
                status = StageStatus.FAILED if verdict == "fail" else StageStatus.SUCCEEDED
                reasons = tuple(outcome.reasons)
            artifact = StageArtifact(
                stage=name, status=status, verdict=verdict, input_hash=digest, inputs=inputs,
                outputs=dict(outcome.outputs), metrics=dict(outcome.metrics), reasons=reasons,
                started_at=started, finished_at=_now(), duration_s=duration, error=error,
            )
            summary = outcome.summary_md
            write_text_atomic(result_dir / "summary.md", summary)
            write_text_atomic(artifact_path(job, key), artifact.to_json())
            echo(f"[{name}] {status.value}" + (f" (verdict {verdict})" if verdict else "") + f" in {duration:.1f} s"
                 + (f": {'; '.join(reasons)}" if reasons and not status.ok else ""))
        if key == name:  # dependents use the stage's own result (the train stage's baseline side)
            this_run[name] = artifact
        if decision.action != "skip":
            tracker.log_stage(artifact)
        records.append(StageRecord(artifact=artifact, decision=decision, summary_md=summary))
    from migrate.tracking.report import write_job_summary

    summary_path = write_job_summary(job, records, wandb_dir=getattr(tracker, "wandb_dir", None))
    log_report = getattr(tracker, "log_report", None)
    if log_report is not None and any(r.decision.action == "run" for r in records):
        keys = [STAGES[r.artifact.stage].key(job.stage_options.get(r.artifact.stage)) for r in records]
        log_report(f"{job.name}-report", [summary_path, job.work_dir / "summary.json",
                                          *(job.work_dir / k / f for k in keys for f in ("summary.md", "result.json"))])
    return PipelineResult(records=tuple(records), summary_path=summary_path)
