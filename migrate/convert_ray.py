"""Ray tasks as the converter's `map_fn`: each target file is written by one Ray task.

The checkpoint library stays Ray-free: `checkpoint.execute.execute(plan, writer, dest, map_fn=...)`
calls `map_fn(write_target_file, [args per target file])`; here every call becomes a Ray task that
reads its source regions and writes its file itself (source and destination must be on storage
every node sees). The coordinator (the caller) still writes the manifest last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from checkpoint.pools import MapFn


def ray_map(*, num_cpus: float = 1.0, max_in_flight: int | None = None) -> MapFn:
    """A map over argument tuples as Ray tasks on the current Ray session (see `ray_cluster.connect`).

    Results come back in argument order; the first task error is raised on the coordinator with the
    task's own exception type (Ray re-raises it as a subclass), after every task still queued or running is
    cancelled (force: its worker process is killed), so no task writes on after the conversion failed.
    """

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("ray_map needs a Ray session: call migrate.runtime.ray_cluster.connect(...) first")
        task = ray.remote(num_cpus=num_cpus, max_retries=0)(fn)
        limit = max_in_flight or len(args) or 1
        refs: list[Any] = []
        try:
            for a in args:
                if len(refs) >= limit:
                    ray.wait(refs, num_returns=len(refs) - limit + 1)
                refs.append(task.remote(*a))
            return ray.get(refs)
        except BaseException:
            for ref in refs:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - finished or already gone
                    pass
            raise

    return run
