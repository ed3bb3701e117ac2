"""A conversion on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head without CPUs and
three one-CPU raylets), in its own process so the test session's embedded Ray stays untouched.

    python tests/ray_nodes_scenario.py SRC WORKDIR  ->  prints one JSON object

Cases, one cluster: `placed` (every file written by a task on its planned node), `node_local` (`migrate convert
--storage node-local` from its own driver process: each raylet has its own "disk", the folder $NODE_DISK names
in its environment), `node_local_shared` (node-local storage into a folder the nodes share: refused),
`node_lost` (the raylet owning ranks 0-1 is removed while its tasks are mid-write: they are redone on other
nodes, and the temporary files they left are gone), `node_lost_local` (the same with node-local storage),
`exhausted` (the same with no retries: NodeLostError naming the node and ranks, nothing left at the
destination). The cluster is shut down whatever happens.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SLEEP_S = 120.0  # a doomed task's wait: far longer than the test waits before removing its node


def _doomed(fn: Any, node_id: str, marks: str) -> Any:
    """fn, except on node `node_id`: there the task leaves a half-written temporary file of its target, marks
    that it started, and waits to be killed with its node."""

    def run(*args: Any) -> Any:
        import ray

        if ray.get_runtime_context().get_node_id() == node_id:
            target = Path(args[3]) / args[0].path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.with_name(f".{target.name}.tmp-{os.getpid()}").write_bytes(b"half written")
            Path(marks, f"{os.getpid()}").write_text(args[0].path)
            time.sleep(SLEEP_S)
        return fn(*args)

    return run


def _convert_removing(cluster: Any, node: Any, src: str, dst: Path | str, marks: Path, retries: int,
                      node_local: bool = False) -> dict[str, Any]:
    """Convert with the tasks on `node` doomed; remove `node` once one of them has started."""
    from checkpoint.api import LayoutRequest, convert
    from checkpoint.errors import CheckpointError
    from migrate.convert_node_local import NodeLocalStorage
    from migrate.convert_ray import ray_map

    marks.mkdir(parents=True)
    mapper = ray_map(retries=retries)
    storage = NodeLocalStorage(mapper) if node_local else None
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            convert(src, dst, to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3), storage=storage,
                    map_fn=lambda fn, args: mapper(_doomed(fn, node.node_id, str(marks)), args))
            if storage is not None:
                outcome["job_manifest"] = storage.job_manifest
            outcome["ok"] = True
        except CheckpointError as err:
            outcome["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=work)
    thread.start()
    deadline = time.monotonic() + 90
    while not any(marks.iterdir()) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    started = sorted(p.read_text() for p in marks.iterdir())
    cluster.remove_node(node)
    thread.join(timeout=240)
    return {**outcome, "doomed_node": node.node_id, "doomed_started": started, "finished": not thread.is_alive(),
            "placements": [vars_of(p) for p in mapper.placements]}


def vars_of(placement: Any) -> dict[str, Any]:
    return {"path": placement.path, "rank": placement.rank, "planned": placement.planned, "written": placement.written}


DISK = "NODE_DISK"  # each raylet's own disk (a folder of its own on this machine)
REPO = Path(__file__).resolve().parents[1]


def _add_node(cluster: Any, work: Path, disks: dict[str, str]) -> Any:
    disk = work / "disks" / f"node{len(disks)}"
    node = cluster.add_node(num_cpus=1, env_vars={DISK: str(disk)})
    disks[node.node_id] = str(disk)
    return node


def _node_local(cluster: Any, src: str, work: Path) -> dict[str, Any]:
    """`migrate convert --storage node-local` in a driver process of its own, whose $NODE_DISK is `driver`."""
    from checkpoint.api import LayoutRequest, convert
    from checkpoint.errors import CheckpointError
    from migrate.convert_node_local import NodeLocalStorage
    from migrate.convert_ray import ray_map

    env = {**os.environ, DISK: str(work / "disks" / "driver"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "migrate", "convert", src, f"${DISK}/out", "--to", "deepspeed",
                           "--dp", "4", "--zero-stage", "3", "--ray-address", cluster.address,
                           "--storage", "node-local"], capture_output=True, text=True, env=env, timeout=300)
    result: dict[str, Any] = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-3000:]}
    mapper = ray_map(shared=(src,))
    try:  # the nodes share this folder: node-local storage refuses it
        convert(src, work / "shared_out", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3), map_fn=mapper,
                storage=NodeLocalStorage(mapper))
        result["shared"] = "converted"
    except CheckpointError as err:
        result["shared"] = f"{type(err).__name__}: {err}"
    return result


def main(src: str, work: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    from checkpoint.api import LayoutRequest, convert
    from migrate.convert_ray import alive_nodes, bytes_by_node, ray_map

    os.environ[DISK] = str(work / "disks" / "driver")  # this driver's own folder: the job manifest's
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        disks: dict[str, str] = {}
        workers = [_add_node(cluster, work, disks) for _ in range(3)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        result: dict[str, Any] = {"nodes": alive_nodes(), "disks": disks}
        mapper = ray_map(shared=(src, work / "placed"))
        outcome = convert(src, work / "placed", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3),
                          map_fn=mapper)
        result["placed"] = [vars_of(p) for p in mapper.placements]
        result["shared_by"] = mapper.shared_by
        result["bytes_by_node"] = [dataclasses.asdict(n) for n in bytes_by_node(outcome.plan, mapper.placements)]
        result["node_local"] = _node_local(cluster, src, work)
        owner = next(w for w in workers if w.node_id == result["nodes"][0])  # ranks 0-1
        result["node_lost"] = _convert_removing(cluster, owner, src, work / "node_lost", work / "marks1", retries=2)
        _add_node(cluster, work, disks)
        cluster.wait_for_nodes()
        owner = next(w for w in cluster.worker_nodes if w.node_id == alive_nodes()[0])
        result["node_lost_local"] = _convert_removing(cluster, owner, src, f"${DISK}/node_lost", work / "marks3",
                                                      retries=2, node_local=True)
        _add_node(cluster, work, disks)
        cluster.wait_for_nodes()
        nodes = alive_nodes()
        owner = next(w for w in cluster.worker_nodes if w.node_id == nodes[0])
        result["exhausted"] = _convert_removing(cluster, owner, src, work / "exhausted", work / "marks2", retries=0)
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
