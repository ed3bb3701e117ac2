"""Capability and correctness matrix: every collective x dtype x size on the live backend.

Call sequence:

1. The coordinator builds a :class:`MatrixPlan` (frozen, picklable).
2. ``group.run(run_matrix_on_rank, plan)`` runs the checks on every rank; each
   rank returns its :class:`CellObservation` list.
3. :func:`merge_observations` (pure) turns the per-rank lists into a :class:`CommMatrix`.

Inputs are deterministic functions of (check, rank, element index); each rank
computes the output it must receive in float64 from all ranks' inputs, without
the backend (:func:`expected_outputs`), so a backend that returns wrong data is
caught.  A cell is ``ok`` (supported and correct on every rank), ``wrong``
(completed but some rank received a wrong value), ``error`` (the backend
raised; its own message is kept) or ``n/a`` (not meaningful: bitwise
reductions of floats, point-to-point at world size 1).

Test hook: :class:`CorruptionSpec` in the plan perturbs one rank's received
data after the collective, as a broken backend would; it exists only so tests
can prove that wrong results are detected.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from migrate.runtime.worker_group import RankContext

CellStatus = Literal["ok", "wrong", "error", "n/a"]

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
"""Dtype names accepted in plans."""

SHORT_NAMES: Mapping[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
"""The CLI's and the job's spelling of the float dtypes -> torch's (the integer dtypes keep torch's names)."""

DEFAULT_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")
DEFAULT_SIZES = (1, 7, 1024, 65_537, 1_048_576)
"""Elements per rank chunk: a few, odd, and large (4 MiB of fp32)."""

REDUCE_OPS: Mapping[str, Callable[[], Any]] = {  # dist.ReduceOp members (torch types them RedOpType)
    "sum": lambda: dist.ReduceOp.SUM,
    "product": lambda: dist.ReduceOp.PRODUCT,
    "min": lambda: dist.ReduceOp.MIN,
    "max": lambda: dist.ReduceOp.MAX,
    "avg": lambda: dist.ReduceOp.AVG,
    "band": lambda: dist.ReduceOp.BAND,
    "bor": lambda: dist.ReduceOp.BOR,
    "bxor": lambda: dist.ReduceOp.BXOR,
    "premul_sum": lambda: dist._make_nccl_premul_sum(PREMUL_FACTOR),
}
PREMUL_FACTOR = 0.5
BITWISE = frozenset({"band", "bor", "bxor"})
BARRIER_DELAY_S = 0.05
CORRUPTION_DELTA = 3.0
NO_DTYPE = "none"

Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class CorruptionSpec:
    """Test hook: after ``check`` completes on ``rank``, add 3 to the first received element.

    ``dtype`` / ``numel`` narrow it to one cell; ``None`` means every dtype / size.
    For ``barrier`` it hides one rank's arrival from the observation.
    """

    check: str
    rank: int
    dtype: str | None = None
    numel: int | None = None

    def matches(self, check: str, rank: int, dtype: str, numel: int) -> bool:
        """True when this spec applies to the given cell on the given rank."""
        return (self.check == check and self.rank == rank and self.dtype in (None, dtype)
                and self.numel in (None, numel))


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckSpec:
    """One collective call pattern: how each rank runs it and what it must receive."""

    name: str
    family: str
    redop: str | None
    needs_peer: bool
    run: Callable[[int, int, torch.dtype, int, torch.device], Outputs]
    expected: Callable[[int, int, int], Mapping[str, torch.Tensor]]
    tolerance_kind: Literal["exact", "sum", "avg"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MatrixPlan:
    """What to check: ``checks`` x ``dtypes`` x ``sizes`` (elements per rank chunk)."""

    checks: tuple[str, ...]
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    sizes: tuple[int, ...] = DEFAULT_SIZES
    corrupt: CorruptionSpec | None = None
    run_id: str = "matrix"

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"MatrixPlan.checks: unknown {unknown}; known: {list(CHECKS)}")
        bad_dtypes = [d for d in self.dtypes if d not in DTYPES]
        if bad_dtypes:
            raise ValueError(f"MatrixPlan.dtypes: unknown {bad_dtypes}; known: {list(DTYPES)}")
        bad_sizes = [s for s in self.sizes if not isinstance(s, int) or s < 1]
        if bad_sizes:
            raise ValueError(f"MatrixPlan.sizes: every size must be an int >= 1, got {bad_sizes}")
        if not self.checks or not self.dtypes or not self.sizes:
            raise ValueError(f"MatrixPlan is empty: checks={self.checks} dtypes={self.dtypes} sizes={self.sizes}")
        if self.corrupt is not None and self.corrupt.check not in self.checks:
            raise ValueError(f"MatrixPlan.corrupt.check {self.corrupt.check!r} is not among checks {self.checks}")

    def cells(self) -> list[tuple[str, str, int]]:
        """(check, dtype, numel) in execution order; barrier is one cell (dtype 'none', numel 0)."""
        out: list[tuple[str, str, int]] = []
        for check in self.checks:
            if check == "barrier":
                out.append((check, NO_DTYPE, 0))
                continue
            out.extend((check, d, n) for d in self.dtypes for n in self.sizes)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CellObservation:
    """One rank's outcome for one cell."""

    check: str
    dtype: str
    numel: int
    rank: int
    status: CellStatus
    max_abs_err: float = 0.0
    mismatches: int = 0
    first_mismatch: str = ""
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class MatrixCell:
    """Merged outcome of one (check, dtype, numel) over all ranks."""

    check: str
    dtype: str
    numel: int
    status: CellStatus
    wrong_ranks: tuple[int, ...] = ()
    error_ranks: tuple[int, ...] = ()
    max_abs_err: float = 0.0
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommMatrix:
    """The capability/correctness matrix of one backend at one world size."""

    backend: str
    device_type: str
    world_size: int
    torch_version: str
    cells: tuple[MatrixCell, ...] = field(default_factory=tuple)

    def cell(self, check: str, dtype: str, numel: int) -> MatrixCell:
        """The cell for (check, dtype, numel); KeyError naming it when absent."""
        for c in self.cells:
            if (c.check, c.dtype, c.numel) == (check, dtype, numel):
                return c
        raise KeyError(f"matrix has no cell check={check!r} dtype={dtype!r} numel={numel}")

    def by_status(self, status: CellStatus) -> tuple[MatrixCell, ...]:
        """All cells with the given status."""
        return tuple(c for c in self.cells if c.status == status)


