"""The gate on real runs of the built-in workloads: a correct migration passes, each fault fails.

A DeepSpeed baseline trains 16 steps at dp2 ZeRO-1 and saves at step 6; a repeat at dp1 (the same
training, another reduction order) gives the gate the baseline's own noise to calibrate its bands.
The "migration" converts the step-6 checkpoint to dp1 ZeRO-2 with our converter, and the target
trains on from it to step 16.
Each fault breaks a copy of the converted checkpoint (``checkpoint.state.faults``) before the
target resumes; the gate compares the target's steps 7..16 with the baseline's and must fail with
the reason that names the fault.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from checkpoint.api import LayoutRequest, convert
from checkpoint.state.faults import inject_fault
from convergence.gate import evaluate
from convergence.readers import read_metrics
from convergence.tolerances import Tolerances
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec, TrainSpec

STEPS, SAVED_AT = 16, 6

# fault: (codes of which at least one must fail, codes that must pass)
FAULTS = {
    "drop_optimizer": ({"loss_step", "resume_continuity", "loss_mean"}, {"first_step", "lr_mismatch", "nonfinite"}),
    # Swapped moments diverge; the steps skipped on non-finite gradients also shift the LR schedule.
    "swap_moments": ({"loss_step", "resume_continuity", "nonfinite", "grad_norm_band"}, {"first_step"}),
    "reset_lr": ({"lr_mismatch"}, {"first_step"}),
    "shift_data": ({"first_step"}, {"lr_mismatch"}),
    "nan_weights": ({"nonfinite"}, set()),
    "scale_weights": ({"grad_norm_band"}, set()),
}


def _train(tmp: Path, name: str, world_size: int, zero_stage: int, load_dir: Path | None) -> Path:
    metrics = tmp / f"{name}.jsonl"
    spec = RunSpec(engine="deepspeed", model=TINY_LLAMA, train=TrainSpec(precision="fp32"), steps=STEPS,
                   zero_stage=zero_stage, save_dir=str(tmp / f"{name}_ckpt") if load_dir is None else None,
                   save_every=SAVED_AT if load_dir is None else 0, load_dir=str(load_dir) if load_dir else None,
                   metrics_path=str(metrics), stop_on_nonfinite=False)
    launch(spec, world_size)
    return metrics


@pytest.fixture(scope="module")
def migration(tmp_path_factory, workload_extensions_dir):
    """(baseline metrics of two repeats, converted checkpoint at step 6 for dp1 ZeRO-2, scratch dir)."""
    tmp = tmp_path_factory.mktemp("gate_workloads")
    baselines = [_train(tmp, "baseline", world_size=2, zero_stage=1, load_dir=None),
                 _train(tmp, "repeat", world_size=1, zero_stage=1, load_dir=None)]
    converted = tmp / "converted"
    convert(tmp / "baseline_ckpt" / f"global_step{SAVED_AT}", converted, to="deepspeed", target=LayoutRequest(dp=1, zero_stage=2))
    return baselines, converted, tmp


def _gate(migration, fault: str | None):
    baselines, converted, tmp = migration
    name = fault or "correct"
    checkpoint = tmp / f"{name}_input"
    shutil.copytree(converted, checkpoint)
    if fault is not None:
        inject_fault(checkpoint, fault)
    candidate = _train(tmp, name, world_size=1, zero_stage=2, load_dir=checkpoint)
    return evaluate([read_metrics(b) for b in baselines], read_metrics(candidate), Tolerances())


@pytest.mark.slow
def test_correct_migration_of_a_real_deepspeed_run_passes(migration):
    verdict = _gate(migration, None)
    assert verdict.passed, verdict.reasons
    assert len(verdict.baselines) == 2


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_in_a_real_deepspeed_migration_fails_with_its_reason(migration, fault):
    verdict = _gate(migration, fault)
    must_fail_any, must_pass = FAULTS[fault]
    failed = set(verdict.failed_codes)
    assert not verdict.passed
    assert failed & must_fail_any, f"{fault}: failed {sorted(failed)}, expected one of {sorted(must_fail_any)}"
    assert not failed & must_pass, f"{fault}: {sorted(failed & must_pass)} should have passed; reasons {verdict.reasons}"
