"""The overhead benchmark's arithmetic: paired ratios, medians over rounds, the structural bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_comm_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_comm_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_overhead_is_the_median_paired_ratio_over_ranks(bench) -> None:
    # rank seconds per round; round 2 is disturbed for both loops alike (drift cancels in the pair)
    rank0 = {"all_reduce/4194304": {"bare": [1.0, 1.0, 3.0], "migrate": [1.02, 1.01, 3.03]}}
    rank1 = {"all_reduce/4194304": {"bare": [1.0, 1.0, 3.0], "migrate": [1.02, 1.03, 3.03]}}
    (row,) = bench.summarize([rank0, rank1], limit=0.05)
    assert row["op"] == "all_reduce" and row["size_bytes"] == 4194304
    assert row["overhead_pct"] == pytest.approx(2.0)
    assert row["bare_ms"] == pytest.approx(1000.0) and row["within_limit"] is True
    (slow,) = bench.summarize([{"x/1": {"bare": [1.0, 1.0], "migrate": [1.2, 1.1]}}], limit=0.05)
    assert slow["within_limit"] is False


def test_the_loop_adds_well_under_a_microsecond_per_call(bench) -> None:
    per_call = bench.loop_call_overhead_s(200_000)
    assert 0.0 <= per_call < 1e-6
    assert bench._size("4M") == 4 * 2**20 and bench._size("512") == 512
