"""Overlap math of the planner: property tests against a brute-force element map."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.overlap import box_as_flat_range, box_overlap, global_flat_range, range_overlap


@st.composite
def shape_and_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))

    def box():
        offs, lens = [], []
        for s in shape:
            o = draw(st.integers(0, s - 1))
            offs.append(o)
            lens.append(draw(st.integers(1, s - o)))
        return tuple(offs), tuple(lens)

    return shape, box(), box()


def _cells(offsets, lengths):
    cells = {()}
    for o, n in zip(offsets, lengths):
        cells = {c + (i,) for c in cells for i in range(o, o + n)}
    return cells


@given(shape_and_boxes())
@settings(max_examples=300, deadline=None)
def test_box_overlap_equals_brute_force_intersection(data):
    _, (ao, al), (bo, bl) = data
    expected = _cells(ao, al) & _cells(bo, bl)
    narrows = box_overlap(ao, al, bo, bl)
    if not expected:
        assert narrows is None
        return
    got = _cells(tuple(ao[d] + a for d, a, _, _ in narrows), tuple(n for *_, n in narrows))
    assert got == expected
    assert _cells(tuple(bo[d] + b for d, _, b, _ in narrows), tuple(n for *_, n in narrows)) == expected


@given(shape_and_boxes())
@settings(max_examples=300, deadline=None)
def test_box_as_flat_range_is_exact_when_contiguous(data):
    shape, (offs, lens), _ = data
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    flat = sorted(sum(i * s for i, s in zip(c, strides)) for c in _cells(offs, lens))
    contiguous = flat == list(range(flat[0], flat[-1] + 1))
    rng = box_as_flat_range(offs, lens, shape)
    assert (rng is not None) == contiguous
    if rng is not None:
        assert rng == (flat[0], flat[-1] + 1)


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
def test_range_overlap_matches_set_intersection(a0, a1, b0, b1):
    a, b = (min(a0, a1), max(a0, a1)), (min(b0, b1), max(b0, b1))
    expected = set(range(*a)) & set(range(*b))
    got = range_overlap(a, b)
    assert (set(range(*got)) if got else set()) == expected


def test_global_flat_range_shifts_flat_range_by_box_start():
    assert global_flat_range((0, 0), (4, 3), (4, 3), (5, 9)) == (5, 9)
    assert global_flat_range((2, 0), (2, 3), (4, 3), None) == (6, 12)
    assert global_flat_range((0, 1), (4, 2), (4, 3), None) is None
