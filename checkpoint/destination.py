"""A conversion's destination: what state it is in, the in-progress marker, and the commit order.

States (`state_of`): absent, empty, finished (`manifest.json`, no marker), unfinished (the marker: a
conversion that crashed or still runs) and foreign (anything else: never written over).

Call sequence (coordinator = the caller of `checkpoint.execute.execute`):
1. `open_destination(dest, plan_id, existing)` checks the state against `Existing`, clears what is to be
   replaced, writes the marker `.migrate-incomplete/plan.json` (fsynced) and returns the records of the
   files an unfinished conversion of the same plan already completed (`Existing.RESUME`);
2. workers, each after its file's rename: `journal(dest, record)` puts the file's record (size, CRC-32,
   writer extra) into the marker folder, fsynced, so a resumed run knows it without reading the file;
3. coordinator: the files that describe the data (DCP's `.metadata`, ...) and `manifest.json`, then the
   files a loader uses to find the checkpoint (`TargetSpec.commit`: DeepSpeed's `latest`, ...), each
   fsynced, then `close_destination` removes the marker: the commit point of our own tools.
A crash at any point leaves the marker (our readers refuse such a folder: `refuse_unfinished`) and no
file a framework's loader starts from, unless every data file is already in place.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointFormatError, DestinationError, OtherPlanError

MANIFEST = "manifest.json"
JOB_MANIFEST = "manifest.nodes.json"  # node-local storage: the driver's list of every node's files, written last
INCOMPLETE = ".migrate-incomplete"  # the marker folder: plan.json and files/<record>.json
_PLAN = "plan.json"
_FILES = "files"


class Existing(enum.Enum):
    """What to do with a destination that is not empty."""

    REFUSE = "refuse"  # the default: the destination must be absent or empty
    RESUME = "resume"  # finish an unfinished conversion of the same plan, keeping the files it completed
    OVERWRITE = "overwrite"  # replace an earlier conversion's output, finished or not (never foreign content)


class State(enum.Enum):
    ABSENT = "absent"
    EMPTY = "empty"
    FINISHED = "finished"
    UNFINISHED = "unfinished"
    FOREIGN = "foreign"


def state_of(dest: Path) -> State:
    """The destination's state (reads directory entries only)."""
    if not dest.exists():
        return State.ABSENT
    if not dest.is_dir():
        return State.FOREIGN
    names = {p.name for p in dest.iterdir()}
    if not names:
        return State.EMPTY
    if any(n == INCOMPLETE or n.startswith(f"{INCOMPLETE}.tmp-") for n in names):
        return State.UNFINISHED
    return State.FINISHED if MANIFEST in names or JOB_MANIFEST in names else State.FOREIGN


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename in it is durable once this returns)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _clear(dest: Path) -> None:
    for child in dest.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def _started(dest: Path) -> dict[str, Any]:
    try:
        return json.loads((dest / INCOMPLETE / _PLAN).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def check_state(dest: Path, existing: Existing) -> State:
    """The destination's state when `existing` lets a conversion proceed into it; else DestinationError
    naming the state and the option that would proceed."""
    state = state_of(dest)
    if state is State.FOREIGN:
        raise DestinationError(f"destination {dest} exists and is not empty, and holds no conversion of ours "
                               f"(no {MANIFEST}, no {INCOMPLETE}); choose a new or empty directory")
    if state is State.FINISHED and existing is not Existing.OVERWRITE:
        raise DestinationError(f"destination {dest} holds a finished conversion ({MANIFEST}); choose a new or empty "
                               f"directory, or pass --overwrite to replace it")
    if state is State.UNFINISHED and existing is Existing.REFUSE:
        started = _started(dest)
        raise DestinationError(
            f"destination {dest} holds an unfinished conversion (started {started.get('started', '?')} by pid "
            f"{started.get('pid', '?')}, no {MANIFEST}: it crashed or still runs); pass --resume to finish it or "
            f"--overwrite to replace it")
    return state


def open_destination(dest: Path, plan_id: str, existing: Existing, *, plan_files: frozenset[str],
                     source: str, owner: str = "") -> dict[str, dict[str, Any]]:
    """Make `dest` ready for the plan `plan_id` and write its marker (naming `owner`, the node that writes
    there, when given: `marker_owner` reads it back); return {path: record} of the plan's
    files a resumed conversion keeps (empty unless RESUME). Raises DestinationError (`check_state`), or when
    RESUME finds an unfinished conversion of another plan."""
    state = check_state(dest, existing)
    kept: dict[str, dict[str, Any]] = {}
    started = _started(dest) if state is State.UNFINISHED else {}
    if state is State.UNFINISHED and existing is Existing.RESUME and not started:
        state = State.FINISHED  # killed while writing its marker, before any data file: nothing to keep
    if state is State.UNFINISHED and existing is Existing.RESUME:
        if started.get("plan") != plan_id:
            raise OtherPlanError(
                f"destination {dest} holds an unfinished conversion of another plan (source "
                f"{started.get('source', '?')}, other target options or a changed source); --resume finishes "
                f"only the same conversion: pass --overwrite to replace it")
        kept = _completed(dest, plan_files)
        for child in sorted(dest.rglob("*"), reverse=True):  # what the crashed run left half done or uncommitted
            rel = child.relative_to(dest).as_posix()
            if rel == INCOMPLETE or rel.startswith(f"{INCOMPLETE}/") or rel in kept:
                continue
            if rel.startswith(f"{INCOMPLETE}.tmp-"):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
                continue
            if child.is_file() or child.is_symlink():
                child.unlink()
    if state is State.FINISHED or (state is State.UNFINISHED and existing is Existing.OVERWRITE):
        _clear(dest)
    plan = {"plan": plan_id, "pid": os.getpid(), "source": source, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "owner": owner}
    try:
        if kept:  # the same plan resumed: its journal stays
            _write_json(dest / INCOMPLETE / _PLAN, plan)
        else:  # the marker appears whole (plan and empty journal) or not at all
            tmp = dest / f"{INCOMPLETE}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(dest / INCOMPLETE, ignore_errors=True)
            (tmp / _FILES).mkdir(parents=True)
            _write_json(tmp / _PLAN, plan)
            os.replace(tmp, dest / INCOMPLETE)
        fsync_dir(dest)
    except OSError as err:
        raise DestinationError(f"cannot create destination {dest}: {err}") from err
    return kept


def marker_owner(dest: Path) -> str:
    """The owner named in `dest`'s in-progress marker ("" when none is named or there is no marker)."""
    return str(_started(dest).get("owner", ""))


def _completed(dest: Path, plan_files: frozenset[str]) -> dict[str, dict[str, Any]]:
    """Records of the journal whose file is still in place with its recorded size (complete: renamed after fsync)."""
    out = {}
    for entry in sorted((dest / INCOMPLETE / _FILES).glob("*.json")):
        try:
            rec = json.loads(entry.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        path = rec.get("path")
        if path in plan_files and (dest / path).is_file() and (dest / path).stat().st_size == rec.get("bytes"):
            out[path] = rec
    return out


def journal(dest: Path, record: Mapping[str, Any]) -> None:
    """Record a completed file (path, bytes, crc32, extra) in the marker folder, fsynced (worker side;
    idempotent). A record whose extra is not plain JSON data is not kept: a resumed run rewrites the file."""
    try:
        text = json.dumps(dict(record), sort_keys=True)
    except (TypeError, ValueError):
        return
    name = hashlib.sha1(str(record["path"]).encode()).hexdigest()[:20] + ".json"
    folder = dest / INCOMPLETE / _FILES
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)
    fsync_dir(folder)


def close_destination(dest: Path) -> None:
    """Remove the marker: the conversion is finished (manifest and commit files are in place)."""
    shutil.rmtree(dest / INCOMPLETE)
    fsync_dir(dest)


def refuse_unfinished(path: str | Path) -> None:
    """Raise CheckpointFormatError when `path` (or the folder holding it) is a conversion's unfinished output."""
    path = Path(path)
    for folder in (path, path.parent):
        if (folder / INCOMPLETE).exists():
            raise CheckpointFormatError(f"{folder}: an unfinished conversion ({INCOMPLETE} is present: it crashed or "
                                        f"still runs); rerun it with --resume to finish it or --overwrite to replace "
                                        f"it")


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitFile:
    """A file a loader starts from, written by the coordinator after the manifest: its bytes are known first."""

    path: str
    data: bytes
