"""Fingerprints of a loaded training state, independent of the layout it was loaded at.

A `StatePrint` names every logical tensor of the state a framework holds after its own load
(weights, fp32 master, each optimizer state tensor) and every small exact value (per-parameter
steps, the scheduler state, the current learning rate, the data position). A tensor's print is
the element count, the sum of squares, the largest magnitude, the non-finite count and an
order-independent hash of (position in the logical tensor, value bits): any rank may contribute
any chunk of any tensor, in any order, and the prints combine to the same value, so a state
loaded at TP2/DP4 prints as the same state loaded at TP1/DP2 when, and only when, every element
sits at the same logical position with the same bits. Comparing two prints (`differences`,
pure) names the first tensors that differ with their numbers.

The per-rank part (`chunk_print`) runs on the rank's own shard; `combine` sums the parts that
every rank gathers (`torch.distributed.all_gather_object`, a few numbers per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_MASK = (1 << 64) - 1
_CHUNK = 1 << 22  # elements hashed at once (bounded scratch memory)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX_VALUE = -4417276706812531889  # 0xC2B2AE3D27D4EB4F
_FMIX1 = -49064778989728563  # 0xff51afd7ed558ccd
_FMIX2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53
_LOW33 = (1 << 31) - 1  # after an arithmetic shift by 33, the 31 bits that a logical shift keeps


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorPrint:
    """One logical tensor: its shape and dtype, the elements printed, and their combined numbers."""

    shape: tuple[int, ...]
    dtype: str
    count: int
    hash: int
    sum_sq: float
    abs_max: float
    nonfinite: int

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_sq)

    def as_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "count": self.count, "hash": f"{self.hash:016x}",
                "norm": self.norm, "abs_max": self.abs_max, "nonfinite": self.nonfinite}


@dataclass(frozen=True, kw_only=True, slots=True)
class StatePrint:
    """A whole loaded state: tensors by logical name, exact values by name (JSON-able)."""

    tensors: Mapping[str, TensorPrint] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"tensors": {k: v.as_dict() for k, v in sorted(self.tensors.items())},
                "values": dict(sorted(self.values.items()))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatePrint:
        tensors = {k: TensorPrint(shape=tuple(v["shape"]), dtype=v["dtype"], count=int(v["count"]),
                                  hash=int(v["hash"], 16), sum_sq=float(v["norm"]) ** 2, abs_max=float(v["abs_max"]),
                                  nonfinite=int(v["nonfinite"]))
                   for k, v in data.get("tensors", {}).items()}
        return cls(tensors=tensors, values=dict(data.get("values", {})))


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns as int64 (floats by their own width, integers and bools as numbers)."""
    import torch

    if values.dtype.is_floating_point:
        width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[values.element_size()]
        return values.contiguous().view(width).to(torch.int64)
    return values.to(torch.int64)


def _shr33(x: torch.Tensor) -> torch.Tensor:
    return (x >> 33) & _LOW33


