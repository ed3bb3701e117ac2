"""Bandwidth: algbw and busbw per op, size and mode, with the nccl-tests definitions.

Definitions (nccl-tests ``doc/PERFORMANCE.md`` and ``src/*.cu``):

* ``S`` is the message size in bytes: the per-rank buffer for all_reduce,
  broadcast and reduce; the total (all ranks') buffer for all_gather,
  reduce_scatter, gather and scatter; the per-rank send buffer for
  all_to_all; the bytes one rank sends for send/recv.
* ``t`` is the seconds per call: ``iters`` back-to-back calls after ``warmup``
  calls and a barrier, one device synchronisation at the end, averaged over ranks.
* ``algbw = S / t``; ``busbw = algbw * factor`` with factor 2(n-1)/n for
  all_reduce, (n-1)/n for all_gather, reduce_scatter, all_to_all, gather and
  scatter, and 1 for broadcast, reduce and send/recv.

Call sequence: ``group.run(run_bandwidth_on_rank, plan)`` on every rank, then
:func:`merge_bandwidth` (pure).  The timed loop is :func:`time_op`: a bare
``for`` loop over one prepared closure, so its overhead next to a plain
torch.distributed loop is one Python call per iteration
(``scripts/bench_comm_overhead.py`` measures it).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from migrate.comm.matrix import DTYPES, synchronize

if TYPE_CHECKING:
    from migrate.runtime.worker_group import RankContext

Mode = Literal["out_of_place", "in_place"]
MODES: tuple[Mode, ...] = ("out_of_place", "in_place")

BW_OPS: tuple[str, ...] = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                           "broadcast", "reduce", "gather", "scatter", "send_recv")

SIZE_SCOPE: Mapping[str, Literal["per_rank", "total", "per_rank_send"]] = {
    "all_reduce": "per_rank", "broadcast": "per_rank", "reduce": "per_rank",
    "all_gather_into_tensor": "total", "reduce_scatter_tensor": "total", "gather": "total", "scatter": "total",
    "all_to_all_single": "per_rank_send", "send_recv": "per_rank_send",
}
"""What S counts for each op (nccl-tests convention)."""

SUPPORTED_MODES: Mapping[str, tuple[Mode, ...]] = {
    "all_reduce": ("in_place",), "broadcast": ("in_place",), "reduce": ("in_place",),
    "all_gather_into_tensor": MODES, "reduce_scatter_tensor": MODES,
    "all_to_all_single": ("out_of_place",), "gather": ("out_of_place",), "scatter": ("out_of_place",),
    "send_recv": ("out_of_place",),
}
"""Modes torch.distributed's API can express: all_reduce/broadcast/reduce only work in place."""

DEFAULT_SIZES_BYTES: tuple[int, ...] = (8 * 1024, 256 * 1024, 4 * 2**20, 32 * 2**20)