# --------------------------------------------------------------------------- inputs (pure)


def signed_values(rank: int, start: int, count: int) -> torch.Tensor:
    """Small signed integers in [-2, 2], exact in every dtype: ((i*7 + rank*3) % 5) - 2."""
    i = torch.arange(start, start + count, dtype=torch.int64)
    return (((i * 7 + rank * 3) % 5) - 2).to(torch.float64)


def bit_values(rank: int, start: int, count: int) -> torch.Tensor:
    """Non-negative integers in [0, 15] for bitwise reductions: (i*7 + rank*5) % 16."""
    i = torch.arange(start, start + count, dtype=torch.int64)
    return ((i * 7 + rank * 5) % 16).to(torch.float64)


def product_values(rank: int, world: int, count: int) -> torch.Tensor:
    """±1, and ±2 where i % world == rank: every product is ±2, exact in every dtype."""
    i = torch.arange(count, dtype=torch.int64)
    sign = 1 - 2 * ((i + rank) % 2)
    mag = torch.where(i % world == rank, 2, 1)
    return (sign * mag).to(torch.float64)


def reduction_input(redop: str, rank: int, world: int, numel: int) -> torch.Tensor:
    """The float64 input a rank contributes to a reduction with ``redop``."""
    if redop == "product":
        return product_values(rank, world, numel)
    if redop in BITWISE:
        return bit_values(rank, 0, numel)
    return signed_values(rank, 0, numel)


