"""CRC-32 (zlib's polynomial, as zip files use) of files and byte ranges, its combination without
re-reading, and sha256 for manifests of version 1."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

try:  # ISA-L's CRC-32 (carry-less multiply, ~10 GB/s, GIL released); zlib's gives the same values, slower
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the same function
    from zlib import crc32


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


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHECKSUM_BLOCK):
            h.update(block)
    return h.hexdigest()
