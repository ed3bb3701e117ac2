"""The streaming executor: runs a ConversionPlan, writing each target file once, atomically.

Call sequence (coordinator = the caller of `execute`):
1. coordinator: check the destination is absent or empty, create it;
2. workers (by default two threads of this process for in-place/streaming targets, else inline; a
   local process pool, or any `map_fn` such as Ray tasks): for each target file allocate its
   buffers, fill them from memory-mapped source files, let the writer assemble the file's object,
   save it to a temporary name, fsync, rename; return its CRC-32. The target's `WriteMode` says how:
   `IN_PLACE` saves the object without tensor data first and sends each copy item's bytes straight
   to their place in that file (kernel file-to-file copies where possible); `STREAMING` fills
   buffers one at a time, as the writer asks for them, and writes each before the next: either way a
   worker holds at most one tensor. The disk's writeback of each file starts as its bytes
   land (`start_writeback`), so the fsync that ends a file waits for little and the disk works while
   the copies go on. An in-place file's CRC comes from the one pass that fills in its zip records'
   CRCs; any other file is read back once for its CRC;
3. coordinator: let the writer add files that describe the others (`Writer.finalize`, optional: e.g.
   DCP's `.metadata`, which needs every data file's byte offsets), then write `manifest.json`
   (files, sizes, CRC-32), then the files a loader starts from (`TargetSpec.commit`: DeepSpeed's
   `latest`, DCP's `.metadata`, ...), each fsynced, and remove the in-progress marker
   (`checkpoint.destination`): the commit point.
On any error the coordinator removes what it wrote, so nothing that looks complete is left; a crash
(kill -9) or an interrupt (Ctrl-C) leaves the marker, which our readers refuse and `Existing.RESUME`
finishes. The source is
only ever opened read-only.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import math
import mmap
import os
import pickle
import shutil
import struct
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy
import torch

from checkpoint import safe_load
from checkpoint.destination import (INCOMPLETE, MANIFEST, CommitFile, Existing, check_state, close_destination,
                                    fsync_dir, journal, open_destination)
from checkpoint.errors import CheckpointError, CheckpointFormatError, DestinationError, UntrustedCheckpointError
from checkpoint.index import ChunkRef, KeyPath
from checkpoint.overlap import global_flat_range, row_major_strides
from checkpoint.paths import inside
from checkpoint.plan import ConversionPlan, CopyItem, TargetFile, WriteMode

try:  # ISA-L's CRC-32 (carry-less multiply, ~10 GB/s, GIL released); zlib's gives the same values, slower
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the same function
    from zlib import crc32 as _crc32

MANIFEST_VERSION = 2  # 2: a CRC-32 per file (1: sha256; verify_manifest checks either)


class Writer(Protocol):
    """Turns a target file's filled buffers into the object (or bytes) the target framework stores.

    `assemble` returns bytes/str, a `StreamPayload`, or a torch-saveable object. A writer may also
    define `finalize(records, meta) -> {relative path: bytes}`: files the coordinator writes after all
    workers returned (it sees each record's `extra`, what a StreamPayload's `write` returned).
    What `assemble` gets and must return depends on the target's `WriteMode` (`TargetSpec.write_mode`).
    For `IN_PLACE` it returns a torch-saveable object holding every buffer unchanged at its key path
    (`_write_in_place`); 0-d buffers (e.g. Adam's step) are the exception: they arrive filled, and the
    writer may store them as tensors at their key path or as Python numbers. For `STREAMING` it gets
    buffers filled on lookup and returns a `StreamPayload` that looks up each buffer once.
    """

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamPayload:
    """A payload written piece by piece into the open temp file; `write` returns writer-defined extra data."""

    write: Callable[[BinaryIO], Any]


# Key paths that address stored tensors outside a torch.save'd object (see `_Sources.tensor`):
BYTE_RANGE = "@range"  # (BYTE_RANGE, offset, length): one torch.save'd tensor at that byte range (DCP)
SAFETENSORS = "@safetensors"  # (SAFETENSORS, name): tensor `name` of a .safetensors file


MapFn = Callable[[Callable[..., Any], Sequence[tuple[Any, ...]]], list[Any]]


@dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    path: str
    nbytes: int
    crc32: str  # the file's CRC-32 (zlib's), 8 hex digits; empty while a caller computes it
    extra: Any = None  # what the file's StreamPayload returned (for Writer.finalize)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionResult:
    destination: str
    files: tuple[FileRecord, ...]
    seconds: float
    resumed: int = 0  # files an unfinished earlier run had completed, kept (Existing.RESUME)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def resolve_key(obj: Any, key: KeyPath, *, file: str) -> Any:
    """obj[k0][k1]...; a missing key raises CheckpointFormatError naming the file and the path."""
    cur = obj
    for i, k in enumerate(key):
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            raise CheckpointFormatError(f"{file}: key path {list(key[:i + 1])} not found") from None
    return cur


def load_range(path: Path, offset: int, length: int, *, trust_checkpoint: bool = False) -> Any:
    """The object torch.save'd at bytes [offset, offset + length) of `path`, loaded with weights_only=True
    and the allow-list for stored values (`safe_load.OBJECT_GLOBALS`: what DeepSpeed and Megatron store, and
    BytesIO, which torchtitan's train state and Megatron-Core's extra states are); a global outside it raises
    UntrustedCheckpointError naming the file and the global, unless trust_checkpoint."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise CheckpointFormatError(f"{path}: needs bytes [{offset}, {offset + length}) but the file has {size} "
                                        f"(truncated?)")
    needed = safe_load.range_globals(path, offset, length)
    refused = sorted(n for n in needed if n not in safe_load.OBJECT_GLOBALS)
    if refused and not trust_checkpoint:
        raise UntrustedCheckpointError(f"{path}: the object at bytes [{offset}, {offset + length}) needs "
                                       f"{', '.join(refused)} (not in the allow-list of classes that DeepSpeed/"
                                       f"Megatron store); pass trust_checkpoint / --trust-checkpoint if you trust "
                                       f"this file")
    with open(path, "rb") as f:
        try:
            if refused:
                return torch.load(safe_load.window(f, offset, length), map_location="cpu", weights_only=False)
            with safe_load.allowing(needed):
                return torch.load(safe_load.window(f, offset, length), map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
            raise CheckpointFormatError(f"{path}: bytes [{offset}, {offset + length}) unreadable: {err}") from err


class _Sources:
    """Source files opened lazily with mmap (data stays on disk until a region is copied).

    Byte-range keys load one stored tensor, kept in a small cache (at most `cache_bytes`, least
    recently used evicted) since several copy items often read the same stored tensor; safetensors
    keys read the one tensor's bytes at the offsets the file's header gives (no mapping of the file,
    whose touched pages would stay resident).
    """

    def __init__(self, root: Path, trust_checkpoint: bool, cache_bytes: int = 256 << 20) -> None:
        self.root, self.trust = root, trust_checkpoint
        self.cache: dict[str, Any] = {}
        self.ranges: dict[tuple[str, int, int], torch.Tensor] = {}
        self.cache_bytes = cache_bytes

    def close(self) -> None:
        """Drop the loaded files and cached ranges (their mappings are released with them)."""
        self.cache.clear()
        self.ranges.clear()

    @staticmethod
    def mapped(key: KeyPath) -> bool:
        """Whether `tensor(file, key)` is a view of a memory-mapped torch file (pages can be released)."""
        return not (key and key[0] in (BYTE_RANGE, SAFETENSORS))

    def _range(self, file: str, offset: int, length: int) -> torch.Tensor:
        k = (file, offset, length)
        if k in self.ranges:
            self.ranges[k] = self.ranges.pop(k)  # most recently used last
            return self.ranges[k]
        t = load_range(self.root / file, offset, length)
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{self.root / file}: bytes [{offset}, {offset + length}) hold "
                                        f"{type(t).__name__}, not a tensor")
        self.ranges[k] = t
        while len(self.ranges) > 1 and sum(v.untyped_storage().nbytes() for v in self.ranges.values()) > \
                self.cache_bytes:
            self.ranges.pop(next(iter(self.ranges)))
        return t

    def tensor(self, file: str, key: KeyPath) -> torch.Tensor:
        if key and key[0] == BYTE_RANGE:
            return self._range(file, int(key[1]), int(key[2]))
        if key and key[0] == SAFETENSORS:
            if file not in self.cache:
                self.cache[file] = safetensors_header(self.root / file)
            return read_safetensor(self.root / file, self.cache[file], str(key[1]))
        if file not in self.cache:
            self.cache[file] = safe_load.load(self.root / file, mmap=True, trust_checkpoint=self.trust)
        t = resolve_key(self.cache[file], key, file=str(self.root / file))
        if isinstance(t, int) and not isinstance(t, bool):  # a step DeepSpeed's FusedAdam/CPUAdam keep as int
            return torch.tensor(t, dtype=torch.int64)
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{self.root / file}: {list(key)} is {type(t).__name__}, not a tensor")
        return t


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32,
                       "U64": torch.uint64}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The parsed JSON header of a .safetensors file, with `__data_start__`: the byte offset of its data."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointFormatError(f"{path}: header of {n} bytes but the file has {size} (truncated?)")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as err:
        raise CheckpointFormatError(f"{path}: unreadable safetensors header: {err}") from err
    return {**header, "__data_start__": 8 + n}


