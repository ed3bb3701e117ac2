"""A conversion spread over a multi-node Ray cluster: each target rank's files written by a task on its node, a
lost node's share redone elsewhere, and a clear failure once the retries are spent (ray_nodes_scenario.py runs
the cluster in its own process)."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.api import read_index
from checkpoint.destination import INCOMPLETE, JOB_MANIFEST
from checkpoint.errors import CheckpointFormatError
from checkpoint.io.checksum import file_crc32
from checkpoint.manifest import verify_manifest
from checkpoint.plan import TargetBuffer, TargetFile
from checkpoint.verify import compare_indexes
from migrate.convert_ray import place_files, storage_view, view_differences
from migrate.workload.fixtures import launch

REPO = Path(__file__).resolve().parents[2]


def _files(ranks, shared=()):
    weights = (TargetBuffer(key=("w",), shape=(1000,), dtype="float32"),)
    return [TargetFile(path=f"r{r}.pt", role="x", rank=r, buffers=weights) for r in ranks] + [
        TargetFile(path=p, role="x", rank=None) for p in shared]


def test_ranks_are_laid_node_major_and_shared_files_go_to_the_least_loaded_node():
    placed = place_files(_files(range(4), ["latest", "report.json"]), ["a", "b", "c"])
    assert [placed[f"r{r}.pt"] for r in range(4)] == ["a", "a", "b", "b"]
    assert placed["latest"] == "c" and placed["report.json"] == "c"  # empty files: c stays the least loaded
    placed = place_files(_files(range(5)), ["a", "b"])
    assert [placed[f"r{r}.pt"] for r in range(5)] == ["a", "a", "a", "b", "b"]
    placed = place_files(_files(range(2), ["latest"]), ["a", "b", "c", "d"])
    assert (placed["r0.pt"], placed["r1.pt"], placed["latest"]) == ("a", "b", "c")
    assert place_files(_files((), ["latest"]), ["a"]) == {"latest": "a"}
    with pytest.raises(ValueError, match="no nodes"):
        place_files(_files(range(2)), [])


def test_a_nodes_view_of_the_storage_is_compared_file_by_file_with_the_coordinators(tmp_path):
    shared = tmp_path / "shared"
    (shared / "sub").mkdir(parents=True)
    (shared / "a.pt").write_bytes(b"x" * 10)
    (shared / "sub" / "plan.json").write_text('{"plan": "1"}')
    local = tmp_path / "local"  # what a node with its own disk under the same path would see
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "plan.json").write_text('{"plan": "2"}')  # same size, other content
    (local / "b.pt").write_bytes(b"y")
    coordinator, node = storage_view([str(shared)]), storage_view([str(local)])
    assert coordinator[0] == {"a.pt": (10, coordinator[0]["a.pt"][1]), "sub/plan.json": (13, coordinator[0]["sub/plan.json"][1])}
    assert view_differences("/ckpt", coordinator[0], coordinator[0]) == []
    assert view_differences("/ckpt", coordinator[0], node[0]) == [
        "/ckpt: 1 of the coordinator's 2 files are missing (first: a.pt)",
        "/ckpt: 1 files differ in size or content (first: sub/plan.json, 13 bytes there, 13 on the coordinator)",
        "/ckpt: 1 files the coordinator does not have (first: b.pt)"]
    assert storage_view([str(tmp_path / "absent")]) == [None]
    assert view_differences("/ckpt", coordinator[0], None) == ["/ckpt does not exist there"]
    assert view_differences("/ckpt", None, None) == []
    single = storage_view([str(shared / "a.pt")])[0]
    assert single is not None and list(single) == [""]


@pytest.fixture(scope="module")
def scenario(deepspeed_checkpoint, tmp_path_factory):
    ck = deepspeed_checkpoint(2, 1)
    src = ck.path
    work = tmp_path_factory.mktemp("ray_nodes")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "ray_nodes_scenario.py"), str(src), str(work)],
                          capture_output=True, text=True, cwd=REPO, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ck, work, json.loads(proc.stdout.strip().splitlines()[-1])


def _rank_files(placements):
    return [p for p in placements if p["rank"] is not None]


@pytest.mark.slow
def test_every_file_is_written_on_the_node_that_owns_its_rank(scenario):
    ck, work, result = scenario
    src = ck.path
    nodes, placed = result["nodes"], result["placed"]
    assert len(nodes) == 3
    assert result["shared_by"] == nodes  # each raylet saw the source and destination as the coordinator does
    assert placed and all(p["written"] == p["planned"] for p in placed), placed
    by_rank = {p["rank"]: p["written"] for p in _rank_files(placed)}
    assert [by_rank[r] for r in range(4)] == [nodes[0], nodes[0], nodes[1], nodes[1]]  # 4 ranks, 2 per node
    assert {p["written"] for p in placed if p["rank"] is None} <= {nodes[2]}  # a state report: once, on the idle node
    assert verify_manifest(work / "placed") == []
    assert compare_indexes(read_index(src), read_index(work / "placed")) == []
    # a dp change reads about what it writes, per node: each node reads only the source ranges its files take
    per_node = {n["node"]: n for n in result["bytes_by_node"]}
    assert [per_node[nodes[0]]["ranks"], per_node[nodes[1]]["ranks"]] == [[0, 1], [2, 3]]
    for n in per_node.values():
        if n["ranks"]:
            assert 0.9 * n["bytes_written"] <= n["bytes_read"] <= n["bytes_written"], n


@pytest.mark.slow
def test_a_lost_nodes_files_are_redone_on_another_node(scenario):
    """...and DeepSpeed loads the result at dp4 ZeRO-3 and trains on as the source resumed at dp2 does."""
    ck, work, result = scenario
    src = ck.path
    lost = result["node_lost"]
    assert lost.get("ok") and lost["finished"], lost
    assert lost["doomed_started"], "no task started on the node before it was removed"
    moved = [p for p in lost["placements"] if p["planned"] == lost["doomed_node"]]
    assert {p["rank"] for p in moved} == {0, 1}
    assert all(p["written"] not in ("", lost["doomed_node"]) for p in moved), moved
    dst = work / "node_lost"
    assert not list(dst.rglob(".*.tmp-*")), "a lost task's temporary file was left behind"
    assert verify_manifest(dst) == []
    assert compare_indexes(read_index(src), read_index(dst)) == []
    step = dataclasses.replace(ck.spec, steps=ck.spec.steps + 1, save_dir=None)
    resumed = launch(dataclasses.replace(step, zero_stage=3, load_dir=str(dst)), 4)[0].losses
    reference = launch(dataclasses.replace(step, load_dir=str(src)), 2)[0].losses
    assert len(resumed) == len(reference) == 1, (resumed, reference)
    assert resumed[0] == pytest.approx(reference[0], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_without_retries_a_lost_node_fails_naming_its_ranks_and_leaves_nothing(scenario):
    _, work, result = scenario
    failed = result["exhausted"]
    assert "ok" not in failed and failed["error"].startswith("NodeLostError: "), failed
    assert "after 1 attempt(s) each" in failed["error"], failed["error"]
    # the task(s) the node was still running when it was lost (one seen starting there may have finished its file
    # before the node went, another started after), each named with its rank and the node it was planned on
    named = re.findall(r"(\S+) \(rank (\d+), planned on node ([^)]*)\)", failed["error"])
    assert named and all(rank in ("0", "1") and f"rank_{rank}_" in path and node == failed["doomed_node"][:12]
                         for path, rank, node in named), failed["error"]  # the doomed node's ranks only: 0 and 1
    assert not (work / "exhausted").exists()


@pytest.mark.slow
def test_node_local_storage_keeps_each_nodes_files_on_its_own_disk(scenario, tmp_path):
    """`migrate convert --storage node-local`: each raylet writes its ranks' files into its own folder, each folder
    has a manifest of what it holds, the driver lists every node's files last; DeepSpeed loads the nodes' folders
    brought together at dp4 ZeRO-3 and trains on as the source resumed at dp2 does."""
    ck, work, result = scenario
    out = result["node_local"]
    assert out["rc"] == 0, out["stderr"]
    nodes, disks = result["nodes"], result["disks"]
    assert "ray: 3 node(s) see the source as this one does" in out["stdout"], out["stdout"]
    assert "node-local storage: 3 node(s) hold their files under $NODE_DISK/out on their own disks" in out["stdout"]
    driver = work / "disks" / "driver" / "out"
    assert sorted(p.name for p in driver.iterdir()) == [JOB_MANIFEST]
    job = json.loads((driver / JOB_MANIFEST).read_text())
    assert job["storage"] == "node-local" and job["path"] == "$NODE_DISK/out" and sorted(job["nodes"]) == sorted(nodes)
    for node, entry in job["nodes"].items():
        folder = Path(disks[node]) / "out"
        assert entry["path"] == str(folder)
        assert verify_manifest(folder) == [], node
        assert not (folder / INCOMPLETE).exists()
        on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        assert on_disk == sorted([*entry["files"], "manifest.json"])
        assert entry["manifest_crc32"] == file_crc32(folder / "manifest.json")
    # ranks node-major, each rank's files on its node's disk only; `latest` (what a loader starts from) on every node
    ranks = {r: [node for node, e in job["nodes"].items() if any(f"_rank_{r}_" in f for f in e["files"])]
             for r in range(4)}
    assert ranks == {0: [nodes[0]], 1: [nodes[0]], 2: [nodes[1]], 3: [nodes[1]]}
    assert sorted(job["files"]["latest"]["nodes"]) == sorted(nodes)
    assert all(len(rec["nodes"]) >= 1 for rec in job["files"].values())
    merged = tmp_path / "merged"
    for node in nodes:
        shutil.copytree(Path(disks[node]) / "out", merged, dirs_exist_ok=True)
    assert compare_indexes(read_index(ck.path), read_index(merged)) == []
    step = dataclasses.replace(ck.spec, steps=ck.spec.steps + 1, save_dir=None)
    resumed = launch(dataclasses.replace(step, zero_stage=3, load_dir=str(merged)), 4)[0].losses
    reference = launch(dataclasses.replace(step, load_dir=str(ck.path)), 2)[0].losses
    assert resumed[0] == pytest.approx(reference[0], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_node_local_storage_refuses_a_folder_the_nodes_share(scenario):
    _, work, result = scenario
    assert result["node_local"]["shared"].startswith("DestinationError: "), result["node_local"]["shared"]
    assert "storage the nodes share" in result["node_local"]["shared"]
    assert not (work / "shared_out").exists()


@pytest.mark.slow
def test_node_local_storage_redoes_a_lost_nodes_files_on_another_nodes_disk(scenario):
    """The raylet owning ranks 0-1 is removed mid-write: its files land on the other nodes' disks, the job
    manifest lists only the nodes that hold files, and the lost node's folder keeps its marker."""
    _, work, result = scenario
    lost, disks = result["node_lost_local"], result["disks"]
    assert lost.get("ok") and lost["finished"], lost
    assert lost["doomed_started"], "no task started on the node before it was removed"
    doomed, job = lost["doomed_node"], lost["job_manifest"]
    moved = [p for p in lost["placements"] if p["planned"] == doomed]
    assert {p["rank"] for p in moved} == {0, 1}
    assert all(p["written"] not in ("", doomed) for p in moved), moved
    assert doomed not in job["nodes"] and len(job["nodes"]) == 2
    for node, entry in job["nodes"].items():
        folder = Path(disks[node]) / "node_lost"
        assert verify_manifest(folder) == [], node
        assert not list(folder.rglob(".*.tmp-*")), "a lost task's temporary file was left behind"
        assert {p["path"] for p in lost["placements"] if p["written"] == node} <= set(entry["files"])
    assert {f for e in job["nodes"].values() for f in e["files"]} == set(job["files"])
    assert (work / "disks" / "driver" / "node_lost" / JOB_MANIFEST).is_file()
    left = Path(disks[doomed]) / "node_lost"  # its "disk" outlives the raylet here: never read as a checkpoint
    assert (left / INCOMPLETE).is_dir()
    with pytest.raises(CheckpointFormatError, match="unfinished conversion"):
        read_index(left)
