"""The pure planner: (source index, target spec) -> frozen copy items. No tensor data is touched.

Call sequence: a reader builds the source `CheckpointIndex`; the target format's writer turns it and
the target layout into a `TargetSpec` (target index + the files it will write, with their buffers);
`make_plan` matches chunks of equal tensor keys and returns a `ConversionPlan`, which the executor
consumes and `summarize` prints.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint.errors import PlanError
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey, dtype_size
from checkpoint.overlap import box_as_flat_range, box_overlap, global_flat_range, range_overlap


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetBuffer:
    """A tensor the executor allocates (zero-filled) in a target file and fills from copy items."""

    key: KeyPath
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetFile:
    """One file the writer produces: path relative to the destination, writer-defined role, rank."""

    path: str
    role: str
    rank: int | None
    buffers: tuple[TargetBuffer, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetSpec:
    """What a writer will produce: the target index (chunks point into `files`) and the files.

    `commit`: the relative paths of the files a loader starts from (DeepSpeed's `latest`, DCP's `.metadata`,
    Megatron's `metadata.json`), among `files` or the writer's `finalize` output; the executor writes them
    last, after every other file and the manifest, so a crash never leaves one pointing at missing data.
    """

    index: CheckpointIndex
    files: tuple[TargetFile, ...]
    commit: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyItem:
    """Copy one region of a source chunk into a target chunk.

    `flat` = (source element, target element, length) in the flattened stored tensors; otherwise
    `narrows` = (dim, offset in source box, offset in target box, length) per dim.
    """

    tensor: TensorKey
    src: ChunkRef
    dst: ChunkRef
    flat: tuple[int, int, int] | None
    narrows: tuple[tuple[int, int, int, int], ...] | None
    numel: int
    cast: bool = False  # source kind differs (param derived from the fp32 master)


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionPlan:
    """Frozen result of planning; printable with `summarize`."""

    source: CheckpointIndex
    target: TargetSpec
    items: tuple[CopyItem, ...]
    src_dtypes: Mapping[TensorKey, str] = field(default_factory=dict)

    def items_by_file(self) -> dict[str, list[CopyItem]]:
        out: dict[str, list[CopyItem]] = defaultdict(list)
        for it in self.items:
            out[it.dst.file].append(it)
        return dict(out)


def source_for(key: TensorKey, dtype: str, source: Mapping[TensorKey, TensorEntry]) -> tuple[TensorEntry, bool]:
    """The source tensor a target tensor (key, dtype) is copied from, and whether the copy casts.

    A param is taken from the fp32 master when the source param is missing or of another dtype
    (bf16 training: the target wants fp32 weights); an fp32 master from an fp32 param (formats that
    keep no separate master, e.g. DCP/FSDP2 in fp32).
    """
    own = source.get(key)
    if own is not None and (own.dtype == dtype or key.kind is not Kind.PARAM):
        return own, False
    if key.kind is Kind.PARAM:
        master = source.get(TensorKey(name=key.name, kind=Kind.MASTER))
        if master is not None:
            return master, True
    if key.kind is Kind.MASTER:
        param = source.get(TensorKey(name=key.name, kind=Kind.PARAM))
        if param is not None and param.dtype == "float32":
            return param, False
    if own is not None:
        return own, False
    present = sorted(str(k.kind) for k in source if k.name == key.name)
    raise PlanError(f"target needs tensor {key} but the source has no such tensor "
                    f"(kinds present for {key.name!r}: {present or 'none'})")


def _overlap(entry: TensorEntry, src: ChunkRef, dst: ChunkRef) -> tuple[tuple[int, int, int] | None,
                                                                      tuple[tuple[int, int, int, int], ...] | None, int]:
    if src.flat_range is None and dst.flat_range is None:
        narrows = box_overlap(src.offsets, src.lengths, dst.offsets, dst.lengths)
        return None, narrows, (0 if narrows is None else math.prod(n[3] for n in narrows))
    s = global_flat_range(src.offsets, src.lengths, entry.shape, src.flat_range)
    d = global_flat_range(dst.offsets, dst.lengths, entry.shape, dst.flat_range)
    if s is None or d is None:
        raise PlanError(f"{entry.key}: cannot map a flat-sharded chunk onto a non-contiguous box "
                        f"(source {src.file} box {src.offsets}+{src.lengths}, target {dst.file} box "
                        f"{dst.offsets}+{dst.lengths}, shape {entry.shape})")
    ov = range_overlap(s, d)
    if ov is None:
        return None, None, 0
    n = ov[1] - ov[0]
    return (src.storage_offset + ov[0] - s[0], dst.storage_offset + ov[0] - d[0], n), None, n


def contiguous_parts(chunk: ChunkRef, shape: tuple[int, ...]) -> tuple[ChunkRef, ...]:
    """A box chunk that is not contiguous in the global `shape` (e.g. a column slice of a row-parallel
    weight) as its row-major contiguous runs: same file and key, storage offsets advanced. Flat-sharded
    and contiguous chunks come back unchanged. Lets a box meet a flat (ZeRO) chunk, row by row."""
    if chunk.flat_range is not None or box_as_flat_range(chunk.offsets, chunk.lengths, shape) is not None:
        return (chunk,)
    j = max(d for d in range(len(shape)) if chunk.lengths[d] != shape[d])
    run = math.prod(chunk.lengths[j:])
    out = []
    for k, idx in enumerate(itertools.product(*(range(n) for n in chunk.lengths[:j]))):
        out.append(ChunkRef(file=chunk.file, key=chunk.key,
                            offsets=(*(o + i for o, i in zip(chunk.offsets, idx)), *chunk.offsets[j:]),
                            lengths=(*(1,) * j, *chunk.lengths[j:]), storage_offset=chunk.storage_offset + k * run))
    return tuple(out)


def make_plan(source: CheckpointIndex, target: TargetSpec) -> ConversionPlan:
    """Match every target chunk with the source chunks that overlap it; raise PlanError on any gap.

    Pure: reads only the two indexes. Every target element must be covered exactly once.
    """
    src_entries = source.by_key()
    target_files = {f.path for f in target.files}
    items: list[CopyItem] = []
    src_dtypes: dict[TensorKey, str] = {}
    for entry in target.index.entries:
        src_entry, cast = source_for(entry.key, entry.dtype, src_entries)
        if src_entry.shape != entry.shape:
            raise PlanError(f"{entry.key}: source shape {src_entry.shape} != target shape {entry.shape}")
        if src_entry.dtype != entry.dtype and not cast:
            raise PlanError(f"{entry.key}: source dtype {src_entry.dtype} != target dtype {entry.dtype}")
        src_dtypes[entry.key] = src_entry.dtype
        for dst in entry.chunks:
            if dst.file not in target_files:
                raise PlanError(f"{entry.key}: target chunk in {dst.file}, which the writer does not produce")
            covered = 0
            dst_parts: tuple[ChunkRef, ...] | None = None  # dst split into contiguous runs, when a flat chunk meets it
            for src_chunk in src_entry.chunks:
                mixed = (src_chunk.flat_range is None) != (dst.flat_range is None)
                if mixed and dst_parts is None:
                    dst_parts = contiguous_parts(dst, entry.shape)
                for src in (contiguous_parts(src_chunk, entry.shape) if mixed else (src_chunk,)):
                    for dst_part in (dst_parts if mixed else (dst,)):
                        flat, narrows, n = _overlap(entry, src, dst_part)
                        if n:
                            items.append(CopyItem(tensor=entry.key, src=src, dst=dst_part, flat=flat,
                                                  narrows=narrows, numel=n, cast=cast))
                            covered += n
            if covered != dst.numel:
                raise PlanError(f"{entry.key}: target chunk in {dst.file} (box {dst.offsets}+{dst.lengths}, "
                                f"flat {dst.flat_range}) needs {dst.numel} elements, the source covers {covered}")
    return ConversionPlan(source=source, target=target, items=tuple(items), src_dtypes=src_dtypes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSummary:
    rank: int | None
    files: tuple[str, ...]
    bytes_written: int
    bytes_read: int


def rank_summaries(plan: ConversionPlan) -> list[RankSummary]:
    """Files, bytes written (tensor buffers) and bytes read (copied regions) per target rank."""
    by_file = plan.items_by_file()
    ranks: dict[int | None, list[Any]] = defaultdict(list)
    for f in plan.target.files:
        ranks[f.rank].append(f)
    out = []
    for rank in sorted(ranks, key=lambda r: -1 if r is None else r):
        files = ranks[rank]
        read = sum(it.numel * dtype_size(plan.src_dtypes[it.tensor]) for f in files for it in by_file.get(f.path, ()))
        out.append(RankSummary(rank=rank, files=tuple(f.path for f in files),
                               bytes_written=sum(f.nbytes for f in files), bytes_read=read))
    return out


def summarize(plan: ConversionPlan) -> str:
    """Human-readable plan: per target rank its files and bytes read/written, plus totals and drops."""
    lines = [f"plan: {plan.source.format} ({plan.source.root}) -> {plan.target.index.format}",
             f"  {len(plan.target.index.entries)} target tensors, {len(plan.items)} copy items, "
             f"{len(plan.target.files)} files"]
    for s in rank_summaries(plan):
        who = "shared" if s.rank is None else f"rank {s.rank}"
        lines.append(f"  {who}: {len(s.files)} files, read {_fmt(s.bytes_read)}, write {_fmt(s.bytes_written)}")
        lines.extend(f"    {p}" for p in s.files)
    dropped = sorted({str(e.key.kind) for e in plan.source.entries} - {str(e.key.kind) for e in plan.target.index.entries})
    if dropped:
        lines.append(f"  source kinds not in the target format: {', '.join(dropped)}")
    if not plan.target.index.meta.get("weights_only") and not any(
            e.key.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ) for e in plan.source.entries):
        lines.append("  optimizer state: ABSENT in the source (weights only): the target holds no Adam moments "
                     "or step; training resumes with a fresh optimizer")
    if note := plan.target.index.meta.get("start_note"):
        lines.append(f"  target: {note}")
    if named := plan.source.meta.get("source_param_naming"):
        lines.append(f"  parameter names: {named} -> {plan.source.meta['param_naming']} (name table)")
    for d in plan.target.index.meta.get("trainer_rng") or ():
        lines.append(f"  Trainer RNG file of process {d['target_rank']}: {d['policy']} ({d['reason']})")
    derived = sorted({it.tensor.name for it in plan.items if it.cast})
    if derived:
        lines.append(f"  {len(derived)} params derived from the fp32 master (cast)")
    return "\n".join(lines)


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
