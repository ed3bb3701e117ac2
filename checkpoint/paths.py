"""Paths that stay inside a checkpoint: what readers and the executor open is checked here first.

A checkpoint names its own files (DCP storage paths, DeepSpeed's `latest`, Megatron's tracker, our
manifest). Each name is taken only as a relative path that stays under the checkpoint's root, and a
symbolic link under the root is followed only when it resolves inside the root, unless the user
opts in (`follow_symlinks`, the CLI's `--follow-symlinks`). Pure path arithmetic plus `stat`/`readlink`:
no file is opened here.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from checkpoint.errors import CheckpointFormatError, DestinationError


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def inside(root: str | Path, rel: str, *, what: str) -> Path:
    """`root / rel` when `rel` is a relative path that stays inside `root` (no absolute path, no `..`); raises
    CheckpointFormatError naming `what` (the file or field that gave the name), the name and the root
    otherwise. Links are `check_links`'s part: a tree is checked once before anything in it is read."""
    root = Path(root)
    name = str(rel)
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not name or "\x00" in name or PurePosixPath(name).is_absolute() or Path(name).is_absolute() \
            or ".." in parts or (parts and parts[0].endswith(":")):
        raise CheckpointFormatError(f"{what}: names {name!r}, which is not a relative path inside {root}; refusing "
                                    f"to read outside the checkpoint")
    return root / name


def check_links(root: str | Path, *, follow_symlinks: bool = False) -> int:
    """Refuse a checkpoint tree holding a symbolic link that resolves outside `root` (or a dangling one)
    unless `follow_symlinks`; the number of links seen. Lists directories only (no file is opened)."""
    root = Path(root)
    real_root = Path(os.path.realpath(root))
    links = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_symlinks):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            if not path.is_symlink():
                continue
            links += 1
            if follow_symlinks:
                continue
            real = Path(os.path.realpath(path))
            if not _within(real, real_root):
                raise CheckpointFormatError(f"{path}: a symbolic link to {os.readlink(path)} (resolves to {real}), "
                                            f"outside the checkpoint {real_root}; pass --follow-symlinks to read "
                                            f"through links")
            if not real.exists():
                raise CheckpointFormatError(f"{path}: a dangling symbolic link to {os.readlink(path)}")
    return links


def tag_name(value: str, *, what: str) -> str:
    """A directory name read from a pointer file (DeepSpeed's `latest`): one plain path component."""
    tag = value.strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
        raise CheckpointFormatError(f"{what}: names tag {tag!r}; expected the name of a checkpoint directory beside "
                                    f"it (e.g. global_step100)")
    return tag


def check_disjoint(source: str | Path, destination: str | Path) -> None:
    """Refuse a destination that is the source, lies inside it, or contains it (a conversion never
    writes into its source tree, nor over it)."""
    src, dst = Path(os.path.realpath(source)), Path(os.path.realpath(destination))
    if src == dst:
        raise DestinationError(f"destination {destination} is the source; choose another directory")
    if _within(dst, src):
        raise DestinationError(f"destination {destination} lies inside the source checkpoint {src}; choose a "
                               f"directory outside it (the source is never written to)")
    if _within(src, dst):
        raise DestinationError(f"destination {destination} contains the source checkpoint {src}; choose a "
                               f"directory that does not hold the source")
