"""The pure planner: (source index, target spec) -> frozen copy items. No tensor data is touched.

Call sequence: a reader builds the source `CheckpointIndex`; the target format's writer turns it and
the target layout into a `TargetSpec` (target index + the files it will write, with their buffers);
`make_plan` matches chunks of equal tensor keys and returns a `ConversionPlan`, which the executor
consumes and `summarize` prints.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey, dtype_size
from checkpoint.overlap import box_as_flat_range, box_overlap, box_range_pieces, global_flat_range, range_overlap


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetBuffer:
    """A tensor the executor allocates (zero-filled) in a target file and fills from copy items."""

    key: KeyPath
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


class ValueRole(enum.StrEnum):
    """What a planned value (not a tensor chunk) is to the target's loader."""

    STEP = "step"  # Adam's per-parameter step derived from a per-group one (a 0-d tensor)
    RNG = "rng"  # random-generator states
    COMMON = "common"  # the run's shared state: iteration, param groups, scheduler, FLOP count, ours
    ARGS = "args"  # the training arguments (Megatron-LM's args)
    OBJECT = "object"  # any other stored value: a train state, a dataloader position, a module's extra state


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceBytes:
    """A stored value copied byte for byte: `length` bytes at `offset` of the source file `path` (absolute)."""

    path: str
    offset: int
    length: int

    def read(self) -> bytes:
        """The bytes; raises CheckpointFormatError when the file ends before `offset + length`."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.length)
        if len(data) != self.length:
            raise CheckpointFormatError(f"{self.path}: a stored value at byte {self.offset} is truncated: "
                                        f"{len(data)} of {self.length} bytes")
        return data


@dataclass(frozen=True, kw_only=True, eq=False)
class ValueItem:
    """A value a target file stores at `key` that is not a tensor chunk, planned as DCP's planner plans a
    BYTE_IO item: given (`value`: a Python object, or a whole tensor) or copied from a source (`copy`).
    Compared by identity (values may be unhashable)."""

    key: KeyPath
    role: ValueRole
    value: Any = None
    copy: SourceBytes | None = None

    def __repr__(self) -> str:
        held = f"copy={self.copy!r}" if self.copy is not None else f"value={self.value!r}"
        return f"ValueItem(key={self.key!r}, role={self.role.value}, {held})"


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetFile:
    """One file the writer produces: path relative to the destination, writer-defined role, rank, the tensor
    buffers the plan fills and the values it stores beside them."""

    path: str
    role: str
    rank: int | None
    buffers: tuple[TargetBuffer, ...] = ()
    values: tuple[ValueItem, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class WriteMode(enum.Enum):
    """How the executor builds each target file from its buffers, and what that costs in memory."""

    IN_MEMORY = "in_memory"
    """Every buffer is filled, then the object `assemble` returns is saved. Peak: the whole file. For files
    whose content the writer derives or rearranges (not only copies)."""
    IN_PLACE = "in_place"
    """`assemble` returns a torch-saveable object holding every buffer unchanged at its key path; the
    executor saves it without tensor data and streams each copy item into its place in the file (kernel
    file-to-file copies where possible). Peak: the largest tensor."""
    STREAMING = "streaming"
    """`assemble` gets a mapping that fills a buffer when it is looked up (anew each time, nothing kept) and
    returns a `StreamPayload` that writes each buffer before looking up the next. Peak: the largest tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetSpec:
    """What a writer will produce: the target index (chunks point into `files`), the files, and how the
    executor builds them (`write_mode`).

    `commit`: the relative paths of the files a loader starts from (DeepSpeed's `latest`, DCP's `.metadata`,
    Megatron's `metadata.json`), among `files` or the writer's `finalize` output; the executor writes them
    last, after every other file and the manifest, in this order, so a crash never leaves one pointing at
    missing data.
    `described`: files the coordinator writes from their values once every worker returned, on every node
    (Megatron's `common.pt` and tracker); not among `files`, whose workers write them on their rank's node.
    """

    index: CheckpointIndex
    files: tuple[TargetFile, ...]
    commit: tuple[str, ...] = ()
    described: tuple[TargetFile, ...] = ()
    write_mode: WriteMode = WriteMode.IN_MEMORY


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyItem:
    """Copy one region of a source chunk into a target chunk.

    `flat` = (source element, target element, length) in the flattened stored tensors; or
    `narrows` = (dim, offset in source box, offset in target box, length) per dim between two boxes; or
    `region` = (global offset, length) per dim of a box of the global tensor of `global_shape` that one side
    stores as a box and the other as a flat range of the row-major order (a column slice meeting a ZeRO
    partition): each side views it as a narrowed box or as a strided window of its flat range.
    """

    tensor: TensorKey
    src: ChunkRef
    dst: ChunkRef
    flat: tuple[int, int, int] | None
    narrows: tuple[tuple[int, int, int, int], ...] | None
    numel: int
    cast: bool = False  # source kind differs (param derived from the fp32 master)
    region: tuple[tuple[int, int], ...] | None = None
    global_shape: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ConversionPlan:
    """Frozen result of planning; printable with `summarize`.

    `make_plan` checks everything before any byte moves (every target tensor's source, shape and dtype, the
    source chunks tiling it, the target files); the copy items of one target file are computed when the
    executor (or `items`) asks for them (`items_for`, pure, memoized), so a plan of millions of items needs
    none of them in memory to be printed or checked. `fixed_items` holds items given whole instead."""

    source: CheckpointIndex
    target: TargetSpec
    src_dtypes: Mapping[TensorKey, str] = field(default_factory=dict)
    sources: Mapping[TensorKey, tuple[TensorEntry, bool]] = field(default_factory=dict)  # target key -> (source, cast)
    fixed_items: tuple[CopyItem, ...] | None = None
    _memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def chunks_by_file(self) -> dict[str, list[tuple[TensorEntry, ChunkRef]]]:
        """Every target chunk with its tensor, by the file it is written to (memoized)."""
        found = self._memo.get("\0chunks")
        if found is None:
            by_file: dict[str, list[tuple[TensorEntry, ChunkRef]]] = defaultdict(list)
            for entry in self.target.index.entries:
                for chunk in entry.chunks:
                    by_file[chunk.file].append((entry, chunk))
            found = dict(by_file)
            self._memo["\0chunks"] = found
        return found

    def items_for(self, path: str) -> tuple[CopyItem, ...]:
        """The copy items that fill target file `path` (raises PlanError on a chunk not covered exactly)."""
        if self.fixed_items is not None:
            return tuple(it for it in self.fixed_items if it.dst.file == path)
        if path not in self._memo:
            self._memo[path] = tuple(file_items(self, path))
        return self._memo[path]

    def items_by_file(self) -> dict[str, list[CopyItem]]:
        if self.fixed_items is not None:
            out: dict[str, list[CopyItem]] = defaultdict(list)
            for it in self.fixed_items:
                out[it.dst.file].append(it)
            return dict(out)
        return {f.path: list(items) for f in self.target.files if (items := self.items_for(f.path))}

    @property
    def items(self) -> tuple[CopyItem, ...]:
        """Every copy item, target file by target file."""
        if self.fixed_items is not None:
            return self.fixed_items
        return tuple(it for f in self.target.files for it in self.items_for(f.path))

    @property
    def target_chunks(self) -> int:
        return sum(len(e.chunks) for e in self.target.index.entries)


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


