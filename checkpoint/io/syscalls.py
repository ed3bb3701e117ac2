"""Kernel calls that move and flush bytes: writeback started early, kernel file-to-file copies, page
release of mapped tensors, and the parent-death signal for pool workers (Linux; advisory elsewhere)."""

from __future__ import annotations

import ctypes
import io
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from checkpoint.errors import CheckpointError
from checkpoint.io.buffers import bytes_of


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


class WritebackFile(io.FileIO):
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
    On anonymous memory this would discard data, hence `Sources.mapped` and `_write_in_place`.
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


def copy_range(src_fd: int, dst_fd: int, nbytes: int, src_off: int, dst_off: int) -> None:
    """Copy bytes between files inside the kernel (no user-space buffer), then start their writeback."""
    start, total = dst_off, nbytes
    while nbytes > 0:
        done = os.copy_file_range(src_fd, dst_fd, nbytes, src_off, dst_off)
        if done <= 0:
            raise OSError(f"copy_file_range returned {done} with {nbytes} bytes left")
        nbytes, src_off, dst_off = nbytes - done, src_off + done, dst_off + done
    start_writeback(dst_fd, start, total)


def pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    """Write a tensor's bytes at `offset`, then start their writeback."""
    view, start = bytes_of(t.contiguous().reshape(-1)), offset
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
    start_writeback(fd, start, offset - start)


def die_with_parent(parent: int) -> None:
    """Process-pool initializer: SIGKILL this worker when its coordinator dies (Linux PR_SET_PDEATHSIG), and
    exit at once if it is already gone, so no worker writes on after a killed conversion."""
    import signal

    prctl = getattr(_libc, "prctl", None)
    if prctl is not None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
