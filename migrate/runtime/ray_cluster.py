"""Start an embedded Ray cluster or join an existing one.

``connect("embedded")`` starts a local cluster for this process (stopped again on
``close``, and by `migrate.runtime.reaper` when this process is killed, so no Ray process
outlives the job); ``connect("auto")`` or ``connect("ray://host:10001")`` joins a running
one and leaves it running. Only ``migrate/`` uses Ray; the libraries never do.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from migrate.runtime import reaper as _reaper


class RayConnectionError(RuntimeError):
    """Ray could not be started or reached; the message names the address."""


def validate_address(address: str) -> str:
    """``embedded``, ``auto``, ``ray://host:port`` or ``host:port``; anything else raises."""
    if address in ("embedded", "auto"):
        return address
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"Ray address {address!r} must be 'embedded', 'auto', 'ray://HOST:PORT' or 'HOST:PORT'"
        )
    return address


@dataclass
class RayConnection:
    """An initialized Ray session; ``close`` stops it only if this process started it."""

    address: str
    started_here: bool
    resources: Mapping[str, float]
    reaper: _reaper.Reaper | None = field(default=None, repr=False)

    def close(self) -> None:
        import ray

        if self.started_here and ray.is_initialized():
            ray.shutdown()
        if self.reaper is not None:  # kills what ray.shutdown() left running (agents retrying a stopped GCS)
            self.reaper.release()
            self.reaper = None

    def __enter__(self) -> RayConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _driver_pythonpath() -> str:
    """The driver's import path, so embedded workers import what the driver imports."""
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def connect(address: str = "embedded", *, num_cpus: int | None = None,
            resources: Mapping[str, float] | None = None) -> RayConnection:
    """Start (``embedded``) or join Ray; reuse the session if this process already has one.

    ``num_cpus`` for an embedded cluster is a logical count: it may exceed the cores so
    that a CPU worker group of more ranks than cores can be placed.
    """
    import ray

    validate_address(address)
    if ray.is_initialized():
        return RayConnection(address=address, started_here=False, resources=ray.cluster_resources())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Rank output stays in Ray's session logs (/tmp/ray/session_latest/logs): failures reach the
    # driver as WorkerGroupError with the rank's traceback, progress through the stages.
    log_to_driver = os.environ.get("MIGRATE_RAY_LOG_TO_DRIVER", "0") == "1"
    kwargs: dict[str, Any] = {"namespace": "migrate", "log_to_driver": log_to_driver, "configure_logging": False}
    reaper = _reaper.start() if address == "embedded" else None
    try:
        if address == "embedded":
            # The driver's import path reaches the workers through the environment the raylet inherits, not a
            # runtime_env: each worker started for one pays Ray's runtime-env setup first (~0.5 s of CPU).
            saved = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = _driver_pythonpath()
            try:
                ray.init(
                    address="local",  # a new cluster of this process's own, even where RAY_ADDRESS names another
                    num_cpus=max(num_cpus or 0, os.cpu_count() or 1),
                    resources=dict(resources or {}),
                    include_dashboard=False,
                    **kwargs,
                )
            finally:
                if saved is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved
        else:
            ray.init(address=address, **kwargs)
    except Exception as exc:  # re-raised with the address in the message
        if reaper is not None:
            reaper.release()
        raise RayConnectionError(f"could not {'start' if address == 'embedded' else 'join'} Ray at {address!r}: {exc}") from exc
    return RayConnection(address=address, started_here=True, resources=ray.cluster_resources(), reaper=reaper)