def reduce_reference(redop: str, stacked: torch.Tensor) -> torch.Tensor:
    """Reduce ``stacked`` (world, ...) along dim 0 in float64/int64, independently of any backend."""
    if redop in ("sum",):
        return stacked.sum(0)
    if redop == "avg":
        return stacked.sum(0) / stacked.shape[0]
    if redop == "premul_sum":
        return stacked.sum(0) * PREMUL_FACTOR
    if redop == "product":
        return stacked.prod(0)
    if redop == "min":
        return stacked.amin(0)
    if redop == "max":
        return stacked.amax(0)
    ints = stacked.to(torch.int64)
    fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[redop]
    return functools.reduce(fn, list(ints)).to(torch.float64)


def a2a_split(src: int, dst: int, numel: int) -> int:
    """Uneven all_to_all split: elements ``src`` sends to ``dst`` (numel + (src + 2*dst) % 3)."""
    return numel + (src + 2 * dst) % 3


def a2a_chunk(src: int, dst: int, world: int, numel: int) -> torch.Tensor:
    """Float64 chunk ``src`` sends to ``dst`` (values continue over src's send buffer)."""
    start = sum(a2a_split(src, j, numel) for j in range(dst))
    return signed_values(src, start, a2a_split(src, dst, numel))


def uneven_count(rank: int, numel: int) -> int:
    """Elements rank contributes to the uneven all_gather: numel + rank."""
    return numel + rank


