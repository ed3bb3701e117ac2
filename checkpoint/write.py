"""Writing one target file, the worker's step: its buffers filled from the sources by its copy items, the
writer's object saved under a temporary name, fsynced, renamed. The target's `WriteMode` says how:
`IN_MEMORY` fills every buffer then saves; `STREAMING` fills each buffer when the writer looks it up and
writes it before the next; `IN_PLACE` saves the object without tensor data and puts each item's bytes at
their place in that file (file-to-file copies where possible)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from checkpoint import safe_load
from checkpoint.copy_items import box_run, copy_item, region
from checkpoint.destination import fsync_dir, journal
from checkpoint.errors import CheckpointError, CheckpointFormatError, DestinationError
from checkpoint.index import KeyPath
from checkpoint.io.buffers import zeros
from checkpoint.io.checksum import Span, file_crc32
from checkpoint.io.sources import Sources
from checkpoint.io.syscalls import WritebackFile, copy_range, pwrite_all, release_pages
from checkpoint.io.torch_zip import TensorLocations, StoredTensor, fix_zip_crcs
from checkpoint.plan import CopyItem, TargetFile, WriteMode


class Writer(Protocol):
    """Turns a target file's filled buffers into the object (or bytes) the target framework stores.

    `assemble` returns bytes/str, a `StreamPayload`, or a torch-saveable object. A writer may also
    define `finalize(records, meta) -> {relative path: bytes}`: files the coordinator writes after all
    workers returned (it sees each record's `extra`, what a StreamPayload's `write` returned).
    A file's non-tensor content comes from its planned values (`TargetFile.values`); `assemble` also builds
    the target's described files (`TargetSpec.described`), which have values and no buffers, for the
    coordinator.
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


@dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    path: str
    nbytes: int
    crc32: str  # the file's CRC-32 (zlib's), 8 hex digits; empty while a caller computes it
    extra: Any = None  # what the file's StreamPayload returned (for Writer.finalize)


def temp_path(path: Path) -> Path:
    """Where this process writes `path` before renaming it into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_temps(dest: Path, paths: Iterable[str]) -> None:
    """Remove what a worker lost mid-write (its process or node gone) left beside each of `paths` under
    `dest`: its temporary files. Only once every worker has returned: a live worker's would go too.
    Lists each folder once, whatever the number of files in it."""
    names_by_folder: dict[Path, set[str]] = {}
    for rel in paths:
        target = dest / rel
        names_by_folder.setdefault(target.parent, set()).add(target.name)
    for folder, names in names_by_folder.items():
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            name, sep, _ = entry.name.partition(".tmp-")
            if sep and name.startswith(".") and name[1:] in names:
                os.unlink(entry.path)


def write_atomic(path: Path, payload: Any, *, checksum: bool = True) -> FileRecord:
    """Write bytes/str, a StreamPayload or a torch-saveable object to a temp name, fsync, rename; return
    its record (`checksum=False`: with an empty crc32, for the caller to fill)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        raw = WritebackFile(tmp)
        with io.BufferedWriter(raw) as f:
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
    nbytes = path.stat().st_size
    crc = "" if not checksum else f"{raw.crc:08x}" if raw.crc is not None and raw.written == nbytes else \
        file_crc32(path)  # the CRC taken while writing, unless the payload seeked back: then one read
    return FileRecord(path=str(path), nbytes=nbytes, crc32=crc, extra=extra)


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
    sources = Sources(Path(source_root), trust_checkpoint)
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

    def __init__(self, file: TargetFile, items: Sequence[CopyItem], sources: Sources, source_root: str) -> None:
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
    sources = Sources(Path(source_root), trust_checkpoint)
    payload = writer.assemble(file, _FilledOnLookup(file, items, sources, source_root), meta)
    if not isinstance(payload, (bytes, str, StreamPayload)):
        raise CheckpointError(f"{file.path}: a streaming writer returned {type(payload).__name__}; it must return a "
                              f"StreamPayload (or bytes/str)")
    rec = write_atomic(Path(dest_root) / file.path, payload, checksum=hash_file)
    del sources
    return FileRecord(path=file.path, nbytes=rec.nbytes, crc32=rec.crc32, extra=rec.extra)


