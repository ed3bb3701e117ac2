"""Worker groups: one process per rank, torch.distributed initialized, a function run on all.

Call sequence (driver side)::

    with start_worker_group(WorkerGroupSpec(world_size=4, backend="gloo")) as group:
        sums = group.run(all_reduce_rank, 1.0)      # fn(ctx, 1.0) on every rank
        group.run(another_fn)                       # same processes, same process group

``mode="ray"`` places one Ray actor per rank, one placement group per node (needs
``migrate.runtime.ray_cluster.connect`` first); ``mode="local"`` spawns local processes
and runs the very same rank code without Ray. A rank that raises, dies or is still busy
when the timeout expires makes ``run`` raise ``WorkerGroupError`` naming each such rank
and its node; the group is then torn down (no orphan processes).
"""

from __future__ import annotations

import sys

from migrate.runtime.group import (RankContext, RankFailure, WorkerGroup, WorkerGroupError, WorkerGroupSpec,
                                   rank_placement)

__all__ = ["RankContext", "RankFailure", "WorkerGroup", "WorkerGroupError", "WorkerGroupSpec", "rank_placement",
           "start_worker_group", "warm_local_ranks"]


# Starts of a group whose rendezvous port was taken between its choice and the bind, before giving up.
PORT_ATTEMPTS = 3


def start_worker_group(spec: WorkerGroupSpec) -> WorkerGroup:
    """Start every rank, initialize torch.distributed on each, and return the group.

    A start that fails only because the rendezvous port was taken meanwhile (another process bound it between
    its choice and rank 0's listen) is made again on a new port, up to ``PORT_ATTEMPTS`` starts in all; every
    other failure raises at once. A failed start leaves no process behind."""
    if spec.mode == "local":
        from migrate.runtime._local import LocalWorkerGroup as group_class
    else:
        from migrate.runtime._ray import RayWorkerGroup as group_class  # type: ignore[assignment]
    for attempt in range(1, PORT_ATTEMPTS):
        try:
            return group_class(spec)
        except WorkerGroupError as exc:
            if not exc.port_taken:
                raise
            cause = next(f for f in exc.failures if f.kind == "exception").describe()
            print(f"worker group: start {attempt} of {PORT_ATTEMPTS} found its rendezvous port taken ({cause}); "
                  "starting again on another port", file=sys.stderr)
    return group_class(spec)


def warm_local_ranks(*modules: str) -> None:
    """Have local groups' ranks start with `modules` imported (by the fork server, once per driver
    process); takes effect only before the first local group starts."""
    from migrate.runtime._local import warm

    warm(*modules)
