"""The streaming executor: runs a ConversionPlan, writing each target file once, atomically.

Call sequence (coordinator = the caller of `execute`):
1. coordinator: check the destination is absent or empty, create it;
2. workers (inline, a local process pool, or any `map_fn` such as Ray tasks): for each target file
   allocate its buffers, fill them from memory-mapped source files, let the writer assemble the
   file's object, save it to a temporary name, fsync, rename; return its sha256;
3. coordinator: write `manifest.json` (files, sizes, sha256) last, fsynced: the commit point.
On any error the coordinator removes what it wrote, so nothing that looks complete is left; the
source is only ever opened read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointError, CheckpointFormatError, DestinationError
from checkpoint.index import KeyPath
from checkpoint.plan import ConversionPlan, CopyItem, TargetFile

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class Writer(Protocol):
    """Turns a target file's filled buffers into the object (or bytes) the target framework stores."""

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        ...


MapFn = Callable[[Callable[..., Any], Sequence[tuple[Any, ...]]], list[Any]]


@dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    path: str
    nbytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionResult:
    destination: str
    files: tuple[FileRecord, ...]
    seconds: float

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


class _Sources:
    """Source files opened lazily with mmap (data stays on disk until a region is copied)."""

    def __init__(self, root: Path, trust_checkpoint: bool) -> None:
        self.root, self.trust, self.cache = root, trust_checkpoint, {}

    def tensor(self, file: str, key: KeyPath) -> torch.Tensor:
        if file not in self.cache:
            self.cache[file] = safe_load.load(self.root / file, mmap=True, trust_checkpoint=self.trust)
        t = resolve_key(self.cache[file], key, file=str(self.root / file))
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{self.root / file}: {list(key)} is {type(t).__name__}, not a tensor")
        return t


def _region(t: torch.Tensor, ref_offset: int, numel: int, *, where: str) -> torch.Tensor:
    flat = t.reshape(-1)
    if ref_offset + numel > flat.numel():
        raise CheckpointFormatError(f"{where}: needs elements [{ref_offset}, {ref_offset + numel}) but the stored "
                                    f"tensor has {flat.numel()} (shape {tuple(t.shape)})")
    return flat[ref_offset:ref_offset + numel]


def copy_item(item: CopyItem, src: torch.Tensor, dst: torch.Tensor, *, src_where: str) -> None:
    """Copy one item's region from the stored source tensor into the target buffer."""
    if item.flat is not None:
        s, d, n = item.flat
        _region(dst, d, n, where=f"target {item.dst.file} {list(item.dst.key)}").copy_(
            _region(src, s, n, where=f"{src_where} {list(item.src.key)} ({item.tensor})"))
        return
    sview = _region(src, item.src.storage_offset, item.src.numel, where=f"{src_where} {list(item.src.key)}")
    dview = _region(dst, item.dst.storage_offset, item.dst.numel, where=f"target {item.dst.file}")
    sview, dview = sview.view(item.src.lengths), dview.view(item.dst.lengths)
    for dim, so, do, n in item.narrows or ():
        sview, dview = sview.narrow(dim, so, n), dview.narrow(dim, do, n)
    dview.copy_(sview)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, payload: Any) -> FileRecord:
    """Write bytes/str or a torch-saveable object to a temp name, fsync, rename; return its record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if isinstance(payload, (bytes, str)):
                f.write(payload.encode() if isinstance(payload, str) else payload)
            else:
                torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise DestinationError(f"{path}: write failed ({err.strerror or err}); disk full or not writable?") from err
    return FileRecord(path=str(path), nbytes=path.stat().st_size, sha256=_sha256(path))


def write_target_file(file: TargetFile, items: Sequence[CopyItem], source_root: str, dest_root: str,
                      writer: Writer, meta: Mapping[str, Any], trust_checkpoint: bool) -> FileRecord:
    """Worker step: build one target file from its copy items and write it atomically.

    Peak memory: this file's buffers plus the pages of the source regions being copied.
    """
    sources = _Sources(Path(source_root), trust_checkpoint)
    buffers = {b.key: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for b in file.buffers}
    for it in items:
        if it.dst.key not in buffers:
            raise CheckpointError(f"plan targets {file.path} {list(it.dst.key)}, which is not a buffer of that file")
        copy_item(it, sources.tensor(it.src.file, it.src.key), buffers[it.dst.key],
                  src_where=str(Path(source_root) / it.src.file))
    payload = writer.assemble(file, buffers, meta)
    del sources
    rec = write_atomic(Path(dest_root) / file.path, payload)
    return FileRecord(path=file.path, nbytes=rec.nbytes, sha256=rec.sha256)


def local_map(workers: int) -> MapFn:
    """A map over argument tuples: inline for 1 worker, else a spawned process pool."""

    def run(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
        if workers <= 1 or len(args) <= 1:
            return [fn(*a) for a in args]
        with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=get_context("spawn")) as pool:
            return [f.result() for f in [pool.submit(fn, *a) for a in args]]

    return run


def check_destination(dest: Path) -> None:
    """The destination must be absent or an empty directory."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DestinationError(f"destination {dest} exists and is not empty; choose a new or empty directory")


def execute(plan: ConversionPlan, writer: Writer, dest: str | Path, *, map_fn: MapFn | None = None,
            trust_checkpoint: bool = False) -> ExecutionResult:
    """Run `plan` into `dest` (absent or empty); the manifest written last commits the checkpoint."""
    dest = Path(dest)
    check_destination(dest)
    created = not dest.exists()
    start = time.perf_counter()
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DestinationError(f"cannot create destination {dest}: {err}") from err
    by_file = plan.items_by_file()
    meta = plan.target.index.meta
    jobs = [(f, tuple(by_file.get(f.path, ())), plan.source.root, str(dest), writer, meta, trust_checkpoint)
            for f in plan.target.files]
    try:
        records = (map_fn or local_map(1))(write_target_file, jobs)
        manifest = {
            "version": MANIFEST_VERSION,
            "format": plan.target.index.format,
            "source": {"root": plan.source.root, "format": plan.source.format},
            "files": {r.path: {"bytes": r.nbytes, "sha256": r.sha256} for r in records},
        }
        write_atomic(dest / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    except BaseException:
        _remove_partial(dest, created)
        raise
    return ExecutionResult(destination=str(dest), files=tuple(records), seconds=time.perf_counter() - start)


def _remove_partial(dest: Path, created: bool) -> None:
    if created:
        shutil.rmtree(dest, ignore_errors=True)
    else:
        for child in dest.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def verify_manifest(dest: str | Path) -> list[str]:
    """Problems found re-hashing every file listed in dest/manifest.json (empty list: intact)."""
    dest = Path(dest)
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return [f"{dest / MANIFEST}: unreadable ({err})"]
    problems = []
    for rel, rec in manifest["files"].items():
        p = dest / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif (h := _sha256(p)) != rec["sha256"]:
            problems.append(f"{p}: sha256 {h} != manifest {rec['sha256']}")
    return problems