def _write_in_place(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str, writer: Writer,
                    meta: Mapping[str, Any], trust_checkpoint: bool, hash_file: bool = True) -> FileRecord:
    """Worker step for `IN_PLACE` targets: save the file's object without tensor data (the data regions
    stay holes, i.e. zeros), then put each copy item's bytes at their place in the file, fsync, rename.

    A flat item, or a box item that moves one contiguous run, between equal dtypes of torch.save'd
    files is copied file to file through a small block of memory (`copy_range`); other flat items go
    through the source tensor's region (pages released after); other box items fill their buffer in
    memory. Every write returns the CRC-32 of its bytes, so the file's CRC combines those with the few
    bytes around them (headers, the pickle): no tensor byte is read back.
    0-d buffers are filled before `assemble`, which may store them as Python numbers (then they are
    not located in the file: their value is in the pickle).
    Peak memory: one tensor, never the file.
    """
    src_root = Path(source_root)
    sources = Sources(src_root, trust_checkpoint)
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
    tmp = temp_path(path)
    locations, fds = TensorLocations(), {}
    try:
        with open(tmp, "wb") as f, torch.serialization.skip_data():
            torch.save(payload, f, pickle_module=safe_load.PICKLE_MODULE)
        del payload, placeholders
        targets, inline = {}, set()
        for b in file.buffers:
            loc = locations.locate(tmp, b.key)
            if loc is None and b.shape == ():
                inline.add(b.key)  # stored as a Python number, already filled
                continue
            if loc is None or loc.numel != math.prod(b.shape) or loc.dtype != getattr(torch, b.dtype):
                raise CheckpointError(f"{file.path}: the in_place writer's object holds no contiguous {b.shape} "
                                      f"{b.dtype} tensor at {list(b.key)} (found {loc})")
            targets[b.key] = loc
        boxes: dict[KeyPath, list[CopyItem]] = {}
        written: list[Span] = []  # pieces of the tensor records with the CRC-32 their writes returned

        def _copy_file_to_file(it: CopyItem, run: tuple[int, int, int], dst: StoredTensor) -> bool:
            """Copy elements run = (source offset, target offset, count) file to file when both are one
            contiguous run of the same dtype inside the files; False when they are not."""
            s, d, n = run
            src_loc = locations.locate(src_root / it.src.file, it.src.key) if sources.mapped(it.src.key) else None
            if src_loc is None or src_loc.dtype != dst.dtype or s + n > src_loc.numel or d + n > dst.numel:
                return False
            if it.src.file not in fds:
                fds[it.src.file] = os.open(src_root / it.src.file, os.O_RDONLY)
            size = torch.empty((), dtype=dst.dtype).element_size()
            at = dst.offset + d * size
            written.append(Span(at, n * size, copy_range(fds[it.src.file], out.fileno(), n * size,
                                                         src_loc.offset + s * size, at)))
            return True

        with open(tmp, "rb+") as out:
            for it in sorted(items, key=lambda i: (str(i.dst.key), i.flat[1] if i.flat else 0)):
                if it.dst.key in inline:
                    continue
                if it.dst.key not in targets:
                    raise CheckpointError(f"plan targets {file.path} {list(it.dst.key)}, which is not a buffer of "
                                          f"that file")
                run = box_run(it) if it.flat is None else it.flat
                if it.flat is None and (run is None or not _copy_file_to_file(it, run, targets[it.dst.key])):
                    boxes.setdefault(it.dst.key, []).append(it)
                    continue
                if it.flat is None:
                    continue
                dst, (s, d, n) = targets[it.dst.key], it.flat
                if d + n > dst.numel:
                    raise CheckpointFormatError(f"target {file.path} {list(it.dst.key)}: needs elements [{d}, "
                                                f"{d + n}) but the buffer has {dst.numel}")
                if _copy_file_to_file(it, it.flat, dst):
                    continue
                src = sources.tensor(it.src.file, it.src.key)
                part = region(src, s, n, where=f"{src_root / it.src.file} {list(it.src.key)} ({it.tensor})")
                part = part.to(dst.dtype)
                at = dst.offset + d * part.element_size()
                written.append(Span(at, n * part.element_size(), pwrite_all(out.fileno(), part, at)))
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
                written.append(Span(targets[key].offset, buf.numel() * buf.element_size(),
                                    pwrite_all(out.fileno(), buf, targets[key].offset)))
                del buf
            out.flush()
            crc = fix_zip_crcs(out, tmp, written)
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
