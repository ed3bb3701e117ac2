"""What a job's stages will ask of the cluster, what the cluster has, and every shortfall, before anything runs.

Call sequence: ``stage_needs(job, stages)`` (pure) lists the worker groups each stage starts: how many ranks of
which device type, packed how many to a node; ``local_resources()`` (an embedded cluster: this machine) or
``ray_resources()`` (a running Ray cluster's alive nodes) says what there is; ``shortfalls(needs, cluster)``
(pure) names every group that cannot be placed, with the numbers, so a job that cannot run says so in
seconds instead of waiting for placement timeouts stage after stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEVICE_RESOURCE = {"cuda": "GPU", "npu": "NPU"}  # the Ray resource each accelerator is counted by


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupNeed:
    """One worker group a stage starts: `world_size` ranks of `device_type`, `per_node` of them to a node."""

    stage: str
    purpose: str
    world_size: int
    device_type: str
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.per_node)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeResources:
    """One node: its name, logical CPUs and accelerators by device type."""

    name: str
    cpus: float
    devices: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterResources:
    """The nodes there are, where that was learned, and why a device type cannot be used at all (a missing
    torch_npu, a CUDA build without a driver), by device type."""

    nodes: tuple[NodeResources, ...]
    where: str
    unusable: Mapping[str, str] = field(default_factory=dict)
    elastic_cpus: bool = False  # an embedded cluster is started with as many logical CPUs as the groups need

    def count(self, device_type: str) -> int:
        return sum(n.devices.get(device_type, 0) for n in self.nodes)


def stage_needs(job: Any, stages: Sequence[str]) -> list[GroupNeed]:
    """The worker groups `stages` of `job` start (pure; the layouts are the job's, the search's choice has
    the target's device count)."""
    spec = job.spec
    target, source = spec.target, spec.source
    kind = target.device_type
    per_node = target.devices_per_node or target.device_count
    needs: list[GroupNeed] = []

    def group(stage: str, purpose: str, world: int) -> None:
        needs.append(GroupNeed(stage=stage, purpose=purpose, world_size=world, device_type=kind,
                               per_node=min(per_node, world) if world % min(per_node, world) == 0 else world))

    source_world = source.layout.to_layout().world_size
    for stage in stages:
        options = job.stage_options.get(stage)
        if stage in ("preflight", "comm"):
            group(stage, "the target's ranks", target.device_count)
        elif stage == "ops":
            compare = getattr(options, "compare", None)
            group(stage, "one device" if not compare else "the compared model step's ranks",
                  getattr(options, "world_size", 1) if compare else 1)
        elif stage == "search" and getattr(options, "profile", True):
            group(stage, "candidates profiled on the target", target.device_count)
        elif stage == "train":
            side = getattr(options, "side", "baseline")
            group(stage, f"the {side} run", source_world if side == "baseline" else target.device_count)
        elif stage == "resume":
            group(stage, "the baseline's continuation at the source layout", source_world)
            group(stage, "the target's continuation", target.device_count)
        elif stage == "stability":
            group(stage, "the long run on the target", target.device_count)
    return needs


def shortfalls(needs: Sequence[GroupNeed], cluster: ClusterResources) -> list[str]:
    """Every group that cannot be placed on `cluster`, one line each with the numbers (pure)."""
    problems: list[str] = []
    for need in needs:
        what = f"stage {need.stage}: {need.purpose}: {need.world_size} {need.device_type} wanted"
        if need.device_type in cluster.unusable:
            problems.append(f"{what}; {cluster.unusable[need.device_type]}")
            continue
        if need.device_type == "cpu":
            have = sum(int(n.cpus) for n in cluster.nodes)
            if not cluster.elastic_cpus and have < need.world_size:
                problems.append(f"{what}, one CPU each; {cluster.where} has {have} CPUs")
            continue
        total = cluster.count(need.device_type)
        slots = sum(n.devices.get(need.device_type, 0) // need.per_node for n in cluster.nodes)  # per-node groups
        if total < need.world_size:
            problems.append(f"{what}; {cluster.where} has {total} ({_per_node(cluster, need.device_type)})")
        elif slots < need.nodes:
            problems.append(f"{what}, {need.per_node} on each of {need.nodes} node(s); {cluster.where} has room for "
                            f"{slots} such node(s) ({_per_node(cluster, need.device_type)})")
    return list(dict.fromkeys(problems))


def _per_node(cluster: ClusterResources, device_type: str) -> str:
    counts = [str(n.devices.get(device_type, 0)) for n in cluster.nodes]
    return f"{', '.join(counts[:8])}{', ...' if len(counts) > 8 else ''} a node"


def device_unusable(device_type: str) -> str | None:
    """Why this process cannot use `device_type` at all, or None (cpu always works)."""
    if device_type == "cpu":
        return None
    import torch

    if device_type == "cuda":
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a build without CUDA (install a CUDA build of torch)"
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine (no GPU or no driver)"
        return None
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return "torch_npu (Ascend's PyTorch adapter) is not installed, and the npu device needs it"
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return "torch_npu is installed but no NPU is available (driver, ASCEND_RT_VISIBLE_DEVICES)"
        return None
    return f"device type {device_type!r} has no check here"


def local_resources(device_types: Sequence[str]) -> ClusterResources:
    """This machine as an embedded cluster would see it: its CPUs and the accelerators torch finds."""
    import os

    import torch

    devices: dict[str, int] = {}
    unusable: dict[str, str] = {}
    for kind in sorted(set(device_types) - {"cpu"}):
        why = device_unusable(kind)
        if why:
            unusable[kind] = why
        else:
            devices[kind] = getattr(torch, kind).device_count()
    node = NodeResources(name="this machine", cpus=float(os.cpu_count() or 1), devices=devices)
    return ClusterResources(nodes=(node,), where="this machine (embedded Ray)", unusable=unusable, elastic_cpus=True)


def ray_resources(address: str) -> ClusterResources:
    """The alive nodes of the Ray cluster this process is connected to (`ray.init` done by the caller)."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(NodeResources(name=n.get("NodeManagerAddress", "?"), cpus=float(res.get("CPU", 0)),
                                   devices={kind: int(res.get(name, 0)) for kind, name in DEVICE_RESOURCE.items()}))
    return ClusterResources(nodes=tuple(nodes), where=f"the Ray cluster at {address} ({len(nodes)} node(s))")
