"""Real-step profilers: the built-in workloads on a worker group, or the user's own command.

Both are ``parallel_search.search.Profiler`` callables: ``profiler(candidate, steps)`` runs
``warmup`` + ``steps`` optimizer steps of the candidate on the target devices and returns a
``Measurement`` (per-step seconds, the slowest rank's; peak bytes above the rank's footprint
before the run, the largest rank's). A candidate that fails (OOM, an unsupported feature, a
crash) returns ``ok=False`` with the reason; it never raises.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

from checkpoint.model_shape import ModelShape
from migrate.runtime.worker_group import WorkerGroup, WorkerGroupError
from migrate.workload.run_spec import RunSpec, TrainSpec
from parallel_search.emit import deepspeed_config, megatron_args
from parallel_search.search import Measurement
from parallel_search.space import Candidate
from parallel_search.spec import TrainingShape

_OOM_MARKERS = ("out of memory", "outofmemory", "cannot allocate memory", "memoryerror", "std::bad_alloc")


def unsupported_by_builtin(cand: Candidate) -> str | None:
    """Why the built-in workloads cannot run ``cand`` (None: they can)."""
    lay = cand.layout
    if lay.cp > 1:
        return f"unsupported by the built-in workloads: context parallel cp({lay.cp}) (RunSpec has no cp)"
    if cand.recompute != "none":
        return f"unsupported by the built-in workloads: recompute={cand.recompute} (RunSpec has no recompute)"
    return None


def run_spec_for(cand: Candidate, model: ModelShape, train: TrainSpec, steps: int) -> RunSpec:
    """The built-in workload run that realises ``cand`` (Megatron-Core or DeepSpeed)."""
    lay = cand.layout
    train = dataclasses.replace(train, micro_batch_size=cand.micro_batch_size)
    return RunSpec(engine=cand.framework, model=model, train=train, steps=steps, tp=lay.tp, pp=lay.pp, ep=lay.ep,
                   vpp=lay.vpp, sequence_parallel=cand.sequence_parallel, zero_stage=lay.zero_stage,
                   distributed_optimizer=lay.distributed_optimizer, stop_on_nonfinite=False)


class PeakRss:
    """Samples this process's resident set every ``interval_s`` (CPU ranks have no allocator stats)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def current(self) -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.peak = self.current()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def release_freed_memory() -> None:
    """Return freed heap pages to the OS so the next run's RSS growth is its own (glibc only)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def profile_rank(ctx: Any, spec: RunSpec) -> dict[str, Any]:
    """On one rank: run the built-in engine and report step seconds and the peak bytes the run added."""
    import torch

    from migrate.workload.engines import rank_entry

    entry = rank_entry(spec.engine)
    if spec.engine == "deepspeed":
        import deepspeed  # noqa: F401  (imported before the baseline: its import is not the run's memory)
    else:
        import megatron.core  # noqa: F401
    if ctx.device_type == "cpu":
        release_freed_memory()
        with PeakRss() as rss:
            baseline = rss.peak
            result = entry(ctx, spec)
        peak = rss.peak - baseline
    else:
        backend = getattr(torch, ctx.device_type)
        backend.empty_cache()
        backend.reset_peak_memory_stats()
        baseline = backend.memory_allocated()
        result = entry(ctx, spec)
        peak = backend.max_memory_allocated() - baseline
    return {"rank": ctx.rank, "step_times_s": [m.step_time_s for m in result.metrics], "peak_bytes": int(peak)}


def failure_reason(exc: BaseException) -> str:
    """One line for the table: OOM named as such, else the first failing rank's last line."""
    text = str(exc)
    lowered = text.lower()
    if any(marker in lowered for marker in _OOM_MARKERS):
        return "out of memory (measured): " + text.strip().splitlines()[-1].strip()[:300]
    if isinstance(exc, WorkerGroupError) and exc.failures:
        return exc.failures[0].describe()[:400]
    return f"{type(exc).__name__}: {text.strip().splitlines()[-1] if text.strip() else ''}"[:400]


def is_fault(exc: BaseException, reason: str) -> bool:
    """Whether a failed run was lost to the infrastructure (a rank that died or hung) rather than to the
    candidate: out of memory and exceptions raised by the training code are the candidate's."""
    if reason.startswith("out of memory"):
        return False
    return isinstance(exc, WorkerGroupError) and any(f.kind in ("died", "timeout") for f in exc.failures)


