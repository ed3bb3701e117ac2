"""Before any stage runs, the job's worker groups are checked against the cluster: a job for NPUs on a machine
without them, or for more devices than a cluster has, or packed more to a node than its nodes hold, stops in
seconds with every shortfall named and the numbers, exit code 2."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from migrate.job.load import load_job
from migrate.runtime.resources import ClusterResources, GroupNeed, NodeResources, shortfalls, stage_needs
from tests.cli_process import run_migrate

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, **target) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["target"].update(target)
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_every_stage_says_which_groups_it_starts(tmp_path):
    job = load_job(_job(tmp_path, device_type="npu", backend="hccl", device_count=8, devices_per_node=4,
                        device_profile="ascend-910b"))
    needs = {(n.stage, n.purpose): (n.world_size, n.per_node) for n in stage_needs(job, list(job.stage_options))}
    assert needs[("preflight", "the target's ranks")] == (8, 4)
    assert needs[("resume", "the baseline's continuation at the source layout")] == (4, 4)
    assert needs[("ops", "one device")] == (1, 1)
    assert needs[("stability", "the long run on the target")] == (8, 4)
    assert ("convert", "") not in {(n.stage, "") for n in stage_needs(job, ["convert", "gate"])}


def test_shortfalls_name_the_stage_the_numbers_and_the_nodes():
    cluster = ClusterResources(nodes=(NodeResources(name="a", cpus=64, devices={"npu": 8}),
                                      NodeResources(name="b", cpus=64, devices={"npu": 4})),
                               where="the Ray cluster at auto (2 node(s))")
    found = shortfalls([GroupNeed(stage="preflight", purpose="the target's ranks", world_size=16, device_type="npu",
                                  per_node=8),
                        GroupNeed(stage="comm", purpose="the target's ranks", world_size=16, device_type="npu",
                                  per_node=4),
                        GroupNeed(stage="stability", purpose="the long run", world_size=12, device_type="npu",
                                  per_node=6)], cluster)
    assert found == [
        "stage preflight: the target's ranks: 16 npu wanted; the Ray cluster at auto (2 node(s)) has 12 (8, 4 a node)",
        "stage comm: the target's ranks: 16 npu wanted; the Ray cluster at auto (2 node(s)) has 12 (8, 4 a node)",
        "stage stability: the long run: 12 npu wanted, 6 on each of 2 node(s); the Ray cluster at auto (2 node(s)) has "
        "room for 1 such node(s) (8, 4 a node)",
    ]
    fits = ClusterResources(nodes=(NodeResources(name="a", cpus=64, devices={"npu": 16}),), where="x")
    assert shortfalls([GroupNeed(stage="comm", purpose="p", world_size=16, device_type="npu", per_node=8)], fits) == []


def test_a_device_that_cannot_be_used_is_one_reason_per_stage():
    cluster = ClusterResources(nodes=(NodeResources(name="here", cpus=2),), where="this machine",
                               unusable={"npu": "torch_npu (Ascend's PyTorch adapter) is not installed"})
    found = shortfalls([GroupNeed(stage="ops", purpose="one device", world_size=1, device_type="npu", per_node=1)],
                       cluster)
    assert found == ["stage ops: one device: 1 npu wanted; torch_npu (Ascend's PyTorch adapter) is not installed"]


@pytest.mark.parametrize("target,expected", [
    ({"device_type": "npu", "backend": "hccl", "device_profile": "ascend-910b"},
     "torch_npu (Ascend's PyTorch adapter) is not installed"),
    ({"device_type": "cuda", "backend": "nccl", "device_profile": "h100"}, "CUDA"),
])
def test_a_job_for_devices_this_machine_lacks_stops_in_seconds_naming_every_stage(tmp_path, target, expected):
    job = _job(tmp_path, **target)
    began = time.monotonic()
    run = run_migrate(["run", str(job)], timeout=120)
    seconds = time.monotonic() - began
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"{job}: the cluster cannot run") and seconds < 60
    named = {line.split(":")[0].strip("- ") for line in lines[1:]}
    assert {"stage preflight", "stage comm", "stage ops", "stage search", "stage train", "stage resume",
            "stage stability"} <= named, lines
    assert all(expected in line for line in lines[1:])
    assert not (tmp_path / "work" / "preflight").exists()  # nothing ran


@pytest.mark.parametrize("device,expected", [
    ("cuda:0", "error: --device cuda:0: torch 2.13.0+cpu is a build without CUDA (install a CUDA build of torch)"),
    ("npu:0", "error: --device npu:0: torch_npu (Ascend's PyTorch adapter) is not installed, and the npu device needs it"),
])
def test_ops_on_a_device_this_machine_lacks_is_one_line(device, expected):
    import torch
    from click.testing import CliRunner

    from migrate.commands.ops import command

    if device.startswith("cuda") and torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    result = CliRunner().invoke(command, ["--device", device, "--op", "gelu"])
    assert result.exit_code == 2 and result.output.strip() == expected


def test_a_ray_cluster_that_cannot_be_reached_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """`target.ray.address: auto` on a machine outside any cluster: `run` and `run --dry-run` say which address
    could not be joined and what to do, in one line, instead of a traceback."""
    from click.testing import CliRunner

    from migrate.cli import main
    from migrate.runtime import session
    from migrate.runtime.ray_cluster import RayConnectionError

    def unreachable(address, **_):
        raise RayConnectionError(f"could not join Ray at {address!r}: Could not find any running Ray instance.")

    monkeypatch.setattr(session, "connect", unreachable)
    path = _job(tmp_path, ray={"address": "auto"})
    for argv in (["run", str(path)], ["run", str(path), "--dry-run"]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2, result.output
        line = next(line for line in result.output.splitlines() if line.startswith("error:"))
        assert line.startswith("error: could not join Ray at 'auto': Could not find any running Ray instance.")
        assert "target.ray.address in the job" in line and "Traceback" not in result.output
    assert not (tmp_path / "work" / "preflight").exists()