def _region_items(entry: TensorEntry, src: ChunkRef, dst: ChunkRef, cast: bool) -> list[CopyItem]:
    """A plain box (not contiguous in the global tensor) against a flat chunk: the box's elements inside
    the flat chunk's global range, as at most 2 * ndim - 1 region items (`box_range_pieces`)."""
    box, flat = (src, dst) if dst.flat_range is not None else (dst, src)
    span = global_flat_range(flat.offsets, flat.lengths, entry.shape, flat.flat_range)
    if span is None or box.flat_range is not None:
        raise PlanError(f"{entry.key}: cannot map a flat-sharded chunk onto a non-contiguous box "
                        f"(source {src.file} box {src.offsets}+{src.lengths} flat {src.flat_range}, target {dst.file} "
                        f"box {dst.offsets}+{dst.lengths} flat {dst.flat_range}, shape {entry.shape})")
    return [CopyItem(tensor=entry.key, src=src, dst=dst, flat=None, narrows=None, numel=math.prod(lengths),
                     cast=cast, region=tuple(zip(offsets, lengths)), global_shape=entry.shape)
            for offsets, lengths in box_range_pieces(box.offsets, box.lengths, entry.shape, *span)]


def make_plan(source: CheckpointIndex, target: TargetSpec) -> ConversionPlan:
    """Check that every target element has exactly one source element and return the plan; raise PlanError
    naming the tensor otherwise.

    Pure: reads only the two indexes. Each target tensor's source (`source_for`) must have its shape and
    dtype (or be the fp32 master it is cast from) and chunks that tile it (their elements add up to the
    tensor's); every target chunk must lie in a file the writer produces. Copy items are computed per target
    file (`file_items`), which checks again that each target chunk is covered exactly once."""
    src_entries = source.by_key()
    target_files = {f.path for f in target.files}
    src_dtypes: dict[TensorKey, str] = {}
    sources: dict[TensorKey, tuple[TensorEntry, bool]] = {}
    tiled: set[TensorKey] = set()
    for entry in target.index.entries:
        src_entry, cast = source_for(entry.key, entry.dtype, src_entries)
        if src_entry.shape != entry.shape:
            raise PlanError(f"{entry.key}: source shape {src_entry.shape} != target shape {entry.shape}")
        if src_entry.dtype != entry.dtype and not cast:
            raise PlanError(f"{entry.key}: source dtype {src_entry.dtype} != target dtype {entry.dtype}")
        if src_entry.key not in tiled:
            held = sum(c.numel for c in src_entry.chunks)
            if held != src_entry.numel:  # name the first target chunk it leaves short, as the copy would
                found = _source_chunks(src_entry)
                for dst in entry.chunks:
                    _, covered = _chunk_items(entry, dst, found, cast)
                    if covered != dst.numel:
                        raise PlanError(_short(entry, dst, covered) + f" (the source's {len(src_entry.chunks)} "
                                        f"chunks hold {held} of the tensor's {src_entry.numel} elements)")
                raise PlanError(f"{src_entry.key}: the source's {len(src_entry.chunks)} chunks hold {held} of the "
                                f"tensor's {src_entry.numel} elements (shape {src_entry.shape}): "
                                f"{'some are missing' if held < src_entry.numel else 'some overlap'}")
            tiled.add(src_entry.key)
        for dst in entry.chunks:
            if dst.file not in target_files:
                raise PlanError(f"{entry.key}: target chunk in {dst.file}, which the writer does not produce")
        src_dtypes[entry.key] = src_entry.dtype
        sources[entry.key] = (src_entry, cast)
    return ConversionPlan(source=source, target=target, src_dtypes=src_dtypes, sources=sources)


