"""Node-local storage for a conversion over a Ray cluster: each node keeps the target files its tasks wrote on its
own disk, under the same path.

The destination names one folder on every node (`checkpoint.storage.NodePath`: `$VAR` and `~` expand in each
node's environment, so '$LOCAL_NVME/ckpt' may differ per node). The source must still be read by every node at
the same path (`RayMap`'s shared check covers it). Call sequence (coordinator = the Ray driver):
1. `check`: on every node (a zero-CPU task pinned to it) the folder is absent or empty, or holds what
   `--overwrite` replaces; the driver's own folder (where the job manifest goes) likewise;
2. `open`: each node creates its folder with the in-progress marker naming that node; then each node reads its
   marker back, so nodes that share the folder (a shared file system by mistake) are caught before any data;
3. the `RayMap` writes each target file on its node (`place_files`; a lost node's files are redone on another
   node, whose disk then holds them);
4. `write`: the files that describe the others (DCP's `.metadata`, ...) go to every node;
5. `commit`: each node writes its `manifest.json` (the files on its disk: its tasks' files, the describing and
   commit files) and the commit files, and removes its marker; then the driver writes `manifest.nodes.json`
   (every node's folder, files and manifest CRC-32) in its own folder, last: the conversion's commit point.
A file whose node was lost after writing it fails the commit (`NodeLostError`, naming the files and the node).
On any failure every reachable node's folder is removed (or emptied, where it existed before). `--resume` is
not available: which node kept which file is not known to a new run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from checkpoint.destination import (JOB_MANIFEST, MANIFEST, CommitFile, Existing, State, check_state,
                                    marker_owner, state_of)
from checkpoint.errors import CheckpointError, DestinationError
from checkpoint.io.checksum import file_crc32
from checkpoint.storage import ManifestSource, NodePath, commit_here, open_here, remove_partial, write_files
from checkpoint.write import FileRecord, remove_temps, write_atomic
from migrate.convert_ray import NodeLostError, RayMap, alive_nodes

JOB_MANIFEST_VERSION = 1


def _here(template: str) -> Path:
    return Path(os.fspath(NodePath(template)))


def _check_here(template: str, existing: Existing) -> str:
    try:
        check_state(_here(template), existing)
    except DestinationError as err:
        return str(err)
    return ""


def _open_here(template: str, plan_id: str, existing: Existing, plan_files: frozenset[str], source: str,
               owner: str) -> bool:
    dest = _here(template)
    created = not dest.exists()
    open_here(dest, plan_id, existing, plan_files=plan_files, source=source, owner=owner)
    return created


def _owner_here(template: str) -> str:
    return marker_owner(_here(template))


def _remove_temps_here(template: str, paths: list[str]) -> None:
    remove_temps(_here(template), paths)


def _write_here(template: str, files: Mapping[str, Any]) -> list[FileRecord]:
    return write_files(_here(template), files)


def _commit_here(template: str, records: list[FileRecord], commit_files: list[CommitFile],
                 source: ManifestSource) -> tuple[str, str]:
    dest = _here(template)
    commit_here(dest, records, commit_files, source)
    return str(dest), file_crc32(dest / MANIFEST)


def _remove_partial_here(template: str, created: bool) -> None:
    remove_partial(_here(template), created)


def on_nodes(fn: Callable[..., Any], args_by_node: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
    """{node id: fn(*args) run in a zero-CPU task pinned to that node}, for each node's args; once every task
    has returned, the first task error is raised (a CheckpointError as itself)."""
    import ray
    from ray.exceptions import RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
            .remote(*args) for node, args in args_by_node.items()}
    if refs:
        ray.wait(list(refs.values()), num_returns=len(refs))
    out = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref)
        except RayTaskError as err:  # bad input or a full disk there: its own one-line error, without Ray's trace
            if isinstance(err.cause, CheckpointError):
                raise err.cause from None
            raise
    return out


def on_each_node(nodes: Sequence[str], fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """`on_nodes` with the same args for every node in `nodes`."""
    return on_nodes(fn, dict.fromkeys(nodes, args))


class NodeLocalStorage:
    """A `checkpoint.storage.Storage` whose destination is a folder on each node's own disk (see the module
    docstring); `mapper` is the `RayMap` that writes the target files (its placements say which node holds
    which file)."""

    def __init__(self, mapper: RayMap) -> None:
        self.mapper = mapper
        self.created: dict[str, bool] = {}  # node id -> whether this conversion created its folder
        self.driver_created = False
        self.job_manifest: dict[str, Any] = {}  # what was written to manifest.nodes.json (after commit)

    def _nodes(self) -> list[str]:
        return alive_nodes(self.mapper.num_cpus)

    def _driver_node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def check(self, dest: Path, existing: Existing) -> None:
        if existing is Existing.RESUME:
            raise DestinationError(f"{dest}: --resume is not available with node-local storage (which node kept "
                                   f"which file is not known to a new run); pass --overwrite to start over")
        nodes = self._nodes()
        problems = [f"node {node[:12]}: {err}" for node, err in
                    on_each_node(nodes, _check_here, str(dest), existing).items() if err]
        if self._driver_node() not in nodes:
            here = _here(str(dest))
            state = state_of(here)
            only_job = state is State.FINISHED and {p.name for p in here.iterdir()} == {JOB_MANIFEST}
            if state not in (State.ABSENT, State.EMPTY) and not (only_job and existing is Existing.OVERWRITE):
                problems.append(f"driver: {here} must be absent or empty (it receives {JOB_MANIFEST}), or hold only "
                                f"an earlier {JOB_MANIFEST} with --overwrite")
        if problems:
            raise DestinationError("node-local destination: " + "; ".join(problems))

    def open(self, dest: Path, plan_id: str, existing: Existing, *, plan_files: frozenset[str],
             source: str) -> Mapping[str, Mapping[str, Any]]:
        self.check(dest, existing)
        nodes = self._nodes()
        self.created = {}
        try:
            for node in nodes:  # one after the other: a folder two nodes share is found taken by the second
                try:
                    self.created[node] = on_each_node([node], _open_here, str(dest), plan_id, existing, plan_files,
                                                      source, node)[node]
                except DestinationError as err:
                    owner = on_each_node([node], _owner_here, str(dest))[node]
                    if owner in self.created:
                        raise DestinationError(
                            f"node-local destination {dest}: node {node[:12]} sees the folder node {owner[:12]} has "
                            f"just opened (storage the nodes share): use shared storage instead") from None
                    raise DestinationError(f"node {node[:12]}: {err}") from None
            owners = on_each_node(nodes, _owner_here, str(dest))
            shared = sorted(node[:12] for node, owner in owners.items() if owner != node)
            if shared:
                raise DestinationError(f"node-local destination {dest}: nodes {', '.join(shared)} see another node's "
                                       f"folder there (storage the nodes share): use shared storage instead")
        except BaseException:
            self.remove_partial(dest)
            raise
        return {}

    def worker_root(self, dest: Path) -> NodePath:
        return NodePath(str(dest))

    def remove_temps(self, dest: Path, paths: Iterable[str]) -> None:
        on_each_node(self._opened(), _remove_temps_here, str(dest), sorted(paths))

    def write(self, dest: Path, files: Mapping[str, Any]) -> list[FileRecord]:
        written = on_each_node(self._opened(), _write_here, str(dest), dict(files))
        return next(iter(written.values()), [])

    def commit(self, dest: Path, records: Sequence[FileRecord], commit_files: Sequence[CommitFile],
               source: ManifestSource) -> None:
        nodes = self._opened()
        where = {p.path: p.written for p in self.mapper.placements}
        gone = sorted(p for p, node in where.items() if node not in nodes)
        if gone:
            lost = sorted({where[p][:12] for p in gone})
            raise NodeLostError(f"{len(gone)} target file(s) were written on node(s) {', '.join(lost)}, lost before "
                                f"the commit (first: {gone[0]}); rerun the conversion")
        per_node = {node: [r for r in records if where.get(r.path, node) == node] for node in nodes}
        committed = on_nodes(_commit_here, {node: (str(dest), per_node[node], list(commit_files), source)
                                            for node in nodes})
        import ray

        addresses = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
        self.job_manifest = {
            "version": JOB_MANIFEST_VERSION,
            "storage": "node-local",
            "format": source.target_format,
            "source": {"root": source.source_root, "format": source.source_format},
            "path": str(dest),
            "nodes": {node: {"address": addresses.get(node, ""), "path": committed[node][0],
                             "manifest_crc32": committed[node][1], "files": [r.path for r in per_node[node]]}
                      for node in nodes},
            "files": {r.path: {"bytes": r.nbytes, "crc32": r.crc32,
                               "nodes": [node for node in nodes if where.get(r.path, node) == node]}
                      for r in records},
        }
        here = _here(str(dest))
        if self._driver_node() not in nodes:
            self.driver_created = not here.exists()
            here.mkdir(parents=True, exist_ok=True)
        write_atomic(here / JOB_MANIFEST, json.dumps(self.job_manifest, indent=1, sort_keys=True), checksum=False)

    def remove_partial(self, dest: Path) -> None:
        from ray.exceptions import RayError

        reachable = set(alive_nodes(0))
        try:
            on_nodes(_remove_partial_here, {node: (str(dest), created) for node, created in self.created.items()
                                            if node in reachable})
        except RayError:  # a node lost meanwhile: its folder keeps the marker, which readers refuse
            pass
        if self.driver_created:
            remove_partial(_here(str(dest)), True)

    def _opened(self) -> list[str]:
        """The nodes whose folder this conversion opened and that are still alive."""
        reachable = set(alive_nodes(0))
        return [node for node in self.created if node in reachable]
