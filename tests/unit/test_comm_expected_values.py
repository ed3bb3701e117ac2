"""Checking collectives without trusting the backend: expected values, merging, formulas, comparison.

Pure tests: no process group.  The expectations must be independent closed forms
so a backend returning wrong data cannot also produce the "expected" value.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from migrate.comm import bandwidth as bw
from migrate.comm import fallbacks as fb
from migrate.comm import matrix as mx
from migrate.comm.compare import compare_results, comparison_markdown
from migrate.comm.report import CommResult, bandwidth_csv, markdown, plot_bandwidth, read_json, write_json


@given(world=st.integers(1, 8), numel=st.integers(1, 50), rank=st.integers(0, 7))
@settings(max_examples=60, deadline=None)
def test_sum_and_product_expectations_match_closed_forms(world: int, numel: int, rank: int) -> None:
    rank = rank % world
    i = torch.arange(numel, dtype=torch.float64)
    closed_sum = sum(((i * 7 + r * 3) % 5) - 2 for r in range(world))
    assert torch.equal(mx.expected_outputs("all_reduce.sum", rank, world, numel)["out"], closed_sum)
    prod = mx.expected_outputs("all_reduce.product", rank, world, numel)["out"]
    # exactly one factor of 2 per element, signs alternate per rank
    assert torch.equal(prod.abs(), torch.full((numel,), 2.0))
    assert torch.equal(mx.expected_outputs("all_reduce.avg", rank, world, numel)["out"], closed_sum / world)


@given(world=st.integers(1, 6), numel=st.integers(0, 9))
@settings(max_examples=40, deadline=None)
def test_uneven_all_to_all_expectation_is_what_each_sender_sent(world: int, numel: int) -> None:
    sent = {src: torch.cat([mx.a2a_chunk(src, dst, world, numel) for dst in range(world)]) for src in range(world)}
    for src in range(world):
        assert sent[src].numel() == sum(mx.a2a_split(src, d, numel) for d in range(world))
    for dst in range(world):
        got = mx.expected_outputs("all_to_all_single", dst, world, numel)["out"]
        pieces, offset = [], 0
        for src in range(world):
            start = sum(mx.a2a_split(src, d, numel) for d in range(dst))
            pieces.append(sent[src][start:start + mx.a2a_split(src, dst, numel)])
        assert torch.equal(got, torch.cat(pieces)), (dst, offset)
    if world > 1:
        assert len({mx.a2a_split(0, d, numel) for d in range(world)}) > 1  # really uneven


def test_root_ops_expect_output_on_the_root_only() -> None:
    assert mx.expected_outputs("reduce", 0, 3, 5) == {}
    assert set(mx.expected_outputs("gather", 2, 3, 5)) == {"from0", "from1", "from2"}
    scatter = [mx.expected_outputs("scatter", r, 3, 4)["out"] for r in range(3)]
    assert torch.equal(torch.cat(scatter), mx.signed_values(0, 0, 12))


def test_bitwise_expectations_use_integer_bits() -> None:
    a, b = mx.bit_values(0, 0, 16).long(), mx.bit_values(1, 0, 16).long()
    assert torch.equal(mx.expected_outputs("all_reduce.bxor", 0, 2, 16)["out"].long(), a ^ b)
    assert mx.applicable("all_reduce.band", "bfloat16", 2) == (False, "bitwise reduction band is undefined for bfloat16")
    assert mx.applicable("send_recv", "float32", 1)[0] is False


def test_values_are_exact_in_every_dtype() -> None:
    for name, dtype in mx.DTYPES.items():
        if name == "uint8":
            continue
        for redop in ("sum", "product", "band"):
            x = mx.reduction_input(redop, 3, 4, 100)
            assert torch.equal(x.to(dtype).to(torch.float64), x), (name, redop)


def test_tolerance_is_zero_for_data_movement_and_bounded_for_half_sums() -> None:
    assert mx.tolerance("all_gather", torch.bfloat16, 0, 4, 8, "from0") == 0.0
    tol = mx.tolerance("all_reduce.sum", torch.bfloat16, 0, 4, 8, "out")
    assert isinstance(tol, torch.Tensor) and float(tol.max()) < mx.CORRUPTION_DELTA
    assert mx.tolerance("all_reduce.avg", torch.int32, 0, 4, 8, "out") == 1.0
    assert mx.tolerance("all_reduce.sum", torch.int64, 0, 4, 8, "out") == 0.0


def test_compare_outputs_catches_one_wrong_element_and_nan() -> None:
    exp = {"out": torch.arange(5, dtype=torch.float64)}
    good = {"out": torch.arange(5, dtype=torch.bfloat16)}
    assert mx.compare_outputs(good, exp, lambda _: 0.0)[0] is True
    bad = {"out": torch.arange(5, dtype=torch.float32)}
    bad["out"][3] += 3
    ok, worst, n, first = mx.compare_outputs(bad, exp, lambda _: 0.0)
    assert (ok, worst, n) == (False, 3.0, 1) and first == "out[3]: got 6.0, expected 3.0"
    nan = {"out": torch.tensor([0.0, float("nan"), 2, 3, 4])}
    assert mx.compare_outputs(nan, exp, lambda _: 1.0)[0] is False
    assert mx.compare_outputs({"x": good["out"]}, exp, lambda _: 0.0)[0] is False


def test_plan_rejects_unknown_names_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown \['all_reduce.median'\]"):
        mx.MatrixPlan(checks=("all_reduce.median",))
    with pytest.raises(ValueError, match=r"sizes: every size must be an int >= 1, got \[0\]"):
        mx.MatrixPlan(checks=("broadcast",), sizes=(0,))
    with pytest.raises(ValueError, match="corrupt.check 'gather' is not among"):
        mx.MatrixPlan(checks=("broadcast",), corrupt=mx.CorruptionSpec(check="gather", rank=0))
    assert mx.expand_checks(["all_reduce"])[:2] == ("all_reduce.sum", "all_reduce.product")
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        mx.expand_checks(["allreduce"])
    plan = mx.MatrixPlan(checks=("barrier", "broadcast"), dtypes=("float32", "int32"), sizes=(1, 3))
    assert plan.cells()[0] == ("barrier", mx.NO_DTYPE, 0) and len(plan.cells()) == 5


def _obs(check: str, dtype: str, numel: int, rank: int, status: str, **kw: object) -> mx.CellObservation:
    return mx.CellObservation(check=check, dtype=dtype, numel=numel, rank=rank, status=status, **kw)  # type: ignore[arg-type]


def test_merge_takes_the_worst_rank_and_keeps_the_backends_message() -> None:
    plan = mx.MatrixPlan(checks=("broadcast", "all_gather"), dtypes=("float32",), sizes=(3,))
    per_rank = [
        [_obs("broadcast", "float32", 3, 0, "ok"), _obs("all_gather", "float32", 3, 0, "ok")],
        [_obs("broadcast", "float32", 3, 1, "wrong", mismatches=1, first_mismatch="out[0]: got 4.0, expected 1.0",
              max_abs_err=3.0),
         _obs("all_gather", "float32", 3, 1, "error", error="RuntimeError: invalid tensor size")],
    ]
    m = mx.merge_observations(plan, per_rank, backend="gloo", device_type="cpu")
    assert m.cell("broadcast", "float32", 3).status == "wrong"
    assert m.cell("broadcast", "float32", 3).wrong_ranks == (1,)
    assert "expected 1.0" in m.cell("broadcast", "float32", 3).detail
    assert m.cell("all_gather", "float32", 3).detail == "RuntimeError: invalid tensor size"
    with pytest.raises(ValueError, match="rank 1 returned 1 observations for 2 planned cells"):
        mx.merge_observations(plan, [per_rank[0], per_rank[1][:1]], backend="gloo", device_type="cpu")


NCCL_TESTS_FACTORS = {  # nccl-tests doc/PERFORMANCE.md and src/*.cu, at n = 8
    "all_reduce": 2 * 7 / 8, "reduce_scatter_tensor": 7 / 8, "all_gather_into_tensor": 7 / 8,
    "broadcast": 1.0, "reduce": 1.0, "all_to_all_single": 7 / 8, "gather": 7 / 8, "scatter": 7 / 8,
    "send_recv": 1.0,
}


def test_bus_factors_are_the_nccl_tests_ones() -> None:
    for op, factor in NCCL_TESTS_FACTORS.items():
        assert bw.bus_factor(op, 8) == pytest.approx(factor), op
    assert bw.algbw_gbps(4_000_000_000, 2.0) == 2.0
    assert bw.element_count("all_gather_into_tensor", 1000, 4, 3) == (83, 996)
    assert bw.element_count("all_reduce", 1000, 4, 3) == (250, 1000)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        bw.algbw_gbps(10, 0.0)


def test_bandwidth_rows_average_ranks_and_report_failures() -> None:
    plan = bw.BandwidthPlan(ops=("all_reduce", "all_gather_into_tensor"), sizes_bytes=(1024,), warmup=0, iters=1)
    assert plan.cells() == [("all_reduce", "in_place", 1024), ("all_gather_into_tensor", "out_of_place", 1024),
                            ("all_gather_into_tensor", "in_place", 1024)]
    per_rank = [[bw.BandwidthObservation(op=o, mode=m, size_bytes=s, count=128, rank=r,
                                         seconds=None if (r == 1 and m == "in_place" and o != "all_reduce")
                                         else 1e-6 * (r + 1), error="boom" if r == 1 else "")
                 for o, m, s in plan.cells()] for r in range(2)]
    rows = bw.merge_bandwidth(plan, per_rank)
    assert rows[0].time_us == pytest.approx(1.5)
    assert rows[0].algbw_gbps == pytest.approx(1024 / 1e9 / 1.5e-6)
    assert rows[0].busbw_gbps == pytest.approx(rows[0].algbw_gbps * 1.0)
    assert rows[2].busbw_gbps is None and rows[2].error == "boom"
    assert bandwidth_csv(rows).splitlines()[0].startswith("op,mode,dtype,world_size,size_bytes")


def _matrix(statuses: dict[tuple[str, str], str], backend: str = "gloo") -> mx.CommMatrix:
    cells = tuple(mx.MatrixCell(check=c, dtype=d, numel=7, status=s, detail=f"{c} says {s}")  # type: ignore[arg-type]
                  for (c, d), s in statuses.items())
    return mx.CommMatrix(backend=backend, device_type="cpu", world_size=2, torch_version="x", cells=cells)


def test_fallbacks_are_chosen_only_when_their_building_blocks_work() -> None:
    m = _matrix({("all_reduce.sum", "bfloat16"): "ok", ("all_reduce.avg", "bfloat16"): "error",
                 ("all_to_all_single", "bfloat16"): "error", ("batch_isend_irecv", "bfloat16"): "ok",
                 ("reduce_scatter_tensor.avg", "bfloat16"): "error",
                 ("reduce_scatter_tensor.sum", "bfloat16"): "error", ("broadcast", "bfloat16"): "ok"})
    needs = [("all_reduce.avg", "bfloat16"), ("reduce_scatter_tensor.avg", "bfloat16"),
             ("broadcast", "bfloat16"), ("all_to_all_single", "bfloat16"), ("send_recv", "bfloat16")]
    choices = {(c.check, c.dtype): c for c in fb.select_fallbacks(m, needs)}
    assert choices[("all_reduce.avg", "bfloat16")].fallback == "all_reduce_avg_via_sum"
    rs = choices[("reduce_scatter_tensor.avg", "bfloat16")]
    assert rs.fallback is None and "reduce_scatter_tensor.sum" in rs.reason
    assert choices[("all_to_all_single", "bfloat16")].fallback is None
    assert choices[("send_recv", "bfloat16")].status == "absent"
    assert ("broadcast", "bfloat16") not in choices
    assert ("barrier", mx.NO_DTYPE) in fb.training_needs("bf16")
    with pytest.raises(ValueError, match="precision 'tf32'"):
        fb.training_needs("tf32")


def test_fp32_upcast_fallback_needs_fp32_reductions() -> None:
    m = _matrix({("all_reduce.sum", "bfloat16"): "error", ("all_reduce.sum", "float32"): "ok"})
    (choice,) = fb.select_fallbacks(m, [("all_reduce.sum", "bfloat16")])
    assert choice.fallback == "all_reduce_sum_via_fp32"


def _result(matrix: mx.CommMatrix, busbw: float, backend: str) -> CommResult:
    row = bw.BandwidthRow(op="all_reduce", mode="in_place", dtype="float32", world_size=2, size_bytes=1024,
                          count=256, time_us=1024 / 1e3 / busbw, algbw_gbps=busbw, busbw_gbps=busbw)
    return CommResult(backend=backend, device_type="cpu", world_size=2, torch_version="x", matrix=matrix,
                      bandwidth=(row,))


def test_source_vs_target_shows_lost_support_wrong_results_and_bandwidth_ratio() -> None:
    src = _result(_matrix({("all_reduce.avg", "bfloat16"): "ok", ("all_gather", "float32"): "ok",
                           ("broadcast", "int64"): "error", ("gather", "float32"): "ok"}, "nccl"), 100.0, "nccl")
    tgt = _result(_matrix({("all_reduce.avg", "bfloat16"): "error", ("all_gather", "float32"): "wrong",
                           ("broadcast", "int64"): "ok", ("scatter", "float32"): "ok"}), 25.0, "gloo")
    cmp = compare_results(src, tgt)
    assert [(c.check, c.source, c.target) for c in cmp.lost_support] == [("all_reduce.avg", "ok", "error")]
    assert [(c.check, c.target) for c in cmp.correctness] == [("all_gather", "wrong")]
    assert [c.check for c in cmp.gained_support] == ["broadcast"]
    assert cmp.only_source == (("gather", "float32"),) and cmp.only_target == (("scatter", "float32"),)
    assert cmp.bandwidth[0].busbw_ratio == pytest.approx(0.25)
    assert cmp.regressions == 2
    text = comparison_markdown(cmp)
    assert "all_reduce.avg` bfloat16: ok -> error" in text and "| 0.25 |" in text


def test_result_file_round_trips_and_renders(tmp_path: Path) -> None:
    res = _result(_matrix({("all_reduce.sum", "float32"): "ok", ("gather", "int32"): "error"}), 3.0, "gloo")
    res = CommResult(**{**{f: getattr(res, f) for f in res.__slots__},  # type: ignore[attr-defined]
                        "fallbacks": (fb.FallbackResult(fallback="all_reduce_avg_via_sum", replaces="all_reduce.avg",
                                                        dtype="float32", numel=7, status="ok", fallback_s=1e-4,
                                                        native_status="ok", native_s=5e-5, cost_ratio=2.0),),
                        "option_mapping": ({"key": "NCCL_ALGO", "value": "Tree", "status": "unmapped",
                                            "target_key": None, "target_value": None, "note": "n", "doc": "d"},)})
    path = write_json(res, tmp_path / "r.json")
    assert read_json(path) == res
    text = markdown(res)
    assert "| gather | " in text and "error @ 7" in text and "1 option(s) have no equivalent" in text
    png = plot_bandwidth(res.bandwidth, tmp_path / "bw.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"bad.json: format is 'other'"):
        read_json(tmp_path / "bad.json")
    assert not math.isnan(read_json(path).bandwidth[0].busbw_gbps or math.nan)
