"""The prepared accelerator check (scripts/accelerator_check.py) runs on the CPU in the suite, so it cannot rot
between the few minutes an accelerator is lent; on a machine with a GPU or NPU the same script runs there
(tests/accelerator/test_accelerator_check.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "accelerator_check.py"


def run_check_script(out: Path, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, dict]:
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run, json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_the_check_runs_every_step_on_the_cpu_and_writes_its_reports(tmp_path):
    run, report = run_check_script(tmp_path, "--device", "cpu", "--size", "small")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["device_facts", "operator_numerics", "checkpoint_round_trip", "memory_and_step_time"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s["error"] for k, s in steps.items()}
    facts = steps["device_facts"]["data"]
    assert facts["profile"] == "cpu" and facts["matmul"]["fp32"]["measured_tflops"] > 0 and facts["copy_gbps"] > 0
    assert steps["operator_numerics"]["data"]["passed"]
    for direction in steps["checkpoint_round_trip"]["data"].values():
        assert direction["differences"] == [] and direction["tensors"] > 50
    memory = steps["memory_and_step_time"]["data"]
    under = [r for r in memory["rows"] if r.get("under_predicted")]
    assert memory["measured"] == len(memory["rows"]) == 16 and memory["under_predicted"] == [], under
    for row in memory["rows"]:  # the CPU's measure: tensor bytes the torch profiler saw allocated
        assert row["measure"].startswith("torch profiler") and row["measured_tensor_bytes"] > 0
        assert 1.0 <= row["tensor_ratio"] < 3.0, row
        assert row["measured_step_s"] > 0 and "calibrated_ratio" in row
        assert len(row["tensor_peaks_bytes"]) == 2 and row["measured_tensor_bytes"] == min(row["tensor_peaks_bytes"])
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.startswith("# Accelerator check on `cpu`") and "| memory_and_step_time | ok |" in markdown


def test_a_spent_budget_skips_the_remaining_steps_and_says_so(tmp_path):
    from migrate.accelerator.check import run_check

    report = run_check("cpu", tmp_path, size="small", budget_s=0.0, echo=lambda line: None)
    assert [s["status"] for s in report["steps"]] == ["skipped"] * 4 and not report["passed"]
    assert all("budget of 0 s was spent" in s["summary"] for s in report["steps"])
