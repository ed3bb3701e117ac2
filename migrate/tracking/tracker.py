"""Where progress goes: JSONL always, TensorBoard and W&B when enabled.

One ``Tracker`` per ``migrate`` invocation: ``log_metrics`` for per-step series (of one ``side``, baseline or
target, where a stage runs both), ``log_table`` and ``log_image`` for a stage's tables and plots,
``log_stage`` for each stage's artifact, ``log_report`` for the job's report files; ``close`` flushes every
sink.

* JSONL (``metrics.jsonl``): every row carries its kind, stage, side and this invocation's id.
* TensorBoard: series without a side under ``tensorboard/``, a side's under ``tensorboard/<side>/``: two
  runs of one chart, so baseline and target curves lie side by side.
* W&B: one run per job (its id derived from the job's name and work dir, resumed by every later invocation),
  created on the first thing logged, so an invocation that ran nothing makes none; grouped by the job;
  every stage's series on its own step axis (``define_metric("<stage>/*", step_metric="<stage>/step")``);
  a side's series as ``<stage>/<side>/<metric>``; tables as ``wandb.Table``, plots as ``wandb.Image``, the
  report as an artifact. Offline unless the job says ``mode: online`` or the environment sets ``WANDB_MODE``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, Sequence

if TYPE_CHECKING:
    from migrate.job.schema import TrackingSection
    from migrate.pipeline.stage import StageArtifact


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _json_safe(value: Any) -> Any:
    """NaN/Inf become strings so the JSONL stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def run_id(name: str, work_dir: Path) -> str:
    """The W&B run id of a job: the same for every invocation on the same job name and work dir."""
    return "migrate-" + hashlib.sha256(f"{name}\0{Path(work_dir).resolve()}".encode()).hexdigest()[:16]


class Tracker:
    """Fan-out of metrics to JSONL (``metrics.jsonl``), TensorBoard and W&B (see the module docstring)."""

    def __init__(self, work_dir: Path, tracking: TrackingSection, *, run_name: str, config: Mapping[str, Any] | None = None):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.work_dir / "metrics.jsonl"
        self.invocation = uuid.uuid4().hex[:12]
        self._jsonl = self.jsonl_path.open("a", buffering=1)
        self._tracking, self._run_name, self._config = tracking, run_name, dict(config or {})
        self._tb: dict[str | None, Any] = {}
        self._wandb_run: Any = None
        self._axes: set[str] = set()

    @property
    def wandb_dir(self) -> str | None:
        return None if self._wandb_run is None else str(Path(self._wandb_run.dir).parent)

    # ------------------------------------------------------------------------------------------- sinks

    def _write(self, record: Mapping[str, Any]) -> None:
        row = {"time": time.time(), "invocation": self.invocation, **record}
        self._jsonl.write(json.dumps(_json_safe(row), sort_keys=True) + "\n")

    def _board(self, side: str | None) -> Any:
        if not self._tracking.tensorboard:
            return None
        if side not in self._tb:
            from torch.utils.tensorboard import SummaryWriter

            self._tb[side] = SummaryWriter(log_dir=str(self.work_dir / "tensorboard" / (side or "")))
        return self._tb[side]

    def _wandb(self) -> Any:
        """The job's W&B run, started (or resumed) on first use; None when W&B is off."""
        if self._wandb_run is None and self._tracking.wandb.enabled:
            import wandb

            mode: Any = os.environ.get("WANDB_MODE", self._tracking.wandb.mode)  # wandb refuses a mode it does not know
            os.environ.setdefault("WANDB_SILENT", "true")  # the run's folder is printed by `migrate` itself
            self._wandb_run = wandb.init(
                project=self._tracking.wandb.project, entity=self._tracking.wandb.entity,
                group=self._tracking.wandb.group or self._run_name, job_type="migration", name=self._run_name,
                id=run_id(self._run_name, self.work_dir), resume="allow", dir=str(self.work_dir), mode=mode,
                config=self._config, reinit="finish_previous")
        return self._wandb_run

    def _axis(self, run: Any, stage: str) -> None:
        if stage not in self._axes:
            run.define_metric(f"{stage}/step")
            run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self._axes.add(stage)

    # ------------------------------------------------------------------------------------------- what

    def log_metrics(self, step: int, metrics: Mapping[str, Any], *, prefix: str, side: str | None = None) -> None:
        """One step of a stage's series (``prefix`` is the stage; ``side`` baseline or target, or None)."""
        self._write({"kind": "step", "stage": prefix, "side": side, "step": step, "metrics": dict(metrics)})
        scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        board = self._board(side)
        if board is not None:
            for key, value in scalars.items():
                board.add_scalar(f"{prefix}/{key}", value, global_step=step)
        run = self._wandb() if scalars else None
        if run is not None:
            self._axis(run, prefix)
            where = f"{prefix}/{side}" if side else prefix
            run.log({**{f"{where}/{k}": v for k, v in scalars.items()}, f"{prefix}/step": step})

    def log_table(self, stage: str, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table of a stage (the search's ranking, the comm matrix)."""
        self._write({"kind": "table", "stage": stage, "side": None, "name": name, "columns": list(columns),
                     "rows": len(rows)})
        run = self._wandb()
        if run is not None:
            import wandb

            run.log({f"{stage}/{name}": wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def log_image(self, stage: str, name: str, path: str | Path) -> None:
        """A picture a stage drew (a PNG)."""
        self._write({"kind": "image", "stage": stage, "side": None, "name": name, "path": str(path)})
        run = self._wandb()
        if run is not None:
            import wandb

            run.log({f"{stage}/{name}": wandb.Image(str(path))})

    def log_stage(self, artifact: StageArtifact) -> None:
        """A stage's end: status, verdict, timings and scalar metrics; and every picture among its outputs."""
        record = {
            "kind": "stage", "stage": artifact.stage, "side": artifact.metrics.get("side"),
            "status": artifact.status.value, "verdict": artifact.verdict, "duration_s": artifact.duration_s,
            "metrics": dict(artifact.metrics), "reasons": list(artifact.reasons),
        }
        self._write(record)
        for name, path in artifact.outputs.items():
            if str(path).endswith(".png") and Path(path).is_file():
                self.log_image(artifact.stage, name.removesuffix("_png"), path)
        run = self._wandb()
        if run is not None:
            summary = {f"{artifact.stage}/status": artifact.status.value, f"{artifact.stage}/duration_s": artifact.duration_s}
            if artifact.verdict:
                summary[f"{artifact.stage}/verdict"] = artifact.verdict
            for key, value in artifact.metrics.items():
                if (s := _scalar(value)) is not None:
                    summary[f"{artifact.stage}/{key}"] = s
            run.summary.update(summary)

    def log_report(self, name: str, files: Sequence[Path]) -> None:
        """The job's report (summary.md, summary.json, each stage's summary and result) as one W&B artifact."""
        present = [Path(f) for f in files if Path(f).is_file()]
        self._write({"kind": "report", "stage": None, "side": None, "name": name, "files": [str(f) for f in present]})
        run = self._wandb_run  # a report alone starts no run: only what ran is reported
        if run is not None and present:
            import wandb

            artifact = wandb.Artifact(name, type="migration-report")
            for f in present:
                artifact.add_file(str(f), name=str(f.relative_to(self.work_dir)) if f.is_relative_to(self.work_dir)
                                  else f.name)
            run.log_artifact(artifact)

    def close(self) -> None:
        self._jsonl.close()
        for board in self._tb.values():
            board.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
