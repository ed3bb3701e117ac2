"""Worker group of local processes: the same rank code as Ray, without Ray.

Ranks are forked from multiprocessing's fork server, which imports torch (and the modules named in
``warm`` or ``WorkerGroupSpec.preload``) once when the first group starts: a rank then starts in
milliseconds instead of importing torch and a framework anew (5-15 s each). Each rank gets the driver's
environment, working directory and ``sys.path`` as of its group's start, as a spawned process would.
Modules asked for after the server started are imported by each rank itself.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any
from collections.abc import Callable

from migrate.runtime._rank import RankOutcome, execute, free_port, hostname, pack_call, setup_rank, teardown_rank
from migrate.runtime.group import FailureKind, RankContext, RankFailure, WorkerGroupError, WorkerGroupSpec, rank_placement

# After one rank fails the others are usually blocked in a collective with it:
# wait this long for their own answers before stopping them.
FAILURE_GRACE_S = 3.0
_CLOSE_WAIT_S = 5.0


# What every rank imports anyway: the fork server holds it from the start.
_WARM: set[str] = {"torch", "torch.distributed", "cloudpickle", "migrate.runtime._rank"}


def warm(*modules: str) -> None:
    """Add modules for the fork server to import when it starts (no effect on a server already running);
    also for other users of multiprocessing's fork server in this process."""
    _WARM.update(modules)
    if sys.platform == "linux":
        multiprocessing.set_forkserver_preload(sorted(_WARM))


def _context(spec: WorkerGroupSpec) -> multiprocessing.context.BaseContext:
    """The fork server's context, the server started (with ``spec.env`` set while its modules import)."""
    if sys.platform != "linux":
        return multiprocessing.get_context("spawn")
    import multiprocessing.forkserver as forkserver

    warm(*spec.preload)  # read only when the server starts
    saved = dict(os.environ)
    os.environ.update({k: str(v) for k, v in spec.env.items()})
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return multiprocessing.get_context("forkserver")


def _rank_main(ctx: RankContext, spec: WorkerGroupSpec, conn: Connection, environ: dict[str, str]) -> None:
    # A forked rank has the fork server's environment: give it the driver's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    # Its own process group, which the processes a framework starts (DCP and Megatron savers) join: the group
    # is killed with the rank, also when the rank died first and left them behind (`_kill_all`).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    try:
        setup_rank(ctx, spec)
    except BaseException:  # noqa: BLE001
        conn.send(("result", RankOutcome(ok=False, error=traceback.format_exc(limit=20))))
        return
    conn.send(("result", RankOutcome(ok=True, value=None)))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # driver went away
            break
        if kind == "close":
            break
        outcome = execute(ctx, payload)
        try:
            conn.send(("result", outcome))
        except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("result", RankOutcome(ok=False, error=f"result could not be sent back:\n{traceback.format_exc(limit=5)}")))
    teardown_rank()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "process vanished"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class LocalWorkerGroup:
    """``spec.world_size`` processes on this host, each one rank."""

    def __init__(self, spec: WorkerGroupSpec):
        self.spec = spec
        self._closed = False
        port = free_port()
        self._contexts = []
        for rank in range(spec.world_size):
            node_rank, local_rank = rank_placement(spec, rank)
            self._contexts.append(
                RankContext(
                    rank=rank, world_size=spec.world_size, local_rank=local_rank,
                    local_world_size=spec.ranks_per_node, node_rank=node_rank, backend=spec.backend,
                    device_type=spec.device_type,
                    device="cpu" if spec.device_type == "cpu" else f"{spec.device_type}:{local_rank}",
                    master_addr="127.0.0.1", master_port=port, node=hostname(),
                )
            )
        mp = _context(spec)
        environ = dict(os.environ)
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        for ctx in self._contexts:
            parent, child = mp.Pipe()
            # Not daemonic: frameworks (DCP save) start child processes of their own.
            proc = mp.Process(  # type: ignore[attr-defined]  # a spawn or fork context has Process
                target=_rank_main, args=(ctx, spec, child, environ), name=f"migrate-rank{ctx.rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))
        atexit.register(self._finalizer)
        self._collect("starting the worker group", spec.timeout_s)

    def contexts(self) -> list[RankContext]:
        return list(self._contexts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        if self._closed:
            raise RuntimeError("worker group is closed")
        payload = pack_call(fn, args, kwargs)
        for conn in self._conns:
            conn.send(("run", payload))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(f"{name} on {self.spec.world_size} rank(s)", timeout_s or self.spec.timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        n = self.spec.world_size
        outcomes: dict[int, RankOutcome] = {}
        failures: list[RankFailure] = []
        pending = set(range(n))
        deadline = time.monotonic() + timeout_s
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for obj in wait(waitables, timeout=remaining):
                rank = by_sentinel[obj] if isinstance(obj, int) else by_conn[id(obj)]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if conn.poll():
                    try:
                        _, outcome = conn.recv()
                    except EOFError:
                        outcome = None
                    if outcome is not None:
                        pending.discard(rank)
                        outcomes[rank] = outcome
                        if not outcome.ok:
                            failures.append(RankFailure(rank, self._contexts[rank].node, "exception", outcome.error.strip()))
                            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                        continue
                proc = self._procs[rank]
                proc.join(timeout=0.1)
                if not proc.is_alive():
                    pending.discard(rank)
                    failures.append(
                        RankFailure(rank, self._contexts[rank].node, "died",
                                    f"pid {proc.pid} {_exit_reason(proc.exitcode)} during {what}")
                    )
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if pending:
            kind: FailureKind = "aborted" if failures else "timeout"
            causes = sorted(f.rank for f in failures)
            for rank in sorted(pending):
                detail = (
                    f"stopped after rank(s) {causes} failed"
                    if failures
                    else f"did not finish {what} within {timeout_s:.1f} s"
                )
                failures.append(RankFailure(rank, self._contexts[rank].node, kind, detail))
        if failures:
            self.close(graceful=False)
            raise WorkerGroupError(what, sorted(failures, key=lambda f: f.rank))
        return [outcomes[r].value for r in range(n)]

    def close(self, graceful: bool = True) -> None:
        """Ask every rank to leave its process group and exit (when ``graceful``); kill the rest."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self._conns, self._procs):
            if graceful and proc.is_alive():
                try:
                    conn.send(("close", None))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + (_CLOSE_WAIT_S if graceful else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_all(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Kill every rank still alive, then what is left of each rank's process group (see `_rank_main`)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)
    _kill_process_groups({proc.pid for proc in procs if proc.pid is not None})


def _kill_process_groups(pgids: set[int]) -> None:
    """SIGKILL the processes of the groups `pgids` that run this Python (the ranks' leftovers), in one pass over
    the processes; nothing else, should a number have been reused by an unrelated group."""
    import psutil

    python = os.path.realpath(sys.executable)
    for process in psutil.process_iter(["pid", "exe"]):
        try:
            if process.pid != os.getpid() and os.getpgid(process.pid) in pgids and process.info["exe"] == python:
                process.kill()
        except (ProcessLookupError, psutil.Error, OSError):
            continue
