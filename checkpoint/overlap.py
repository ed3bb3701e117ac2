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


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of `shape`."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def box_range_pieces(offsets: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...], lo: int,
                     hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements of the box (offsets, lengths) of a row-major tensor of `shape` whose flat index lies in
    [lo, hi), as boxes (offsets, lengths) in row-major order: at most 2 * ndim - 1 of them (a partial first
    row, whole rows, a partial last row, recursively), however many rows the range spans."""
    if lo >= hi or any(n == 0 for n in lengths):
        return []
    if not shape:
        return [((), ())] if lo <= 0 < hi else []
    stride = math.prod(shape[1:])
    sub_o, sub_l, sub_s = offsets[1:], lengths[1:], shape[1:]
    strides = row_major_strides(sub_s)
    rest_min = sum(o * s for o, s in zip(sub_o, strides))
    rest_max = sum((o + n - 1) * s for o, n, s in zip(sub_o, sub_l, strides))
    first_row, last_row = offsets[0], offsets[0] + lengths[0] - 1
    a = max(first_row, -((rest_max - lo) // stride))  # rows reaching lo: r * stride + rest_max >= lo
    b = min(last_row, (hi - 1 - rest_min) // stride)  # rows starting below hi: r * stride + rest_min < hi
    if a > b:
        return []
    full_a = max(a, -((rest_min - lo) // stride))  # rows wholly inside: r * stride + rest_min >= lo ...
    full_b = min(b, (hi - 1 - rest_max) // stride)  # ... and r * stride + rest_max < hi
    pieces: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def partial(row: int) -> None:
        for po, pl in box_range_pieces(sub_o, sub_l, sub_s, lo - row * stride, hi - row * stride):
            pieces.append(((row, *po), (1, *pl)))

    if full_a <= full_b:
        for row in range(a, full_a):
            partial(row)
        pieces.append(((full_a, *sub_o), (full_b - full_a + 1, *sub_l)))
        for row in range(full_b + 1, b + 1):
            partial(row)
    else:
        for row in range(a, b + 1):
            partial(row)
    return pieces
