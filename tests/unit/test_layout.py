"""ParallelLayout: rank <-> coordinates, Megatron-Core's rank order, errors with numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.layout import LayoutError, OptimizerSharding, ParallelLayout

sizes = st.sampled_from([1, 2, 3, 4])


@settings(max_examples=200, deadline=None)
@given(tp=sizes, pp=sizes, dp=sizes, cp=sizes, order=st.permutations(["tp", "cp", "ep", "dp", "pp"]))
def test_coordinates_and_rank_of_are_inverse(tp, pp, dp, cp, order):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp, order="-".join(order))
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        assert layout.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == rank
        seen.add((c.tp, c.cp, c.dp, c.pp))
    assert len(seen) == layout.world_size


def test_default_order_matches_megatron_groups():
    # Megatron-Core 'tp-cp-ep-dp-pp' with tp=2, dp=2, pp=2: TP groups [0,1],[2,3],...; DP groups [0,2],[1,3],...
    layout = ParallelLayout(tp=2, dp=2, pp=2)
    assert [layout.coordinates(r).tp for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [layout.coordinates(r).dp for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coordinates(r).pp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_expert_ranks_are_carved_out_of_data_parallel():
    layout = ParallelLayout(tp=1, dp=4, ep=2)
    assert [(layout.coordinates(r).ep, layout.coordinates(r).expert_dp) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, "parallel sizes must be integers >= 1"),
        ({"dp": 3, "ep": 2}, "ep(2) must divide dp(3) * cp(1) = 3"),
        ({"order": "tp-dp-pp"}, "order 'tp-dp-pp' must name each of tp, cp, ep, dp, pp exactly once"),
        ({"vpp": 2}, "vpp(2) > 1 needs pp > 1, got pp(1)"),
    ],
)
def test_invalid_layouts_print_their_numbers(kwargs, message):
    with pytest.raises(LayoutError) as info:
        ParallelLayout(**kwargs)
    assert message in str(info.value)


def test_world_size_check_and_round_trip():
    layout = ParallelLayout(tp=4, pp=3, dp=2, sharding="zero2")
    assert layout.sharding is OptimizerSharding.ZERO2 and layout.zero_stage == 2
    with pytest.raises(LayoutError, match=r"tp\(4\) \* cp\(1\) \* dp\(2\) \* pp\(3\) = 24 != world_size\(16\)"):
        layout.check_world_size(16)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert layout.describe() == "tp4·pp3·dp2 zero2"
