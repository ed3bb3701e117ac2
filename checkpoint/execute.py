"""The streaming executor: runs a ConversionPlan, writing each target file once, atomically.

Call sequence (coordinator = the caller of `execute`; what touches the destination goes through its
`checkpoint.storage.Storage`: one shared folder by default, or each node's own disk):
1. coordinator: check the destination is absent or empty, create it;
2. workers (by default two threads of this process for in-place/streaming targets, else inline; a
   local process pool, or any `map_fn` such as Ray tasks): for each target file allocate its
   buffers, fill them from memory-mapped source files, let the writer assemble the file's object,
   save it to a temporary name, fsync, rename; return its CRC-32. The target's `WriteMode` says how:
   `IN_PLACE` saves the object without tensor data first and sends each copy item's bytes straight
   to their place in that file (file-to-file copies where possible); `STREAMING` fills
   buffers one at a time, as the writer asks for them, and writes each before the next: either way a
   worker holds at most one tensor. The disk's writeback of each file starts as its bytes
   land (`start_writeback`), so the fsync that ends a file waits for little and the disk works while
   the copies go on. Every write returns the CRC-32 of its bytes, taken while they are in the CPU's
   cache: a file's CRC (and an in-place file's zip record CRCs) combines those, so what was written is
   not read back;
3. coordinator: write the files that describe the others: those the target plans from values
   (`TargetSpec.described`: Megatron's common.pt) and the writer's own (`Writer.finalize`, optional: e.g.
   DCP's `.metadata`, which needs every data file's byte offsets), then write `manifest.json`
   (files, sizes, CRC-32), then the files a loader starts from (`TargetSpec.commit`: DeepSpeed's
   `latest`, DCP's `.metadata`, ...), each fsynced, and remove the in-progress marker
   (`checkpoint.destination`): the commit point.
On any error the coordinator removes what it wrote, so nothing that looks complete is left; a crash
(kill -9) or an interrupt (Ctrl-C) leaves the marker, which our readers refuse and `Existing.RESUME`
finishes. The source is only ever opened read-only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.destination import CommitFile, Existing
from checkpoint.errors import CheckpointError
from checkpoint.io.checksum import crc32
from checkpoint.plan import ConversionPlan, WriteMode
from checkpoint.pools import IO_THREADS, MapFn, in_threads
from checkpoint.storage import ManifestSource, SharedStorage, Storage
from checkpoint.write import FileRecord, Writer, write_target_file


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionResult:
    destination: str
    files: tuple[FileRecord, ...]
    seconds: float
    resumed: int = 0  # files an unfinished earlier run had completed, kept (Existing.RESUME)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def execute(plan: ConversionPlan, writer: Writer, dest: str | Path, *, map_fn: MapFn | None = None,
            trust_checkpoint: bool = False, existing: Existing = Existing.REFUSE,
            storage: Storage | None = None) -> ExecutionResult:
    """Run `plan` into `dest` (absent or empty; `existing` says what to do with an earlier conversion's
    output) on `storage` (default: one folder every worker sees, `SharedStorage`); the manifest, the commit
    files and the removal of the marker, last, commit the checkpoint."""
    dest = Path(dest)
    storage = storage or SharedStorage()
    start = time.perf_counter()
    commit = frozenset(plan.target.commit)
    plan_files = frozenset(f.path for f in plan.target.files if f.path not in commit)
    kept = storage.open(dest, plan_id(plan, writer), existing, plan_files=plan_files, source=plan.source.root)
    try:
        records = _write_files(plan, writer, dest, storage, plan_files - kept.keys(), kept, map_fn, trust_checkpoint)
        records, commit_files = _describe(plan, writer, dest, storage, records, commit)
        storage.commit(dest, records, commit_files, ManifestSource(target_format=plan.target.index.format,
                                                                   source_root=plan.source.root,
                                                                   source_format=plan.source.format))
    except KeyboardInterrupt:  # as a kill would: the marker stays, `Existing.RESUME` finishes the conversion
        raise
    except BaseException:
        storage.remove_partial(dest)
        raise
    return ExecutionResult(destination=str(dest), files=tuple(records), seconds=time.perf_counter() - start,
                           resumed=len(kept))


def check_destination(dest: Path, existing: Existing = Existing.REFUSE, storage: Storage | None = None) -> None:
    """The destination must be absent or empty, or (RESUME/OVERWRITE) hold a conversion of ours; raises
    DestinationError naming its state and the option that would proceed (nothing is written)."""
    (storage or SharedStorage()).check(dest, existing)


def _write_files(plan: ConversionPlan, writer: Writer, dest: Path, storage: Storage, todo: frozenset[str],
                 kept: Mapping[str, Mapping[str, Any]], map_fn: MapFn | None, trust_checkpoint: bool
                 ) -> list[FileRecord]:
    """Step 2: the workers write the target files in `todo`; the records of every written or kept file, in the
    target's order."""
    by_file = plan.items_by_file()
    meta = plan.target.index.meta
    mode = plan.target.write_mode
    root = storage.worker_root(dest)
    jobs = [(f, tuple(by_file.get(f.path, ())), plan.source.root, root, writer, mode, meta, trust_checkpoint)
            for f in plan.target.files if f.path in todo]
    # two files at once only where a worker holds one tensor, not a whole file
    bounded = mode is not WriteMode.IN_MEMORY
    written = list((map_fn or in_threads(IO_THREADS if bounded else 1))(write_target_file, jobs))
    storage.remove_temps(dest, todo)  # a retried worker's (its node lost mid-write) temporary file
    by_path = {r.path: r for r in written} | {
        p: FileRecord(path=p, nbytes=int(r["bytes"]), crc32=str(r["crc32"]), extra=r.get("extra"))
        for p, r in kept.items()}
    return [by_path[f.path] for f in plan.target.files if f.path in by_path]


