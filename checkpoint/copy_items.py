"""One copy item's elements, from the stored source tensor into the target buffer: a flat range, a box
(narrowed per dimension) or a region of the global tensor; a single memcpy where both sides allow."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from checkpoint.errors import CheckpointFormatError
from checkpoint.index import ChunkRef
from checkpoint.overlap import global_flat_range, row_major_strides
from checkpoint.plan import CopyItem


def region(t: torch.Tensor, ref_offset: int, numel: int, *, where: str) -> torch.Tensor:
    flat = t.reshape(-1)
    if ref_offset + numel > flat.numel():
        raise CheckpointFormatError(f"{where}: needs elements [{ref_offset}, {ref_offset + numel}) but the stored "
                                    f"tensor has {flat.numel()} (shape {tuple(t.shape)})")
    return flat[ref_offset:ref_offset + numel]


def _copy_bytes(src: torch.Tensor, s: int, dst: torch.Tensor, d: int, n: int) -> bool:
    """dst.flat[d:d+n] = src.flat[s:s+n] as one memcpy (no thread pool) when both are contiguous and of
    one dtype; False (nothing copied) otherwise. Callers check the bounds."""
    if src.dtype != dst.dtype or not src.is_contiguous() or not dst.is_contiguous():
        return False
    size = src.element_size()
    out = dst.reshape(-1).view(torch.uint8).numpy()
    out[d * size:(d + n) * size] = src.reshape(-1).view(torch.uint8).numpy()[s * size:(s + n) * size]
    return True


def region_view(stored: torch.Tensor, chunk: ChunkRef, item: CopyItem, *, where: str) -> torch.Tensor:
    """One side of a region item: the region as a narrowed box of a box chunk, or as a strided window (the
    global tensor's row-major strides) of a flat chunk's range."""
    assert item.region is not None and item.global_shape is not None
    whole = region(stored, chunk.storage_offset, chunk.numel, where=where)
    offsets, lengths = zip(*item.region) if item.region else ((), ())
    if chunk.flat_range is None:
        view = whole.view(chunk.lengths)
        for dim, (o, n) in enumerate(item.region):
            view = view.narrow(dim, o - chunk.offsets[dim], n)
        return view
    strides = row_major_strides(item.global_shape)
    span = global_flat_range(chunk.offsets, chunk.lengths, item.global_shape, chunk.flat_range)
    assert span is not None
    first = sum(o * s for o, s in zip(offsets, strides)) - span[0]
    return whole.as_strided(tuple(lengths), strides, whole.storage_offset() + first)


def copy_item(item: CopyItem, src: torch.Tensor, dst: torch.Tensor, *, src_where: str) -> None:
    """Copy one item's region from the stored source tensor into the target buffer."""
    if item.region is not None:
        sview = region_view(src, item.src, item, where=f"{src_where} {list(item.src.key)} ({item.tensor})")
        region_view(dst, item.dst, item, where=f"target {item.dst.file} {list(item.dst.key)}").copy_(sview)
        return
    if item.flat is not None:
        s, d, n = item.flat
        dview = region(dst, d, n, where=f"target {item.dst.file} {list(item.dst.key)}")
        sview = region(src, s, n, where=f"{src_where} {list(item.src.key)} ({item.tensor})")
        if not _copy_bytes(src, s, dst, d, n):
            dview.copy_(sview)
        return
    run = box_run(item)
    if run is not None and run[0] + run[2] <= src.numel() and run[1] + run[2] <= dst.numel() and \
            _copy_bytes(src, run[0], dst, run[1], run[2]):
        return
    sview = region(src, item.src.storage_offset, item.src.numel, where=f"{src_where} {list(item.src.key)}")
    dview = region(dst, item.dst.storage_offset, item.dst.numel, where=f"target {item.dst.file}")
    sview, dview = sview.view(item.src.lengths), dview.view(item.dst.lengths)
    for dim, so, do, n in item.narrows or ():
        sview, dview = sview.narrow(dim, so, n), dview.narrow(dim, do, n)
    dview.copy_(sview)


def _run_in(lengths: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> int | None:
    """Element offset of the box [starts, starts + counts) of a row-major tensor of `lengths` when the
    box is one contiguous run (leading dims of count 1, then one partial dim, then full dims), else None."""
    k = next((i for i, c in enumerate(counts) if c != 1), len(counts))
    if any(counts[j] != lengths[j] for j in range(k + 1, len(lengths))):
        return None
    offset, stride = 0, 1
    for n, st in zip(reversed(lengths), reversed(starts)):
        offset, stride = offset + st * stride, stride * n
    return offset


def box_run(item: CopyItem) -> tuple[int, int, int] | None:
    """(source element offset, target element offset, count) of a box item that moves one contiguous
    run in both chunks (e.g. a whole tensor, or a range of dim-0 rows), else None (region items too)."""
    if item.region is not None:
        return None
    slen, dlen = tuple(item.src.lengths), tuple(item.dst.lengths)
    if len(slen) != len(dlen):
        return None
    s_start, d_start, s_count, d_count = [0] * len(slen), [0] * len(dlen), list(slen), list(dlen)
    for dim, so, do, n in item.narrows or ():
        s_start[dim], d_start[dim], s_count[dim], d_count[dim] = so, do, n, n
    if s_count != d_count:
        return None
    s_off, d_off = _run_in(slen, s_start, s_count), _run_in(dlen, d_start, d_count)
    if s_off is None or d_off is None:
        return None
    return item.src.storage_offset + s_off, item.dst.storage_offset + d_off, math.prod(s_count)
