"""Worker groups under embedded Ray (and the local mode): results, failures, cleanup."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from migrate.runtime.worker_group import WorkerGroupError, WorkerGroupSpec, start_worker_group


def all_reduce_rank_values(ctx, scale):
    """Every rank contributes (rank + 1) * scale; returns the sum and the rank's view of itself."""
    t = torch.tensor([float(ctx.rank + 1) * scale], dtype=torch.float64)
    dist.all_reduce(t)
    return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(), "env_rank": os.environ["RANK"]}


def pid_of_rank(ctx):
    return os.getpid()


def kill_rank_mid_all_reduce(ctx, victim):
    """The victim kills itself with SIGKILL while the others wait in an all_reduce."""
    if ctx.rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    dist.all_reduce(t)
    return t.sum().item()


def exit_while_others_set_up_a_group(ctx, victim):
    """The victim exits (code 3) while the others create a subgroup, as a comm suite's setup does."""
    if ctx.rank == victim:
        os._exit(3)
    group = dist.new_group(list(range(ctx.world_size)))
    dist.barrier(group=group)
    return ctx.rank


def hang_on_rank(ctx, victim):
    if ctx.rank == victim:
        time.sleep(3600)
    return ctx.rank


def raise_on_rank(ctx, victim):
    if ctx.rank == victim:
        raise ValueError(f"bad shard on rank {ctx.rank}")
    return ctx.rank


def start_a_helper_then_die(ctx, victim, folder):
    """What a framework's saver does (a process of its own), then the rank dies, leaving the helper behind."""
    import multiprocessing
    from pathlib import Path

    helper = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    helper.start()
    (Path(folder) / f"helper-{helper.pid}").touch()
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return helper.pid


def _assert_gone(pids, within_s=10.0):
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert not alive, f"rank processes still alive after close: {alive}"


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_all_reduce_under_embedded_ray(ray_session, world_size):
    spec = WorkerGroupSpec(world_size=world_size, backend="gloo", devices_per_node=2 if world_size == 4 else None, timeout_s=120)
    with start_worker_group(spec) as group:
        results = group.run(all_reduce_rank_values, 0.5)
        pids = group.run(pid_of_rank)
        contexts = group.contexts()
    expected = 0.5 * world_size * (world_size + 1) / 2
    assert [r["sum"] for r in results] == [expected] * world_size
    assert [r["rank"] for r in results] == list(range(world_size))
    assert [r["env_rank"] for r in results] == [str(r) for r in range(world_size)]
    assert all(r["world"] == world_size for r in results)
    if world_size == 4:
        assert [(c.node_rank, c.local_rank) for c in contexts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(set(pids)) == world_size
    _assert_gone(pids)


@pytest.mark.slow
def test_eight_ranks_on_two_cores(ray_session):
    with start_worker_group(WorkerGroupSpec(world_size=8, timeout_s=180)) as group:
        results = group.run(all_reduce_rank_values, 1.0)
    assert {r["sum"] for r in results} == {36.0}


@pytest.mark.slow
def test_killed_rank_is_reported_with_its_rank_within_the_timeout(ray_session):
    group = start_worker_group(WorkerGroupSpec(world_size=4, timeout_s=60))
    pids = group.run(pid_of_rank)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as info:
        group.run(kill_rank_mid_all_reduce, 2, timeout_s=30)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < 30
    died = [f for f in err.failures if f.kind == "died"]
    assert [f.rank for f in died] == [2]
    assert str(err).splitlines()[1].strip().startswith("rank 2 on ")  # root cause listed first
    assert "died" in str(err)
    _assert_gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ray", "local"])
def test_rank_dying_during_setup_is_named_first_not_its_bystanders(ray_session, mode):
    group = start_worker_group(WorkerGroupSpec(world_size=3, timeout_s=60, mode=mode))
    pids = group.run(pid_of_rank)
    with pytest.raises(WorkerGroupError) as info:
        group.run(exit_while_others_set_up_a_group, 1, timeout_s=40)
    err = info.value
    assert [f.rank for f in err.failures if f.kind == "died"] == [1], str(err)
    assert str(err).splitlines()[1].strip().startswith("rank 1 on "), str(err)  # the cause, then the bystanders
    assert err.ranks[0] == 1
    assert all(f.detail == "stopped after rank(s) [1] failed" for f in err.failures if f.kind == "aborted"), str(err)
    _assert_gone(pids)


@pytest.mark.slow
def test_hung_rank_times_out_naming_the_rank(ray_session):
    group = start_worker_group(WorkerGroupSpec(world_size=2, timeout_s=60))
    pids = group.run(pid_of_rank)
    with pytest.raises(WorkerGroupError) as info:
        group.run(hang_on_rank, 1, timeout_s=3)
    assert [(f.rank, f.kind) for f in info.value.failures] == [(1, "timeout")]
    assert "within 3.0 s" in str(info.value)
    _assert_gone(pids)


def test_exception_on_a_rank_carries_its_traceback(ray_session):
    with start_worker_group(WorkerGroupSpec(world_size=2, timeout_s=60)) as group:
        with pytest.raises(WorkerGroupError) as info:
            group.run(raise_on_rank, 0)
    (failure,) = info.value.failures
    assert failure.rank == 0 and failure.kind == "exception"
    assert "ValueError: bad shard on rank 0" in failure.detail
    assert "raise_on_rank" in failure.detail


def test_unplaceable_group_is_an_error_not_a_hang(ray_session):
    spec = WorkerGroupSpec(world_size=2, device_type="cuda", backend="nccl", timeout_s=3)
    with pytest.raises(WorkerGroupError, match="could not be placed"):
        start_worker_group(spec)


def test_local_mode_runs_the_same_rank_code_and_reports_a_killed_rank():
    with start_worker_group(WorkerGroupSpec(world_size=3, mode="local", timeout_s=60)) as group:
        results = group.run(all_reduce_rank_values, 1.0)
        assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]
        pids = group.run(pid_of_rank)
        with pytest.raises(WorkerGroupError) as info:
            group.run(kill_rank_mid_all_reduce, 1, timeout_s=30)
    assert [f.rank for f in info.value.failures if f.kind == "died"] == [1]
    assert "SIGKILL" in str(info.value)
    _assert_gone(pids)