@dataclass(frozen=True, slots=True)
class _SourceChunks:
    """A source tensor's chunks with what matching needs of each, computed once: the global row-major
    span a contiguous (or flat) chunk covers, and the chunks sorted by it for a bisect."""

    flat: tuple[tuple[int, int, ChunkRef], ...]  # (start, end, chunk) of chunks contiguous in the tensor
    starts: tuple[int, ...]
    boxes: tuple[ChunkRef, ...]  # chunks not contiguous in the tensor (a column slice)


def _source_chunks(entry: TensorEntry) -> _SourceChunks:
    flat, boxes = [], []
    for c in entry.chunks:
        span = global_flat_range(c.offsets, c.lengths, entry.shape, c.flat_range)
        if span is None:
            boxes.append(c)
        else:
            flat.append((span[0], span[1], c))
    flat.sort(key=lambda t: t[0])
    return _SourceChunks(flat=tuple(flat), starts=tuple(t[0] for t in flat), boxes=tuple(boxes))


def _short(entry: TensorEntry, dst: ChunkRef, covered: int) -> str:
    return (f"{entry.key}: target chunk in {dst.file} (box {dst.offsets}+{dst.lengths}, flat {dst.flat_range}) "
            f"needs {dst.numel} elements, the source covers {covered}")


def _chunk_items(entry: TensorEntry, dst: ChunkRef, found: _SourceChunks, cast: bool) -> tuple[list[CopyItem], int]:
    """The items that fill target chunk `dst` from the source chunks that overlap it (found by bisect on
    their spans), and how many elements they cover."""
    span = global_flat_range(dst.offsets, dst.lengths, entry.shape, dst.flat_range)
    if span is None:  # a box not contiguous in the tensor: every source chunk may meet it
        candidates = [c for _, _, c in found.flat] + list(found.boxes)
    else:
        first = max(bisect.bisect_right(found.starts, span[0]) - 1, 0)
        candidates = [c for _, _, c in found.flat[first:bisect.bisect_left(found.starts, span[1])]] + list(found.boxes)
    items: list[CopyItem] = []
    covered = 0
    for src in candidates:
        mixed = (src.flat_range is None) != (dst.flat_range is None)
        box = src if src.flat_range is None else dst
        if mixed and box_as_flat_range(box.offsets, box.lengths, entry.shape) is None:
            pieces = _region_items(entry, src, dst, cast)
            items += pieces
            covered += sum(it.numel for it in pieces)
            continue
        flat, narrows, n = _overlap(entry, src, dst)
        if n:
            items.append(CopyItem(tensor=entry.key, src=src, dst=dst, flat=flat, narrows=narrows, numel=n, cast=cast))
            covered += n
    return items, covered


def file_items(plan: ConversionPlan, path: str) -> list[CopyItem]:
    """The copy items of target file `path` (pure), raising PlanError unless each of its target chunks is
    covered exactly once."""
    cache: dict[TensorKey, _SourceChunks] = {}
    items: list[CopyItem] = []
    for entry, dst in plan.chunks_by_file().get(path, ()):
        src_entry, cast = plan.sources[entry.key]
        found = cache.get(src_entry.key)
        if found is None:
            found = cache[src_entry.key] = _source_chunks(src_entry)
        chunk_items, covered = _chunk_items(entry, dst, found, cast)
        if covered != dst.numel:
            raise PlanError(_short(entry, dst, covered))
        items += chunk_items
    return items


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSummary:
    rank: int | None
    files: tuple[str, ...]
    bytes_written: int
    bytes_read: int


