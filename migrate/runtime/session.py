"""The job's target runtime: Ray connected on first use, worker groups shaped by the job."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from migrate.job.schema import TargetSection
from migrate.runtime.ray_cluster import RayConnection, connect
from migrate.runtime.worker_group import WorkerGroup, WorkerGroupSpec, start_worker_group

if TYPE_CHECKING:
    from migrate.runtime.resources import ClusterResources


def group_spec(target: TargetSection, **overrides: Any) -> WorkerGroupSpec:
    """The worker group the target section describes; ``overrides`` replace fields."""
    spec = WorkerGroupSpec(
        world_size=target.device_count,
        backend=target.resolved_backend,
        device_type=target.device_type,
        devices_per_node=target.devices_per_node,
        timeout_s=target.timeout_s,
    )
    if "world_size" in overrides and "devices_per_node" not in overrides:
        per_node = spec.ranks_per_node
        if overrides["world_size"] % per_node:
            overrides["devices_per_node"] = None
    return dataclasses.replace(spec, **overrides)


class TargetRuntime:
    """Connects Ray (embedded or remote) lazily and starts worker groups on the target."""

    def __init__(self, target: TargetSection):
        self.target = target
        self._ray: RayConnection | None = None

    def start_group(self, **overrides: Any) -> WorkerGroup:
        spec = group_spec(self.target, **overrides)
        if spec.mode == "ray" and self._ray is None:
            logical_cpus = self.target.ray.num_cpus
            if self.target.device_type == "cpu":
                # Logical CPUs: room for a CPU worker group of every size up to 8 or the target's.
                ranks = max(spec.world_size, self.target.device_count, 8)
                logical_cpus = max(logical_cpus or 0, int(ranks * spec.cpus_per_rank) + 1)
            self._ray = connect(self.target.ray.address, num_cpus=logical_cpus)
        return start_worker_group(spec)

    def resources(self, device_types: Sequence[str]) -> ClusterResources:
        """What the target cluster offers: this machine for an embedded cluster (nothing started), else the
        alive nodes of the Ray cluster (connected now, and kept for the worker groups)."""
        from migrate.runtime.resources import local_resources, ray_resources

        address = self.target.ray.address
        if address == "embedded":
            return local_resources(device_types)
        if self._ray is None:
            self._ray = connect(address, num_cpus=self.target.ray.num_cpus)
        return ray_resources(address)

    def close(self) -> None:
        if self._ray is not None:
            self._ray.close()
            self._ray = None

    def __enter__(self) -> TargetRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
