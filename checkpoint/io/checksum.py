"""CRC-32 (zlib's polynomial, as zip files use) of files and byte ranges, its combination without
re-reading (a range whose pieces' CRCs are known reads only the bytes between them), and sha256 for
manifests of version 1."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# ISA-L's CRC-32 (carry-less multiply, ~10 GB/s, GIL released; the values are zlib's) and its combination
# (in C, ~0.1 us a call: one call per piece of a file written piece by piece)
from isal.isal_zlib import crc32, crc32_combine


CHECKSUM_BLOCK = 4 << 20  # bytes read per CRC step: fixed memory, whatever the file


def crc_range(fd: int, start: int, end: int, value: int = 0) -> int:
    """CRC-32 of bytes [start, end) of an open file, continuing from `value`."""
    buf = bytearray(min(CHECKSUM_BLOCK, max(end - start, 1)))
    view = memoryview(buf)
    while start < end:
        n = os.preadv(fd, [view[:min(len(buf), end - start)]], start)
        if n <= 0:
            raise OSError(f"read {n} bytes at {start} with {end - start} left (file shrank?)")
        value, start = crc32(view[:n], value), start + n
    return value


def file_crc32(path: Path) -> str:
    """CRC-32 (zlib's polynomial, as zip files use) of a file, as 8 hex digits."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return f"{crc_range(fd, 0, os.fstat(fd).st_size):08x}"
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes [offset, offset + nbytes) of a file whose CRC-32 is known (computed as they were written)."""

    offset: int
    nbytes: int
    crc: int


def crc_with_spans(fd: int, start: int, end: int, spans: Iterable[Span], value: int = 0) -> int:
    """CRC-32 of bytes [start, end) of an open file, continuing from `value`: each span inside the range
    contributes its known CRC and only the bytes between spans are read. Spans that overlap each other
    (bytes written twice: the last write's CRC is unknown here) make it read the whole range."""
    inside = sorted((s for s in spans if s.nbytes > 0 and start <= s.offset and s.offset + s.nbytes <= end),
                    key=lambda s: s.offset)
    if any(a.offset + a.nbytes > b.offset for a, b in zip(inside, inside[1:])):
        return crc_range(fd, start, end, value)
    pos = start
    for s in inside:
        value = crc32_combine(crc_range(fd, pos, s.offset, value), s.crc, s.nbytes)
        pos = s.offset + s.nbytes
    return crc_range(fd, pos, end, value)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHECKSUM_BLOCK):
            h.update(block)
    return h.hexdigest()