def bytes_read_by_file(plan: ConversionPlan) -> dict[str, int]:
    """{target file: the source bytes its chunks take (elements in the source's dtype)}; needs no copy item."""
    read_by_file: dict[str, int] = defaultdict(int)
    if plan.fixed_items is not None:
        for it in plan.fixed_items:
            read_by_file[it.dst.file] += it.numel * dtype_size(plan.src_dtypes.get(it.tensor, "float32"))
    else:
        for path, chunks in plan.chunks_by_file().items():
            read_by_file[path] = sum(c.numel * dtype_size(plan.src_dtypes[e.key]) for e, c in chunks)
    return dict(read_by_file)


def rank_summaries(plan: ConversionPlan) -> list[RankSummary]:
    """Files, bytes written (tensor buffers) and bytes read (the source elements each target chunk takes, in
    the source's dtype) per target rank; needs no copy item."""
    ranks: dict[int | None, list[Any]] = defaultdict(list)
    for f in plan.target.files:
        ranks[f.rank].append(f)
    read_by_file = bytes_read_by_file(plan)
    out = []
    for rank in sorted(ranks, key=lambda r: -1 if r is None else r):
        files = ranks[rank]
        out.append(RankSummary(rank=rank, files=tuple(f.path for f in files),
                               bytes_written=sum(f.nbytes for f in files),
                               bytes_read=sum(read_by_file.get(f.path, 0) for f in files)))
    return out


PER_RANK_LISTED = 16  # ranks listed one by one; more are summarized unless asked for
FILES_LISTED = 8  # files listed under one rank unless asked for


def _rank_lines(summaries: list[RankSummary], per_rank: bool) -> list[str]:
    def listing(s: RankSummary) -> list[str]:
        who = "shared" if s.rank is None else f"rank {s.rank}"
        shown = s.files if per_rank else s.files[:FILES_LISTED]
        more = [f"    ... and {len(s.files) - len(shown)} more (--per-rank lists them all)"] if len(shown) < len(s.files) else []
        return [f"  {who}: {len(s.files)} files, read {_fmt(s.bytes_read)}, write {_fmt(s.bytes_written)}",
                *(f"    {p}" for p in shown), *more]

    if per_rank or len(summaries) <= PER_RANK_LISTED:
        return [line for s in summaries for line in listing(s)]
    ranked = [s for s in summaries if s.rank is not None]
    shared = [s for s in summaries if s.rank is None]
    reads, writes = sorted(s.bytes_read for s in ranked), sorted(s.bytes_written for s in ranked)
    largest = sorted(ranked, key=lambda s: -s.bytes_written)[:3]
    lines = [f"  {len(ranked)} target ranks, {max(len(s.files) for s in ranked)} file(s) each at most; "
             f"read min/median/max {_fmt(reads[0])} / {_fmt(reads[len(reads) // 2])} / {_fmt(reads[-1])}, "
             f"write {_fmt(writes[0])} / {_fmt(writes[len(writes) // 2])} / {_fmt(writes[-1])}",
             "  largest: " + ", ".join(f"rank {s.rank} writes {_fmt(s.bytes_written)}" for s in largest)
             + " (--per-rank lists every rank and its files)"]
    for s in shared:
        lines += listing(s)
    return lines


def summarize(plan: ConversionPlan, *, per_rank: bool = False) -> str:
    """Human-readable plan: per target rank its files and bytes read/written (summarized over more than
    `PER_RANK_LISTED` ranks unless `per_rank`), plus totals and what is dropped or derived."""
    summaries = rank_summaries(plan)
    lines = [f"plan: {plan.source.format} ({plan.source.root}) -> {plan.target.index.format}",
             f"  {len(plan.target.index.entries)} target tensors in {plan.target_chunks} chunks, "
             f"{len(plan.target.files)} files; read {_fmt(sum(s.bytes_read for s in summaries))}, write "
             f"{_fmt(sum(s.bytes_written for s in summaries))}"]
    lines += _rank_lines(summaries, per_rank)
    roles = [v.role.value for f in (*plan.target.files, *plan.target.described) for v in f.values]
    if roles:
        counts = ", ".join(f"{role} {roles.count(role)}" for role in dict.fromkeys(roles))
        lines.append(f"  {len(roles)} values beside the tensors ({counts})")
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
    derived = sorted({key.name for key, (_, cast) in plan.sources.items() if cast} if plan.fixed_items is None
                     else {it.tensor.name for it in plan.fixed_items if it.cast})
    if derived:
        lines.append(f"  {len(derived)} params derived from the fp32 master (cast)")
    return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