def _listening() -> socket.socket:
    """A socket listening on every address at a port the kernel picks, as another program's would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    sock.listen()
    return sock


def test_a_rendezvous_port_taken_before_rank_0_listens_is_replaced_by_another(monkeypatch, capfd):
    """Another program binds the port between its choice and rank 0's listen: the group starts again on a new
    port, and a port taken at every start fails after the last one, naming EADDRINUSE."""
    import migrate.runtime.worker_group as worker_group
    import migrate.runtime._local as local

    with _listening() as taken:
        port = taken.getsockname()[1]
        chosen: list[int] = []
        local_free_port = local.free_port

        def taken_once_then_free() -> int:
            chosen.append(port if not chosen else local_free_port())
            return chosen[-1]

        monkeypatch.setattr(local, "free_port", taken_once_then_free)
        with start_worker_group(WorkerGroupSpec(world_size=2, mode="local", timeout_s=60)) as group:
            assert [c.master_port for c in group.contexts()] == [chosen[-1]] * 2 and chosen[-1] != port
            assert [r["sum"] for r in group.run(all_reduce_rank_values, 1.0)] == [3.0, 3.0]
        assert len(chosen) == 2
        assert capfd.readouterr().err.count("rendezvous port taken") == 1

        monkeypatch.setattr(local, "free_port", lambda: chosen.append(port) or port)
        monkeypatch.setattr(worker_group, "PORT_ATTEMPTS", 2)
        with pytest.raises(WorkerGroupError) as info:
            start_worker_group(WorkerGroupSpec(world_size=2, mode="local", timeout_s=60))
    assert len(chosen) == 4 and info.value.port_taken
    assert [f.rank for f in info.value.failures if f.kind == "exception"] == [0]
    assert "EADDRINUSE" in str(info.value) or "address already in use" in str(info.value).lower()


def test_other_start_failures_are_not_taken_for_a_taken_port(monkeypatch):
    """A start that fails for another reason raises at once (no second start)."""
    import migrate.runtime._local as local

    starts: list[int] = []
    real = local.free_port
    monkeypatch.setattr(local, "free_port", lambda: starts.append(1) or real())
    with pytest.raises(WorkerGroupError) as info:  # Gloo told to use a network interface this host lacks
        start_worker_group(WorkerGroupSpec(world_size=2, mode="local", timeout_s=60,
                                           env={"GLOO_SOCKET_IFNAME": "migrate-no-such-nic0"}))
    assert not info.value.port_taken and len(starts) == 1
    assert "migrate-no-such-nic0" in str(info.value)


def test_processes_a_rank_started_die_with_the_group_also_when_the_rank_died_first(tmp_path):
    group = start_worker_group(WorkerGroupSpec(world_size=2, mode="local", timeout_s=60))
    try:
        group.run(start_a_helper_then_die, -1, str(tmp_path))  # every rank starts a helper and stays
        with pytest.raises(WorkerGroupError):
            group.run(start_a_helper_then_die, 1, str(tmp_path), timeout_s=30)  # rank 1 starts another, dies
        helpers = [int(p.name.removeprefix("helper-")) for p in tmp_path.glob("helper-*")]
        assert len(helpers) == 4 and all(psutil.pid_exists(pid) for pid in helpers)
    finally:
        group.close()
    _assert_gone(helpers)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"world_size": 3, "devices_per_node": 2}, "world_size(3) is not a multiple of devices_per_node(2)"),
        ({"world_size": 2, "device_type": "cpu", "backend": "nccl"}, "backend 'nccl' cannot drive device type 'cpu'"),
        ({"world_size": 2, "device_type": "tpu"}, "device_type 'tpu' is not one of"),
    ],
)
def test_bad_group_specs_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError) as info:
        WorkerGroupSpec(**kwargs)
    assert message in str(info.value)
