"""What a run of the pipeline leaves: each stage's record and artifact, where artifacts are stored, and how
they are written (atomically)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from migrate.job.job import Job
from migrate.pipeline.stage import StageArtifact

ARTIFACT_NAME = "result.json"


@dataclass(frozen=True)
class Decision:
    """What the runner does with one stage, and why."""

    action: Literal["run", "skip", "block"]
    reason: str


@dataclass(frozen=True)
class StageRecord:
    """A stage's fate in this invocation: the artifact, and whether it ran, was skipped or blocked."""

    artifact: StageArtifact
    decision: Decision
    summary_md: str


@dataclass(frozen=True)
class PipelineResult:
    records: tuple[StageRecord, ...]
    summary_path: Path
    metrics_path: Path | None = None
    """The job's metrics.jsonl (every step and stage result of every invocation)."""
    wandb_dir: str | None = None
    """The W&B run folder, where the job logs to W&B and this invocation logged anything."""

    @property
    def ok(self) -> bool:
        return all(r.artifact.status.ok for r in self.records)


def artifact_path(job: Job, stage: str) -> Path:
    return job.work_dir / stage / ARTIFACT_NAME


def read_artifact(job: Job, stage: str) -> StageArtifact | None:
    path = artifact_path(job, stage)
    if not path.exists():
        return None
    try:
        return StageArtifact.from_json(path.read_text())
    except (ValueError, TypeError, KeyError):
        return None  # an unreadable artifact is treated as absent: the stage re-runs


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
