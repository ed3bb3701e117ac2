"""A conversion spread over a multi-node Ray cluster: each target rank's files written by a task on its node, a
lost node's share redone elsewhere, and a clear failure once the retries are spent (ray_nodes_scenario.py runs
the cluster in its own process)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.api import read_index
from checkpoint.manifest import verify_manifest
from checkpoint.plan import TargetBuffer, TargetFile
from checkpoint.verify import compare_indexes
from migrate.convert_ray import place_files, storage_view, view_differences
from migrate.workload.fixtures import launch

REPO = Path(__file__).resolve().parents[1]


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
    for path in failed["doomed_started"]:  # the task(s) the node was running when it was lost, named with rank and node
        rank = 0 if "rank_0_" in path else 1
        assert f"{path} (rank {rank}, planned on node {failed['doomed_node'][:12]})" in failed["error"], failed["error"]
    assert not (work / "exhausted").exists()
