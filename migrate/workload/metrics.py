"""Per-step training metrics, the non-finite check, and the per-rank result of a run."""
from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from migrate.workload.run_spec import LRScheduleSpec, lr_at


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One optimizer step, as the whole job saw it (loss averaged over every micro-batch of every
    DP rank). `step` is 1-based: the number of optimizer steps done after this one."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    consumed_samples: int
    step_time_s: float
    peak_memory_bytes: int

    @property
    def nonfinite(self) -> tuple[str, ...]:
        """Names of the fields that are NaN or Inf."""
        return tuple(name for name in ("loss", "grad_norm", "lr") if not math.isfinite(getattr(self, name)))

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    """What one rank of a run reports back.

    `start_step` is the step loaded from the checkpoint (0 for a fresh run); `checkpoints`
    lists the checkpoint directories this run wrote (tag directories for DeepSpeed); `stopped`
    is None, or why training stopped early (non-finite metrics).
    """

    rank: int
    engine: str
    start_step: int
    metrics: tuple[StepMetrics, ...]
    checkpoints: tuple[str, ...] = ()
    stopped: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.metrics]


def peak_memory_bytes(device: str) -> int:
    """Peak allocated accelerator memory, or the process's peak RSS on the CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def nonfinite_message(metrics: StepMetrics) -> str | None:
    """An error line naming the non-finite fields and their values, or None."""
    bad = metrics.nonfinite
    if not bad:
        return None
    values = ", ".join(f"{name}={getattr(metrics, name)}" for name in bad)
    return f"non-finite metrics at step {metrics.step}: {values}"


class MetricsLog:
    """Appends one JSON object per step to `path` (rank 0 only); flushes every line so a crash
    loses nothing, and prints non-finite steps to stderr at once."""

    def __init__(self, path: str | None, enabled: bool) -> None:
        self._file = None
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # closed in close()

    def write(self, metrics: StepMetrics) -> str | None:
        """Record the step; returns the non-finite message when there is one."""
        message = nonfinite_message(metrics)
        if self._file is not None:
            record = metrics.as_dict() | ({"nonfinite": list(metrics.nonfinite)} if message else {})
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        if message:
            print(f"[migrate.workload] {message}", file=sys.stderr, flush=True)
        return message

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ScheduledLR:
    """LR scheduler driven by the pure `lr_at`: optimizer step `n` uses lr_at(schedule, lr, n).

    Its whole state is the step count, so frameworks save and restore it exactly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRScheduleSpec, base_lr: float) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.base_lr = base_lr
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.schedule, self.base_lr, self.last_step)

    def step(self, *_args: object) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [lr_at(self.schedule, self.base_lr, self.last_step)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict[str, int]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
