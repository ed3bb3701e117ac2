"""Gate building blocks a user relies on: restarts, token alignment, tolerances, single checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convergence.checks import check_restart_continuity, spike_steps
from convergence.gate import evaluate
from convergence.series import MetricSeries, SeriesError, align, resolve_restarts, run_from_points
from convergence.tolerances import ToleranceError, Tolerances, load_tolerances, tolerances_from_mapping


def _loss(step: int) -> float:
    return 3.0 * math.exp(-step / 40) + 1.0


def test_restart_that_reproduces_passes_and_one_that_jumps_fails():
    first = [(s, _loss(s)) for s in range(1, 31)]
    good = resolve_restarts("loss", first + [(s, _loss(s)) for s in range(21, 41)], source="good.log")
    assert [(r.from_step, r.to_step) for r in good.restarts] == [(30, 21)]
    assert check_restart_continuity(good, Tolerances()).passed
    bad = resolve_restarts("loss", first + [(s, _loss(s) + 0.5) for s in range(21, 41)], source="bad.log")
    result = check_restart_continuity(bad, Tolerances())
    assert not result.passed
    assert "step 21 logged" in result.reason and "jumps" in result.reason


def test_restart_policy_last_drops_the_abandoned_timeline():
    points = [(s, 1.0) for s in range(1, 31)] + [(s, 2.0) for s in range(21, 26)]
    series = resolve_restarts("loss", points)
    assert series.steps == tuple(range(1, 26)) and series.value_at(25) == 2.0
    assert len(series.superseded) == 10  # 21..30 of the first attempt


def test_alignment_by_tokens_across_batch_sizes():
    base = {"loss": [(s, _loss(s)) for s in range(1, 101)], "tokens": [(s, 1024 * s) for s in range(1, 101)]}
    # The candidate runs twice the batch: half the steps, same tokens.
    cand = {"loss": [(s, _loss(2 * s)) for s in range(1, 51)], "tokens": [(s, 2048 * s) for s in range(1, 51)]}
    tol = tolerances_from_mapping({"align": {"by": "tokens"}})
    verdict = evaluate([run_from_points("b", base)], run_from_points("c", cand), tol)
    assert verdict.passed, verdict.reasons
    assert verdict.loss_bands.steps[0] == 2048
    no_tokens = run_from_points("c", {"loss": cand["loss"]})
    with pytest.raises(SeriesError, match="no consumed tokens"):
        evaluate([run_from_points("b", base)], no_tokens, tol)


def test_interpolated_alignment_stays_inside_the_baseline_range():
    b = MetricSeries(name="loss", steps=(10, 20, 30), values=(3.0, 2.0, 1.0))
    c = MetricSeries(name="loss", steps=(5, 15, 25, 35), values=(0.0, 2.5, 1.5, 0.0))
    aligned = align([b], c, interpolate=True)
    assert aligned.steps.tolist() == [15, 25] and aligned.baselines[0].tolist() == [2.5, 1.5]


def test_spikes_are_found_against_the_rolling_median():
    rng = np.random.default_rng(0)
    values = [2.0 + 0.01 * rng.standard_normal() for _ in range(100)]
    values[60] = 3.0
    series = MetricSeries(name="loss", steps=tuple(range(1, 101)), values=tuple(values))
    assert spike_steps(series, 20, 6.0).tolist() == [61]


def test_too_short_a_candidate_fails_coverage():
    base = run_from_points("b", {"loss": [(s, _loss(s)) for s in range(1, 101)]})
    cand = run_from_points("c", {"loss": [(s, _loss(s)) for s in range(1, 6)]})
    verdict = evaluate([base], cand, tolerances_from_mapping({"coverage": {"key_steps": [50]}}))
    assert verdict.failed_codes[0] == "coverage"
    assert "only 5 aligned steps" in verdict.reasons[0]


def test_tolerances_yaml_round_trip_and_errors(tmp_path):
    path = tmp_path / "tol.yaml"
    path.write_text("loss:\n  step_rel: 0.02\n  allowed_failures: 3\nrule:\n  alpha: 0.05\n  windows: [20, 100]\n")
    tol = load_tolerances(path)
    assert tol.loss.step_rel == 0.02 and tol.loss.allowed_failures == 3
    assert tol.rule.alpha == 0.05 and tol.rule.windows == (20, 100)
    path.write_text("loss:\n  step_rel: -1\n")
    with pytest.raises(ToleranceError, match=r"tol.yaml.*loss.step_rel must be >= 0, got -1"):
        load_tolerances(path)
    path.write_text("rule:\n  alpha: 1.5\n")
    with pytest.raises(ToleranceError, match=r"tol.yaml.rule: rule.alpha must be in \(0, 1\), got 1.5"):
        load_tolerances(path)
    path.write_text("rule:\n  windows: [1]\n")
    with pytest.raises(ToleranceError, match=r"window lengths >= 2"):
        load_tolerances(path)
    path.write_text("lossy: {}\n")
    with pytest.raises(ToleranceError, match=r"unknown key\(s\) \['lossy'\]"):
        load_tolerances(path)
    with pytest.raises(ToleranceError, match="align.by"):
        tolerances_from_mapping({"align": {"by": "epoch"}})
