"""The user's own launch line as a workload: a command template started once per rank of a
worker group with torchrun-style environment variables, its metrics read from its log.

Call sequence: `render_command(template, values)` (pure) -> start a worker group with
`init_distributed=False` (the command joins its own process group on MASTER_ADDR/PORT, which
the group sets) -> `group.run(run_external, argv, log_dir)` -> rank 0's log (or the run's
TensorBoard dir) read by `convergence.readers.read_metrics`.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from string import Formatter
from typing import Any
from collections.abc import Mapping

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