def _mix(index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A 64-bit mix of (position, bits) (murmur3's finaliser), wrapping int64 arithmetic."""
    h = index * _GOLDEN ^ (bits * _MIX_VALUE + 0x5851F42D)
    h = h ^ _shr33(h)
    h = h * _FMIX1
    h = h ^ _shr33(h)
    h = h * _FMIX2
    return h ^ _shr33(h)


def _flat_indices(positions: torch.Tensor, local_shape: Sequence[int], offset: Sequence[int],
                  logical_shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices in `logical_shape`, mask of the positions inside it) of flat `positions` in a chunk of
    `local_shape` placed at `offset` (its leading axes of size 1 when the chunk has fewer axes)."""
    import torch

    lead = len(offset) - len(local_shape)
    coords = []
    rest = positions
    for size in reversed(local_shape):
        coords.append(rest % size)
        rest = rest // size
    coords = [torch.zeros_like(positions)] * lead + coords[::-1]
    inside = torch.ones_like(positions, dtype=torch.bool)
    flat = torch.zeros_like(positions)
    for c, o, size in zip(coords, offset, logical_shape):
        g = c + int(o)
        inside &= g < size
        flat = flat * int(size) + g
    return flat, inside


def chunk_print(data: torch.Tensor, *, logical_shape: Sequence[int], offset: Sequence[int] | None = None,
                flat_range: slice | None = None, local_shape: Sequence[int] | None = None) -> TensorPrint:
    """The print of one rank's chunk of a logical tensor of `logical_shape`.

    `data` is the chunk placed at `offset` (default: the origin; a whole tensor), or, with `flat_range`,
    the elements [start, stop) of the flattened chunk of `local_shape` at `offset` (Megatron's
    distributed-optimizer shards). Elements beyond `logical_shape` (padding) are left out."""
    import torch

    logical_shape = tuple(int(s) for s in logical_shape)
    local_shape = tuple(int(s) for s in (local_shape if local_shape is not None else data.shape))
    offset = tuple(int(o) for o in (offset if offset is not None else (0,) * len(logical_shape)))
    values = data.detach().reshape(-1)
    if values.device.type != "cpu":
        values = values.cpu()
    start = flat_range.start if flat_range is not None else 0
    count, total, sum_sq, abs_max, nonfinite = 0, 0, 0.0, 0.0, 0
    whole = local_shape == logical_shape and not any(offset)
    for begin in range(0, values.numel(), _CHUNK):
        part = values[begin:begin + _CHUNK]
        positions = torch.arange(start + begin, start + begin + part.numel(), dtype=torch.int64)
        if whole:
            flat = positions
        else:
            flat, inside = _flat_indices(positions, local_shape, offset, logical_shape)
            if not bool(inside.all()):
                part, flat = part[inside], flat[inside]
        count += part.numel()
        total = (total + int(_mix(flat, _bits(part)).sum())) & _MASK
        if part.dtype.is_floating_point or part.dtype.is_complex:
            as64 = part.to(torch.float64)
            finite = torch.isfinite(as64)
            nonfinite += int((~finite).sum())
            as64 = as64[finite]
        else:
            as64 = part.to(torch.float64)
        if as64.numel():
            sum_sq += float((as64 * as64).sum())
            abs_max = max(abs_max, float(as64.abs().max()))
    return TensorPrint(shape=logical_shape, dtype=str(data.dtype).removeprefix("torch."), count=count, hash=total,
                       sum_sq=sum_sq, abs_max=abs_max, nonfinite=nonfinite)


def combine(parts: Iterable[Mapping[str, TensorPrint]]) -> dict[str, TensorPrint]:
    """Every rank's prints summed per logical tensor (a tensor's chunks on any ranks, in any order)."""
    out: dict[str, TensorPrint] = {}
    for part in parts:
        for name, p in part.items():
            q = out.get(name)
            if q is None:
                out[name] = p
                continue
            if q.shape != p.shape or q.dtype != p.dtype:
                raise ValueError(f"state print of {name}: ranks hold chunks of shape {list(q.shape)} {q.dtype} and "
                                 f"{list(p.shape)} {p.dtype}")
            out[name] = TensorPrint(shape=q.shape, dtype=q.dtype, count=q.count + p.count,
                                    hash=(q.hash + p.hash) & _MASK, sum_sq=q.sum_sq + p.sum_sq,
                                    abs_max=max(q.abs_max, p.abs_max), nonfinite=q.nonfinite + p.nonfinite)
    return out


def gather_prints(mine: Mapping[str, TensorPrint], values: Mapping[str, Any], group: Any = None) -> StatePrint:
    """The whole state's print from every rank's part (collective over `group`; every rank gets it).
    `values` from every rank are merged; a value two ranks hold differently is kept per rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ({k: v.as_dict() | {"sum_sq": v.sum_sq, "hash": v.hash}
                                       for k, v in mine.items()}, dict(values)), group=group)
    parts = [{k: TensorPrint(shape=tuple(v["shape"]), dtype=v["dtype"], count=v["count"], hash=v["hash"],
                             sum_sq=v["sum_sq"], abs_max=v["abs_max"], nonfinite=v["nonfinite"])
              for k, v in tensors.items()} for tensors, _ in gathered]
    merged: dict[str, Any] = {}
    for rank, (_, vals) in enumerate(gathered):
        for k, v in vals.items():
            if k not in merged:
                merged[k] = v
            elif merged[k] != v:
                merged[f"{k}@rank{rank}"] = v
    return StatePrint(tensors=combine(parts), values=merged)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def _tensor_difference(name: str, t: TensorPrint, b: TensorPrint) -> str | None:
    if t.shape != b.shape:
        return f"{name}: shape {list(t.shape)} in the target, {list(b.shape)} in the baseline"
    if t.dtype != b.dtype:
        return f"{name}: dtype {t.dtype} in the target, {b.dtype} in the baseline"
    full = math.prod(t.shape)
    if t.count != b.count or t.count != full:
        return (f"{name}: {t.count} element(s) loaded in the target, {b.count} in the baseline, of {full} "
                f"(a chunk missing or loaded twice)")
    if t.hash == b.hash:
        return None
    return (f"{name} {list(t.shape)} {t.dtype}: values or their positions differ: norm target {t.norm:.9g} "
            f"baseline {b.norm:.9g} (relative {_rel(t.norm, b.norm):.3g}), max |x| target {t.abs_max:.6g} baseline "
            f"{b.abs_max:.6g}, non-finite target {t.nonfinite} baseline {b.nonfinite}")


def differences(target: StatePrint, baseline: StatePrint) -> list[str]:
    """Each logical tensor and value where the target's loaded state is not the baseline's, in name
    order (tensors first); empty when every element and value agrees exactly."""
    out = []
    for name in sorted(set(target.tensors) | set(baseline.tensors)):
        t, b = target.tensors.get(name), baseline.tensors.get(name)
        if t is None or b is None:
            out.append(f"{name}: loaded only in the {'baseline' if t is None else 'target'}")
            continue
        problem = _tensor_difference(name, t, b)
        if problem:
            out.append(problem)
    for name in sorted(set(target.values) | set(baseline.values)):
        t, b = target.values.get(name, "<absent>"), baseline.values.get(name, "<absent>")
        if t != b:
            out.append(f"{name}: target {t!r} baseline {b!r}")
    return out
