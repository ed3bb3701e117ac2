"""Overlap math between chunks: tiny pure functions (cf. torch.distributed.checkpoint.resharding)."""

from __future__ import annotations

import math


def range_overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Intersection [lo, hi) of two half-open ranges, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def box_overlap(a_offsets: tuple[int, ...], a_lengths: tuple[int, ...], b_offsets: tuple[int, ...],
                b_lengths: tuple[int, ...]) -> tuple[tuple[int, int, int, int], ...] | None:
    """Overlap of boxes a and b as (dim, offset in a, offset in b, length) per dim; None when empty."""
    narrows = []
    for dim, (ao, al, bo, bl) in enumerate(zip(a_offsets, a_lengths, b_offsets, b_lengths)):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        narrows.append((dim, lo - ao, lo - bo, hi - lo))
    return tuple(narrows)


def box_as_flat_range(offsets: tuple[int, ...], lengths: tuple[int, ...],
                      shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The row-major element range a box covers when it is contiguous in `shape`, else None.

    Contiguous means: after the first dim whose length exceeds 1, every dim is taken whole.
    """
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    start = sum(o * s for o, s in zip(offsets, strides))
    numel = math.prod(lengths)
    if numel == 0:
        return (start, start)
    first = next((d for d, n in enumerate(lengths) if n > 1), len(shape))
    if any(lengths[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    return (start, start + numel)


def global_flat_range(offsets: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...],
                      flat_range: tuple[int, int] | None) -> tuple[int, int] | None:
    """The row-major range of the global tensor a chunk holds (box, optionally narrowed by flat_range)."""
    box = box_as_flat_range(offsets, lengths, shape)
    if box is None:
        return None
    if flat_range is None:
        return box
    return (box[0] + flat_range[0], box[0] + flat_range[1])
