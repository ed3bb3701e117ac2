"""The stability stage's decisions without a cluster: trend intervals over restart segments, the growth
verdict, step-time tails, the periodic-slowdown test's power and false-alarm rate, the recovery decision,
the job's options and the CLI's --kill flag."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from convergence.stability import (Segment, check_growth, check_periodic, check_tails, compare_steps, fit_trend,
                                   periodic_slowdown, step_times)
from migrate.stages.stability import Attempt, StabilityOptions, decide_recovery
from migrate.workload.long_run import RunRecords


def _segments(rng, slope, levels, lengths, noise, start=0):
    out, step = [], start
    for level, n in zip(levels, lengths):
        x = np.arange(step, step + n)
        out.append(Segment(steps=tuple(int(v) for v in x), values=tuple(level + slope * x + rng.normal(0, noise, n))))
        step += n - 3  # each restart repeats a few steps
    return out


@settings(max_examples=40, deadline=None)
@given(slope=st.floats(-5, 5), seed=st.integers(0, 2**31 - 1), levels=st.lists(st.floats(0, 1e4), min_size=1, max_size=4))
def test_a_restart_is_neither_growth_nor_shrinkage(slope, seed, levels):
    """Each segment has a level of its own: the common slope is recovered whatever the levels are."""
    rng = np.random.default_rng(seed)
    trend = fit_trend(_segments(rng, slope, levels, [60] * len(levels), noise=0.01), confidence=0.99)
    assert trend is not None and trend.segments == len(levels)
    assert abs(trend.slope - slope * 1000) < 5 and trend.lower <= trend.slope <= trend.upper


def test_trend_intervals_cover_the_true_slope_at_their_confidence():
    rng = np.random.default_rng(7)
    covered = 0
    for _ in range(400):
        trend = fit_trend(_segments(rng, 0.02, [100.0, 90.0], [150, 150], noise=1.0), confidence=0.95)
        covered += trend.lower <= 20.0 <= trend.upper
    assert covered / 400 >= 0.92


def test_growth_fails_only_when_significantly_above_the_limit():
    rng = np.random.default_rng(1)
    leak = fit_trend(_segments(rng, 1.0, [400.0], [40], noise=0.05), confidence=0.99)  # 1 MiB a step
    flat = fit_trend(_segments(rng, 0.0, [400.0], [40], noise=0.05), confidence=0.99)
    short = fit_trend(_segments(rng, 0.07, [400.0], [8], noise=0.3), confidence=0.99)  # 70 MiB / 1k, 8 steps
    failed = check_growth("host_memory_growth", "host RSS of rank 3", leak, 64, "MiB")
    assert not failed.passed and "host RSS of rank 3 grows +1e+03 MiB per 1000 steps" in failed.reason
    assert "significantly above the limit of 64 MiB per 1000 steps" in failed.reason
    assert check_growth("host_memory_growth", "host RSS", flat, 64, "MiB").passed
    undecided = check_growth("host_memory_growth", "host RSS", short, 64, "MiB")
    assert undecided.passed and "a longer run would tell" in undecided.reason
    assert check_growth("x", "host RSS", None, 64, "MiB").skipped


def test_tails_and_percentiles():
    stats = step_times([0.1] * 98 + [0.5, 0.5])
    assert stats.p50 == pytest.approx(0.1) and stats.jitter > 1.5
    result = check_tails(stats, 1.5)
    assert not result.passed and "jitter P99/P50" in result.reason and "> limit 1.5" in result.reason
    assert check_tails(step_times([0.1] * 100), 1.5).passed


def test_a_periodic_stall_is_found_with_its_period_and_phase():
    rng = np.random.default_rng(3)
    steps = np.arange(7, 67)
    times = 0.03 + rng.normal(0, 0.002, len(steps)) + 0.2 * (steps % 6 == 1)
    found = periodic_slowdown(steps, times, max_period=200)
    assert (found.period, found.phase) == (6, 1) and found.excess_s == pytest.approx(0.2, abs=0.01)
    result = check_periodic(found, alpha=0.01, limit=0.1)
    assert not result.passed and "every 6 steps (step % 6 == 1)" in result.reason


def test_the_periodic_test_keeps_its_false_alarm_rate_on_heavy_tailed_noise():
    rng = np.random.default_rng(11)
    alarms = sum(periodic_slowdown(np.arange(100), 0.03 + 0.003 * rng.standard_t(2, 100), max_period=200).p_value < 0.01
                 for _ in range(300))
    assert alarms <= 6  # 1 % of 300 is 3


def test_compare_steps_is_bit_exact_by_default():
    ours, ref = {5: {"loss": 1.0, "grad_norm": 2.0}}, {5: {"loss": 1.0, "grad_norm": float(np.nextafter(2.0, 3.0))}}
    exact = compare_steps("recovery_reference", "recovered run", ours, ref, keys=("loss", "grad_norm"), rtol=0)
    assert not exact.passed and "grad_norm at step 5" in exact.reason
    assert compare_steps("recovery_reference", "recovered run", ours, ref, keys=("loss", "grad_norm"), rtol=1e-12).passed


def _attempt(index, loaded_step, last, failure=""):
    rows = tuple({"step": s, "wall_time": float(s)} for s in range(loaded_step + 1, last + 1))
    return Attempt(index=index, loaded_step=loaded_step, loaded=f"/ck/{loaded_step}", started_at=0.0, ended_at=1.0,
                   records=RunRecords(ranks={0: rows, 1: rows}, checkpoints=()), failure=failure)


def test_recovery_restarts_from_the_newest_checkpoint_within_the_budget():
    committed = [(2, "/converted"), (4, "/ck/4"), (8, "/ck/8")]
    failed = _attempt(1, 2, 10, "rank 1 on node-a: died: pid 9 killed by signal SIGKILL")
    decision = decide_recovery(failed, restarts=0, max_restarts=3, committed=committed)
    assert decision.action == "restart" and decision.load == (8, "/ck/8")
    assert "attempt 1 failed after step 10 (rank 1 on node-a: died" in decision.reason
    given_up = decide_recovery(failed, restarts=3, max_restarts=3, committed=committed)
    assert given_up.action == "fail" and given_up.reason.startswith("not recovered: 3 restart(s) used of max_restarts 3")
    assert "rank 1 on node-a" in given_up.reason
    assert decide_recovery(_attempt(2, 8, 20), restarts=1, max_restarts=3, committed=committed).action == "done"


def test_options_are_checked_where_the_job_states_them():
    with pytest.raises(ValueError, match=r"faults rank 1 at step 30 lie after the run's last step \(steps 20\)"):
        StabilityOptions(steps=20, faults=[{"kill_rank": 1, "at_step": 30}])
    with pytest.raises(ValueError, match="stall_every.*and stall_s.*go together"):
        StabilityOptions(stall_every=5)
    assert StabilityOptions().planned_steps == 200 and StabilityOptions(minutes=5).planned_steps is None


def test_the_cli_reads_kill_flags_and_refuses_bad_ones(tmp_path):
    from migrate.cli import main

    runner = CliRunner()
    bad = runner.invoke(main, ["stability", str(tmp_path / "job.yaml"), "--kill", "1-30"])
    assert bad.exit_code == 2 and "'1-30': expected RANK@STEP" in bad.output
    missing = runner.invoke(main, ["stability", str(tmp_path / "job.yaml"), "--kill", "1@30"])
    assert missing.exit_code == 2 and "file not found" in missing.output
