"""Tracking sinks: JSONL always; TensorBoard and W&B (offline) read back by their own libraries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from migrate.job.schema import TrackingSection
from migrate.tracking.tracker import Tracker, run_id


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


def _records(run_dir: Path) -> list[dict]:
    out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_one_wandb_run_per_job_resumed_with_sides_axes_tables_images_and_a_report(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.plot([1, 2])
    plt.savefig(tmp_path / "plot.png")
    tracking = TrackingSection(tensorboard=True, wandb={"enabled": True, "mode": "offline", "project": "t"})
    idle = Tracker(tmp_path, tracking, run_name="job")
    idle.close()
    assert idle.wandb_dir is None and not (tmp_path / "wandb").exists()  # nothing logged: no run
    first = Tracker(tmp_path, tracking, run_name="job")
    for step in range(2):
        first.log_metrics(step, {"loss": 1.0 + step}, prefix="train", side="baseline")
        first.log_metrics(step, {"loss": 2.0 + step}, prefix="train", side="target")
    first.log_table("search", "ranking", ["candidate", "seconds"], [["tp1", 0.5], ["tp2", 0.4]])
    first.log_image("gate", "loss", tmp_path / "plot.png")
    (tmp_path / "summary.md").write_text("# job\n")
    first.log_report("job-report", [tmp_path / "summary.md"])
    first_dir = first.wandb_dir
    first.close()
    second = Tracker(tmp_path, tracking, run_name="job")
    second.log_metrics(0, {"max_loss_diff": 0.0}, prefix="resume")
    second_dir = second.wandb_dir
    second.close()
    job_run = run_id("job", tmp_path)
    assert job_run in Path(first_dir).name and job_run in Path(second_dir).name  # one run id for the job, resumed
    records = _records(Path(first_dir))
    keys = {k for r in records if r["type"] == "history" for k in r["history"]["item"]}
    assert {"train/baseline/loss", "train/target/loss", "train/step"} <= keys
    assert "search/ranking._type" in keys and "gate/loss._type" in keys
    axes = {r["metric"].get("glob_name"): r["metric"].get("step_metric") for r in records if r["type"] == "metric"}
    assert axes.get("train/*") == "train/step"
    assert any(r["type"] == "artifact" and r["artifact"]["name"] == "job-report" for r in records)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("invocation" in r and "side" in r for r in rows)
    assert len({r["invocation"] for r in rows}) == 2 and {r["side"] for r in rows if r["kind"] == "step"} == {
        "baseline", "target", None}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for side, values in (("baseline", [1.0, 2.0]), ("target", [2.0, 3.0])):
        acc = EventAccumulator(str(tmp_path / "tensorboard" / side))
        acc.Reload()
        assert [e.value for e in acc.Scalars("train/loss")] == values
