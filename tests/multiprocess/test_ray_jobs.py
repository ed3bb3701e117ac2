"""`ray job submit --working-dir . -- python -m migrate run job.yaml` on a running Ray cluster (`ray start
--head` on this machine): the job joins the cluster (`target.ray.address: auto`), its results land in the
job's persistent work_dir and a rerun skips them; a relative work_dir, which would land in Ray's temporary
copy of the working dir, is refused with a clear line before anything runs."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on this machine with its job server, stopped (with every process it started) afterwards."""
    venv = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{venv}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "WANDB_MODE": "offline"}
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    port, dashboard, agent, agent_grpc, runtime_env, metrics = (_free_port() for _ in range(6))
    # Every port this head listens on is chosen here: the defaults (the job agent's 52365 above all) are held
    # by any other Ray on the machine, such as an embedded one another test left running, and a head whose
    # agent cannot bind answers every submission with "No available agent".
    start = subprocess.run([str(venv / "ray"), "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}",
                            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                            f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
                            "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=4",
                            "--disable-usage-stats", f"--temp-dir={temp}"], env=env, capture_output=True, text=True,
                           timeout=240)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield env, f"http://127.0.0.1:{dashboard}"
    finally:
        _stop(temp)


def _stop(temp: str) -> None:
    """Stop this head's processes only (`ray stop` would stop every Ray on the machine, other tests' too): the
    ones whose command line names its temp dir, and their children."""
    import psutil

    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in part for part in proc.info["cmdline"] or ()):
                mine += [proc, *proc.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in mine:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(mine, timeout=5)  # a test cluster: no state worth a longer grace period
    for proc in alive:
        proc.kill()
    shutil.rmtree(temp, ignore_errors=True)


def _job_dir(tmp_path: Path, work_dir: str) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = work_dir
    data["target"]["ray"] = {"address": "auto"}
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    data["stages"] = {"preflight": {}, "search": {"profile": False}}
    folder = tmp_path / "job"
    folder.mkdir(exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder


def _submit(env: dict, address: str, folder: Path) -> subprocess.CompletedProcess:
    """Submit and wait; a head whose job agent has not registered yet says so ("try again later"): retried."""
    for _ in range(15):
        run = subprocess.run([str(Path(sys.executable).with_name("ray")), "job", "submit", f"--address={address}",
                              "--working-dir", str(folder), "--", "python", "-m", "migrate", "run", "job.yaml"],
                             env=env, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in run.stdout + run.stderr:
            return run
        time.sleep(2)
    return run


def test_a_submitted_job_runs_on_the_cluster_and_keeps_its_results(ray_head, tmp_path):
    env, address = ray_head
    work = tmp_path / "work"
    folder = _job_dir(tmp_path, str(work))
    first = _submit(env, address, folder)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert "PASSED: 2 stage(s) of job demo-cpu" in first.stdout
    assert (work / "preflight" / "result.json").is_file() and (work / "search" / "ranking.md").is_file()
    second = _submit(env, address, folder)
    assert second.returncode == 0 and "[preflight] skipped: inputs unchanged" in second.stdout + second.stderr


def test_a_relative_work_dir_under_ray_job_submit_is_refused(ray_head, tmp_path):
    env, address = ray_head
    run = _submit(env, address, _job_dir(tmp_path, "runs/{name}"))
    assert run.returncode != 0
    assert "work_dir: 'runs/{name}' resolves to" in run.stdout and "inside Ray's temporary copy" in run.stdout
