"""Maps over target files: threads of this process (the default) or a spawned process pool whose workers
die with their coordinator. Any callable of the same shape (`MapFn`, e.g. Ray tasks) can stand in."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from typing import Any

from checkpoint.io.syscalls import die_with_parent

MapFn = Callable[[Callable[..., Any], Sequence[tuple[Any, ...]]], list[Any]]


IO_THREADS = 2  # target files written at once by the default map (each holds at most one tensor)


def _gather(pool: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Results of fn(*a) for every a, submitted to `pool`, in order; on the first error the rest are cancelled."""
    futures = [pool.submit(fn, *a) for a in args]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def in_threads(threads: int = IO_THREADS) -> MapFn:
    """The default map: target files written by `threads` threads of this process. Kernel copies,
    reads, CRCs and fsync release the GIL, so one file's fsync overlaps the next file's copies."""

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        if threads <= 1 or len(args) <= 1:
            return [fn(*a) for a in args]
        with ThreadPoolExecutor(max_workers=min(threads, len(args))) as pool:
            return _gather(pool, fn, args)

    return run


def local_map(workers: int) -> MapFn:
    """A map over argument tuples: inline for 1 worker, else a spawned process pool whose workers die
    with the calling process."""

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        if workers <= 1 or len(args) <= 1:
            return [fn(*a) for a in args]
        with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=get_context("spawn"),
                                 initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            return _gather(pool, fn, args)

    return run
