"""Running the collective matrix, the fallbacks and the bandwidth table on live Gloo at 2, 3 and 4 ranks.

One worker group per world size (module-scoped); every part runs on it through
``group.run``.  Sizes are small here; the benchmark script uses large ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

import pytest

from migrate.comm import bandwidth as bw
from migrate.comm import fallbacks as fb
from migrate.comm import matrix as mx
from migrate.runtime.worker_group import WorkerGroup, WorkerGroupSpec, start_worker_group

SIZES = (1, 7, 33)
WORLD_SIZES = (2, 3, 4)


@dataclass
class Live:
    world: int
    group: WorkerGroup
    plan: mx.MatrixPlan
    matrix: mx.CommMatrix


# Starting 3-4 spawned ranks on a small CPU box takes 10-17 s: those sizes are marked slow.
@pytest.fixture(scope="module", params=[pytest.param(w, id=f"world{w}", marks=[pytest.mark.slow] if w > 2 else [])
                                        for w in WORLD_SIZES])
def live(request: pytest.FixtureRequest) -> Iterator[Live]:
    world = request.param
    with start_worker_group(WorkerGroupSpec(mode="local", world_size=world, backend="gloo", timeout_s=120)) as group:
        plan = mx.MatrixPlan(checks=mx.ALL_CHECKS, sizes=SIZES, run_id=f"w{world}")
        matrix = mx.merge_observations(plan, group.run(mx.run_matrix_on_rank, plan), backend="gloo",
                                       device_type="cpu")
        yield Live(world=world, group=group, plan=plan, matrix=matrix)


def test_every_cell_is_judged_and_gloo_returns_no_wrong_data(live: Live) -> None:
    assert len(live.matrix.cells) == len(live.plan.cells())
    assert {c.status for c in live.matrix.cells} <= {"ok", "error", "n/a"}
    assert live.matrix.by_status("wrong") == ()
    for check in ("all_reduce.sum", "all_reduce.max", "all_reduce.min", "all_reduce.product",
                  "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor.sum",
                  "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "send_recv",
                  "batch_isend_irecv"):
        for dtype in mx.DEFAULT_DTYPES:
            for n in SIZES:
                assert live.matrix.cell(check, dtype, n).status == "ok", (check, dtype, n)
    assert live.matrix.cell("barrier", mx.NO_DTYPE, 0).status == "ok"
    for redop in ("band", "bor", "bxor"):
        assert live.matrix.cell(f"all_reduce.{redop}", "int32", 7).status == "ok"
        assert live.matrix.cell(f"all_reduce.{redop}", "float32", 7).status == "n/a"


def test_what_gloo_lacks_fails_with_gloos_own_message(live: Live) -> None:
    premul = live.matrix.cell("all_reduce.premul_sum", "float32", 7)
    assert premul.status == "error" and "PREMUL_SUM" in premul.detail and "Gloo" in premul.detail
    uneven = live.matrix.cell("all_gather.uneven", "bfloat16", 7)
    assert uneven.status == "error" and "ProcessGroupGloo::allgather: invalid tensor size" in uneven.detail
    a2a = live.matrix.cell("all_to_all", "float32", 7)
    assert a2a.status == "error" and "ProcessGroupGloo::alltoall" in a2a.detail
    assert live.matrix.cell("all_reduce.avg", "int64", 7).status == "error"
    assert live.matrix.cell("all_reduce.avg", "bfloat16", 7).status == "ok"
    assert set(premul.error_ranks) == set(range(live.world))


def test_a_deliberately_wrong_result_is_caught_on_that_rank_only(live: Live) -> None:
    bad_rank = live.world - 1
    plan = mx.MatrixPlan(checks=("all_reduce.sum", "all_to_all_single", "barrier"), dtypes=("bfloat16", "int64"),
                         sizes=(7, 33), run_id=f"corrupt{live.world}",
                         corrupt=mx.CorruptionSpec(check="all_to_all_single", rank=bad_rank, dtype="bfloat16",
                                                   numel=33))
    matrix = mx.merge_observations(plan, live.group.run(mx.run_matrix_on_rank, plan), backend="gloo",
                                   device_type="cpu")
    (wrong,) = matrix.by_status("wrong")
    assert (wrong.check, wrong.dtype, wrong.numel, wrong.wrong_ranks) == ("all_to_all_single", "bfloat16", 33,
                                                                         (bad_rank,))
    assert f"rank {bad_rank}: 1 wrong, out[0]" in wrong.detail and wrong.max_abs_err == mx.CORRUPTION_DELTA

    barrier_plan = mx.MatrixPlan(checks=("barrier",), run_id=f"corrupt-barrier{live.world}",
                                 corrupt=mx.CorruptionSpec(check="barrier", rank=0))
    barrier = mx.merge_observations(barrier_plan, live.group.run(mx.run_matrix_on_rank, barrier_plan),
                                    backend="gloo", device_type="cpu")
    assert barrier.cell("barrier", mx.NO_DTYPE, 0).wrong_ranks == (0,)


FALLBACK_PLAN = fb.FallbackPlan(dtypes=("float32", "bfloat16"), sizes=(5, 257), warmup=1, iters=2)


def test_fallbacks_are_correct_on_gloo_and_their_cost_is_measured(live: Live) -> None:
    results = fb.merge_fallback_observations(FALLBACK_PLAN, live.group.run(fb.run_fallbacks_on_rank, FALLBACK_PLAN))
    assert len(results) == len(FALLBACK_PLAN.cells())
    assert [r for r in results if r.status != "ok"] == []
    by = {(r.fallback, r.dtype, r.numel): r for r in results}
    uneven = by[("all_gather_uneven_via_padding", "float32", 257)]
    assert uneven.native_status == "error" and uneven.native_s is None and uneven.fallback_s > 0
    avg = by[("all_reduce_avg_via_sum", "bfloat16", 257)]
    assert avg.native_status == "ok" and avg.cost_ratio is not None and avg.cost_ratio > 0
    assert by[("all_reduce_sum_via_fp32", "bfloat16", 5)].cost_ratio is not None

    needs = [("all_gather.uneven", "float32"), ("all_to_all", "bfloat16"), ("all_reduce.premul_sum", "bfloat16"),
             ("all_reduce.avg", "int32"), ("all_reduce.sum", "bfloat16")]
    choices = {c.check: c.fallback for c in fb.select_fallbacks(live.matrix, needs)}
    assert choices == {"all_gather.uneven": "all_gather_uneven_via_padding", "all_to_all": "all_to_all_via_single",
                       "all_reduce.premul_sum": "all_reduce_premul_sum_via_scale",
                       "all_reduce.avg": "all_reduce_avg_via_sum"}
    assert fb.select_fallbacks(live.matrix, fb.training_needs("bf16")) == ()


def test_a_wrong_fallback_is_caught(live: Live) -> None:
    plan = fb.FallbackPlan(fallbacks=("all_to_all_via_p2p",), dtypes=("float32",), sizes=(9,), iters=1,
                           corrupt=mx.CorruptionSpec(check="all_to_all_via_p2p", rank=0))
    (result,) = fb.merge_fallback_observations(plan, live.group.run(fb.run_fallbacks_on_rank, plan))
    assert result.status == "wrong" and result.detail.startswith("rank 0: 1 wrong")


def test_bandwidth_table_in_and_out_of_place(live: Live) -> None:
    plan = bw.BandwidthPlan(sizes_bytes=(4096, 65536), warmup=1, iters=3)
    rows = bw.merge_bandwidth(plan, live.group.run(bw.run_bandwidth_on_rank, plan))
    assert len(rows) == len(plan.cells())
    assert [r.error for r in rows if r.error] == []
    for r in rows:
        assert r.time_us is not None and r.time_us > 0 and r.algbw_gbps is not None
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * bw.bus_factor(r.op, live.world))
        assert r.min_rank_time_us is not None and r.min_rank_time_us <= r.time_us <= (r.max_rank_time_us or 0)
    modes = {(r.op, r.mode) for r in rows}
    assert ("all_gather_into_tensor", "in_place") in modes and ("all_gather_into_tensor", "out_of_place") in modes
    ag = next(r for r in rows if r.op == "all_gather_into_tensor" and r.size_bytes <= 4096)
    assert ag.count == 4096 // 4 // live.world and ag.size_bytes == ag.count * 4 * live.world
