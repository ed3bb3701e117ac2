"""`migrate gate` from the command line and the gate stage of a job."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from migrate.commands.gate import command as gate_command

STEPS = 80


def _curve(noise_seed: int, *, lr_reset_at: int | None = None, bias: float = 0.0) -> list[dict]:
    """A loss curve with run-to-run noise (as two repeats of a nondeterministic job show)."""
    rng = np.random.default_rng(noise_seed)
    rows = []
    for step in range(1, STEPS + 1):
        lr = 1e-3 * min(1.0, step / 10)
        if lr_reset_at is not None and step >= lr_reset_at:
            lr = 1e-3 * min(1.0, (step - lr_reset_at + 1) / 10)
        loss = 2.0 + 3.0 * math.exp(-step / 25) + 0.01 * rng.standard_normal() + bias
        rows.append({"step": step, "loss": loss, "grad_norm": 1.0 + 0.5 * math.exp(-step / 30) + 0.02 * rng.standard_normal(),
                     "lr": lr, "consumed_samples": 8 * step})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tensorboard(path: Path, rows: list[dict]) -> str:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(path))
    for r in rows:  # the tags Megatron-LM writes
        writer.add_scalar("lm loss", r["loss"], r["step"])
        writer.add_scalar("grad-norm", r["grad_norm"], r["step"])
        writer.add_scalar("learning-rate", r["lr"], r["step"])
    writer.close()
    return str(path)


def _megatron(path: Path, rows: list[dict]) -> str:
    lines = []
    for r in rows:
        s = f" [2026-01-01 00:00:00] iteration {r['step']:8d}/{STEPS:8d} |"
        s += f" consumed samples: {r['consumed_samples']:12d} | elapsed time per iteration (ms): 100.0 |"
        s += f" learning rate: {r['lr']:.6E} | global batch size: {8:5d} | lm loss: {r['loss']:.6E} |"
        s += f" loss scale: 1.0 | grad norm: {r['grad_norm']:.3f} | number of skipped iterations:   0 |"
        s += " number of nan iterations:   0 |"
        lines.append(s)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture()
def baselines(tmp_path):
    return [_jsonl(tmp_path / "base0.jsonl", _curve(0)), _tensorboard(tmp_path / "tb1", _curve(1))]


def _run(args: list[str]):
    return CliRunner().invoke(gate_command, args, catch_exceptions=False)


def test_gate_passes_a_matching_run_and_writes_the_report(tmp_path, baselines):
    candidate = _megatron(tmp_path / "cand.log", _curve(2))
    report = tmp_path / "report"
    result = _run(["--baseline", baselines[0], "--baseline", baselines[1], "--candidate", candidate,
                   "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert "gate: PASS" in result.output
    verdict = json.loads((report / "verdict.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["bands"]["loss"]["calibrated"]
    for name in ("loss.png", "grad_norm.png", "deviation.png", "report.md"):
        assert (report / name).stat().st_size > 0
    html = (report / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "PASS" in html


def test_gate_fails_a_reset_schedule_with_the_reason(tmp_path, baselines):
    candidate = _jsonl(tmp_path / "cand.jsonl", _curve(2, lr_reset_at=40))
    result = _run(["--baseline", baselines[0], "--baseline", baselines[1], "--candidate", candidate, "--json"])
    assert result.exit_code == 1
    verdict = json.loads(result.output)
    assert "lr_mismatch" in verdict["failed"]
    assert any("step 40" in r for r in verdict["reasons"])


def test_gate_fails_a_shifted_loss(tmp_path, baselines):
    candidate = _jsonl(tmp_path / "cand.jsonl", _curve(2, bias=0.1))
    result = _run(["--baseline", baselines[0], "--baseline", baselines[1], "--candidate", candidate])
    assert result.exit_code == 1
    assert "loss_mean" in result.output and "loss level over the run" in result.output  # a whole-run shift: the level


def test_bad_inputs_exit_2_naming_the_file(tmp_path, baselines):
    garbage = tmp_path / "notes.txt"
    garbage.write_text("nothing to see\n")
    result = CliRunner().invoke(gate_command, ["--baseline", baselines[0], "--candidate", str(garbage)])
    assert result.exit_code == 2
    assert "notes.txt" in result.output and "expected" in result.output
    tol = tmp_path / "tol.yaml"
    tol.write_text(yaml.safe_dump({"loss": {"step_rell": 0.1}}))
    result = CliRunner().invoke(gate_command, ["--baseline", baselines[0], "--candidate", baselines[0],
                                               "--tolerances", str(tol)])
    assert result.exit_code == 2 and "step_rell" in result.output and "tol.yaml" in result.output
    no_loss = _jsonl(tmp_path / "gn.jsonl", [{"step": 1, "grad_norm": 1.0}])
    result = CliRunner().invoke(gate_command, ["--baseline", baselines[0], "--candidate", no_loss])
    assert result.exit_code == 2 and "gn.jsonl" in result.output and "no loss series" in result.output


def test_tolerance_file_loosens_the_gate(tmp_path, baselines):
    candidate = _jsonl(tmp_path / "cand.jsonl", _curve(2, bias=0.1))
    tol = tmp_path / "tol.yaml"
    tol.write_text(yaml.safe_dump({"loss": {"step_rel": 0.2, "window_rel": 0.2, "level_rel": 0.1}}))
    result = _run(["--baseline", baselines[0], "--candidate", candidate, "--tolerances", str(tol)])
    assert result.exit_code == 0, result.output


def test_gate_stage_in_a_job(tmp_path, baselines, monkeypatch):
    from migrate.job.load import parse_job
    from migrate.pipeline.runner import run_pipeline
    from migrate.stages import STAGES
    from migrate.stages.gate import STAGE
    from migrate.tracking.tracker import Tracker

    monkeypatch.setitem(STAGES, "gate", STAGE)
    demo = yaml.safe_load((Path(__file__).parents[2] / "configs" / "demo_cpu.yaml").read_text())
    demo["work_dir"] = str(tmp_path / "work")
    demo["source"]["metrics"] = [{"path": baselines[0], "format": "jsonl", "label": "h100 run 7"}]
    demo["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    candidate = _jsonl(tmp_path / "cand.jsonl", _curve(2))
    demo["stages"] = {"gate": {"candidate": candidate, "extra_baselines": [baselines[1]],
                               "tolerances": {"loss": {"warmup_steps": 5}}}}
    job = parse_job(demo, tmp_path / "job.yaml")
    tracker = Tracker(job.work_dir, job.spec.tracking, run_name=job.name)
    try:
        result = run_pipeline(job, tracker=tracker, start_group=lambda **kw: pytest.fail("gate needs no workers"))
    finally:
        tracker.close()
    assert result.ok, [r for r in result.records]
    artifact = json.loads((job.work_dir / "gate" / "result.json").read_text())
    assert artifact["verdict"] == "pass"
    assert Path(artifact["outputs"]["html"]).exists()
    assert f"* baseline: `h100 run 7 ({baselines[0]})`" in (job.work_dir / "gate" / "summary.md").read_text()
    bad = dict(demo, stages={"gate": {"tolerances": {"loss": {"nope": 1}}}})
    with pytest.raises(Exception, match="nope"):
        parse_job(bad, tmp_path / "job.yaml")
