"""Worker group of Ray actors: one actor per rank, one STRICT_PACK placement group per node."""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from migrate.runtime._local import FAILURE_GRACE_S
from migrate.runtime._rank import RankOutcome, execute, free_port, hostname, node_address, pack_call, setup_rank, teardown_rank
from migrate.runtime.group import RankContext, RankFailure, WorkerGroupError, WorkerGroupSpec, rank_placement

_CLOSE_WAIT_S = 5.0
# A rank that lost a peer raises at once (Gloo/NCCL/HCCL), while Ray reports the peer's death a moment later:
# after such an error the others are waited for this long, so the rank that died is named, not the bystander.
PEER_LOSS_GRACE_S = 10.0
_PEER_LOSS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "recvbytes", "connectfullmesh", "socket closed", "end of file", "remote process exited",
              "ncclremoteerror", "hccl", "timeout waiting for")


def _peer_loss(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in _PEER_LOSS)


def _gone(pid: int | None, host: str) -> bool:
    """Whether the rank process `pid` on this host no longer runs (False when it runs elsewhere or is unknown)."""
    if pid is None or host != hostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _RankActor:
    """Lives in its own Ray worker process; holds one rank's process group."""

    def __init__(self) -> None:
        self._ctx: RankContext | None = None

    def node_info(self) -> tuple[str, str, int, int]:
        """(address, hostname, a free port, pid) of the actor's node/process."""
        return node_address(), hostname(), free_port(), os.getpid()

    def setup(self, ctx: RankContext, spec: WorkerGroupSpec) -> RankOutcome:
        self._ctx = ctx
        setup_rank(ctx, spec)
        return RankOutcome(ok=True)

    def run(self, payload: bytes) -> RankOutcome:
        assert self._ctx is not None, "setup must run first"
        return execute(self._ctx, payload)

    def teardown(self) -> None:
        teardown_rank()


def _bundle(spec: WorkerGroupSpec) -> dict[str, float]:
    if spec.device_type == "cuda":
        return {"GPU": 1.0, "CPU": spec.cpus_per_rank}
    if spec.device_type == "npu":
        return {"NPU": 1.0, "CPU": spec.cpus_per_rank}
    if spec.device_type == "xpu":
        return {"GPU": 1.0, "CPU": spec.cpus_per_rank}
    return {"CPU": spec.cpus_per_rank}