def read_safetensor(path: Path, header: Mapping[str, Any], name: str) -> torch.Tensor:
    """Tensor `name` of a .safetensors file, read from its byte range into fresh memory."""
    spec = header.get(name)
    if not isinstance(spec, dict) or spec.get("dtype") not in _SAFETENSORS_DTYPES:
        raise CheckpointFormatError(f"{path}: no readable tensor {name!r} in the header ({spec})")
    begin, end = spec["data_offsets"]
    t = torch.empty(spec["shape"], dtype=_SAFETENSORS_DTYPES[spec["dtype"]])
    want = t.numel() * t.element_size()
    if end - begin != want:
        raise CheckpointFormatError(f"{path}: tensor {name!r} spans {end - begin} bytes, shape {spec['shape']} "
                                    f"{spec['dtype']} needs {want}")
    view, pos = bytes_of(t.reshape(-1)), header["__data_start__"] + begin
    with open(path, "rb", buffering=0) as f:
        while len(view):
            got = os.preadv(f.fileno(), [view], pos)
            if got <= 0:
                raise CheckpointFormatError(f"{path}: tensor {name!r} ends past the end of the file (truncated?)")
            view, pos = view[got:], pos + got
    return t


def _region(t: torch.Tensor, ref_offset: int, numel: int, *, where: str) -> torch.Tensor:
    flat = t.reshape(-1)
    if ref_offset + numel > flat.numel():
        raise CheckpointFormatError(f"{where}: needs elements [{ref_offset}, {ref_offset + numel}) but the stored "
                                    f"tensor has {flat.numel()} (shape {tuple(t.shape)})")
    return flat[ref_offset:ref_offset + numel]