def _describe(plan: ConversionPlan, writer: Writer, dest: Path, storage: Storage, records: list[FileRecord],
              commit: frozenset[str]) -> tuple[list[FileRecord], list[CommitFile]]:
    """Step 3: the files that describe the others (`TargetSpec.described`, assembled from their values, and
    `Writer.finalize`'s; written now unless they are commit files) and the commit files' bytes; every record
    for the manifest, commit files included."""
    meta = plan.target.index.meta
    commit_files = [CommitFile(path=f.path, data=_commit_bytes(writer.assemble(f, {}, meta), f.path))
                    for f in (*plan.target.files, *plan.target.described) if f.path in commit]
    described: dict[str, Any] = {f.path: writer.assemble(f, {}, meta) for f in plan.target.described
                                 if f.path not in commit}
    finalize = getattr(writer, "finalize", None)
    if finalize is not None:
        for rel, payload in finalize(records, meta).items():
            if rel in commit:
                commit_files.append(CommitFile(path=rel, data=_commit_bytes(payload, rel)))
            else:
                described[rel] = payload
    order = {path: i for i, path in enumerate(plan.target.commit)}
    commit_files.sort(key=lambda c: order[c.path])  # in the order the target lists them: its commit point last
    records = [FileRecord(path=r.path, nbytes=r.nbytes, crc32=r.crc32) for r in records]
    records += storage.write(dest, described) if described else []
    records += [FileRecord(path=c.path, nbytes=len(c.data), crc32=f"{crc32(c.data):08x}") for c in commit_files]
    return records, commit_files


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
    for f in (*plan.target.files, *plan.target.described):
        h.update(repr(f).encode())
    h.update(repr(sorted(plan.target.index.meta.items(), key=lambda kv: kv[0])).encode())
    return h.hexdigest()


def _commit_bytes(payload: Any, path: str) -> bytes:
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    raise CheckpointError(f"{path}: a commit file (what a loader starts from) must be assembled as bytes or text, "
                          f"got {type(payload).__name__}")
