"""The prepared accelerator check (scripts/accelerator_check.py) on this machine's GPU or NPU: skipped where none
is present (the same script runs on the CPU in tests/multiprocess/test_accelerator_check_on_cpu.py)."""
from __future__ import annotations

import pytest

from tests.multiprocess.test_accelerator_check_on_cpu import run_check_script


@pytest.mark.accelerator
def test_the_check_on_the_accelerator_of_this_machine(tmp_path):
    import torch

    device = "cuda" if torch.cuda.is_available() else "npu"
    run, report = run_check_script(tmp_path, "--device", device, "--budget-s", "420", timeout=600)
    print((tmp_path / "report.md").read_text())
    memory = next(s for s in report["steps"] if s["name"] == "memory_and_step_time")["data"]
    assert memory.get("under_predicted") == [], memory.get("under_predicted")
    assert run.returncode == 0, run.stderr[-3000:]