def bytes_of(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-d tensor, without a copy."""
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor from calloc'd memory (untouched pages cost nothing; big ones go back to the
    system when freed) rather than torch's fill, which wakes its whole thread pool for every buffer."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(numpy.zeros(max(nbytes, 1), dtype=numpy.uint8))[:nbytes].view(dtype).reshape(tuple(shape))


def _copy_bytes(src: torch.Tensor, s: int, dst: torch.Tensor, d: int, n: int) -> bool:
    """dst.flat[d:d+n] = src.flat[s:s+n] as one memcpy (no thread pool) when both are contiguous and of
    one dtype; False (nothing copied) otherwise. Callers check the bounds."""
    if src.dtype != dst.dtype or not src.is_contiguous() or not dst.is_contiguous():
        return False
    size = src.element_size()
    out = dst.reshape(-1).view(torch.uint8).numpy()
    out[d * size:(d + n) * size] = src.reshape(-1).view(torch.uint8).numpy()[s * size:(s + n) * size]
    return True


def _region_view(stored: torch.Tensor, chunk: ChunkRef, item: CopyItem, *, where: str) -> torch.Tensor:
    """One side of a region item: the region as a narrowed box of a box chunk, or as a strided window (the
    global tensor's row-major strides) of a flat chunk's range."""
    assert item.region is not None and item.global_shape is not None
    whole = _region(stored, chunk.storage_offset, chunk.numel, where=where)
    offsets, lengths = zip(*item.region) if item.region else ((), ())
    if chunk.flat_range is None:
        view = whole.view(chunk.lengths)
        for dim, (o, n) in enumerate(item.region):
            view = view.narrow(dim, o - chunk.offsets[dim], n)
        return view
    strides = row_major_strides(item.global_shape)
    span = global_flat_range(chunk.offsets, chunk.lengths, item.global_shape, chunk.flat_range)
    assert span is not None
    first = sum(o * s for o, s in zip(offsets, strides)) - span[0]
    return whole.as_strided(tuple(lengths), strides, whole.storage_offset() + first)


def copy_item(item: CopyItem, src: torch.Tensor, dst: torch.Tensor, *, src_where: str) -> None:
    """Copy one item's region from the stored source tensor into the target buffer."""
    if item.region is not None:
        sview = _region_view(src, item.src, item, where=f"{src_where} {list(item.src.key)} ({item.tensor})")
        _region_view(dst, item.dst, item, where=f"target {item.dst.file} {list(item.dst.key)}").copy_(sview)
        return
    if item.flat is not None:
        s, d, n = item.flat
        dview = _region(dst, d, n, where=f"target {item.dst.file} {list(item.dst.key)}")
        sview = _region(src, s, n, where=f"{src_where} {list(item.src.key)} ({item.tensor})")
        if not _copy_bytes(src, s, dst, d, n):
            dview.copy_(sview)
        return
    run = _box_run(item)
    if run is not None and run[0] + run[2] <= src.numel() and run[1] + run[2] <= dst.numel() and \
            _copy_bytes(src, run[0], dst, run[1], run[2]):
        return
    sview = _region(src, item.src.storage_offset, item.src.numel, where=f"{src_where} {list(item.src.key)}")
    dview = _region(dst, item.dst.storage_offset, item.dst.numel, where=f"target {item.dst.file}")
    sview, dview = sview.view(item.src.lengths), dview.view(item.dst.lengths)
    for dim, so, do, n in item.narrows or ():
        sview, dview = sview.narrow(dim, so, n), dview.narrow(dim, do, n)
    dview.copy_(sview)


_CHECKSUM_BLOCK = 4 << 20  # bytes read per CRC step: fixed memory, whatever the file


def _crc_range(fd: int, start: int, end: int, value: int = 0) -> int:
    """CRC-32 of bytes [start, end) of an open file, continuing from `value`."""
    buf = bytearray(min(_CHECKSUM_BLOCK, max(end - start, 1)))
    view = memoryview(buf)
    while start < end:
        n = os.preadv(fd, [view[:min(len(buf), end - start)]], start)
        if n <= 0:
            raise OSError(f"read {n} bytes at {start} with {end - start} left (file shrank?)")
        value, start = _crc32(view[:n], value), start + n
    return value


def file_crc32(path: Path) -> str:
    """CRC-32 (zlib's polynomial, as zip files use) of a file, as 8 hex digits."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return f"{_crc_range(fd, 0, os.fstat(fd).st_size):08x}"
    finally:
        os.close(fd)


_CRC_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order), as zlib's crc32_combine computes it."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n, k = n >> 1, k + 1
    return _multmodp(p, crc1) ^ crc2


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHECKSUM_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, payload: Any, *, checksum: bool = True) -> FileRecord:
    """Write bytes/str, a StreamPayload or a torch-saveable object to a temp name, fsync, rename; return
    its record (`checksum=False`: with an empty crc32, for the caller to fill)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with io.BufferedWriter(_WritebackFile(tmp)) as f:
            extra = None
            if isinstance(payload, (bytes, str)):
                f.write(payload.encode() if isinstance(payload, str) else payload)
            elif isinstance(payload, StreamPayload):
                extra = payload.write(f)
            else:
                torch.save(payload, f, pickle_module=safe_load.PICKLE_MODULE)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise DestinationError(f"{path}: write failed ({err.strerror or err}); disk full or not writable?") from err
    return FileRecord(path=str(path), nbytes=path.stat().st_size, crc32=file_crc32(path) if checksum else "",
                      extra=extra)


def write_target_file(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str,
                      writer: Writer, mode: WriteMode, meta: Mapping[str, Any], trust_checkpoint: bool,
                      hash_file: bool = True) -> FileRecord:
    """Worker step: build one target file from its copy items and write it atomically.

    Peak memory: this file's buffers plus the pages of the source regions being copied (for an
    `IN_PLACE` or `STREAMING` target: one tensor). `hash_file=False` leaves `crc32` empty for the
    caller to fill.
    """
    rec = _write_file(file, items, source_root, dest_root, writer, mode, meta, trust_checkpoint, hash_file)
    if hash_file:
        journal(Path(dest_root), {"path": rec.path, "bytes": rec.nbytes, "crc32": rec.crc32, "extra": rec.extra})
    return rec


def _write_file(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str, writer: Writer,
                mode: WriteMode, meta: Mapping[str, Any], trust_checkpoint: bool, hash_file: bool) -> FileRecord:
    if mode is WriteMode.IN_PLACE and file.buffers:
        return _write_in_place(file, items, source_root, dest_root, writer, meta, trust_checkpoint, hash_file)
    if mode is WriteMode.STREAMING:
        return _write_streaming(file, items, source_root, dest_root, writer, meta, trust_checkpoint, hash_file)
    sources = _Sources(Path(source_root), trust_checkpoint)
    buffers = {b.key: zeros(b.shape, getattr(torch, b.dtype)) for b in file.buffers}
    for it in items:
        if it.dst.key not in buffers:
            raise CheckpointError(f"plan targets {file.path} {list(it.dst.key)}, which is not a buffer of that file")
        copy_item(it, sources.tensor(it.src.file, it.src.key), buffers[it.dst.key],
                  src_where=str(Path(source_root) / it.src.file))
    payload = writer.assemble(file, buffers, meta)
    del sources
    rec = write_atomic(Path(dest_root) / file.path, payload, checksum=hash_file)
    return FileRecord(path=file.path, nbytes=rec.nbytes, crc32=rec.crc32, extra=rec.extra)


class _FilledOnLookup(Mapping[KeyPath, torch.Tensor]):
    """A target file's buffers for a `STREAMING` target: each lookup allocates the buffer, copies its
    items into it (releasing the source pages after) and returns it; nothing is kept."""

    def __init__(self, file: TargetFile, items: Sequence[CopyItem], sources: _Sources, source_root: str) -> None:
        self.file, self.sources, self.root = file, sources, Path(source_root)
        self.specs = {b.key: b for b in file.buffers}
        self.items_by_key: dict[KeyPath, list[CopyItem]] = {}
        for it in items:
            if it.dst.key not in self.specs:
                raise CheckpointError(f"plan targets {file.path} {list(it.dst.key)}, which is not a buffer of that "
                                      f"file")
            self.items_by_key.setdefault(it.dst.key, []).append(it)

    def __getitem__(self, key: KeyPath) -> torch.Tensor:
        b = self.specs[key]
        buf = zeros(b.shape, getattr(torch, b.dtype))
        for it in self.items_by_key.get(key, ()):
            src = self.sources.tensor(it.src.file, it.src.key)
            copy_item(it, src, buf, src_where=str(self.root / it.src.file))
            if self.sources.mapped(it.src.key) and src.numel() > 1:
                lo, n = (it.flat[0], it.flat[2]) if it.flat is not None else (it.src.storage_offset, it.src.numel)
                release_pages(src, lo, n)
        return buf

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def _write_streaming(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str, writer: Writer,
                     meta: Mapping[str, Any], trust_checkpoint: bool, hash_file: bool = True) -> FileRecord:
    """Worker step for `STREAMING` targets: the payload writes buffer after buffer, each filled when looked up."""
    sources = _Sources(Path(source_root), trust_checkpoint)
    payload = writer.assemble(file, _FilledOnLookup(file, items, sources, source_root), meta)
    if not isinstance(payload, (bytes, str, StreamPayload)):
        raise CheckpointError(f"{file.path}: a streaming writer returned {type(payload).__name__}; it must return a "
                              f"StreamPayload (or bytes/str)")
    rec = write_atomic(Path(dest_root) / file.path, payload, checksum=hash_file)
    del sources
    return FileRecord(path=file.path, nbytes=rec.nbytes, crc32=rec.crc32, extra=rec.extra)


_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_sync_file_range = getattr(_libc, "sync_file_range", None)  # Linux only
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes [offset, offset + nbytes) of `fd` to disk now, without
    waiting for it (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; `nbytes=0`: to the end of the file),
    so the disk works while the next bytes are copied and the file's fsync finds little left to do.
    Advisory: a no-op where the call does not exist; a write error still surfaces at the fsync."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _WritebackFile(io.FileIO):
    """A file opened for writing that starts the writeback of what it holds every `every` bytes written
    (see `start_writeback`), for payloads written front to back through `write`."""

    def __init__(self, path: Path, every: int = 32 << 20) -> None:
        super().__init__(path, "w")
        self.every, self.unsubmitted = every, 0

    def write(self, b: Any) -> int:
        n = super().write(b)
        self.unsubmitted += n or 0
        if self.unsubmitted >= self.every:
            start_writeback(self.fileno(), 0, 0)  # pages already on their way are skipped
            self.unsubmitted = 0
        return n


def release_pages(t: torch.Tensor, start: int, numel: int) -> None:
    """Drop elements [start, start + numel) of a tensor backed by a file mapping from this process's
    resident set (madvise MADV_DONTNEED on the pages covering them).

    Only for tensors that view a file mapping (torch.load(mmap=True)): a private read-only mapping
    re-reads the file on the next access, a shared one keeps its written data in the page cache.
    On anonymous memory this would discard data, hence `_Sources.mapped` and `_write_in_place`.
    """
    if numel <= 0:
        return
    size = t.element_size()
    lo = t.data_ptr() + start * size
    hi = lo + numel * size
    lo, hi = lo - lo % _PAGE, -(-hi // _PAGE) * _PAGE
    if _libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise CheckpointError(f"madvise(MADV_DONTNEED) of {hi - lo} bytes failed: {os.strerror(err)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredTensor:
    """Where a contiguous tensor of a torch.save'd (zip) file lies: byte offset of element 0, numel, dtype."""

    offset: int
    numel: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Opaque:
    """Stands in for every non-container class of a pickle read for its layout only: nothing is imported or run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()


def _rebuild_ref(storage: Any, storage_offset: int, size: Any, stride: Any, *args: Any) -> _TensorRef:
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a torch.save'd `data.pkl` into plain containers with `_TensorRef`s in place of tensors."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_ref
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *a: data
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return getattr(torch, name)
        return _Opaque

    def persistent_load(self, pid: Any) -> _StorageRef:
        _, storage_type, key, _, _ = pid
        with warnings.catch_warnings():  # legacy typed-storage classes warn on `.dtype`
            warnings.simplefilter("ignore")
            dtype = storage_type if isinstance(storage_type, torch.dtype) else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {key}: unknown storage type {storage_type!r}")
        return _StorageRef(str(key), dtype)


class _Layouts:
    """Byte locations of tensors in torch.save'd files, from each file's pickle (parsed once, nothing loaded)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[Any, Any]] = {}

    def locate(self, path: Path, key: KeyPath) -> StoredTensor | None:
        """The stored tensor at `key` of `path`, or None when it is not one contiguous run of a zip record."""
        p = str(path)
        if p not in self.files:
            try:
                reader = torch._C.PyTorchFileReader(p)
                obj = _LayoutUnpickler(io.BytesIO(reader.get_record("data.pkl"))).load()
            except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
                obj, reader = None, None
            self.files[p] = (reader, obj)
        reader, obj = self.files[p]
        if reader is None or sys.byteorder != "little":
            return None
        try:
            ref = resolve_key(obj, key, file=p)
        except CheckpointFormatError:
            return None
        if not isinstance(ref, _TensorRef) or not isinstance(ref.storage, _StorageRef):
            return None
        expect, acc = [], 1
        for n in reversed(ref.size):
            expect.append(acc)
            acc *= n
        if any(n > 1 and st != e for n, st, e in zip(ref.size, ref.stride, reversed(expect))):
            return None
        size = torch.empty((), dtype=ref.storage.dtype).element_size()
        base = reader.get_record_offset(f"data/{ref.storage.key}")
        return StoredTensor(offset=base + ref.storage_offset * size, numel=math.prod(ref.size),
                            dtype=ref.storage.dtype)


def _copy_range(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int) -> None:
    """Copy bytes between files inside the kernel (no user-space buffer), then start their writeback."""
    start, total = dst_off, nbytes
    while nbytes > 0:
        done = os.copy_file_range(src_fd, dst_fd, nbytes, src_off, dst_off)
        if done <= 0:
            raise OSError(f"copy_file_range returned {done} with {nbytes} bytes left")
        nbytes, src_off, dst_off = nbytes - done, src_off + done, dst_off + done
    start_writeback(dst_fd, start, total)


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    """Write a tensor's bytes at `offset`, then start their writeback."""
    view, start = bytes_of(t.contiguous().reshape(-1)), offset
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
    start_writeback(fd, start, offset - start)


def _fix_zip_crcs(f: BinaryIO, path: Path) -> int:
    """Write the CRC-32 of every tensor record into its data descriptor and central-directory entry,
    and return the CRC-32 of the whole file: each tensor's bytes are read once, the file's CRC
    combines theirs with that of the bytes around them (read after the fix).

    `torch.save` under `skip_data` leaves them 0 (torch.load does not check them; zip tools do).
    """
    fd = f.fileno()
    with zipfile.ZipFile(path) as z:
        infos, cd_pos = z.infolist(), z.start_dir
    regions: list[tuple[int, int, int]] = []  # (start, end, crc) of each tensor record's data
    for info in infos:
        head = os.pread(fd, 46, cd_pos)
        if head[:4] != b"PK\x01\x02":
            raise CheckpointError(f"{path}: central directory entry of {info.filename} not where expected")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        if info.CRC == 0 and info.compress_size > 0 and "/data/" in info.filename:
            local_name, local_extra = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            start = info.header_offset + 30 + local_name + local_extra
            end = start + info.compress_size
            crc = _crc_range(fd, start, end)
            regions.append((start, end, crc))
            packed = struct.pack("<I", crc)
            os.pwrite(fd, packed, cd_pos + 16)
            if info.flag_bits & 0x08:  # data descriptor after the data, with or without its signature
                sig = os.pread(fd, 4, end)
                os.pwrite(fd, packed, end + 4 if sig == b"PK\x07\x08" else end)
            else:
                os.pwrite(fd, packed, info.header_offset + 14)
        cd_pos += 46 + name_len + extra_len + comment_len
    value, pos = 0, 0
    for start, end, crc in sorted(regions):
        value = crc32_combine(_crc_range(fd, pos, start, value), crc, end - start)
        pos = end
    return _crc_range(fd, pos, os.fstat(fd).st_size, value)


def _run_in(lengths: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> int | None:
    """Element offset of the box [starts, starts + counts) of a row-major tensor of `lengths` when the
    box is one contiguous run (leading dims of count 1, then one partial dim, then full dims), else None."""
    k = next((i for i, c in enumerate(counts) if c != 1), len(counts))
    if any(counts[j] != lengths[j] for j in range(k + 1, len(lengths))):
        return None
    offset, stride = 0, 1
    for n, st in zip(reversed(lengths), reversed(starts)):
        offset, stride = offset + st * stride, stride * n
    return offset


def _box_run(item: CopyItem) -> tuple[int, int, int] | None:
    """(source element offset, target element offset, count) of a box item that moves one contiguous
    run in both chunks (e.g. a whole tensor, or a range of dim-0 rows), else None (region items too)."""
    if item.region is not None:
        return None
    slen, dlen = tuple(item.src.lengths), tuple(item.dst.lengths)
    if len(slen) != len(dlen):
        return None
    s_start, d_start, s_count, d_count = [0] * len(slen), [0] * len(dlen), list(slen), list(dlen)
    for dim, so, do, n in item.narrows or ():
        s_start[dim], d_start[dim], s_count[dim], d_count[dim] = so, do, n, n
    if s_count != d_count:
        return None
    s_off, d_off = _run_in(slen, s_start, s_count), _run_in(dlen, d_start, d_count)
    if s_off is None or d_off is None:
        return None
    return item.src.storage_offset + s_off, item.dst.storage_offset + d_off, math.prod(s_count)


def _write_in_place(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str, writer: Writer,
                    meta: Mapping[str, Any], trust_checkpoint: bool, hash_file: bool = True) -> FileRecord:
    """Worker step for `IN_PLACE` targets: save the file's object without tensor data (the data regions
    stay holes, i.e. zeros), then put each copy item's bytes at their place in the file, fsync, rename.

    A flat item, or a box item that moves one contiguous run, between equal dtypes of torch.save'd
    files is copied file to file inside the kernel (`copy_file_range`: no process memory); other flat
    items go through the source tensor's region (pages released after); other box items fill their
    buffer in memory.
    0-d buffers are filled before `assemble`, which may store them as Python numbers (then they are
    not located in the file: their value is in the pickle).
    Peak memory: one tensor, never the file.
    """
    src_root = Path(source_root)
    sources = _Sources(src_root, trust_checkpoint)
    placeholders = {b.key: torch.empty(b.shape, dtype=getattr(torch, b.dtype)) for b in file.buffers}  # untouched
    for key in [b.key for b in file.buffers if b.shape == ()]:
        placeholders[key] = torch.zeros((), dtype=placeholders[key].dtype)
        for it in items:
            if it.dst.key == key:
                copy_item(it, sources.tensor(it.src.file, it.src.key), placeholders[key], src_where=str(src_root /
                                                                                                        it.src.file))
    payload = writer.assemble(file, placeholders, meta)
    if isinstance(payload, (bytes, str, StreamPayload)):
        raise CheckpointError(f"{file.path}: an in_place writer returned {type(payload).__name__} for a file with "
                              f"buffers; it must return the torch-saveable object holding them")
    path = Path(dest_root) / file.path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    layouts, fds = _Layouts(), {}
    try:
        with open(tmp, "wb") as f, torch.serialization.skip_data():
            torch.save(payload, f, pickle_module=safe_load.PICKLE_MODULE)
        del payload, placeholders
        targets, inline = {}, set()
        for b in file.buffers:
            loc = layouts.locate(tmp, b.key)
            if loc is None and b.shape == ():
                inline.add(b.key)  # stored as a Python number, already filled
                continue
            if loc is None or loc.numel != math.prod(b.shape) or loc.dtype != getattr(torch, b.dtype):
                raise CheckpointError(f"{file.path}: the in_place writer's object holds no contiguous {b.shape} "
                                      f"{b.dtype} tensor at {list(b.key)} (found {loc})")
            targets[b.key] = loc
        boxes: dict[KeyPath, list[CopyItem]] = {}

        def _copy_in_kernel(it: CopyItem, run: tuple[int, int, int], dst: StoredTensor) -> bool:
            """Copy elements run = (source offset, target offset, count) file to file when both are one
            contiguous run of the same dtype inside the files; False when they are not."""
            s, d, n = run
            src_loc = layouts.locate(src_root / it.src.file, it.src.key) if sources.mapped(it.src.key) else None
            if src_loc is None or src_loc.dtype != dst.dtype or s + n > src_loc.numel or d + n > dst.numel:
                return False
            if it.src.file not in fds:
                fds[it.src.file] = os.open(src_root / it.src.file, os.O_RDONLY)
            size = torch.empty((), dtype=dst.dtype).element_size()
            _copy_range(fds[it.src.file], out.fileno(), n * size, src_loc.offset + s * size, dst.offset + d * size)
            return True

        with open(tmp, "rb+") as out:
            for it in sorted(items, key=lambda i: (str(i.dst.key), i.flat[1] if i.flat else 0)):
                if it.dst.key in inline:
                    continue
                if it.dst.key not in targets:
                    raise CheckpointError(f"plan targets {file.path} {list(it.dst.key)}, which is not a buffer of "
                                          f"that file")
                run = _box_run(it) if it.flat is None else it.flat
                if it.flat is None and (run is None or not _copy_in_kernel(it, run, targets[it.dst.key])):
                    boxes.setdefault(it.dst.key, []).append(it)
                    continue
                if it.flat is None:
                    continue
                dst, (s, d, n) = targets[it.dst.key], it.flat
                if d + n > dst.numel:
                    raise CheckpointFormatError(f"target {file.path} {list(it.dst.key)}: needs elements [{d}, "
                                                f"{d + n}) but the buffer has {dst.numel}")
                if _copy_in_kernel(it, it.flat, dst):
                    continue
                src = sources.tensor(it.src.file, it.src.key)
                region = _region(src, s, n, where=f"{src_root / it.src.file} {list(it.src.key)} ({it.tensor})")
                region = region.to(dst.dtype)
                _pwrite_all(out.fileno(), region, dst.offset + d * region.element_size())
                if sources.mapped(it.src.key):
                    release_pages(src, s, n)
            for key, box_items in boxes.items():
                b = next(b for b in file.buffers if b.key == key)
                buf = zeros(b.shape, getattr(torch, b.dtype))
                for it in box_items:
                    src = sources.tensor(it.src.file, it.src.key)
                    copy_item(it, src, buf, src_where=str(src_root / it.src.file))
                    if sources.mapped(it.src.key):
                        release_pages(src, it.src.storage_offset, it.src.numel)
                _pwrite_all(out.fileno(), buf, targets[key].offset)
                del buf
            out.flush()
            crc = _fix_zip_crcs(out, tmp)
            os.fsync(out.fileno())
        sources.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise DestinationError(f"{path}: write failed ({err.strerror or err}); disk full or not writable?") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return FileRecord(path=file.path, nbytes=path.stat().st_size, crc32=f"{crc:08x}")


IO_THREADS = 2  # target files written at once by the default map (each holds at most one tensor)


def _gather(pool: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Results of fn(*a) for every a, submitted to `pool`, in order; on the first error the rest are cancelled."""
    futures = [pool.submit(fn, *a) for a in args]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def in_threads(threads: int = IO_THREADS) -> MapFn:
    """The default map: target files written by `threads` threads of this process. Kernel copies,
    reads, CRCs and fsync release the GIL, so one file's fsync overlaps the next file's copies."""

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        if threads <= 1 or len(args) <= 1:
            return [fn(*a) for a in args]
        with ThreadPoolExecutor(max_workers=min(threads, len(args))) as pool:
            return _gather(pool, fn, args)

    return run


def _die_with_parent(parent: int) -> None:
    """Process-pool initializer: SIGKILL this worker when its coordinator dies (Linux PR_SET_PDEATHSIG), and
    exit at once if it is already gone, so no worker writes on after a killed conversion."""
    import signal

    prctl = getattr(_libc, "prctl", None)
    if prctl is not None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def local_map(workers: int) -> MapFn:
    """A map over argument tuples: inline for 1 worker, else a spawned process pool whose workers die
    with the calling process."""

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        if workers <= 1 or len(args) <= 1:
            return [fn(*a) for a in args]
        with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=get_context("spawn"),
                                 initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            return _gather(pool, fn, args)

    return run


def check_destination(dest: Path, existing: Existing = Existing.REFUSE) -> None:
    """The destination must be absent or empty, or (RESUME/OVERWRITE) hold a conversion of ours; raises
    DestinationError naming its state and the option that would proceed (nothing is written)."""
    check_state(dest, existing)


def plan_id(plan: ConversionPlan, writer: Writer) -> str:
    """A fingerprint of the conversion: the source files (paths, sizes, mtimes), the target files with their
    buffers, the commit files, the target's meta and the writer. Equal ids write equal files."""
    h = hashlib.sha256()
    root = Path(plan.source.root)
    for rel in sorted(plan.source.files):
        try:
            st = (root / rel).stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{rel}\0missing\n".encode())
    h.update(repr((plan.source.root, plan.source.format, plan.target.index.format, type(writer).__qualname__,
                   plan.target.commit, plan.target_chunks)).encode())
    for f in plan.target.files:
        h.update(repr(f).encode())
    h.update(repr(sorted(plan.target.index.meta.items(), key=lambda kv: kv[0])).encode())
    return h.hexdigest()


def execute(plan: ConversionPlan, writer: Writer, dest: str | Path, *, map_fn: MapFn | None = None,
            trust_checkpoint: bool = False, existing: Existing = Existing.REFUSE) -> ExecutionResult:
    """Run `plan` into `dest` (absent or empty; `existing` says what to do with an earlier conversion's
    output); the manifest, the commit files and the removal of the marker, last, commit the checkpoint."""
    dest = Path(dest)
    created = not dest.exists()
    start = time.perf_counter()
    commit = frozenset(plan.target.commit)
    plan_files = frozenset(f.path for f in plan.target.files if f.path not in commit)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DestinationError(f"cannot create destination {dest}: {err}") from err
    try:
        kept = open_destination(dest, plan_id(plan, writer), existing, plan_files=plan_files, source=plan.source.root)
    except BaseException:
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    by_file = plan.items_by_file()
    meta = plan.target.index.meta
    mode = plan.target.write_mode
    jobs = [(f, tuple(by_file.get(f.path, ())), plan.source.root, str(dest), writer, mode, meta, trust_checkpoint)
            for f in plan.target.files if f.path in plan_files and f.path not in kept]
    try:
        # two files at once only where a worker holds one tensor, not a whole file
        bounded = mode is not WriteMode.IN_MEMORY
        written = list((map_fn or in_threads(IO_THREADS if bounded else 1))(write_target_file, jobs))
        by_path = {r.path: r for r in written} | {
            p: FileRecord(path=p, nbytes=int(r["bytes"]), crc32=str(r["crc32"]), extra=r.get("extra"))
            for p, r in kept.items()}
        records = [by_path[f.path] for f in plan.target.files if f.path in by_path]
        commit_files = [CommitFile(path=f.path, data=_commit_bytes(writer.assemble(f, {}, meta), f.path))
                        for f in plan.target.files if f.path in commit]
        finalize = getattr(writer, "finalize", None)
        if finalize is not None:
            for rel, payload in finalize(records, meta).items():
                if rel in commit:
                    commit_files.append(CommitFile(path=rel, data=_commit_bytes(payload, rel)))
                    continue
                rec = write_atomic(dest / rel, payload)
                records.append(FileRecord(path=rel, nbytes=rec.nbytes, crc32=rec.crc32))
        records = [FileRecord(path=r.path, nbytes=r.nbytes, crc32=r.crc32) for r in records]
        records += [FileRecord(path=c.path, nbytes=len(c.data), crc32=f"{_crc32(c.data):08x}") for c in commit_files]
        manifest = {
            "version": MANIFEST_VERSION,
            "format": plan.target.index.format,
            "source": {"root": plan.source.root, "format": plan.source.format},
            "files": {r.path: {"bytes": r.nbytes, "crc32": r.crc32} for r in records},
        }
        write_atomic(dest / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for c in commit_files:  # what a loader starts from, once everything it points at is on disk
            write_atomic(dest / c.path, c.data, checksum=False)
        close_destination(dest)
    except KeyboardInterrupt:  # as a kill would: the marker stays, `Existing.RESUME` finishes the conversion
        raise
    except BaseException:
        _remove_partial(dest, created)
        raise
    return ExecutionResult(destination=str(dest), files=tuple(records), seconds=time.perf_counter() - start,
                           resumed=len(kept))


def _commit_bytes(payload: Any, path: str) -> bytes:
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    raise CheckpointError(f"{path}: a commit file (what a loader starts from) must be assembled as bytes or text, "
                          f"got {type(payload).__name__}")


def _remove_partial(dest: Path, created: bool) -> None:
    if created:
        shutil.rmtree(dest, ignore_errors=True)
    else:
        for child in dest.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def verify_manifest(dest: str | Path) -> list[str]:
    """Problems found re-checking every file listed in dest/manifest.json: size, and each checksum its
    record holds (`crc32`; `sha256` in version-1 manifests and records others updated). Empty: intact."""
    dest = Path(dest)
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return [f"{dest / MANIFEST}: unreadable ({err})"]
    problems = []
    if (dest / INCOMPLETE).exists():
        problems.append(f"{dest / INCOMPLETE}: present: the conversion did not finish")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return problems + [f"{dest / MANIFEST}: holds no 'files' mapping"]
    for rel, rec in files.items():
        try:
            p = inside(dest, rel, what=str(dest / MANIFEST))
        except CheckpointFormatError as err:
            problems.append(str(err))
            continue
        if not isinstance(rec, dict):
            problems.append(f"{dest / MANIFEST}: record of {rel} is {type(rec).__name__}, not a mapping")
            continue
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        if "bytes" in rec and (size := p.stat().st_size) != rec["bytes"]:
            problems.append(f"{p}: {size} bytes != manifest {rec['bytes']}")
        checks = [(name, fn) for name, fn in (("crc32", file_crc32), ("sha256", _sha256)) if name in rec]
        if not checks:
            problems.append(f"{p}: manifest record {rec} holds no checksum (crc32 or sha256)")
        for name, fn in checks:
            if (h := fn(p)) != rec[name]:
                problems.append(f"{p}: {name} {h} != manifest {rec[name]}")
    return problems

