"""Preflight: can the target run the job at all?

Starts the worker group the job's target describes (Ray placement, one process per
device, torch.distributed on the target backend), and on every rank checks identity
(all_gather of ranks), an all_reduce and a broadcast against values computed without
the backend, and the software versions each rank imports. Fails when any rank is
missing, a result is wrong, or ranks disagree on versions.
"""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata
from typing import Any

from pydantic import Field

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome

_PACKAGES = ("torch", "deepspeed", "megatron-core", "ray", "migrate-training")


class PreflightOptions(StageOptions):
    elements: int = Field(default=65536, ge=1, description="elements in the all_reduce / broadcast check")
    world_size: int | None = Field(default=None, ge=1, description="ranks to start; default: target.device_count")
    require_same_versions: bool = True
    """fail when the ranks report different torch, backend or framework versions"""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def probe_rank(ctx: Any, elements: int) -> dict[str, Any]:
    """On one rank: identity, all_reduce, broadcast and versions (runs inside the worker group)."""
    import torch
    import torch.distributed as dist

    device = torch.device(ctx.device)
    world = ctx.world_size
    ranks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(ranks, torch.tensor([ctx.rank], dtype=torch.int64, device=device))
    seen_ranks = [int(r.item()) for r in ranks]

    base = torch.arange(elements, dtype=torch.float32, device=device) % 1024
    tensor = base * (ctx.rank + 1)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    all_reduce_s = time.perf_counter() - start
    expected = (torch.arange(elements, dtype=torch.float64) % 1024) * (world * (world + 1) / 2)
    all_reduce_err = float((tensor.double().cpu() - expected).abs().max())

    token = torch.full((elements,), 7.0 if ctx.rank == 0 else -1.0, device=device)
    dist.broadcast(token, src=0)
    broadcast_ok = bool((token == 7.0).all())
    return {
        "rank": ctx.rank, "node": ctx.node, "device": ctx.device, "backend": ctx.backend,
        "seen_ranks": seen_ranks, "all_reduce_max_abs_err": all_reduce_err, "all_reduce_s": all_reduce_s,
        "broadcast_ok": broadcast_ok, "python": platform.python_version(),
        "versions": {p: _version(p) for p in _PACKAGES},
    }


def judge(results: list[dict[str, Any]], world_size: int, *, require_same_versions: bool) -> list[str]:
    """Reasons the probe results fail (empty: pass). Pure."""
    reasons = []
    for r in results:
        if r["seen_ranks"] != list(range(world_size)):
            reasons.append(f"rank {r['rank']} saw ranks {r['seen_ranks']}, expected 0..{world_size - 1}")
        if r["all_reduce_max_abs_err"] != 0.0:
            reasons.append(f"rank {r['rank']}: all_reduce sum off by up to {r['all_reduce_max_abs_err']}")
        if not r["broadcast_ok"]:
            reasons.append(f"rank {r['rank']}: broadcast from rank 0 delivered wrong values")
    if require_same_versions:
        for package in sorted({p for r in results for p in r["versions"]}):
            found = {r["versions"].get(package) for r in results}
            if len(found) > 1:
                per_rank = ", ".join(f"rank {r['rank']}={r['versions'].get(package)}" for r in results)
                reasons.append(f"ranks import different {package} versions: {per_rank}")
        pythons = {r["python"] for r in results}
        if len(pythons) > 1:
            reasons.append(f"ranks run different Python versions: {sorted(pythons)}")
    return reasons


def run(ctx: StageContext) -> StageOutcome:
    options: PreflightOptions = ctx.options  # type: ignore[assignment]
    target = ctx.job.spec.target
    world = options.world_size or target.device_count
    overrides = {"world_size": world} if options.world_size else {}
    start = time.monotonic()
    with ctx.worker_group(**overrides) as group:
        startup_s = time.monotonic() - start
        results = group.run(probe_rank, options.elements)
    reasons = judge(results, world, require_same_versions=options.require_same_versions)
    nodes = sorted({r["node"].split(" ")[0] for r in results})
    metrics = {
        "world_size": world,
        "nodes": len(nodes),
        "backend": results[0]["backend"],
        "startup_s": round(startup_s, 3),
        "all_reduce_max_abs_err": max(r["all_reduce_max_abs_err"] for r in results),
        "all_reduce_ms_max": round(1000 * max(r["all_reduce_s"] for r in results), 3),
    }
    rows = "\n".join(
        f"| {r['rank']} | {r['node']} | {r['device']} | {r['versions']['torch']} | {r['all_reduce_max_abs_err']:g} | "
        f"{'ok' if r['broadcast_ok'] else 'WRONG'} |"
        for r in results
    )
    summary = (
        f"{world} rank(s) on {len(nodes)} node(s), backend {metrics['backend']}, started in {startup_s:.1f} s.\n\n"
        "| rank | node | device | torch | all_reduce err | broadcast |\n|---|---|---|---|---|---|\n" + rows + "\n"
    )
    if reasons:
        summary += "\nProblems:\n" + "\n".join(f"- {r}" for r in reasons) + "\n"
    (ctx.work_dir / "ranks.json").write_text(json.dumps(results, indent=2))
    return StageOutcome(
        verdict="fail" if reasons else "pass", metrics=metrics, reasons=tuple(reasons), summary_md=summary,
        outputs={"ranks": str(ctx.work_dir / "ranks.json")},
    )


STAGE = StageDefinition(
    name="preflight",
    description="start the target worker group and check ranks, a collective and versions",
    run=run,
    options=PreflightOptions,
    reads=("target",),
)
