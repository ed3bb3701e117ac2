"""The index of a checkpoint: every logical tensor, its global shape and dtype, and the chunks that hold it.

Readers build an index from metadata only; the planner consumes two indexes (source, target).
Vocabulary: a *tensor* is logical (name + kind); a *chunk* is a stored piece of it: a box in the
global tensor (offsets, lengths) held in one file under one key; for flat-sharded optimizer
buffers (ZeRO, distributed optimizer) only the elements `flat_range` of the box (row-major) are
stored, starting at element `storage_offset` of the stored (flattened) tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from checkpoint.errors import CheckpointFormatError

KeyPath = tuple[Any, ...]  # keys into a stored object: names and indexes (a writer's chunk keys also hold offsets)


class Kind(StrEnum):
    """The kinds of logical tensor the formats give a role: weights, fp32 masters and Adam's state.

    Optimizer state is open data: any other kind is the name of a per-parameter state tensor as the optimizer
    keeps it (SGD's and Muon's `momentum_buffer`, AdamW-amsgrad's `max_exp_avg_sq`, ...), see `state_kind`."""

    PARAM = "param"  # model weights (or buffers) in the model's dtype
    MASTER = "fp32_master"  # fp32 master copy of a parameter
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    STEP = "step"  # optimizer step count of the parameter (a 0-d tensor)


STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # an optimizer state's name: one identifier


def state_kind(name: str) -> Kind | str:
    """The kind of a tensor named `name` in an optimizer's per-parameter state: a `Kind` for the names the
    formats know (`exp_avg`, `step`, ...), else the name itself. Raises CheckpointFormatError for a name that
    cannot be one (empty, dotted: state names are single identifiers in every optimizer's state dict)."""
    if name in Kind._value2member_map_:
        return Kind(name)
    if not isinstance(name, str) or not STATE_NAME.match(name):
        raise CheckpointFormatError(f"optimizer state name {name!r} is not an identifier")
    return name


def is_optimizer_state(kind: Kind | str) -> bool:
    """True for the optimizer's per-parameter state (Adam's moments and step, momentum buffers, ...), False for
    weights and fp32 masters."""
    return kind is not Kind.PARAM and kind is not Kind.MASTER


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class TensorKey:
    """Canonical name + kind of a logical tensor; `kind` is a `Kind` or an optimizer state's own name
    (normalized: a known name is always the `Kind` member, so keys compare and hash alike)."""

    name: str
    kind: Kind | str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", state_kind(self.kind))

    def __str__(self) -> str:
        return f"{self.name}[{self.kind}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkRef:
    """A stored piece of a tensor: file, key path in the loaded object, box, optional flat range."""

    file: str  # path relative to the checkpoint root
    key: KeyPath
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat_range: tuple[int, int] | None = None
    storage_offset: int = 0

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths) or any(v < 0 for v in (*self.offsets, *self.lengths)):
            raise CheckpointFormatError(f"invalid chunk box offsets={self.offsets} lengths={self.lengths}: {self}")
        if self.flat_range is not None:
            lo, hi = self.flat_range
            if not 0 <= lo <= hi <= math.prod(self.lengths):
                raise CheckpointFormatError(
                    f"flat_range {self.flat_range} outside box of {math.prod(self.lengths)} elements: {self}")
        if self.storage_offset < 0:
            raise CheckpointFormatError(f"negative storage_offset {self.storage_offset}: {self}")

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.lengths)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    """One logical tensor: key, global shape, dtype name (e.g. "float32") and its chunks."""

    key: TensorKey
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[ChunkRef, ...]

    def __post_init__(self) -> None:
        for c in self.chunks:
            if len(c.offsets) != len(self.shape) or any(
                    o + n > s for o, n, s in zip(c.offsets, c.lengths, self.shape)):
                raise CheckpointFormatError(
                    f"{self.key}: chunk box offsets={c.offsets} lengths={c.lengths} outside shape {self.shape} "
                    f"(file {c.file})")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    def check_complete(self) -> None:
        """Raise unless the chunks hold every element exactly once (by count; readers emit disjoint chunks)."""
        held = sum(c.numel for c in self.chunks)
        if held != self.numel:
            raise CheckpointFormatError(
                f"{self.key}: chunks hold {held} elements but shape {self.shape} has {self.numel} "
                f"(files: {sorted({c.file for c in self.chunks})})")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointIndex:
    """Everything a planner needs to know about a checkpoint, without its tensor data.

    `meta` holds plain, format-specific non-tensor state (step counters, scheduler, client state,
    optimizer hyper-parameters, precision) that writers carry over.
    """

    format: str
    root: str
    entries: tuple[TensorEntry, ...]
    files: tuple[str, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[TensorKey] = set()
        for e in self.entries:
            if e.key in seen:
                raise CheckpointFormatError(f"{self.root}: tensor {e.key} listed twice in the index")
            seen.add(e.key)

    def by_key(self) -> dict[TensorKey, TensorEntry]:
        return {e.key: e for e in self.entries}

    def kinds(self) -> list[str]:
        return sorted({str(e.key.kind) for e in self.entries})

    def dtypes(self) -> list[str]:
        return sorted({e.dtype for e in self.entries})

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


_DTYPE_SIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def dtype_size(name: str) -> int:
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise CheckpointFormatError(f"unknown dtype {name!r}; known: {sorted(_DTYPE_SIZES)}") from None
