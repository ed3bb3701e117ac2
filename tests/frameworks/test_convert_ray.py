"""Writing a conversion's target files as Ray tasks (embedded Ray session) gives the same files."""

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.destination import JOB_MANIFEST
from checkpoint.errors import CheckpointFormatError
from checkpoint.manifest import verify_manifest
from checkpoint.verify import compare_indexes
from migrate.cli import main
from migrate.convert_node_local import NodeLocalStorage
from migrate.convert_ray import SharedStorageError, alive_nodes, check_shared_storage, ray_map, storage_view

pytestmark = pytest.mark.slow


def _files(root):
    return json.loads((root / "manifest.json").read_text())["files"]


def test_ray_tasks_write_the_same_files_as_the_local_pool(deepspeed_checkpoint, ray_session, tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    local = convert(src, tmp_path / "local", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3))
    ray = convert(src, tmp_path / "ray", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3),
                  map_fn=ray_map(max_in_flight=2))
    assert len(ray.result.files) == len(local.result.files)
    assert sorted(_files(tmp_path / "ray")) == sorted(_files(tmp_path / "local"))
    # torch.save embeds a per-process serialization id, so compare contents, not bytes
    assert compare_indexes(read_index(tmp_path / "local"), read_index(tmp_path / "ray")) == []
    assert compare_indexes(read_index(src), read_index(tmp_path / "ray")) == []


def test_a_failing_ray_task_fails_the_conversion_and_leaves_nothing(deepspeed_checkpoint, ray_session, tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    copy = tmp_path / "src"
    copy.mkdir()
    for p in src.rglob("*"):
        if p.is_file():
            (copy / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (copy / p.relative_to(src)).write_bytes(p.read_bytes())
    index = read_index(copy)
    optim = next(copy / f for f in index.files if "optim_states" in f)
    optim.write_bytes(optim.read_bytes()[:-100])  # truncated after indexing: the task reading it fails
    from checkpoint.api import LayoutRequest, plan_conversion
    from checkpoint.execute import execute

    plan, writer = plan_conversion(index, to="deepspeed", target=LayoutRequest(dp=2, zero_stage=2))
    with pytest.raises(CheckpointFormatError):
        execute(plan, writer, tmp_path / "out", map_fn=ray_map())
    assert not (tmp_path / "out").exists()


def test_convert_command_uses_ray_when_given_an_address(deepspeed_checkpoint, ray_session, tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--to", "dcp", "--dp", "2",
                                       "--ray-address", "embedded", "--workers", "2", "--verify"])
    assert result.exit_code == 0, result.output
    assert "every tensor equals the source" in result.output
    # one embedded node wrote both ranks' files: what it read and wrote, from the plan
    assert "ray: 1 node(s) see the source and the destination as this one does" in result.output
    assert re.search(r"ray: \d+ files written by tasks on 1 node\(s\)\n  node \w{12}: ranks 0-1, \d+ files, read "
                     r"[\d.]+ MiB, wrote [\d.]+ MiB", result.output), result.output


def test_a_node_that_sees_other_files_at_the_conversion_paths_stops_it_before_anything_is_written(
        deepspeed_checkpoint, ray_session, tmp_path):
    """A node whose disk holds something else under the same path (node-local storage) is named, with what it sees."""
    src = deepspeed_checkpoint(2, 1).path
    check_shared_storage([src, tmp_path], alive_nodes())  # the embedded node shares this machine's disk

    def node_local(paths):  # run on the coordinator and, in a task, on the node: there the files are elsewhere
        import ray

        in_task = ray.get_runtime_context().get_task_id() is not None
        return storage_view([p.replace(str(tmp_path), str(tmp_path / "elsewhere")) if in_task else p for p in paths])

    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "marker").write_text("plan 1")
    with pytest.raises(SharedStorageError) as info:
        check_shared_storage([src, tmp_path / "dst"], alive_nodes(), view=node_local)
    node = alive_nodes()[0][:12]
    assert f"node {node}: {tmp_path / 'dst'} does not exist there" in str(info.value)
    assert str(src) not in str(info.value).split("same path): ")[1]  # the source is shared: not named
    (tmp_path / "elsewhere" / "dst").mkdir(parents=True)
    (tmp_path / "elsewhere" / "dst" / "marker").write_text("plan 2")
    with pytest.raises(SharedStorageError, match=r"1 files differ in size or content \(first: marker"):
        check_shared_storage([tmp_path / "dst"], alive_nodes(), view=node_local)
    # through the converter: the check runs before the first task, and the destination is removed
    mapper = ray_map(shared=(src, tmp_path / "out"))
    convert(src, tmp_path / "out", to="deepspeed", target=LayoutRequest(dp=2, zero_stage=1), map_fn=mapper)
    assert (tmp_path / "out" / "manifest.json").exists() and mapper.shared_by == alive_nodes()


def test_node_local_storage_on_one_node_holds_its_files_with_both_manifests(deepspeed_checkpoint, ray_session,
                                                                             tmp_path):
    """The driver's node is also the writing node: its folder holds the files, manifest.json and the job manifest."""
    src = deepspeed_checkpoint(2, 1).path
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "--to", "dcp", "--dp", "2",
                                       "--ray-address", "embedded", "--storage", "node-local"])
    assert result.exit_code == 0, result.output
    node = alive_nodes()[0]
    assert f"node-local storage: 1 node(s) hold their files under {out} on their own disks" in result.output
    assert f"  node {node[:12]} (" in result.output
    job = json.loads((out / JOB_MANIFEST).read_text())
    assert list(job["nodes"]) == [node] and job["nodes"][node]["path"] == str(out)
    assert sorted(job["nodes"][node]["files"]) == sorted(_files(out)) == sorted(job["files"])
    assert verify_manifest(out) == []
    assert compare_indexes(read_index(src), read_index(out)) == []
    again = CliRunner().invoke(main, ["convert", str(src), str(out), "--to", "dcp", "--dp", "2",
                                      "--ray-address", "embedded", "--storage", "node-local", "--resume"])
    assert again.exit_code == 2 and "--resume is not available with node-local storage" in again.output


def test_node_local_storage_removes_every_nodes_folder_when_a_task_fails(deepspeed_checkpoint, ray_session,
                                                                         tmp_path):
    src = deepspeed_checkpoint(2, 1).path
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    index = read_index(copy)
    optim = next(copy / f for f in index.files if "optim_states" in f)
    optim.write_bytes(optim.read_bytes()[:-100])  # truncated after indexing: the task reading it fails
    from checkpoint.api import plan_conversion
    from checkpoint.execute import execute

    plan, writer = plan_conversion(index, to="deepspeed", target=LayoutRequest(dp=2, zero_stage=2))
    mapper = ray_map(shared=(copy,))
    with pytest.raises(CheckpointFormatError):
        execute(plan, writer, tmp_path / "out", map_fn=mapper, storage=NodeLocalStorage(mapper))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    ([], "--storage node-local writes on the nodes of a Ray cluster: give --ray-address"),
    (["--ray-address", "embedded", "--verify"], "--verify re-reads DST on this machine"),
])
def test_node_local_storage_needs_a_cluster_and_cannot_be_verified_here(tmp_path, extra, message):
    (tmp_path / "src").mkdir()
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "dcp",
                                       "--storage", "node-local", *extra])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()