def bus_factor(op: str, world: int) -> float:
    """nccl-tests bus-bandwidth correction factor for ``op`` at ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if op == "all_reduce":
        return 2.0 * (world - 1) / world
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter"):
        return (world - 1) / world
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"no bus factor for op {op!r}; known: {list(BW_OPS)}")


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes), as nccl-tests prints it."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds} for {size_bytes} bytes")
    return size_bytes / 1e9 / seconds


def element_count(op: str, size_bytes: int, elem_size: int, world: int) -> tuple[int, int]:
    """(elements per rank chunk, actual S in bytes) for a requested S; chunk 0 means too small.

    Totals are rounded down to a multiple of the world size, as nccl-tests does.
    """
    count = size_bytes // elem_size
    if SIZE_SCOPE[op] == "total":
        chunk = count // world
        return chunk, chunk * world * elem_size
    if op == "all_to_all_single":
        chunk = count // world
        return chunk, chunk * world * elem_size
    return count, count * elem_size


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthPlan:
    """Ops x sizes (bytes, S as defined above) x modes, in ``dtype``, with warm-up and iterations."""

    ops: tuple[str, ...] = BW_OPS
    sizes_bytes: tuple[int, ...] = DEFAULT_SIZES_BYTES
    dtype: str = "float32"
    modes: tuple[Mode, ...] = MODES
    warmup: int = 5
    iters: int = 20

    def __post_init__(self) -> None:
        unknown = [o for o in self.ops if o not in BW_OPS]
        if unknown:
            raise ValueError(f"BandwidthPlan.ops: unknown {unknown}; known: {list(BW_OPS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"BandwidthPlan.dtype {self.dtype!r} not in {list(DTYPES)}")
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes:
            raise ValueError(f"BandwidthPlan.modes: unknown {bad_modes}; known: {list(MODES)}")
        if self.warmup < 0 or self.iters < 1 or any(s < 1 for s in self.sizes_bytes):
            raise ValueError(f"BandwidthPlan: warmup({self.warmup}) >= 0, iters({self.iters}) >= 1 and "
                             f"sizes_bytes {self.sizes_bytes} >= 1 required")

    def cells(self) -> list[tuple[str, Mode, int]]:
        """(op, mode, requested bytes) in execution order, modes the op supports only."""
        return [(o, m, s) for o in self.ops for s in self.sizes_bytes for m in self.modes
                if m in SUPPORTED_MODES[o]]


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthObservation:
    """One rank's timing of one (op, mode, size); ``error`` holds the backend's message if it failed."""

    op: str
    mode: Mode
    size_bytes: int
    count: int
    rank: int
    seconds: float | None
    error: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthRow:
    """Merged over ranks, as one line of an nccl-tests table."""

    op: str
    mode: Mode
    dtype: str
    world_size: int
    size_bytes: int
    count: int
    time_us: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    min_rank_time_us: float | None = None
    max_rank_time_us: float | None = None
    error: str = ""


def build_call(op: str, mode: Mode, rank: int, world: int, dtype: torch.dtype, chunk: int,
               device: torch.device) -> Callable[[], object]:
    """A closure that runs one ``op`` call on buffers allocated once, here."""
    def buf(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    if op == "all_reduce":
        t = buf(chunk)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = buf(chunk)
        return lambda: dist.broadcast(t, src=0)
    if op == "reduce":
        t = buf(chunk)
        return lambda: dist.reduce(t, dst=0)
    if op == "all_gather_into_tensor":
        out = buf(chunk * world)
        inp = out.narrow(0, rank * chunk, chunk) if mode == "in_place" else buf(chunk)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter_tensor":
        inp = buf(chunk * world)
        out = inp.narrow(0, rank * chunk, chunk) if mode == "in_place" else buf(chunk)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if op == "all_to_all_single":
        inp, out = buf(chunk * world), buf(chunk * world)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "gather":
        inp = buf(chunk)
        outs = [buf(chunk) for _ in range(world)] if rank == 0 else None
        return lambda: dist.gather(inp, gather_list=outs, dst=0)
    if op == "scatter":
        out = buf(chunk)
        chunks = [buf(chunk) for _ in range(world)] if rank == 0 else None
        return lambda: dist.scatter(out, scatter_list=chunks, src=0)
    if op == "send_recv":
        send, recv = buf(chunk), buf(chunk)
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def ring() -> None:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)])
            for w in works:
                w.wait()
        return ring
    raise ValueError(f"unknown bandwidth op {op!r}; known: {list(BW_OPS)}")


def time_op(call: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Seconds per call: warm-up, barrier, ``iters`` back-to-back calls, one synchronisation."""
    for _ in range(warmup):
        call()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def run_bandwidth_on_rank(ctx: RankContext, plan: BandwidthPlan) -> list[BandwidthObservation]:
    """Worker-group entry point: time every (op, mode, size) of ``plan`` on this rank."""
    device = torch.device(ctx.device)
    dtype = DTYPES[plan.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    out: list[BandwidthObservation] = []
    for op, mode, size in plan.cells():
        chunk, actual = element_count(op, size, elem, ctx.world_size)
        if chunk == 0 or (op == "send_recv" and ctx.world_size < 2):
            out.append(BandwidthObservation(op=op, mode=mode, size_bytes=actual, count=chunk, rank=ctx.rank,
                                            seconds=None, error="n/a: size below one element per rank"
                                            if chunk == 0 else "n/a: needs a peer"))
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                call = build_call(op, mode, ctx.rank, ctx.world_size, dtype, chunk, device)
                seconds = time_op(call, plan.warmup, plan.iters, device)
        except Exception as exc:  # noqa: BLE001 - the backend's own error
            out.append(BandwidthObservation(op=op, mode=mode, size_bytes=actual, count=chunk, rank=ctx.rank,
                                            seconds=None, error=f"{type(exc).__name__}: {str(exc).strip()[:400]}"))
            continue
        out.append(BandwidthObservation(op=op, mode=mode, size_bytes=actual, count=chunk, rank=ctx.rank,
                                        seconds=seconds))
    return out


def merge_bandwidth(plan: BandwidthPlan, per_rank: Sequence[Sequence[BandwidthObservation]]) -> tuple[BandwidthRow, ...]:
    """Average seconds over ranks and apply the nccl-tests formulas; a failure on any rank fails the row."""
    world = len(per_rank)
    n_cells = len(plan.cells())
    for rank, obs in enumerate(per_rank):
        if len(obs) != n_cells:
            raise ValueError(f"rank {rank} returned {len(obs)} bandwidth observations for {n_cells} planned cells")
    rows: list[BandwidthRow] = []
    for i in range(n_cells):
        row = [obs[i] for obs in per_rank]
        first = row[0]
        failed = [o for o in row if o.seconds is None]
        if failed:
            rows.append(BandwidthRow(op=first.op, mode=first.mode, dtype=plan.dtype, world_size=world,
                                     size_bytes=first.size_bytes, count=first.count, time_us=None, algbw_gbps=None,
                                     busbw_gbps=None, error=failed[0].error))
            continue
        secs = [o.seconds for o in row if o.seconds is not None]
        mean = sum(secs) / len(secs)
        alg = algbw_gbps(first.size_bytes, mean)
        rows.append(BandwidthRow(op=first.op, mode=first.mode, dtype=plan.dtype, world_size=world,
                                 size_bytes=first.size_bytes, count=first.count, time_us=mean * 1e6,
                                 algbw_gbps=alg, busbw_gbps=alg * bus_factor(first.op, world),
                                 min_rank_time_us=min(secs) * 1e6, max_rank_time_us=max(secs) * 1e6))
    return tuple(rows)
