"""A metric source spec -> RunMetrics.

Specs: ``PATH`` (format detected), ``FORMAT:PATH`` with FORMAT one of jsonl, csv,
tensorboard, megatron, deepspeed, wandb, or ``wandb:ENTITY/PROJECT/RUN_ID`` for an
online W&B run.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

from convergence.readers import FORMATS, read_metrics
from convergence.series import RestartPolicy, RunMetrics, SeriesError
from migrate.gate import wandb_source

SOURCE_FORMATS: tuple[str, ...] = (*FORMATS, "wandb")
JOB_FORMATS = {"megatron_log": "megatron", "deepspeed_log": "deepspeed"}
"""The job schema's format names that differ from the readers' names."""


def spec_for(path: str, fmt: str = "auto") -> str:
    """A source spec from a job's ``metrics: {path, format}`` entry."""
    fmt = JOB_FORMATS.get(fmt, fmt)
    return path if fmt == "auto" else f"{fmt}:{path}"


def labelled(run: RunMetrics, label: str | None) -> RunMetrics:
    """`run` named `label (where it was read)` in checks and reports (its series too); unchanged without one."""
    if not label:
        return run
    name = f"{label} ({run.source})" if run.source else label
    return dataclasses.replace(run, source=name, series={k: dataclasses.replace(s, source=name)
                                                         for k, s in run.series.items()})


def load_run(spec: str, *, policy: RestartPolicy = "last") -> RunMetrics:
    """Read one source; raises SeriesError naming the source and what was expected."""
    fmt, sep, rest = spec.partition(":")
    if sep and fmt in SOURCE_FORMATS and rest:
        if fmt == "wandb":
            path = Path(rest)
            if path.exists():
                return wandb_source.read_offline(path, policy=policy)
            if rest.count("/") == 2:
                return wandb_source.read_online(rest, policy=policy)
            raise SeriesError(f"{spec}: neither an existing W&B run folder nor ENTITY/PROJECT/RUN_ID")
        return read_metrics(rest, fmt, policy=policy)  # type: ignore[arg-type]
    path = Path(spec)
    if wandb_source.is_wandb_path(path):
        return wandb_source.read_offline(path, policy=policy)
    return read_metrics(path, policy=policy)