class RayWorkerGroup:
    """``spec.world_size`` Ray actors, ranks laid node-major over per-node placement groups."""

    def __init__(self, spec: WorkerGroupSpec):
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call migrate.runtime.ray_cluster.connect() first")
        self.spec = spec
        self._closed = False
        self._pgs = []
        self._actors: list[Any] = []
        self._contexts: list[RankContext] = []
        self._pids: dict[int, tuple[int, str]] = {}  # rank -> (pid, host)
        bundle = _bundle(spec)
        try:
            for _ in range(spec.num_nodes):
                pg = placement_group([dict(bundle) for _ in range(spec.ranks_per_node)], strategy="STRICT_PACK")
                self._pgs.append(pg)
            for node_rank, pg in enumerate(self._pgs):
                try:
                    ray.get(pg.ready(), timeout=spec.timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise WorkerGroupError(
                        "placing the worker group",
                        [RankFailure(node_rank * spec.ranks_per_node, "unplaced", "timeout",
                                     f"node {node_rank}: {spec.ranks_per_node} bundles of {bundle} could not be placed "
                                     f"on one node "
                                     f"within {spec.timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")],
                    ) from None
            actor_cls = ray.remote(max_restarts=0, max_concurrency=1)(_RankActor)  # type: ignore[call-overload]
            for rank in range(spec.world_size):
                node_rank, local_rank = rank_placement(spec, rank)
                options: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=self._pgs[node_rank], placement_group_bundle_index=local_rank
                    ),
                    "num_cpus": bundle["CPU"],
                    "name": None,
                }
                if "GPU" in bundle:
                    options["num_gpus"] = 1
                if "NPU" in bundle:
                    options["resources"] = {"NPU": 1}
                self._actors.append(actor_cls.options(**options).remote())
            infos = self._gather([a.node_info.remote() for a in self._actors], "starting rank actors", spec.timeout_s, raw=True)
            master_addr, _, master_port, _ = infos[0]
            for rank, (addr, host, _, pid) in enumerate(infos):
                self._pids[rank] = (pid, host)
                node_rank, local_rank = rank_placement(spec, rank)
                self._contexts.append(
                    RankContext(
                        rank=rank, world_size=spec.world_size, local_rank=local_rank,
                        local_world_size=spec.ranks_per_node, node_rank=node_rank, backend=spec.backend,
                        device_type=spec.device_type,
                        device="cpu" if spec.device_type == "cpu" else f"{spec.device_type}:0",
                        master_addr=master_addr, master_port=master_port, node=f"{host} ({addr}, pid {pid})",
                    )
                )
            self._gather(
                [a.setup.remote(ctx, spec) for a, ctx in zip(self._actors, self._contexts)],
                "initializing torch.distributed", spec.timeout_s,
            )
        except BaseException:
            self.close(graceful=False)
            raise

    def contexts(self) -> list[RankContext]:
        return list(self._contexts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        if self._closed:
            raise RuntimeError("worker group is closed")
        payload = ray.put(pack_call(fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        refs = [a.run.remote(payload) for a in self._actors]
        return self._gather(refs, f"{name} on {self.spec.world_size} rank(s)", timeout_s or self.spec.timeout_s)

    def _node(self, rank: int) -> str:
        return self._contexts[rank].node if rank < len(self._contexts) else f"node {rank // self.spec.ranks_per_node}"

    def _gather(self, refs: list[Any], what: str, timeout_s: float, raw: bool = False) -> list[Any]:
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        values: dict[int, Any] = {}
        failures: list[RankFailure] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                rank = index[ref]
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    failures.append(RankFailure(rank, self._node(rank), "died",
                                                f"actor process died during {what}: {type(exc).__name__}: {first}"))
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    continue
                except ray.exceptions.RayTaskError as exc:
                    failures.append(RankFailure(rank, self._node(rank), "exception", str(exc)))
                    deadline = min(deadline, time.monotonic() + self._grace(str(exc)))
                    continue
                if raw:
                    values[rank] = value
                elif value.ok:
                    values[rank] = value.value
                else:
                    failures.append(RankFailure(rank, self._node(rank), "exception", value.error.strip()))
                    deadline = min(deadline, time.monotonic() + self._grace(value.error))
        still = sorted(index[ref] for ref in pending)
        for rank in still:
            pid, host = self._pids.get(rank, (None, ""))
            if _gone(pid, host):
                failures.append(RankFailure(rank, self._node(rank), "died", f"pid {pid} is gone (killed?) during {what}"))
        causes = sorted(f.rank for f in failures)
        for rank in still:
            if rank in causes:
                continue
            if causes:
                failures.append(RankFailure(rank, self._node(rank), "aborted", f"stopped after rank(s) {causes} failed"))
            else:
                failures.append(RankFailure(rank, self._node(rank), "timeout", f"did not finish {what} within {timeout_s:.1f} s"))
        if failures:
            self.close(graceful=False)
            raise WorkerGroupError(what, failures)
        return [values[r] for r in range(len(refs))]

    @staticmethod
    def _grace(error: str) -> float:
        """How long to wait for the other ranks after one failed: longer when it lost a peer (see PEER_LOSS_GRACE_S)."""
        return PEER_LOSS_GRACE_S if _peer_loss(error) else FAILURE_GRACE_S

    def close(self, graceful: bool = True) -> None:
        """Leave the process groups (when ``graceful``), kill every actor, free the placement groups."""
        if self._closed:
            return
        self._closed = True
        if graceful and self._actors and self._contexts:
            refs = [a.teardown.remote() for a in self._actors]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - dead actors cannot tear down; they are killed below
                pass
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
