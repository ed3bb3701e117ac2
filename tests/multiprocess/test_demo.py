"""The README's first command: the CPU demo job end to end (embedded Ray, W&B offline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_job_runs_end_to_end_and_skips_on_rerun(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(REPO / "configs" / "demo_ops.py", configs / "demo_ops.py")  # the custom operator the job registers
    # The job as the README runs it but for one limit. Its step-time tail limit (P99/P50 <= 5) fits an idle 2-core
    # machine; here the other test worker shares the cores, and its bursts alone took a 50 ms step to 733 ms
    # (P99/P50 12.8 over 21 steps). Timing belongs to benchmarks, not to assertions: the copy keeps the check with
    # a limit no shared machine reaches. The limit itself is judged in tests/unit/test_stability_rules.py and
    # tests/frameworks/test_stability_stage.py.
    job = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    job["stages"]["stability"]["max_jitter"] = 1e6
    (configs / "demo_cpu.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    migrate_bin = Path(sys.executable).with_name("migrate")
    env = {**os.environ, "WANDB_MODE": "offline"}
    first = subprocess.run([str(migrate_bin), "run", "configs/demo_cpu.yaml"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    work = tmp_path / "runs" / "demo-cpu"
    summary = json.loads((work / "summary.json").read_text())
    assert summary["ok"] is True
    assert [s["status"] for s in summary["stages"]] == ["succeeded"] * len(summary["stages"])
    summary_md = (work / "summary.md").read_text()
    assert "all stages passed" in summary_md
    assert "(chosen by the search stage)" in summary_md  # the demo leaves the target layout to the search
    runs = list((work / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs, "W&B offline run missing"
    read = subprocess.run([str(migrate_bin.with_name("wandb")), "leet", "inspect", "--json", str(runs[0])],
                          capture_output=True, text=True, timeout=120)  # W&B's own reader
    records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
    keys = {k for r in records if r["type"] == "history" for k in r["history"]["item"]}
    for series in ("train/baseline/loss", "resume/baseline/loss", "resume/target/loss", "resume/target/grad_norm",
                   "stability/loss", "stability/host_rss_mib"):
        assert series in keys, series
    for table in ("search/ranking", "comm/matrix"):
        assert f"{table}._type" in keys, table
    assert {"gate/loss._type", "stability/memory._type", "stability/timeline._type"} <= keys  # the stages' plots
    axes = {r["metric"].get("glob_name"): r["metric"].get("step_metric") for r in records if r["type"] == "metric"}
    assert axes.get("resume/*") == "resume/step" and axes.get("stability/*") == "stability/step"
    assert any(r["type"] == "artifact" and r["artifact"]["name"] == "demo-cpu-report" for r in records)
    assert {p.name for p in (work / "tensorboard").iterdir() if p.is_dir()} >= {"baseline", "target"}
    assert list((work / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard events missing"
    for stage in summary["stages"]:
        artifact = json.loads(Path(stage["artifact"]).read_text())
        assert artifact["status"] == "succeeded"
    ops = json.loads((work / "ops" / "ops.json").read_text())  # the demo's fused RoPE, its CPU substitute
    assert [(v["name"], v["status"], v["chosen"]) for v in ops["custom"]] == [
        ("fused_rope", "native", "demo_ops.py:rope_composed")]
    stability = json.loads((work / "stability" / "stability.json").read_text())  # rank 1 killed, recovered
    assert stability["passed"] and [r["steps_lost"] for r in stability["recoveries"]] == [1]
    assert {c["code"]: c["passed"] for c in stability["checks"]}["recovery_reference"] is True
    tail = next(c for c in stability["checks"] if c["code"] == "step_time_tail")  # measured, reported, not judged
    assert tail["details"]["points"] > 10 and tail["details"]["jitter"] >= 1 and "jitter P99/P50" in tail["reason"]
    assert first.stdout.strip().splitlines()[-1].startswith("PASSED: 9 stage(s) of job demo-cpu; target layout ")
    second = subprocess.run([str(migrate_bin), "run", "configs/demo_cpu.yaml"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0
    assert len(list((work / "wandb").glob("offline-run-*"))) == 1  # a rerun that ran nothing made no W&B run
    assert all(s["decision"] == "skip" for s in json.loads((work / "summary.json").read_text())["stages"])
