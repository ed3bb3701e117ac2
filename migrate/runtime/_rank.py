"""Code that runs inside a rank process, shared by the Ray and the local worker groups."""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from collections.abc import Callable

import cloudpickle

from migrate.runtime.group import RankContext, WorkerGroupSpec


@dataclass(frozen=True)
class RankOutcome:
    """What one ``run`` returned on one rank: a value, or the formatted exception."""

    ok: bool
    value: Any = None
    error: str = ""


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    """This host's address as other nodes reach it (loopback when alone)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def torchrun_env(ctx: RankContext) -> dict[str, str]:
    """The environment torchrun would give this rank."""
    return {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "GROUP_RANK": str(ctx.node_rank),
        "NODE_RANK": str(ctx.node_rank),
        "MASTER_ADDR": ctx.master_addr,
        "MASTER_PORT": str(ctx.master_port),
    }


def setup_rank(ctx: RankContext, spec: WorkerGroupSpec) -> None:
    """Set the environment, select the device and join the default process group."""
    os.environ.update({k: str(v) for k, v in spec.env.items()})
    os.environ.update(torchrun_env(ctx))
    if not spec.init_distributed:
        return
    import torch
    import torch.distributed as dist

    if ctx.device_type == "cuda":
        torch.cuda.set_device(0 if "CUDA_VISIBLE_DEVICES" in os.environ else ctx.local_rank)
    elif ctx.device_type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and HCCL)

        torch.npu.set_device(  # type: ignore[attr-defined]  # torch_npu adds torch.npu
            0 if "ASCEND_RT_VISIBLE_DEVICES" in os.environ else ctx.local_rank)
    dist.init_process_group(
        backend=ctx.backend,
        init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def execute(ctx: RankContext, payload: bytes) -> RankOutcome:
    """Unpickle (fn, args, kwargs) and run ``fn(ctx, *args, **kwargs)``; never raises."""
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        return RankOutcome(ok=True, value=fn(ctx, *args, **kwargs))
    except BaseException:  # noqa: BLE001 - the driver reports it with the rank
        return RankOutcome(ok=False, error=traceback.format_exc(limit=20))


def teardown_rank() -> None:
    """Leave the process group if one was joined."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown of a broken group must not mask the cause
        pass


def pack_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Serialize a call for the ranks (cloudpickle: lambdas and closures work too)."""
    return cloudpickle.dumps((fn, args, kwargs))


def hostname() -> str:
    return socket.gethostname()
