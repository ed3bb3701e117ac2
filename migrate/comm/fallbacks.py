"""Fallbacks: compositions of supported collectives that replace an op or dtype the target lacks.

The public functions have torch.distributed-like signatures so that worker-group
code (and training code) can call them in place of the missing op, e.g.
``all_gather_uneven_via_padding(outputs, tensor)`` where Gloo's ``all_gather``
rejects uneven sizes.  Each one is registered as a :class:`Fallback` that names
the matrix check it replaces and the checks it is built from, so that:

* :func:`select_fallbacks` (pure) picks, from a matrix, a usable fallback for
  every cell that training needs and the backend fails;
* ``group.run(run_fallbacks_on_rank, plan)`` checks each fallback against the
  same backend-independent expectations as the matrix and measures its cost
  next to the native op (when the native op works) on the live backend;
* :func:`merge_fallback_observations` (pure) averages the timings over ranks.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from migrate.comm import matrix as mx

if TYPE_CHECKING:
    from migrate.runtime.worker_group import RankContext

# --------------------------------------------------------------------------- the compositions


def all_reduce_avg_via_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In-place average: SUM all-reduce, then divide by the group size (integers truncate)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    _divide_(tensor, dist.get_world_size(group))


def reduce_scatter_tensor_avg_via_sum(output: torch.Tensor, input: torch.Tensor,
                                      group: dist.ProcessGroup | None = None) -> None:
    """Average reduce-scatter: SUM reduce-scatter, then divide by the group size."""
    dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group)
    _divide_(output, dist.get_world_size(group))


def all_reduce_premul_sum_via_scale(tensor: torch.Tensor, factor: float,
                                    group: dist.ProcessGroup | None = None) -> None:
    """PREMUL_SUM (NCCL only): scale the local tensor by ``factor``, then SUM all-reduce."""
    tensor.mul_(factor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_gather_uneven_via_padding(output_list: list[torch.Tensor], tensor: torch.Tensor,
                                  group: dist.ProcessGroup | None = None) -> None:
    """All-gather of unequal 1-D sizes: pad to the largest, gather into one tensor, slice.

    The sizes come from ``output_list`` (as with ``dist.all_gather``), so no extra
    size exchange is needed.
    """
    world = dist.get_world_size(group)
    longest = max(o.numel() for o in output_list)
    padded = tensor.new_zeros(longest)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = tensor.new_empty(longest * world)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for r, out in enumerate(output_list):
        out.reshape(-1).copy_(gathered[r * longest: r * longest + out.numel()])


def all_to_all_via_single(output_list: list[torch.Tensor], input_list: list[torch.Tensor],
                          group: dist.ProcessGroup | None = None) -> None:
    """List all_to_all with uneven sizes through one ``all_to_all_single`` with split sizes."""
    inp = torch.cat([t.reshape(-1) for t in input_list])
    out = inp.new_empty(sum(o.numel() for o in output_list))
    dist.all_to_all_single(out, inp, output_split_sizes=[o.numel() for o in output_list],
                           input_split_sizes=[t.numel() for t in input_list], group=group)
    for dst, chunk in zip(output_list, out.split([o.numel() for o in output_list])):
        dst.reshape(-1).copy_(chunk)


def all_to_all_via_p2p(output_list: list[torch.Tensor], input_list: list[torch.Tensor],
                       group: dist.ProcessGroup | None = None) -> None:
    """all_to_all as one batch of isend/irecv pairs (the rank's own chunk is copied locally)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    output_list[rank].copy_(input_list[rank])
    ops = []
    for peer in range(world):
        if peer == rank:
            continue
        ops.append(dist.P2POp(dist.isend, input_list[peer].contiguous(), peer, group))
        ops.append(dist.P2POp(dist.irecv, output_list[peer], peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def all_gather_into_tensor_via_list(output: torch.Tensor, input: torch.Tensor,
                                    group: dist.ProcessGroup | None = None) -> None:
    """all_gather_into_tensor through list ``all_gather`` into views of ``output``."""
    world = dist.get_world_size(group)
    views = list(output.reshape(-1).chunk(world))
    dist.all_gather(views, input.reshape(-1), group=group)


def reduce_scatter_tensor_via_all_reduce(output: torch.Tensor, input: torch.Tensor,
                                         op: Any = dist.ReduceOp.SUM,
                                         group: dist.ProcessGroup | None = None) -> None:
    """reduce_scatter_tensor through a full all-reduce of a copy and a slice (W times the traffic)."""
    rank = dist.get_rank(group)
    full = input.reshape(-1).clone()
    dist.all_reduce(full, op=op, group=group)
    n = output.numel()
    output.reshape(-1).copy_(full[rank * n:(rank + 1) * n])


def all_reduce_via_fp32(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None) -> None:
    """All-reduce a 16-bit float tensor in float32 (for backends without bf16/fp16 reductions)."""
    wide = tensor.to(torch.float32)
    dist.all_reduce(wide, op=op, group=group)
    tensor.copy_(wide)


def _divide_(tensor: torch.Tensor, world: int) -> None:
    if tensor.is_floating_point():
        tensor.div_(world)
    else:
        tensor.copy_(torch.div(tensor, world, rounding_mode="trunc"))


# --------------------------------------------------------------------------- registry

RunFn = Callable[[int, int, torch.dtype, int, torch.device], mx.Outputs]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fallback:
    """A composition that produces the outputs of matrix check ``replaces``.

    ``composed_of`` are the matrix checks it calls, in ``compute_dtype`` when set
    (else the cell's own dtype); ``dtypes`` limits it to those dtypes (None: any).
    ``run`` mirrors the replaced check's ``run`` so the matrix expectations apply.
    """

    name: str
    replaces: str
    composed_of: tuple[str, ...]
    description: str
    run: RunFn
    dtypes: frozenset[str] | None = None
    compute_dtype: str | None = None


def _dev(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(dtype).to(device)


def _fb_all_reduce_avg(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    t = _dev(mx.reduction_input("avg", rank, world, numel), dtype, device)
    all_reduce_avg_via_sum(t)
    return {"out": t}


def _fb_reduce_scatter_avg(rank: int, world: int, dtype: torch.dtype, numel: int,
                           device: torch.device) -> mx.Outputs:
    inp = _dev(mx.reduction_input("avg", rank, world, numel * world), dtype, device)
    out = torch.empty(numel, dtype=dtype, device=device)
    reduce_scatter_tensor_avg_via_sum(out, inp)
    return {"out": out}


def _fb_premul(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    t = _dev(mx.reduction_input("premul_sum", rank, world, numel), dtype, device)
    all_reduce_premul_sum_via_scale(t, mx.PREMUL_FACTOR)
    return {"out": t}


def _fb_all_gather_uneven(rank: int, world: int, dtype: torch.dtype, numel: int,
                          device: torch.device) -> mx.Outputs:
    inp = _dev(mx.signed_values(rank, 0, mx.uneven_count(rank, numel)), dtype, device)
    outs = [torch.empty(mx.uneven_count(r, numel), dtype=dtype, device=device) for r in range(world)]
    all_gather_uneven_via_padding(outs, inp)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _a2a_lists(rank: int, world: int, dtype: torch.dtype, numel: int,
               device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ins = [_dev(mx.a2a_chunk(rank, j, world, numel), dtype, device) for j in range(world)]
    outs = [torch.empty(mx.a2a_split(r, rank, numel), dtype=dtype, device=device) for r in range(world)]
    return ins, outs


def _fb_a2a_single(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    ins, outs = _a2a_lists(rank, world, dtype, numel, device)
    all_to_all_via_single(outs, ins)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _fb_a2a_p2p(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    ins, outs = _a2a_lists(rank, world, dtype, numel, device)
    all_to_all_via_p2p(outs, ins)
    return {f"from{r}": o for r, o in enumerate(outs)}


def _fb_agit_list(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    inp = _dev(mx.signed_values(rank, 0, numel), dtype, device)
    out = torch.empty(numel * world, dtype=dtype, device=device)
    all_gather_into_tensor_via_list(out, inp)
    return {"out": out}


def _fb_rst_all_reduce(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    inp = _dev(mx.reduction_input("sum", rank, world, numel * world), dtype, device)
    out = torch.empty(numel, dtype=dtype, device=device)
    reduce_scatter_tensor_via_all_reduce(out, inp)
    return {"out": out}


def _fb_fp32_sum(rank: int, world: int, dtype: torch.dtype, numel: int, device: torch.device) -> mx.Outputs:
    t = _dev(mx.reduction_input("sum", rank, world, numel), dtype, device)
    all_reduce_via_fp32(t)
    return {"out": t}


HALF = frozenset({"bfloat16", "float16"})

FALLBACKS: Mapping[str, Fallback] = {f.name: f for f in (
    Fallback(name="all_reduce_avg_via_sum", replaces="all_reduce.avg", composed_of=("all_reduce.sum",),
             description="SUM all-reduce then divide by world size", run=_fb_all_reduce_avg),
    Fallback(name="reduce_scatter_tensor_avg_via_sum", replaces="reduce_scatter_tensor.avg",
             composed_of=("reduce_scatter_tensor.sum",),
             description="SUM reduce-scatter then divide by world size", run=_fb_reduce_scatter_avg),
    Fallback(name="all_reduce_premul_sum_via_scale", replaces="all_reduce.premul_sum",
             composed_of=("all_reduce.sum",), description="scale locally then SUM all-reduce", run=_fb_premul),
    Fallback(name="all_gather_uneven_via_padding", replaces="all_gather.uneven",
             composed_of=("all_gather_into_tensor",),
             description="pad to the largest size, all_gather_into_tensor, slice", run=_fb_all_gather_uneven),
    Fallback(name="all_to_all_via_single", replaces="all_to_all", composed_of=("all_to_all_single",),
             description="concatenate and use all_to_all_single with split sizes", run=_fb_a2a_single),
    Fallback(name="all_to_all_via_p2p", replaces="all_to_all", composed_of=("batch_isend_irecv",),
             description="one batch_isend_irecv with a send and a receive per peer", run=_fb_a2a_p2p),
    Fallback(name="all_gather_into_tensor_via_list", replaces="all_gather_into_tensor",
             composed_of=("all_gather",), description="list all_gather into views of the output",
             run=_fb_agit_list),
    Fallback(name="reduce_scatter_tensor_via_all_reduce", replaces="reduce_scatter_tensor.sum",
             composed_of=("all_reduce.sum",), description="all-reduce a copy and keep this rank's slice",
             run=_fb_rst_all_reduce),
    Fallback(name="all_reduce_sum_via_fp32", replaces="all_reduce.sum", composed_of=("all_reduce.sum",),
             description="upcast bf16/fp16 to fp32, all-reduce, cast back", run=_fb_fp32_sum,
             dtypes=HALF, compute_dtype="float32"),
)}
"""Every fallback by name."""


# --------------------------------------------------------------------------- selection (pure)

TRAINING_CHECKS: tuple[str, ...] = (
    "all_reduce.sum", "all_reduce.avg", "all_reduce.max", "all_gather_into_tensor", "reduce_scatter_tensor.sum",
    "reduce_scatter_tensor.avg", "all_to_all_single", "broadcast", "send_recv", "batch_isend_irecv", "barrier",
)
"""Collectives that data/tensor/pipeline/expert parallel training and ZeRO use."""


def training_needs(precision: str) -> tuple[tuple[str, str], ...]:
    """(check, dtype) cells a job at ``precision`` (fp32|bf16|fp16) needs from the backend."""
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    if precision not in names:
        raise ValueError(f"precision {precision!r} is not one of {sorted(names)}")
    dtypes = tuple(dict.fromkeys((names[precision], "float32")))
    needs = [(c, mx.NO_DTYPE if c == "barrier" else d) for c in TRAINING_CHECKS for d in dtypes]
    needs.append(("all_reduce.sum", "int64"))
    return tuple(dict.fromkeys(needs))


@dataclass(frozen=True, kw_only=True, slots=True)
class FallbackChoice:
    """For one needed (check, dtype) the backend fails: the fallback to use, or none."""

    check: str
    dtype: str
    status: str
    fallback: str | None
    reason: str


def cell_status(matrix: mx.CommMatrix, check: str, dtype: str) -> str:
    """Worst status of (check, dtype) over all sizes: error > wrong > ok > n/a; 'absent' if not checked."""
    statuses = {c.status for c in matrix.cells if c.check == check and c.dtype == dtype}
    for status in ("error", "wrong", "ok", "n/a"):
        if status in statuses:
            return status
    return "absent"


def select_fallbacks(matrix: mx.CommMatrix, needs: Sequence[tuple[str, str]]) -> tuple[FallbackChoice, ...]:
    """For each needed cell that is not ``ok``, the first fallback whose building blocks are ``ok``.

    Cells that were not checked are reported with status 'absent' and no fallback.
    """
    choices: list[FallbackChoice] = []
    for check, dtype in needs:
        status = cell_status(matrix, check, dtype)
        if status in ("ok", "n/a"):
            continue
        if status == "absent":
            choices.append(FallbackChoice(check=check, dtype=dtype, status=status, fallback=None,
                                          reason="not checked in this matrix"))
            continue
        picked: FallbackChoice | None = None
        rejected: list[str] = []
        for fb in FALLBACKS.values():
            if fb.replaces != check or (fb.dtypes is not None and dtype not in fb.dtypes):
                continue
            compute = fb.compute_dtype or dtype
            blocks = {b: cell_status(matrix, b, mx.NO_DTYPE if b == "barrier" else compute) for b in fb.composed_of}
            bad = {b: s for b, s in blocks.items() if s != "ok"}
            if bad:
                rejected.append(f"{fb.name} (needs {bad})")
                continue
            picked = FallbackChoice(check=check, dtype=dtype, status=status, fallback=fb.name,
                                    reason=f"{check} {dtype} is {status}; {fb.description}")
            break
        choices.append(picked or FallbackChoice(
            check=check, dtype=dtype, status=status, fallback=None,
            reason=f"{check} {dtype} is {status} and no fallback is usable"
                   + (f": {'; '.join(rejected)}" if rejected else ": none registered")))
    return tuple(choices)


# --------------------------------------------------------------------------- measurement


@dataclass(frozen=True, kw_only=True, slots=True)
class FallbackPlan:
    """Which fallbacks to check and time: ``fallbacks`` x ``dtypes`` x ``sizes`` (elements)."""

    fallbacks: tuple[str, ...] = tuple(FALLBACKS)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    sizes: tuple[int, ...] = (7, 65_537)
    warmup: int = 1
    iters: int = 5
    corrupt: mx.CorruptionSpec | None = None

    def __post_init__(self) -> None:
        unknown = [f for f in self.fallbacks if f not in FALLBACKS]
        if unknown:
            raise ValueError(f"FallbackPlan.fallbacks: unknown {unknown}; known: {list(FALLBACKS)}")
        bad = [d for d in self.dtypes if d not in mx.DTYPES]
        if bad:
            raise ValueError(f"FallbackPlan.dtypes: unknown {bad}; known: {list(mx.DTYPES)}")
        if any(s < 1 for s in self.sizes) or self.iters < 1 or self.warmup < 0:
            raise ValueError(f"FallbackPlan: sizes {self.sizes} must be >= 1, iters({self.iters}) >= 1, "
                             f"warmup({self.warmup}) >= 0")

    def cells(self) -> list[tuple[str, str, int]]:
        """(fallback, dtype, numel) in execution order, skipping dtypes a fallback does not cover."""
        return [(f, d, n) for f in self.fallbacks for d in self.dtypes for n in self.sizes
                if (covered := FALLBACKS[f].dtypes) is None or d in covered]


FallbackStatus = Literal["ok", "wrong", "error", "n/a"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FallbackObservation:
    """One rank's result for one fallback cell: correctness and seconds per call."""

    fallback: str
    dtype: str
    numel: int
    rank: int
    status: FallbackStatus
    fallback_s: float = 0.0
    native_status: FallbackStatus = "n/a"
    native_s: float | None = None
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class FallbackResult:
    """Merged over ranks: is the fallback correct, and what does it cost next to the native op."""

    fallback: str
    replaces: str
    dtype: str
    numel: int
    status: FallbackStatus
    fallback_s: float
    native_status: FallbackStatus
    native_s: float | None
    cost_ratio: float | None
    detail: str = ""


def _time_calls(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    mx.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    mx.synchronize(device)
    return (time.perf_counter() - start) / iters


def _fallback_cell(fb: Fallback, dtype_name: str, numel: int, rank: int, world: int, device: torch.device,
                   plan: FallbackPlan) -> FallbackObservation:
    dtype = mx.DTYPES[dtype_name]
    ok_app, why = mx.applicable(fb.replaces, dtype_name, world)
    if not ok_app:
        return FallbackObservation(fallback=fb.name, dtype=dtype_name, numel=numel, rank=rank, status="n/a",
                                   detail=why)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            outputs = fb.run(rank, world, dtype, numel, device)
            mx.synchronize(device)
            if plan.corrupt is not None and plan.corrupt.matches(fb.name, rank, dtype_name, numel):
                mx.corrupt_outputs(outputs)
            expected = mx.expected_outputs(fb.replaces, rank, world, numel)
            good, worst, n_bad, first = mx.compare_outputs(
                outputs, expected, lambda name: mx.tolerance(fb.replaces, dtype, rank, world, numel, name))
            fb_s = _time_calls(lambda: fb.run(rank, world, dtype, numel, device), plan.warmup, plan.iters, device)
    except Exception as exc:  # noqa: BLE001 - the backend's own error
        return FallbackObservation(fallback=fb.name, dtype=dtype_name, numel=numel, rank=rank, status="error",
                                   detail=f"{type(exc).__name__}: {str(exc).strip()[:600]}")
    native = mx.run_cell(fb.replaces, dtype_name, numel, rank, world, device, None, f"fallback/{fb.name}")
    native_s: float | None = None
    if native.status in ("ok", "wrong"):  # it completed on every rank, so every rank times it
        native_s = _time_calls(lambda: mx.CHECKS[fb.replaces].run(rank, world, dtype, numel, device),
                               plan.warmup, plan.iters, device)
    return FallbackObservation(
        fallback=fb.name, dtype=dtype_name, numel=numel, rank=rank, status="ok" if good else "wrong",
        fallback_s=fb_s, native_status=native.status, native_s=native_s,
        detail="" if good else f"{n_bad} wrong, max |err| {worst}, {first}")


def run_fallbacks_on_rank(ctx: RankContext, plan: FallbackPlan) -> list[FallbackObservation]:
    """Worker-group entry point: check and time every fallback cell of ``plan`` on this rank.

    Times include building the inputs on both sides (fallback and native), so the
    ratio compares like with like.
    """
    device = torch.device(ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return [_fallback_cell(FALLBACKS[f], d, n, ctx.rank, ctx.world_size, device, plan)
                for f, d, n in plan.cells()]


def merge_fallback_observations(plan: FallbackPlan,
                                per_rank: Sequence[Sequence[FallbackObservation]]) -> tuple[FallbackResult, ...]:
    """Merge per-rank observations: worst status over ranks, seconds averaged over ranks (as nccl-tests)."""
    cells = plan.cells()
    for rank, obs in enumerate(per_rank):
        if [(o.fallback, o.dtype, o.numel) for o in obs] != cells:
            raise ValueError(f"rank {rank} returned {len(obs)} fallback observations for {len(cells)} planned cells")
    order = {"error": 3, "wrong": 2, "ok": 1, "n/a": 0}
    out: list[FallbackResult] = []
    for i, (name, dtype, numel) in enumerate(cells):
        row = [obs[i] for obs in per_rank]
        status = max((o.status for o in row), key=order.__getitem__)
        native_status = max((o.native_status for o in row), key=order.__getitem__)
        fb_s = sum(o.fallback_s for o in row) / len(row)
        native_s = (sum(o.native_s for o in row if o.native_s is not None) / len(row)
                    if all(o.native_s is not None for o in row) else None)
        ratio = fb_s / native_s if native_s and status == "ok" else None
        detail = "; ".join(f"rank {o.rank}: {o.detail}" for o in row if o.detail and o.status != "ok")
        out.append(FallbackResult(fallback=name, replaces=FALLBACKS[name].replaces, dtype=dtype, numel=numel,
                                  status=status, fallback_s=fb_s, native_status=native_status, native_s=native_s,
                                  cost_ratio=ratio, detail=detail))
    return tuple(out)
