"""``measure`` mode: fill a device profile from the live target devices.

On every rank of a worker group: the matmul rate per dtype (timed square matmuls), the
memory copy bandwidth (a large clone), and over all ranks the all_reduce bus bandwidth and
the small-message latency. The slowest rank's figures go into a copy of the base profile
with a ``source`` entry saying where and when each number was measured.
"""
from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from typing import Any

from parallel_search.profiles import DeviceProfile

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _sync(device: Any) -> None:
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize()


def measure_rank(ctx: Any, matmul_size: int, copy_mb: int, allreduce_mb: int, repeats: int,
                 dtypes: tuple[str, ...]) -> dict[str, Any]:
    """Runs on one rank: TFLOP/s per dtype, copy GB/s, all_reduce bus GB/s and latency in µs."""
    import torch
    import torch.distributed as dist

    device = torch.device(ctx.device)
    rates = {}
    for name in dtypes:
        dtype = getattr(torch, _DTYPES[name])
        a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
        torch.matmul(a, b)
        _sync(device)
        began = time.perf_counter()
        for _ in range(repeats):
            torch.matmul(a, b)
        _sync(device)
        rates[name] = 2 * matmul_size ** 3 * repeats / (time.perf_counter() - began) / 1e12
    src = torch.empty(copy_mb * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    began = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    copy_gbps = 2 * src.numel() * 4 * repeats / (time.perf_counter() - began) / 1e9  # read + write
    world = ctx.world_size
    buf = torch.ones(allreduce_mb * 2**20 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buf)
    _sync(device)
    seconds = (time.perf_counter() - began) / repeats
    busbw = buf.numel() * 4 / seconds / 1e9 * (2 * (world - 1) / world if world > 1 else 1.0)
    small = torch.ones(1, device=device)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeats * 10):
        dist.all_reduce(small)
    _sync(device)
    latency_us = (time.perf_counter() - began) / (repeats * 10) * 1e6
    return {"rank": ctx.rank, "node": ctx.node, "tflops": rates, "copy_gbps": copy_gbps, "busbw_gbps": busbw,
            "latency_us": latency_us}


def measured_profile(base: DeviceProfile, results: list[dict[str, Any]], name: str | None = None,
                     memory_gb: float | None = None) -> DeviceProfile:
    """``base`` with the measured numbers (slowest rank) and their sources. Pure."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    hosts = sorted({r["node"] for r in results}) or [socket.gethostname()]
    where = f"measured by migrate search --measure on {len(results)} rank(s) ({', '.join(hosts)[:80]}) at {when}"
    tflops = dict(base.peak_tflops)
    for name_ in results[0]["tflops"]:
        tflops[name_] = min(r["tflops"][name_] for r in results)
    multi_node = len(hosts) > 1
    busbw = min(r["busbw_gbps"] for r in results)
    source = dict(base.source)
    source.update({"peak_tflops": f"{where}: square matmul rate per dtype",
                   "memory_bandwidth_gbps": f"{where}: tensor copy (read + write)",
                   "collective_latency_us": f"{where}: 4-byte all_reduce"})
    changes: dict[str, Any] = {
        "name": name or f"{base.name}-measured", "peak_tflops": tflops,
        "memory_bandwidth_gbps": min(r["copy_gbps"] for r in results),
        "collective_latency_us": max(r["latency_us"] for r in results),
        "supported_dtypes": tuple(sorted(set(base.supported_dtypes) | set(tflops))),
        "description": f"{base.description} ({where})",
    }
    if len(results) > 1:
        key = "inter_node_bandwidth_gbps" if multi_node else "intra_node_bandwidth_gbps"
        changes[key] = busbw
        source[key] = f"{where}: all_reduce bus bandwidth"
    if memory_gb is not None:
        changes["memory_gb"] = memory_gb
        source["memory_gb"] = f"{where}: device memory"
    return dataclasses.replace(base, source=source, **changes)
