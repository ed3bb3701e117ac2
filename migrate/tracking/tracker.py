"""Where progress goes: JSONL always, TensorBoard and W&B when enabled.

One ``Tracker`` per ``migrate`` invocation: ``log_metrics`` for per-step series,
``log_stage`` for each stage's artifact; ``close`` flushes every sink. W&B is offline
unless the job says ``mode: online`` or the environment sets ``WANDB_MODE``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

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


class Tracker:
    """Fan-out of metrics to JSONL (``metrics.jsonl``), TensorBoard and W&B."""

    def __init__(self, work_dir: Path, tracking: "TrackingSection", *, run_name: str, config: Mapping[str, Any] | None = None):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.work_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a", buffering=1)
        self._tb = None
        self._wandb_run = None
        if tracking.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.work_dir / "tensorboard"))
        if tracking.wandb.enabled:
            import wandb

            mode = os.environ.get("WANDB_MODE", tracking.wandb.mode)
            os.environ.setdefault("WANDB_SILENT", "true")  # the run's folder is printed by `migrate` itself
            self._wandb_run = wandb.init(
                project=tracking.wandb.project, entity=tracking.wandb.entity, group=tracking.wandb.group,
                name=run_name, dir=str(self.work_dir), mode=mode, config=dict(config or {}), reinit="finish_previous",
            )

    @property
    def wandb_dir(self) -> str | None:
        return None if self._wandb_run is None else str(Path(self._wandb_run.dir).parent)

    def _write(self, record: Mapping[str, Any]) -> None:
        self._jsonl.write(json.dumps(_json_safe(record), sort_keys=True) + "\n")

    def log_metrics(self, step: int, metrics: Mapping[str, Any], *, prefix: str) -> None:
        """One step of a series (``prefix`` is usually the stage name)."""
        self._write({"time": time.time(), "kind": "step", "stage": prefix, "step": step, "metrics": dict(metrics)})
        scalars = {f"{prefix}/{k}": s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb_run is not None and scalars:
            self._wandb_run.log({**scalars, f"{prefix}/step": step})

    def log_stage(self, artifact: "StageArtifact") -> None:
        """A stage's end: status, verdict, timings and scalar metrics."""
        record = {
            "time": time.time(), "kind": "stage", "stage": artifact.stage, "status": artifact.status.value,
            "verdict": artifact.verdict, "duration_s": artifact.duration_s, "metrics": dict(artifact.metrics),
            "reasons": list(artifact.reasons),
        }
        self._write(record)
        if self._wandb_run is not None:
            summary = {f"{artifact.stage}/status": artifact.status.value, f"{artifact.stage}/duration_s": artifact.duration_s}
            if artifact.verdict:
                summary[f"{artifact.stage}/verdict"] = artifact.verdict
            for key, value in artifact.metrics.items():
                if (s := _scalar(value)) is not None:
                    summary[f"{artifact.stage}/{key}"] = s
            self._wandb_run.summary.update(summary)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
