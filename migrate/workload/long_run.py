"""What a long run adds inside every rank: per-step time and memory records, a wall-clock limit,
checkpoint commits with retention, and injected failures and defects (the stability stage's).

Call sequence inside the engines' one loop (``migrate.workload.loop.train_loop``, every rank; a no-op
without ``RunSpec.long_run``)::

    probe = StepProbe(ctx, spec.long_run, device)
    for step in range(start_step, spec.steps):
        began = time.perf_counter()
        probe.before_step(step + 1)        # may kill this rank, stall, or grow the leak
        ...                                # the optimizer step
        probe.after_step(record, skipped)  # appends this rank's line to rank<r>.jsonl
        probe.saved(step + 1, path)        # after a save: barrier, rank 0 records it and prunes old ones
        if probe.out_of_time():            # collective when a deadline is set: every rank stops together
            break

Files under ``LongRun.records_dir`` (each line flushed as written, so a killed rank loses nothing):
``rank<r>.jsonl`` (one line per step: the step's metrics, wall time, host RSS, device memory where the
device has an allocator, whether the step was skipped) and ``checkpoints.jsonl`` (rank 0: one line per
committed checkpoint, written after every rank finished saving it).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import torch
import torch.distributed as dist

from migrate.workload.run_spec import LongRun

RANK_FILE = "rank{rank}.jsonl"
CHECKPOINTS_FILE = "checkpoints.jsonl"


def host_rss_bytes() -> int:
    """This process's resident set size now (not its peak)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def device_memory(device: str) -> dict[str, int]:
    """Bytes allocated and reserved by the device's caching allocator now, and the peak allocated; empty
    on the CPU, which has no such allocator."""
    kind = device.split(":")[0]
    module = getattr(torch, kind, None) if kind in ("cuda", "npu", "xpu") else None
    if module is None or not module.is_available():
        return {}
    return {"device_allocated_bytes": int(module.memory_allocated()),
            "device_reserved_bytes": int(module.memory_reserved()),
            "device_max_allocated_bytes": int(module.max_memory_allocated())}


class StepProbe:
    """The rank side of a long run (see the module docstring); every method is a no-op without one."""

    def __init__(self, ctx: Any, long_run: LongRun | None, device: str) -> None:
        self.spec, self.rank, self.device = long_run, ctx.rank, device
        self._leak: list[torch.Tensor] = []
        self._file = None
        self._checkpoints: list[str] = []
        if long_run is not None:
            Path(long_run.records_dir).mkdir(parents=True, exist_ok=True)
            path = Path(long_run.records_dir) / RANK_FILE.format(rank=ctx.rank)
            self._file = path.open("a", encoding="utf-8")  # closed in close()

    @property
    def active(self) -> bool:
        return self.spec is not None

    def before_step(self, step: int) -> None:
        """At the start of optimizer step `step`: an injected kill of this rank, stall or leak."""
        spec = self.spec
        if spec is None:
            return
        if any(k.rank == self.rank and k.step == step for k in spec.kills):
            if self._file is not None:
                self._file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.stall_every and spec.stall_s and step % spec.stall_every == 0:
            time.sleep(spec.stall_s)
        if spec.leak_bytes_per_step:
            self._leak.append(torch.ones(max(1, spec.leak_bytes_per_step // 4), dtype=torch.float32,
                                         device=self.device))

    def after_step(self, record: Any, *, skipped: bool = False) -> None:
        """Append this rank's line for the step `record` (a `StepMetrics`) just finished."""
        if self._file is None:
            return
        line = {**record.as_dict(), "rank": self.rank, "wall_time": time.time(), "skipped": bool(skipped),
                "host_rss_bytes": host_rss_bytes(), **device_memory(self.device)}
        self._file.write(json.dumps(line, allow_nan=True) + "\n")
        self._file.flush()

    def saved(self, step: int, path: str) -> None:
        """A checkpoint of step `step` was written at `path` (collective): once every rank is done, rank 0
        records it and removes this run's checkpoints older than the newest `keep_checkpoints`."""
        spec = self.spec
        if spec is None:
            return
        dist.barrier()
        if self.rank != 0:
            return
        with (Path(spec.records_dir) / CHECKPOINTS_FILE).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "path": path, "wall_time": time.time()}) + "\n")
        self._checkpoints.append(path)
        if spec.keep_checkpoints:
            old, self._checkpoints = (self._checkpoints[:-spec.keep_checkpoints],
                                      self._checkpoints[-spec.keep_checkpoints:])
            for stale in old:
                if stale not in spec.protected:
                    shutil.rmtree(stale, ignore_errors=True)

    def out_of_time(self) -> bool:
        """Whether the deadline has passed, as rank 0's clock says (collective: every rank gets the same
        answer, so all stop at the same step)."""
        spec = self.spec
        if spec is None or spec.deadline is None:
            return False
        flag = torch.tensor([1.0 if self.rank == 0 and time.time() >= spec.deadline else 0.0],
                            device="cpu" if self.device == "cpu" else self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        self._leak.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, kw_only=True)
class RunRecords:
    """What the ranks of one run wrote under `records_dir` (read by the driver, also after a failure):
    each rank's per-step lines in order, and rank 0's committed checkpoints as (step, path, wall time)."""

    ranks: Mapping[int, tuple[dict[str, Any], ...]]
    checkpoints: tuple[tuple[int, str, float], ...]

    def steps(self, rank: int = 0) -> tuple[dict[str, Any], ...]:
        return self.ranks.get(rank, ())


def read_records(records_dir: str | Path, world_size: int) -> RunRecords:
    """Every complete line the ranks wrote (a line cut short by a killed process is left out)."""
    root = Path(records_dir)

    def lines(path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        out = []
        for text in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if text.endswith("\n") and text.strip():
                out.append(json.loads(text))
        return out

    ranks = {r: tuple(lines(root / RANK_FILE.format(rank=r))) for r in range(world_size)}
    saved = tuple((int(c["step"]), str(c["path"]), float(c["wall_time"])) for c in lines(root / CHECKPOINTS_FILE))
    return RunRecords(ranks=ranks, checkpoints=saved)
