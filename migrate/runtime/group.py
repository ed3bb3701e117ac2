"""What a worker group is: its spec, each rank's context, how a rank fails, and the protocol every
implementation (`_local`, `_ray`) follows. Started by `migrate.runtime.worker_group.start_worker_group`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar
from collections.abc import Callable, Mapping, Sequence

from migrate.runtime.backend import DEVICE_TYPES, resolve_backend

R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class WorkerGroupSpec:
    """What to start: how many ranks, on which device type and backend, with which limits."""

    world_size: int
    backend: str = "gloo"
    device_type: str = "cpu"
    devices_per_node: int | None = None  # None: all ranks on one node
    timeout_s: float = 120.0  # default limit for one ``run`` call and for collectives
    env: Mapping[str, str] = field(default_factory=dict)
    init_distributed: bool = True
    mode: Literal["ray", "local"] = "ray"
    cpus_per_rank: float = 1.0  # Ray CPU resource per rank actor
    preload: tuple[str, ...] = ()  # modules the ranks will import: a local group's fork server imports them once

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type {self.device_type!r} is not one of {DEVICE_TYPES}")
        object.__setattr__(self, "backend", resolve_backend(self.device_type, self.backend))
        per_node = self.ranks_per_node
        if self.world_size % per_node:
            raise ValueError(
                f"world_size({self.world_size}) is not a multiple of devices_per_node({per_node})"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.mode not in ("ray", "local"):
            raise ValueError(f"mode must be 'ray' or 'local', got {self.mode!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.devices_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node


@dataclass(frozen=True)
class RankContext:
    """What a rank function is told about itself."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    backend: str
    device_type: str
    device: str
    master_addr: str
    master_port: int
    node: str  # hostname (or Ray node IP) the rank runs on

    @property
    def is_main(self) -> bool:
        return self.rank == 0


FailureKind = Literal["died", "timeout", "exception", "aborted"]


@dataclass(frozen=True)
class RankFailure:
    """One rank that did not return a result: ``kind`` is died, timeout, exception or aborted."""

    rank: int
    node: str
    kind: FailureKind
    detail: str

    def describe(self) -> str:
        """One line: for exceptions the last line of the traceback (``detail`` keeps all)."""
        lines = [line for line in self.detail.strip().splitlines() if line.strip()]
        summary = lines[-1].strip() if self.kind == "exception" and lines else self.detail
        return f"rank {self.rank} on {self.node}: {self.kind}: {summary}"


# Root causes first: a death explains the peers' connection errors, which explain the rest.
_KIND_ORDER = {"died": 0, "timeout": 1, "exception": 2, "aborted": 3}


class WorkerGroupError(RuntimeError):
    """Raised by ``run`` when ranks failed; ``failures`` names each of them."""

    def __init__(self, what: str, failures: Sequence[RankFailure]):
        self.failures = tuple(sorted(failures, key=lambda f: (_KIND_ORDER[f.kind], f.rank)))
        lines = "\n  ".join(f.describe() for f in self.failures)
        super().__init__(f"{what} failed on {len(self.failures)} rank(s):\n  {lines}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(f.rank for f in self.failures if f.kind != "aborted")

    @property
    def port_taken(self) -> bool:
        """Whether a rank could not listen on the rendezvous port (EADDRINUSE): the port was free when it was
        chosen and taken by another process before the rank bound it, so a new port may well work."""
        return any(f.kind == "exception" and ("EADDRINUSE" in f.detail or "address already in use" in f.detail.lower())
                   for f in self.failures)


class WorkerGroup(Protocol):
    """A started group of ranks; close it (or use ``with``) to tear it down."""

    spec: WorkerGroupSpec

    def run(self, fn: Callable[..., R], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[R]: ...

    def contexts(self) -> list[RankContext]: ...

    def close(self) -> None: ...

    def __enter__(self) -> WorkerGroup: ...

    def __exit__(self, *exc: object) -> None: ...


def rank_placement(spec: WorkerGroupSpec, rank: int) -> tuple[int, int]:
    """(node_rank, local_rank) of a global rank: ranks are laid node-major."""
    return divmod(rank, spec.ranks_per_node)
