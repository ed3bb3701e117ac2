"""Ray tasks as the converter's `map_fn`: each target file is written by one Ray task, placed by node.

The checkpoint library stays Ray-free: `checkpoint.execute.execute(plan, writer, dest, map_fn=...)`
calls `map_fn(write_target_file, [args per target file])`; here every call becomes a Ray task that
reads its source regions and writes its file itself (source and destination on storage every node sees).
The coordinator (the caller) still writes the manifest and the commit files last.

Placement (`place_files`, pure): the target layout's ranks are laid node-major over the cluster's nodes, as
a worker group lays its ranks (`rank_placement`): with W target ranks on N nodes, node k writes the files of
ranks [k·⌈W/N⌉, (k+1)·⌈W/N⌉); files no rank owns (DeepSpeed's `latest`, a state report) go, once each, to
the node with the fewest bytes so far. Each task asks for its node with a soft node affinity, so a task whose
node is lost is retried (`retries` times) on another node; a file is complete or absent (written under a
temporary name, then renamed), so a retry is idempotent. After the retries the conversion fails naming the
node and the ranks (`NodeLostError`), and the executor removes what it wrote. Each node is given only as many
tasks as it runs at once, so a failure stops the conversion without cancelling anything.

Storage: the source and the destination must be on storage every node mounts at the same path (a shared
file system), unless the destination is node-local (`migrate.convert_node_local`: then only the source).
Before the first task, `check_shared_storage` has one task on every node list what it sees at those paths
(files, sizes, and the content of small files such as the destination's in-progress marker) and compares it
with the coordinator's view; a node that sees something else (a node-local disk under the same path) fails
the conversion naming the node and the path, before anything is written there.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointError
from checkpoint.io.checksum import file_crc32
from checkpoint.plan import ConversionPlan, TargetFile, bytes_read_by_file


class NodeLostError(CheckpointError):
    """Target files whose task failed on a lost node (or worker) after every retry; names the nodes and ranks."""


class SharedStorageError(CheckpointError):
    """A node of the cluster does not see the source or the destination as the coordinator does."""


SMALL_FILE = 64 << 10  # files up to this size are compared by content (CRC-32) too, not only by size

FileView = dict[str, tuple[int, str]]  # relative path ("" for a file path itself) -> (size, CRC-32 or "")


def storage_view(paths: Sequence[str]) -> list[FileView | None]:
    """Per path, what this process sees there: every file under it (recursively, links followed) with its size
    and, for small files, the CRC-32 of its content; None where the path does not exist."""
    out: list[FileView | None] = []
    for path in paths:
        if not os.path.exists(path):
            out.append(None)
            continue
        files = [("", path)] if os.path.isfile(path) else [
            (os.path.relpath(os.path.join(d, n), path), os.path.join(d, n))
            for d, _, names in os.walk(path) for n in names]
        view: FileView = {}
        for rel, full in files:
            try:
                size = os.stat(full).st_size
                crc = file_crc32(Path(full)) if size <= SMALL_FILE else ""
            except OSError:
                size, crc = -1, ""  # a dangling link or a file gone meanwhile: compared as such
            view[rel] = (size, crc)
        out.append(view)
    return out


def view_differences(path: str, expected: FileView | None, seen: FileView | None) -> list[str]:
    """How `seen` (a node's view of `path`) differs from `expected` (the coordinator's), one line per kind of
    difference with a count and the first file; empty when equal. Pure."""
    if expected is None:
        return [] if seen is None else [f"{path} exists there but not on the coordinator"]
    if seen is None:
        return [f"{path} does not exist there"]
    out = []
    missing = sorted(set(expected) - set(seen))
    if missing:
        out.append(f"{path}: {len(missing)} of the coordinator's {len(expected)} files are missing "
                   f"(first: {missing[0] or path})")
    changed = sorted(k for k in set(expected) & set(seen) if expected[k] != seen[k])
    if changed:
        k = changed[0]
        out.append(f"{path}: {len(changed)} files differ in size or content (first: {k or path}, "
                   f"{seen[k][0]} bytes there, {expected[k][0]} on the coordinator)")
    extra = sorted(set(seen) - set(expected))
    if extra:
        out.append(f"{path}: {len(extra)} files the coordinator does not have (first: {extra[0]})")
    return out


def check_shared_storage(paths: Sequence[str | os.PathLike[str]], nodes: Sequence[str], *,
                         view: Callable[[Sequence[str]], list[FileView | None]] = storage_view) -> None:
    """Raise SharedStorageError unless every node in `nodes` sees at `paths` what the coordinator sees (`view`
    run on the coordinator, then in one zero-CPU task pinned to each node); names every node that differs,
    with what it sees differently."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    absolute = [str(Path(p).absolute()) for p in paths]
    expected = view(absolute)
    task = ray.remote(num_cpus=0, max_retries=0)(view)
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
            .remote(absolute) for node in nodes}
    problems = []
    for node, ref in refs.items():
        seen = ray.get(ref)
        for path, e, s in zip(absolute, expected, seen):
            problems += [f"node {node[:12]}: {d}" for d in view_differences(path, e, s)]
    if problems:
        raise SharedStorageError(f"a Ray conversion reads and writes {' and '.join(absolute)} from every node, "
                                 f"which must see them as the coordinator does (a shared file system mounted at the "
                                 f"same path): " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a target file was planned to be written and where it was (node ids)."""

    path: str
    rank: int | None
    planned: str
    written: str


def place_files(files: Sequence[TargetFile], nodes: Sequence[str]) -> dict[str, str]:
    """{target file path: node id}: ranks node-major over `nodes` in their order, rank-less files to the
    node with the fewest bytes so far (ties: the first). Pure; raises ValueError without nodes."""
    if not nodes:
        raise ValueError("place_files: no nodes to place target files on")
    ranks = sorted({f.rank for f in files if f.rank is not None})
    per_node = max(1, math.ceil((ranks[-1] + 1) / len(nodes))) if ranks else 1
    out: dict[str, str] = {}
    load = dict.fromkeys(nodes, 0)
    for f in files:
        if f.rank is not None:
            node = nodes[min(f.rank // per_node, len(nodes) - 1)]
            out[f.path] = node
            load[node] += max(f.nbytes, 1)
    for f in files:
        if f.rank is None:
            node = min(nodes, key=lambda n: (load[n], nodes.index(n)))
            out[f.path] = node
            load[node] += max(f.nbytes, 1)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeBytes:
    """What one node's tasks wrote: its target ranks, and the plan's bytes read (source elements its files'
    chunks take) and written (their tensor buffers)."""

    node: str
    ranks: tuple[int, ...]
    files: int
    bytes_read: int
    bytes_written: int


def bytes_by_node(plan: ConversionPlan, placements: Sequence[Placement]) -> list[NodeBytes]:
    """Per node that wrote files (in `placements`, where they were written): ranks, files and the plan's bytes
    read and written, in the order of the nodes' first file. Pure."""
    read = bytes_read_by_file(plan)
    size = {f.path: f.nbytes for f in plan.target.files}
    by_node: dict[str, list[Placement]] = {}
    for p in placements:
        by_node.setdefault(p.written, []).append(p)
    return [NodeBytes(node=node, ranks=tuple(sorted({p.rank for p in ps if p.rank is not None})), files=len(ps),
                      bytes_read=sum(read.get(p.path, 0) for p in ps), bytes_written=sum(size.get(p.path, 0) for p in ps))
            for node, ps in by_node.items()]


def alive_nodes(num_cpus: float = 1.0) -> list[str]:
    """Ids of the alive nodes with at least `num_cpus` CPUs, ordered by address then id (the same order on
    every call while the cluster does not change)."""
    return list(task_slots(num_cpus))


def task_slots(num_cpus: float = 1.0) -> dict[str, int]:
    """{node id: how many tasks of `num_cpus` CPUs it runs at once} for the alive nodes that run at least one,
    in `alive_nodes` order."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= num_cpus]
    nodes.sort(key=lambda n: (n.get("NodeManagerAddress", ""), n["NodeID"]))
    return {n["NodeID"]: max(1, int(n["Resources"]["CPU"] // num_cpus)) if num_cpus > 0 else 1 for n in nodes}


def _on_node(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """Run fn(*args) in a task; return the id of the node it ran on with the result."""
    import ray

    return ray.get_runtime_context().get_node_id(), fn(*args)


class RayMap:
    """A `MapFn` over Ray tasks on the current Ray session (see `ray_cluster.connect`).

    Jobs whose first argument is a `TargetFile` (the executor's) are placed by node (`place_files`); other
    jobs go wherever Ray puts them. Each node is given as many tasks at a time as it runs at once (and all
    nodes together at most `max_in_flight`); the rest wait on the coordinator, not in Ray's queues. Results
    come back in argument order; `placements` tells, per target file, the planned and the actual node of the
    last call. A task lost with its node or worker is retried `retries` times by Ray. The first task error is
    raised on the coordinator with the task's own exception type (Ray re-raises it as a subclass), a task
    still lost after its retries as `NodeLostError`; either way no further task is started and every running
    one has finished before the error is raised, so no task writes after the conversion failed. No task is
    ever cancelled: `ray.cancel` races the reply of a running task and aborts the driver (Ray's
    "Tried to complete task that was not pending", ray-project/ray#54260).
    """

    def __init__(self, *, num_cpus: float = 1.0, max_in_flight: int | None = None, retries: int = 2,
                 by_node: bool = True, shared: Sequence[str | os.PathLike[str]] = ()) -> None:
        self.num_cpus, self.max_in_flight, self.retries, self.by_node = num_cpus, max_in_flight, retries, by_node
        self.shared = tuple(shared)
        self.placements: list[Placement] = []
        self.shared_by: list[str] = []  # the nodes seen to share the `shared` paths (last call)

    def __call__(self, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        import ray
        from ray.exceptions import RayError, RayTaskError
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("ray_map needs a Ray session: call migrate.runtime.ray_cluster.connect(...) first")
        slots = task_slots(self.num_cpus)
        if self.shared:
            check_shared_storage(self.shared, list(slots))
            self.shared_by = list(slots)
        files = [a[0] for a in args if a and isinstance(a[0], TargetFile)]
        planned: Mapping[str, str] = place_files(files, list(slots)) if self.by_node and files and slots else {}
        task = ray.remote(num_cpus=self.num_cpus, max_retries=self.retries, retry_exceptions=False)(_on_node)
        waiting: dict[str, deque[int]] = {}
        for i, a in enumerate(args):
            waiting.setdefault(planned.get(a[0].path, "") if a and isinstance(a[0], TargetFile) else "",
                               deque()).append(i)
        width = {node: slots.get(node, 1) if node else max(sum(slots.values()), 1) for node in waiting}
        limit = self.max_in_flight or len(args) or 1
        busy = dict.fromkeys(waiting, 0)
        running: dict[Any, tuple[int, str]] = {}
        done: list[tuple[str, Any]] = [("", None)] * len(args)
        lost: list[str] = []
        failure: BaseException | None = None
        try:
            while running or (failure is None and not lost and any(waiting.values())):
                for node, queue in waiting.items():
                    while failure is None and not lost and queue and busy[node] < width[node] and len(running) < limit:
                        i = queue.popleft()
                        options = ({"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)}
                                   if node else {})
                        running[task.options(**options).remote(fn, *args[i])] = (i, node)
                        busy[node] += 1
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    i, node = running.pop(ref)
                    busy[node] -= 1
                    try:
                        done[i] = ray.get(ref)
                    except RayTaskError as err:  # the task's own error (bad input, disk full): as a local pool
                        failure = failure or err
                    except RayError as err:  # its node or worker lost, after Ray's retries
                        a = args[i]
                        what = (f"{a[0].path} (rank {a[0].rank}, planned on node {node[:12] or '?'})"
                                if a and isinstance(a[0], TargetFile) else "a task")
                        lost.append(f"{what}: {type(err).__name__}")
        except BaseException:  # interrupted on the coordinator: let the running tasks finish their files
            if running:
                ray.wait(list(running), num_returns=len(running))
            raise
        if failure is not None:
            raise failure
        if lost:
            raise NodeLostError(f"{len(lost)} target file(s) lost with their node or worker after "
                                f"{self.retries + 1} attempt(s) each: " + "; ".join(lost))
        self.placements = [Placement(path=a[0].path, rank=a[0].rank, planned=planned.get(a[0].path, ""), written=node)
                           for a, (node, _) in zip(args, done) if a and isinstance(a[0], TargetFile)]
        return [result for _, result in done]


def ray_map(*, num_cpus: float = 1.0, max_in_flight: int | None = None, retries: int = 2,
            by_node: bool = True, shared: Sequence[str | os.PathLike[str]] = ()) -> RayMap:
    """A `RayMap` (see there): target files written by Ray tasks placed by node, retried on a lost node, after
    every node was seen to share the `shared` paths."""
    return RayMap(num_cpus=num_cpus, max_in_flight=max_in_flight, retries=retries, by_node=by_node, shared=shared)
