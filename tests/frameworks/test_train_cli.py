"""`migrate train`: a baseline run, then a target-side run resumed from its checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from migrate.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_baseline_then_resume_continues_the_loss_bit_identically(tmp_path, workload_extensions_dir, ray_session):
    data = copy.deepcopy(yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text()))
    data["work_dir"] = str(tmp_path / "work")
    data["source"]["layout"] = {"tp": 1, "pp": 1, "dp": 2, "sharding": "zero1"}
    data["source"]["cluster"]["device_count"] = 2
    data["target"]["layout"] = {"tp": 1, "pp": 1, "dp": 2, "sharding": "zero1"}
    data["stages"] = {"train": {"side": "baseline", "steps": 4, "save_every": 2}}
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    first = runner.invoke(main, ["run", str(job)])
    assert first.exit_code == 0, first.output
    baseline_dir = tmp_path / "work" / "train" / "baseline"
    baseline = [json.loads(line) for line in (baseline_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in baseline] == [1, 2, 3, 4]
    checkpoint = baseline_dir / "checkpoints" / "global_step2"
    assert checkpoint.is_dir()

    resumed = runner.invoke(main, ["train", str(job), "--side", "target", "--steps", "4", "--load", str(checkpoint)])
    assert resumed.exit_code == 0, resumed.output
    target = [json.loads(line) for line in (tmp_path / "work" / "train" / "target" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in target] == [3, 4]
    assert [r["loss"] for r in target] == [r["loss"] for r in baseline[2:]]
    assert [r["grad_norm"] for r in target] == [r["grad_norm"] for r in baseline[2:]]
    artifact = json.loads((tmp_path / "work" / "train" / "target" / "result.json").read_text())  # its own result
    kept = json.loads((tmp_path / "work" / "train" / "result.json").read_text())  # the baseline's, not overwritten
    assert kept["metrics"]["side"] == "baseline" and kept["metrics"]["start_step"] == 0
    assert artifact["metrics"]["side"] == "target"
    assert artifact["metrics"]["start_step"] == 2 and artifact["verdict"] == "pass"
