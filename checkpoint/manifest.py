"""`manifest.json`: every file of a converted checkpoint with its size and CRC-32, written before the commit
point, and its re-check."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from checkpoint.destination import INCOMPLETE, MANIFEST
from checkpoint.errors import CheckpointFormatError
from checkpoint.io.checksum import file_crc32, sha256_of
from checkpoint.paths import inside
from checkpoint.write import FileRecord, write_atomic

MANIFEST_VERSION = 2  # 2: a CRC-32 per file (1: sha256; verify_manifest checks either)


def write_manifest(dest: Path, records: Sequence[FileRecord], *, target_format: str, source_root: str,
                   source_format: str) -> None:
    """Write dest/manifest.json listing `records` (path, bytes, CRC-32), atomically."""
    manifest = {
        "version": MANIFEST_VERSION,
        "format": target_format,
        "source": {"root": source_root, "format": source_format},
        "files": {r.path: {"bytes": r.nbytes, "crc32": r.crc32} for r in records},
    }
    write_atomic(dest / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


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
        checks = [(name, fn) for name, fn in (("crc32", file_crc32), ("sha256", sha256_of)) if name in rec]
        if not checks:
            problems.append(f"{p}: manifest record {rec} holds no checksum (crc32 or sha256)")
        for name, fn in checks:
            if (h := fn(p)) != rec[name]:
                problems.append(f"{p}: {name} {h} != manifest {rec[name]}")
    return problems
