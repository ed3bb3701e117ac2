"""Where a conversion's files land: the coordinator's steps on the destination, apart from the copy work.

`execute` runs its plan through a `Storage`: `check` (before anything is written), `open` (the destination and
its in-progress marker), the workers' root (`worker_root`, handed to every worker with its target file),
`remove_temps` (what a lost worker left), `write` (the files that describe the others), `commit` (the
manifest, the commit files, the marker removed) and `remove_partial` (on failure). `SharedStorage`, the
default, is one folder the coordinator and every worker see at the same path (a local disk, or a shared file
system under a Ray cluster). Node-local storage, where each node of a cluster keeps its own files on its own
disk, is `migrate.convert_node_local.NodeLocalStorage`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from checkpoint.destination import CommitFile, Existing, check_state, close_destination, open_destination
from checkpoint.errors import DestinationError
from checkpoint.manifest import write_manifest
from checkpoint.write import FileRecord, remove_temps, write_atomic


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestSource:
    """What a manifest says of the conversion besides its files."""

    target_format: str
    source_root: str
    source_format: str


class Storage(Protocol):
    """The coordinator's steps on a conversion's destination (see the module docstring for their order)."""

    def check(self, dest: Path, existing: Existing) -> None:
        """Raise DestinationError unless a conversion may proceed into `dest` under `existing`; writes nothing."""

    def open(self, dest: Path, plan_id: str, existing: Existing, *, plan_files: frozenset[str],
             source: str) -> Mapping[str, Mapping[str, Any]]:
        """Create `dest` with the marker of plan `plan_id`; the records of files a resumed run keeps."""

    def worker_root(self, dest: Path) -> str | os.PathLike[str]:
        """The destination root each worker writes its target file under."""

    def remove_temps(self, dest: Path, paths: Iterable[str]) -> None:
        """Remove the temporary files lost workers left beside `paths` (every worker has returned)."""

    def write(self, dest: Path, files: Mapping[str, Any]) -> list[FileRecord]:
        """Write {relative path: payload} (the files that describe the others) atomically; their records."""

    def commit(self, dest: Path, records: Sequence[FileRecord], commit_files: Sequence[CommitFile],
               source: ManifestSource) -> None:
        """Write the manifest of `records`, then the commit files, then remove the marker: the commit point."""

    def remove_partial(self, dest: Path) -> None:
        """Remove what this conversion wrote (called on failure after `open`)."""


class SharedStorage:
    """One destination folder that the coordinator and every worker see at the same path."""

    def __init__(self) -> None:
        self.created = False

    def check(self, dest: Path, existing: Existing) -> None:
        check_state(dest, existing)

    def open(self, dest: Path, plan_id: str, existing: Existing, *, plan_files: frozenset[str],
             source: str) -> Mapping[str, Mapping[str, Any]]:
        self.created = not dest.exists()
        try:
            return open_here(dest, plan_id, existing, plan_files=plan_files, source=source)
        except BaseException:
            if self.created:
                shutil.rmtree(dest, ignore_errors=True)
            raise

    def worker_root(self, dest: Path) -> str:
        return str(dest)

    def remove_temps(self, dest: Path, paths: Iterable[str]) -> None:
        remove_temps(dest, paths)

    def write(self, dest: Path, files: Mapping[str, Any]) -> list[FileRecord]:
        return write_files(dest, files)

    def commit(self, dest: Path, records: Sequence[FileRecord], commit_files: Sequence[CommitFile],
               source: ManifestSource) -> None:
        commit_here(dest, records, commit_files, source)

    def remove_partial(self, dest: Path) -> None:
        remove_partial(dest, self.created)


def open_here(dest: Path, plan_id: str, existing: Existing, *, plan_files: frozenset[str], source: str,
              owner: str = "") -> dict[str, dict[str, Any]]:
    """In this process: create `dest` and put the marker of plan `plan_id` there (`open_destination`)."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DestinationError(f"cannot create destination {dest}: {err}") from err
    return open_destination(dest, plan_id, existing, plan_files=plan_files, source=source, owner=owner)


def write_files(dest: Path, files: Mapping[str, Any]) -> list[FileRecord]:
    """In this process: each {relative path: payload} written atomically under `dest`; their records."""
    return [FileRecord(path=rel, nbytes=rec.nbytes, crc32=rec.crc32)
            for rel, rec in ((rel, write_atomic(dest / rel, payload)) for rel, payload in files.items())]


def commit_here(dest: Path, records: Sequence[FileRecord], commit_files: Sequence[CommitFile],
                source: ManifestSource) -> None:
    """In this process: `manifest.json` of `records`, the commit files (what a loader starts from, once
    everything they point at is on disk), each fsynced, then the marker removed."""
    write_manifest(dest, records, target_format=source.target_format, source_root=source.source_root,
                   source_format=source.source_format)
    for c in commit_files:
        write_atomic(dest / c.path, c.data, checksum=False)
    close_destination(dest)


def remove_partial(dest: Path, created: bool) -> None:
    """Remove `dest` when this conversion created it, else everything in it."""
    if created:
        shutil.rmtree(dest, ignore_errors=True)
    elif dest.is_dir():
        for child in dest.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class NodePath(os.PathLike):  # type: ignore[type-arg]
    """A path each process resolves in its own environment (`$VAR`, `~`) when it opens it: under node-local
    storage, what one folder name is on every node (e.g. '$LOCAL_NVME/ckpt')."""

    template: str

    def __fspath__(self) -> str:
        return os.path.expanduser(os.path.expandvars(self.template))

    def __str__(self) -> str:
        return self.template
