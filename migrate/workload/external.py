"""The user's own launch line as a workload: a command template started once per rank of a
worker group with torchrun-style environment variables, its metrics read from its log.

Call sequence: `render_command(template, values)` (pure) -> start a worker group with
`init_distributed=False` (the command joins its own process group on MASTER_ADDR/PORT, which
the group sets) -> `group.run(run_external, argv, log_dir)` -> `parse_megatron_log(text)` on
rank 0's log (or `read_tensorboard` on the run's event dir).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Formatter
from typing import Any, Mapping

PLACEHOLDERS = frozenset({"tp", "pp", "dp", "ep", "vpp", "world_size", "load", "save", "steps", "seed",
                          "global_batch_size", "micro_batch_size", "nproc_per_node", "nnodes"})


def render_command(template: str, values: Mapping[str, Any]) -> list[str]:
    """argv of `template` with `{name}` placeholders filled; unknown or missing names are errors."""
    names = {field for _, field, _, _ in Formatter().parse(template) if field}
    unknown = names - PLACEHOLDERS
    if unknown:
        raise ValueError(f"command template uses unknown placeholders {sorted(unknown)}; "
                         f"known: {sorted(PLACEHOLDERS)}")
    missing = names - set(values)
    if missing:
        raise ValueError(f"command template needs values for {sorted(missing)}")
    return shlex.split(template.format(**{k: shlex.quote(str(v)) for k, v in values.items()}))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExternalResult:
    """One rank's run of the command: exit code and where its output went."""

    rank: int
    returncode: int
    log_path: str


def run_external(ctx: Any, argv: list[str], log_dir: str, timeout_s: float | None = None) -> ExternalResult:
    """Per-rank: run `argv` with this rank's torchrun environment; stdout+stderr to `rank<N>.log`."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"rank{ctx.rank}.log")
    env = dict(os.environ)
    env.update({"RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world_size), "LOCAL_RANK": str(ctx.local_rank),
                "LOCAL_WORLD_SIZE": str(ctx.local_world_size), "MASTER_ADDR": ctx.master_addr,
                "MASTER_PORT": str(ctx.master_port), "GROUP_RANK": str(ctx.node_rank)})
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False)
    return ExternalResult(rank=ctx.rank, returncode=proc.returncode, log_path=log_path)


_ITERATION = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|(.*)")
_FIELDS = {"lm loss": "loss", "grad norm": "grad_norm", "learning rate": "lr",
           "elapsed time per iteration (ms)": "step_time_ms", "consumed samples": "consumed_samples",
           "global batch size": "global_batch_size"}


def parse_megatron_log(text: str) -> list[dict[str, float]]:
    """Per-iteration metrics from Megatron-LM's training log lines
    (` iteration 3/ 10 | consumed samples: 24 | ... | lm loss: 4.1E+00 | grad norm: 1.2 |`)."""
    rows = []
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if not match:
            continue
        row: dict[str, float] = {"step": int(match.group(1))}
        for part in match.group(2).split("|"):
            key, _, value = part.partition(":")
            name = _FIELDS.get(key.strip())
            if name and value.strip():
                try:
                    row[name] = float(value.strip())
                except ValueError:
                    continue
        rows.append(row)
    return rows


def read_tensorboard(event_dir: str | Path, tags: Mapping[str, str] | None = None) -> list[dict[str, float]]:
    """Per-step metrics from TensorBoard scalars; `tags` maps a TB tag to our name
    (default: Megatron-LM's 'lm loss', 'grad-norm', 'learning-rate')."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = tags or {"lm loss": "loss", "grad-norm": "grad_norm", "learning-rate": "lr"}
    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0})
    acc.Reload()
    rows: dict[int, dict[str, float]] = {}
    available = set(acc.Tags().get("scalars", []))
    for tag, name in tags.items():
        if tag in available:
            for event in acc.Scalars(tag):
                rows.setdefault(event.step, {"step": event.step})[name] = float(event.value)
    return [rows[s] for s in sorted(rows)]
