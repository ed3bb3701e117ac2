"""Tracking sinks: JSONL always; TensorBoard and W&B (offline) read back by their own libraries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from migrate.job.schema import TrackingSection
from migrate.tracking.tracker import Tracker


def test_jsonl_tensorboard_and_wandb_offline(tmp_path):
    tracking = TrackingSection(tensorboard=True, wandb={"enabled": True, "mode": "offline", "project": "t"})
    tracker = Tracker(tmp_path, tracking, run_name="unit", config={"a": 1})
    for step in range(3):
        tracker.log_metrics(step, {"loss": 2.0 - step * 0.5, "note": "text", "bad": math.nan}, prefix="train")
    wandb_dir = tracker.wandb_dir
    tracker.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["metrics"]["loss"] for r in records] == [2.0, 1.5, 1.0]
    assert records[0]["metrics"]["bad"] == "nan"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [2.0, 1.5, 1.0]

    run_files = list(Path(wandb_dir).glob("run-*.wandb"))
    assert len(run_files) == 1
    out = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run_files[0])],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "train/loss" in out.stdout