class WorkloadProfiler:
    """Profiles candidates with the built-in workloads on one worker group of the target.

    The group (``start_group()``) is started on first use and reused for every candidate; a
    failed run tears it down and the next candidate starts a fresh one. Close it when done.
    """

    def __init__(self, start_group: Callable[[], WorkerGroup], model: ModelShape, train: TrainSpec,
                 warmup: int = 1, timeout_s: float | None = None) -> None:
        self.start_group, self.model, self.train = start_group, model, train
        self.warmup, self.timeout_s = warmup, timeout_s
        self._group: WorkerGroup | None = None
        self.runs = 0

    def __call__(self, cand: Candidate, steps: int) -> Measurement:
        reason = unsupported_by_builtin(cand)
        if reason:
            return Measurement(key=cand.key, ok=False, reason=reason)
        spec = run_spec_for(cand, self.model, self.train, self.warmup + steps)
        began = time.monotonic()
        try:
            if self._group is None:
                self._group = self.start_group()
            self.runs += 1
            results = self._group.run(profile_rank, spec, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a result, not an error
            self.close()
            reason = failure_reason(exc)
            return Measurement(key=cand.key, ok=False, reason=reason, wall_s=time.monotonic() - began,
                               fault=is_fault(exc, reason))
        per_step = list(zip(*(r["step_times_s"] for r in results)))
        timed = [max(step) for step in per_step[self.warmup:]]
        if len(timed) < steps:
            return Measurement(key=cand.key, ok=False, wall_s=time.monotonic() - began,
                               reason=f"the run stopped after {len(per_step)} of {self.warmup + steps} steps")
        return Measurement(key=cand.key, ok=True, step_times_s=tuple(timed), warmup_steps=self.warmup,
                           peak_memory_bytes=max(r["peak_bytes"] for r in results), wall_s=time.monotonic() - began)

    def close(self) -> None:
        if self._group is not None:
            try:
                self._group.close()
            finally:
                self._group = None


class CommandProfiler:
    """Profiles candidates with the user's own launch command.

    ``command`` is a template formatted with the candidate: ``{tp} {pp} {vpp} {cp} {dp} {ep}
    {micro_batch_size} {zero_stage} {steps} {framework} {megatron_args} {deepspeed_config}``
    (a JSON file path) and ``{metrics}`` (a JSONL path). The command must append one JSON
    object per optimizer step to ``{metrics}`` with ``step_time_s`` and optionally
    ``peak_memory_bytes`` (the format of migrate's workload metrics). A non-zero exit makes
    the candidate infeasible with the command's last output line as reason.
    """

    def __init__(self, command: str, model: ModelShape, train: TrainingShape, warmup: int = 1,
                 timeout_s: float = 1800.0, workdir: str | Path | None = None) -> None:
        self.command, self.model, self.train = command, model, train
        self.warmup, self.timeout_s = warmup, timeout_s
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="migrate-search-"))

    def __call__(self, cand: Candidate, steps: int) -> Measurement:
        lay = cand.layout
        run_dir = self.workdir / cand.key.replace(":", "_")
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        ds_path = run_dir / "deepspeed.json"
        ds_path.write_text(json.dumps(deepspeed_config(self.train, cand)))
        margs = shlex.join(megatron_args(self.model, self.train, cand)) if cand.framework == "megatron" else ""
        fields = dict(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, cp=lay.cp, dp=lay.dp, ep=lay.ep,
                      micro_batch_size=cand.micro_batch_size, zero_stage=lay.zero_stage, steps=self.warmup + steps,
                      framework=cand.framework, megatron_args=margs, deepspeed_config=str(ds_path), metrics=str(metrics))
        began = time.monotonic()
        try:
            line = self.command.format(**fields)
        except (KeyError, IndexError) as exc:
            raise ValueError(f"search command template {self.command!r} names an unknown field {exc}; "
                             f"known: {sorted(fields)}") from None
        try:
            done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return Measurement(key=cand.key, ok=False, reason=f"command timed out after {self.timeout_s:g} s",
                               wall_s=time.monotonic() - began, fault=True)
        wall = time.monotonic() - began
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()
            last = tail[-1] if tail else ""
            reason = f"command exited {done.returncode}: {last}"[:400]
            killed = done.returncode < 0 or done.returncode in (128 + 9, 128 + 15)  # a signal, not the candidate
            if any(m in (done.stderr or "").lower() for m in _OOM_MARKERS):
                reason, killed = "out of memory (measured): " + reason, False
            return Measurement(key=cand.key, ok=False, reason=reason, wall_s=wall, fault=killed)
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
        timed = [float(r["step_time_s"]) for r in records[self.warmup:]]
        if len(timed) < steps:
            return Measurement(key=cand.key, ok=False, wall_s=wall,
                               reason=f"command wrote {len(records)} step record(s) to {metrics}, expected "
                                      f"{self.warmup + steps}")
        peaks = [int(r["peak_memory_bytes"]) for r in records if r.get("peak_memory_bytes") is not None]
        return Measurement(key=cand.key, ok=True, step_times_s=tuple(timed), warmup_steps=self.warmup,
                           peak_memory_bytes=max(peaks) if peaks else None, wall_s=wall)