def expected_outputs(check: str, rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    """Float64 outputs ``rank`` must hold after ``check`` (empty when it receives nothing)."""
    return dict(CHECKS[check].expected(rank, world, numel))


def tolerance(check: str, dtype: torch.dtype, rank: int, world: int, numel: int, name: str) -> torch.Tensor | float:
    """Allowed |received - expected| per element.

    Data-movement ops and min/max/product/bitwise are exact.  Floating sums may
    round once per addition: eps(dtype) * sum_r |x_r| bounds that.  Integer
    ``avg`` may truncate: 1.
    """
    spec = CHECKS[check]
    if spec.tolerance_kind == "exact":
        return 0.0
    if not dtype.is_floating_point:
        return 1.0 if spec.tolerance_kind == "avg" else 0.0
    assert spec.redop is not None
    per_rank = [reduction_input(spec.redop, r, world, _reduced_numel(check, numel, world)).abs() for r in range(world)]
    abs_sum = torch.stack(per_rank).sum(0)
    if check.startswith("reduce_scatter"):
        abs_sum = abs_sum[rank * numel:(rank + 1) * numel]
    return torch.finfo(dtype).eps * abs_sum


def _reduced_numel(check: str, numel: int, world: int) -> int:
    return numel * world if check.startswith("reduce_scatter") else numel


# --------------------------------------------------------------------------- checks


def _dev(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(dtype).to(device)


def _make_all_reduce(redop: str) -> CheckSpec:
    def run(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
        t = _dev(reduction_input(redop, rank, world, numel), dtype, device)
        dist.all_reduce(t, op=REDUCE_OPS[redop]())
        return {"out": t}

    def expected(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
        stacked = torch.stack([reduction_input(redop, r, world, numel) for r in range(world)])
        return {"out": reduce_reference(redop, stacked)}

    kind: Literal["exact", "sum", "avg"] = "avg" if redop == "avg" else ("sum" if redop in ("sum", "premul_sum") else "exact")
    return CheckSpec(name=f"all_reduce.{redop}", family="all_reduce", redop=redop, needs_peer=False,
                     run=run, expected=expected, tolerance_kind=kind)


def _make_reduce_scatter_tensor(redop: str) -> CheckSpec:
    def run(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
        inp = _dev(reduction_input(redop, rank, world, numel * world), dtype, device)
        out = torch.empty(numel, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, inp, op=REDUCE_OPS[redop]())
        return {"out": out}

    def expected(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
        stacked = torch.stack([reduction_input(redop, r, world, numel * world) for r in range(world)])
        return {"out": reduce_reference(redop, stacked)[rank * numel:(rank + 1) * numel]}

    return CheckSpec(name=f"reduce_scatter_tensor.{redop}", family="reduce_scatter_tensor", redop=redop,
                     needs_peer=False, run=run, expected=expected,
                     tolerance_kind="avg" if redop == "avg" else "sum")


def _run_reduce_scatter(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    full = _dev(signed_values(rank, 0, numel * world), dtype, device)
    out = torch.empty(numel, dtype=dtype, device=device)
    dist.reduce_scatter(out, list(full.split(numel)), op=dist.ReduceOp.SUM)
    return {"out": out}


def _expected_reduce_scatter(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    stacked = torch.stack([signed_values(r, 0, numel * world) for r in range(world)])
    return {"out": stacked.sum(0)[rank * numel:(rank + 1) * numel]}


def _run_all_gather(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    inp = _dev(signed_values(rank, 0, numel), dtype, device)
    outs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(world)]
    dist.all_gather(outs, inp)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _expected_all_gather(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"from{r}": signed_values(r, 0, numel) for r in range(world)}


def _run_all_gather_uneven(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    inp = _dev(signed_values(rank, 0, uneven_count(rank, numel)), dtype, device)
    outs = [torch.empty(uneven_count(r, numel), dtype=dtype, device=device) for r in range(world)]
    dist.all_gather(outs, inp)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _expected_all_gather_uneven(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"from{r}": signed_values(r, 0, uneven_count(r, numel)) for r in range(world)}


def _run_all_gather_into_tensor(rank: int, world: int, dtype: torch.dtype, numel: int,
                                device: torch.device) -> Outputs:
    inp = _dev(signed_values(rank, 0, numel), dtype, device)
    out = torch.empty(numel * world, dtype=dtype, device=device)
    dist.all_gather_into_tensor(out, inp)
    return {"out": out}


def _expected_all_gather_into_tensor(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"out": torch.cat([signed_values(r, 0, numel) for r in range(world)])}


def _run_all_to_all(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    ins = [_dev(a2a_chunk(rank, j, world, numel), dtype, device) for j in range(world)]
    outs = [torch.empty(a2a_split(r, rank, numel), dtype=dtype, device=device) for r in range(world)]
    dist.all_to_all(outs, ins)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _expected_all_to_all(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"from{r}": a2a_chunk(r, rank, world, numel) for r in range(world)}


def _run_all_to_all_single(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    in_splits = [a2a_split(rank, j, numel) for j in range(world)]
    out_splits = [a2a_split(r, rank, numel) for r in range(world)]
    inp = _dev(torch.cat([a2a_chunk(rank, j, world, numel) for j in range(world)]), dtype, device)
    out = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    return {"out": out}


def _expected_all_to_all_single(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"out": torch.cat([a2a_chunk(r, rank, world, numel) for r in range(world)])}


def _run_broadcast(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    t = _dev(signed_values(rank, 0, numel), dtype, device)
    dist.broadcast(t, src=0)
    return {"out": t}


def _expected_broadcast(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"out": signed_values(0, 0, numel)}


def _run_reduce(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    t = _dev(signed_values(rank, 0, numel), dtype, device)
    dist.reduce(t, dst=world - 1, op=dist.ReduceOp.SUM)
    return {"out": t} if rank == world - 1 else {}


def _expected_reduce(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    if rank != world - 1:
        return {}
    return {"out": torch.stack([signed_values(r, 0, numel) for r in range(world)]).sum(0)}


def _run_gather(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    inp = _dev(signed_values(rank, 0, numel), dtype, device)
    dst = world - 1
    outs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(world)] if rank == dst else None
    dist.gather(inp, gather_list=outs, dst=dst)
    return {f"from{r}": o for r, o in enumerate(outs)} if outs is not None else {}


def _expected_gather(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {f"from{r}": signed_values(r, 0, numel) for r in range(world)} if rank == world - 1 else {}


def _run_scatter(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    out = torch.empty(numel, dtype=dtype, device=device)
    chunks = [_dev(signed_values(0, j * numel, numel), dtype, device) for j in range(world)] if rank == 0 else None
    dist.scatter(out, scatter_list=chunks, src=0)
    return {"out": out}


def _expected_scatter(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"out": signed_values(0, rank * numel, numel)}


def _run_send_recv(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    send = _dev(signed_values(rank, 0, numel), dtype, device)
    recv = torch.empty(numel, dtype=dtype, device=device)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(send, dst=nxt)
        dist.recv(recv, src=prv)
    else:
        dist.recv(recv, src=prv)
        dist.send(send, dst=nxt)
    return {"from_prev": recv}


def _expected_send_recv(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"from_prev": signed_values((rank - 1) % world, 0, numel)}


def _run_batch_isend_irecv(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    send = _dev(signed_values(rank, 0, numel), dtype, device)
    from_prev = torch.empty(numel, dtype=dtype, device=device)
    from_next = torch.empty(numel, dtype=dtype, device=device)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ops = [
        dist.P2POp(dist.isend, send, nxt),
        dist.P2POp(dist.isend, send, prv),
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.irecv, from_next, nxt),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"from_prev": from_prev, "from_next": from_next}


def _expected_batch_isend_irecv(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"from_prev": signed_values((rank - 1) % world, 0, numel),
            "from_next": signed_values((rank + 1) % world, 0, numel)}


def _simple(name: str, run: Callable[..., Outputs], expected: Callable[..., dict[str, torch.Tensor]],
            needs_peer: bool = False) -> CheckSpec:
    return CheckSpec(name=name, family=name, redop=None, needs_peer=needs_peer, run=run, expected=expected,
                     tolerance_kind="exact")


def _build_checks() -> dict[str, CheckSpec]:
    checks: dict[str, CheckSpec] = {}
    for redop in REDUCE_OPS:
        checks[f"all_reduce.{redop}"] = _make_all_reduce(redop)
    checks["all_gather"] = _simple("all_gather", _run_all_gather, _expected_all_gather)
    checks["all_gather.uneven"] = _simple("all_gather.uneven", _run_all_gather_uneven, _expected_all_gather_uneven)
    checks["all_gather_into_tensor"] = _simple("all_gather_into_tensor", _run_all_gather_into_tensor,
                                               _expected_all_gather_into_tensor)
    checks["reduce_scatter"] = CheckSpec(name="reduce_scatter", family="reduce_scatter", redop="sum",
                                         needs_peer=False, run=_run_reduce_scatter,
                                         expected=_expected_reduce_scatter, tolerance_kind="sum")
    checks["reduce_scatter_tensor.sum"] = _make_reduce_scatter_tensor("sum")
    checks["reduce_scatter_tensor.avg"] = _make_reduce_scatter_tensor("avg")
    checks["all_to_all"] = _simple("all_to_all", _run_all_to_all, _expected_all_to_all)
    checks["all_to_all_single"] = _simple("all_to_all_single", _run_all_to_all_single, _expected_all_to_all_single)
    checks["broadcast"] = _simple("broadcast", _run_broadcast, _expected_broadcast)
    checks["reduce"] = CheckSpec(name="reduce", family="reduce", redop="sum", needs_peer=False, run=_run_reduce,
                                 expected=_expected_reduce, tolerance_kind="sum")
    checks["gather"] = _simple("gather", _run_gather, _expected_gather)
    checks["scatter"] = _simple("scatter", _run_scatter, _expected_scatter)
    checks["send_recv"] = _simple("send_recv", _run_send_recv, _expected_send_recv, needs_peer=True)
    checks["batch_isend_irecv"] = _simple("batch_isend_irecv", _run_batch_isend_irecv, _expected_batch_isend_irecv,
                                          needs_peer=True)
    checks["barrier"] = _simple("barrier", _run_barrier_placeholder, _expected_barrier)
    return checks


def _run_barrier_placeholder(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> Outputs:
    raise RuntimeError("barrier runs through _run_barrier (it needs the rendezvous store)")


def _expected_barrier(rank: int, world: int, numel: int) -> dict[str, torch.Tensor]:
    return {"arrived": torch.full((1,), float(world), dtype=torch.float64)}


CHECKS: dict[str, CheckSpec] = _build_checks()
ALL_CHECKS: tuple[str, ...] = tuple(CHECKS)

FAMILIES: Mapping[str, tuple[str, ...]] = {
    family: tuple(n for n, s in CHECKS.items() if s.family == family)
    for family in dict.fromkeys(s.family for s in CHECKS.values())
}
"""Op family (what users type on the CLI, e.g. ``all_reduce``) -> its checks."""


def expand_checks(names: Sequence[str]) -> tuple[str, ...]:
    """Expand family names (``all_reduce``) and exact check names into check names, order kept."""
    out: list[str] = []
    for name in names:
        if name in CHECKS:
            out.append(name)
        elif name in FAMILIES:
            out.extend(FAMILIES[name])
        else:
            raise ValueError(f"unknown collective {name!r}; families: {list(FAMILIES)}; checks: {list(CHECKS)}")
    return tuple(dict.fromkeys(out))


def applicable(check: str, dtype: str, world: int) -> tuple[bool, str]:
    """Whether a cell is meaningful; the reason when it is not."""
    spec = CHECKS[check]
    if spec.needs_peer and world < 2:
        return False, f"{check} needs a peer; world_size is {world}"
    if spec.redop in BITWISE and DTYPES[dtype].is_floating_point:
        return False, f"bitwise reduction {spec.redop} is undefined for {dtype}"
    return True, ""


# --------------------------------------------------------------------------- per-rank execution


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU; torch.<device>.synchronize otherwise)."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def compare_outputs(received: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                    tol: Callable[[str], torch.Tensor | float]) -> tuple[bool, float, int, str]:
    """Compare received tensors with float64 expectations; (ok, max_abs_err, mismatches, first mismatch)."""
    if set(received) != set(expected):
        return False, float("inf"), 1, f"outputs {sorted(received)} != expected {sorted(expected)}"
    worst, count, first = 0.0, 0, ""
    for name in sorted(expected):
        got = received[name].detach().to("cpu").to(torch.float64)
        exp = expected[name]
        if got.shape != exp.shape:
            return False, float("inf"), 1, f"{name}: shape {tuple(got.shape)} != expected {tuple(exp.shape)}"
        err = (got - exp).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        bad = err > torch.as_tensor(tol(name), dtype=torch.float64)
        if err.numel():
            worst = max(worst, float(err.max()))
        n_bad = int(bad.sum())
        if n_bad and not first:
            idx = int(bad.nonzero()[0, 0])
            first = f"{name}[{idx}]: got {float(got[idx])!r}, expected {float(exp[idx])!r}"
        count += n_bad
    return count == 0, worst, count, first


def corrupt_outputs(outputs: Outputs) -> None:
    """Shift the first element of the first non-empty output (by name) by CORRUPTION_DELTA: the self-check
    that a wrong result is caught."""
    for name in sorted(outputs):
        t = outputs[name]
        if t.numel():
            t.view(-1)[0] += CORRUPTION_DELTA
            return


def _run_barrier(rank: int, world: int, run_id: str, hide_arrival: bool) -> Outputs:
    """Each rank writes a key before the barrier (the last one late); after it, count the keys."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"migrate/comm/barrier/{run_id}"
    if rank == world - 1:
        time.sleep(BARRIER_DELAY_S)
    store.set(f"{prefix}/{rank}", "1")
    dist.barrier()
    arrived = sum(1 for r in range(world) if store.check([f"{prefix}/{r}"]))
    if hide_arrival:
        arrived -= 1
    return {"arrived": torch.full((1,), float(arrived), dtype=torch.float64)}


def run_cell(check: str, dtype_name: str, numel: int, rank: int, world: int, device: torch.device,
             corrupt: CorruptionSpec | None, run_id: str) -> CellObservation:
    """Run one cell on this rank and judge it against the backend-independent expectation."""
    ok, why = applicable(check, dtype_name, world) if check != "barrier" else (True, "")
    if not ok:
        return CellObservation(check=check, dtype=dtype_name, numel=numel, rank=rank, status="n/a", error=why)
    corrupting = corrupt is not None and corrupt.matches(check, rank, dtype_name, numel)
    start = time.perf_counter()
    try:
        if check == "barrier":
            outputs = _run_barrier(rank, world, run_id, corrupting)
        else:
            with warnings.catch_warnings():  # torch 2.13 renames *_into_tensor/*_tensor; we check both names' op
                warnings.simplefilter("ignore", FutureWarning)
                outputs = CHECKS[check].run(rank, world, DTYPES[dtype_name], numel, device)
            synchronize(device)
            if corrupting:
                corrupt_outputs(outputs)
    except Exception as exc:  # noqa: BLE001 - the backend's own error is the observation
        return CellObservation(check=check, dtype=dtype_name, numel=numel, rank=rank, status="error",
                               error=f"{type(exc).__name__}: {str(exc).strip()[:600]}",
                               seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    expected = expected_outputs(check, rank, world, numel)
    dtype = DTYPES.get(dtype_name, torch.float64)
    good, worst, n_bad, first = compare_outputs(
        outputs, expected, lambda name: tolerance(check, dtype, rank, world, numel, name))
    return CellObservation(check=check, dtype=dtype_name, numel=numel, rank=rank,
                           status="ok" if good else "wrong", max_abs_err=worst, mismatches=n_bad,
                           first_mismatch=first, seconds=seconds)


def run_matrix_on_rank(ctx: RankContext, plan: MatrixPlan) -> list[CellObservation]:
    """Worker-group entry point: run every cell of ``plan`` on this rank, in plan order."""
    device = torch.device(ctx.device)
    return [run_cell(check, dtype, numel, ctx.rank, ctx.world_size, device, plan.corrupt,
                     f"{plan.run_id}/{i}")
            for i, (check, dtype, numel) in enumerate(plan.cells())]


# --------------------------------------------------------------------------- merge (pure)


def merge_observations(plan: MatrixPlan, per_rank: Sequence[Sequence[CellObservation]], *, backend: str,
                       device_type: str) -> CommMatrix:
    """Merge per-rank observations into the matrix: error > wrong > ok; n/a only when all ranks agree.

    Raises ValueError when a rank's list does not cover the plan's cells in order.
    """
    world = len(per_rank)
    cells = plan.cells()
    for rank, obs in enumerate(per_rank):
        got = [(o.check, o.dtype, o.numel) for o in obs]
        if got != cells:
            first = next((i for i, (a, b) in enumerate(zip(got, cells)) if a != b), min(len(got), len(cells)))
            raise ValueError(f"rank {rank} returned {len(got)} observations for {len(cells)} planned cells "
                             f"(first difference at {first})")
    merged: list[MatrixCell] = []
    for i, (check, dtype, numel) in enumerate(cells):
        row = [per_rank[r][i] for r in range(world)]
        errors = tuple(o.rank for o in row if o.status == "error")
        wrong = tuple(o.rank for o in row if o.status == "wrong")
        worst = max((o.max_abs_err for o in row), default=0.0)
        if errors:
            failed = next(o for o in row if o.status == "error")
            status: CellStatus = "error"
            detail = failed.error
        elif wrong:
            status = "wrong"
            detail = "; ".join(f"rank {o.rank}: {o.mismatches} wrong, {o.first_mismatch}" for o in row
                               if o.status == "wrong")
        elif all(o.status == "n/a" for o in row):
            status, detail = "n/a", row[0].error
        else:
            status, detail = "ok", ""
        merged.append(MatrixCell(check=check, dtype=dtype, numel=numel, status=status, wrong_ranks=wrong,
                                 error_ranks=errors, max_abs_err=worst, detail=detail))
    return CommMatrix(backend=backend, device_type=device_type, world_size=world,
                      torch_version=torch.__version__, cells=tuple(merged))
