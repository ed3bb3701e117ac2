"""Deliverable 6: the gate passes a correct migration and fails each injected fault
with the right reason, on real (small) torch training runs.

The workload is a real nn model (MLP with dropout) trained with torch.optim.Adam and
a warm-up + cosine LambdaLR schedule on deterministic data, four micro-batches per
step. Gradient accumulation order is permuted per run (``order_seed``): the baselines
are two repeats that differ only in reduction order, like a nondeterministic
all-reduce, so the calibrated bands measure real floating-point noise. The candidate
is the "migrated" run: the baseline's state at step K saved with torch.save, loaded
with ``torch.load(weights_only=True)`` into fresh objects, and trained on with yet
another reduction order (another cluster). Each fault corrupts that resume.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from convergence.gate import evaluate
from convergence.series import RunMetrics, run_from_points
from convergence.tolerances import Tolerances

STEPS, RESUME, MICRO, SEED = 60, 30, 4, 1234


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(64, 4))


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS + 4, MICRO, 8, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    y = (x @ teacher + 0.3 * torch.randn(STEPS + 4, MICRO, 8, 4, generator=g)).argmax(-1)
    return x, y


DATA = _batches()


def _schedule(step: int) -> float:
    if step < 10:
        return (step + 1) / 10
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 10) / (STEPS - 10)))


@dataclass
class Trainer:
    model: nn.Module
    optim: torch.optim.Adam
    sched: torch.optim.lr_scheduler.LambdaLR
    position: int = 0


def _fresh() -> Trainer:
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    return Trainer(model, optim, torch.optim.lr_scheduler.LambdaLR(optim, _schedule))


def _step(t: Trainer, step: int, order: torch.Generator, points: dict, fault: str | None) -> None:
    x, y = DATA[0][t.position].clone(), DATA[1][t.position]
    if fault == "nan_step" and step == RESUME + 5:
        x[0, 0, 0] = math.nan  # one corrupted sample
    scale = 1e3 if fault == "grad_blowup" and step >= RESUME + 3 else 1.0  # loss scale never unscaled
    lr = t.optim.param_groups[0]["lr"]
    t.optim.zero_grad()
    total = 0.0
    # Forward in data order (dropout masks do not depend on the run), backward and
    # sum in a per-run order: only the floating-point reduction order differs.
    losses = [nn.functional.cross_entropy(t.model(x[m]), y[m]) / MICRO for m in range(MICRO)]
    for m in torch.randperm(MICRO, generator=order).tolist():
        (losses[m] * scale).backward()
        total += losses[m].item()
    gn = float(torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm=1e12))
    if math.isfinite(gn):
        t.optim.step()
        t.sched.step()
    # else: the step is skipped, as mixed-precision optimizers do
    t.position += 1
    for key, value in (("loss", total), ("grad_norm", gn), ("lr", lr)):
        points[key].append((step, value))


def _save(t: Trainer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": t.model.state_dict(), "optim": t.optim.state_dict(), "sched": t.sched.state_dict(),
                "rng": torch.get_rng_state(), "position": t.position}, buffer)
    return buffer.getvalue()


def _baseline(order_seed: int) -> tuple[RunMetrics, bytes]:
    torch.manual_seed(SEED)
    t = _fresh()
    order = torch.Generator().manual_seed(order_seed)
    points: dict = {"loss": [], "grad_norm": [], "lr": []}
    saved = b""
    for step in range(1, STEPS + 1):
        _step(t, step, order, points, None)
        if step == RESUME:
            saved = _save(t)
    return run_from_points(f"baseline-order{order_seed}", points), saved


def _resumed(saved: bytes, fault: str | None, order_seed: int = 2) -> RunMetrics:
    """The migrated run: fresh objects, state loaded (minus what the fault drops), steps K+1..N."""
    torch.manual_seed(999)  # a new process on another machine
    state = torch.load(io.BytesIO(saved), weights_only=True)
    t = _fresh()
    t.model.load_state_dict(state["model"])
    if fault != "optimizer_dropped":
        optim_state = state["optim"]
        if fault == "moments_swapped":
            for s in optim_state["state"].values():
                s["exp_avg"], s["exp_avg_sq"] = s["exp_avg_sq"], s["exp_avg"]
        t.optim.load_state_dict(optim_state)
    if fault != "lr_reset":
        t.sched.load_state_dict(state["sched"])
    # As Megatron's scheduler does every iteration: the lr comes from the scheduler's step.
    for group, lr in zip(t.optim.param_groups, t.sched.get_last_lr()):
        group["lr"] = lr
    if fault == "rng_reset":
        torch.manual_seed(SEED)
    else:
        torch.set_rng_state(state["rng"])
    t.position = state["position"] + (1 if fault == "data_shift" else 0)
    order = torch.Generator().manual_seed(order_seed)
    points: dict = {"loss": [], "grad_norm": [], "lr": []}
    for step in range(RESUME + 1, STEPS + 1):
        _step(t, step, order, points, fault)
    return run_from_points(f"candidate-{fault or 'correct'}", points)


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    try:
        (a, saved), (b, _) = _baseline(0), _baseline(1)
        yield [a, b], saved
    finally:
        torch.set_num_threads(threads)


def test_baseline_repeats_differ_only_by_reduction_noise(runs):
    (a, b), _ = runs
    la, lb = a.series["loss"].y, b.series["loss"].y
    assert not (la == lb).all(), "the two baselines must differ (reduction order), or calibration measures nothing"
    assert abs(la - lb).max() < 1e-4 * abs(la).max()


def test_correct_migration_passes_with_calibrated_bands(runs):
    baselines, saved = runs
    verdict = evaluate(baselines, _resumed(saved, None), Tolerances())
    assert verdict.passed, verdict.reasons
    assert verdict.loss_bands.calibrated and verdict.grad_norm_bands.calibrated


def test_correct_migration_passes_with_one_baseline_and_prior_tolerances(runs):
    baselines, saved = runs
    verdict = evaluate(baselines[:1], _resumed(saved, None), Tolerances())
    assert verdict.passed, verdict.reasons
    assert verdict.loss_bands.provenance() == {"prior": len(verdict.loss_bands.steps)}


EXPECTED = {
    # fault: (codes that must be among the failures, codes that must not)
    "optimizer_dropped": ({"resume_continuity", "loss_step"}, {"first_step", "nonfinite", "lr_mismatch"}),
    # NaN updates are skipped together with their scheduler step, so the lr drifts too.
    "moments_swapped": ({"nonfinite"}, {"first_step"}),
    "lr_reset": ({"lr_mismatch"}, {"first_step", "nonfinite"}),
    "data_shift": ({"first_step", "loss_step"}, {"nonfinite", "lr_mismatch"}),
    "rng_reset": ({"first_step", "loss_step"}, {"nonfinite", "lr_mismatch"}),
    "nan_step": ({"nonfinite"}, {"first_step"}),
    "grad_blowup": ({"grad_norm_band"}, {"first_step", "nonfinite", "lr_mismatch"}),
}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_injected_fault_fails_with_the_right_reason(runs, fault):
    baselines, saved = runs
    verdict = evaluate(baselines, _resumed(saved, fault), Tolerances())
    must, must_not = EXPECTED[fault]
    failed = set(verdict.failed_codes)
    assert not verdict.passed
    assert must <= failed, (fault, verdict.reasons)
    assert not (must_not & failed), (fault, verdict.reasons)
    for check in verdict.checks:
        if not check.passed:
            assert check.reason and any(ch.isdigit() for ch in check.reason)


def test_optimizer_fault_reason_points_at_optimizer_or_schedule(runs):
    baselines, saved = runs
    verdict = evaluate(baselines, _resumed(saved, "optimizer_dropped"), Tolerances())
    reason = next(c.reason for c in verdict.checks if c.code == "resume_continuity")
    assert "optimizer state or LR schedule" in reason


def test_report_of_a_failed_migration_shows_the_reasons(runs, tmp_path):
    from convergence.report import write_report

    baselines, saved = runs
    verdict = evaluate(baselines, _resumed(saved, "optimizer_dropped"), Tolerances())
    paths = write_report(verdict, tmp_path)
    data = json.loads(paths["verdict"].read_text())
    assert data["verdict"] == "fail" and "resume_continuity" in data["failed"]
    assert data["bands"]["loss"]["sources"].get("calibrated", 0) + data["bands"]["loss"]["sources"].get("floor", 0) == 30
    markdown = paths["markdown"].read_text()
    assert "## Why it failed" in markdown and "resume_continuity" in markdown
    assert paths["loss"].stat().st_size > 10_000
