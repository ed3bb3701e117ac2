"""No process outlives its job: an embedded Ray cluster ends with the process that started it, killed or not;
a search candidate lost to a fault is measured again next time, not cached as the candidate's failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from migrate.runtime.worker_group import RankFailure, WorkerGroupError
from parallel_search.search import Measurement, ProfileCache

DRIVER = textwrap.dedent("""
    import sys
    from migrate.runtime.ray_cluster import connect
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group

    def rank(ctx):
        return ctx.rank

    conn = connect("embedded", num_cpus=4)
    group = start_worker_group(WorkerGroupSpec(world_size=2, timeout_s=120))
    assert group.run(rank) == [0, 1]
    print("READY", flush=True)
    sys.stdin.readline()  # the test says when to end
    group.close()
    conn.close()
""")


def _listeners(pids: set[int]) -> list[tuple[int, str]]:
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.append((c.pid, f"{c.laddr.ip}:{c.laddr.port}"))
    return out


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["killed", "exit"])
def test_embedded_ray_leaves_no_process_or_listener(tmp_path, ending):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # set by this session's own cluster
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert "READY" in line, proc.stderr.read()
    time.sleep(1.0)  # the reaper polls the driver's processes twice a second
    descendants = psutil.Process(proc.pid).children(recursive=True)
    ray_procs = [p for p in descendants if "ray" in " ".join(p.cmdline()).lower()]
    assert len(ray_procs) >= 4, [p.cmdline()[:2] for p in descendants]  # gcs, raylet, agents, rank actors
    assert _listeners({p.pid for p in ray_procs}), "expected Ray to listen while the job runs"
    if ending == "killed":
        proc.send_signal(signal.SIGKILL)
    else:
        proc.stdin.write("exit\n")
        proc.stdin.flush()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 15
    while _alive(ray_procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(ray_procs), f"still running after the job ended ({ending}): {_alive(ray_procs)}"
    assert not _listeners({p.pid for p in ray_procs})


def test_a_candidate_lost_to_a_fault_is_not_cached(tmp_path):
    cache_file = tmp_path / "profile_cache.jsonl"
    cache = ProfileCache(cache_file, fingerprint="f")
    cache.put("tp1", Measurement(key="tp1", ok=False, reason="rank 1 on node: died: pid 7 killed by SIGKILL",
                                 fault=True))
    cache.put("tp2", Measurement(key="tp2", ok=False, reason="out of memory (measured): 81 GB"))
    cache.put("tp4", Measurement(key="tp4", ok=True, step_times_s=(1.0, 1.1)))
    assert cache.get("tp1", 2) is not None  # this search does not retry it in a loop
    again = ProfileCache(cache_file, fingerprint="f")  # the next search (or --force)
    assert again.get("tp1", 2) is None, "a rank killed by a fault was cached as the candidate's failure"
    assert again.get("tp2", 2) is not None and not again.get("tp2", 2).ok
    assert again.get("tp4", 2).ok


def test_profiler_tells_faults_from_the_candidates_failures():
    from migrate.search.profiler import WorkloadProfiler
    from migrate.workload.fixtures import TINY_LLAMA
    from migrate.workload.run_spec import TrainSpec

    class Group:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def run(self, *args, **kwargs):
            raise self.exc

        def close(self) -> None:
            pass

    died = WorkerGroupError("profile_rank", [RankFailure(1, "node", "died", "pid 9 killed by signal SIGKILL"),
                                             RankFailure(0, "node", "exception", "RuntimeError: Connection reset")])
    oom = WorkerGroupError("profile_rank", [RankFailure(0, "node", "exception", "RuntimeError: CUDA out of memory")])
    raised = WorkerGroupError("profile_rank", [RankFailure(0, "node", "exception", "ValueError: bad shape")])
    model, train = TINY_LLAMA, TrainSpec()
    cand = _candidate()
    for exc, fault in ((died, True), (oom, False), (raised, False)):
        m = WorkloadProfiler(lambda exc=exc: Group(exc), model, train)(cand, 2)
        assert not m.ok and m.fault is fault, (m.reason, m.fault)
    assert "rank 1" in WorkloadProfiler(lambda: Group(died), model, train)(cand, 2).reason


def _candidate():
    from checkpoint.layout import ParallelLayout
    from parallel_search.space import Candidate

    return Candidate(layout=ParallelLayout(tp=1, pp=1, dp=2), micro_batch_size=1, recompute="none",
                     framework="deepspeed")
