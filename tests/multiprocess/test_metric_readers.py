"""Reading metric series from the files real training stacks write."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from convergence.readers import detect_format, read_metrics
from convergence.series import SeriesError


def _megatron_line(iteration: int, train_iters: int, samples: int, lr: float, loss: float | None, grad_norm: float,
                   nan_iters: int = 0) -> str:
    """One line exactly as megatron/training/training.py training_log() formats it."""
    log_string = f" [{datetime(2026, 1, 1, 12, 0, 0).strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += f' iteration {iteration:8d}/{train_iters:8d} |'
    log_string += f' consumed samples: {samples:12d} |'
    log_string += f' elapsed time per iteration (ms): {123.4:.1f} |'
    log_string += ' memory(GiB): 12.5 | elapsed time: 0:01:02 | remaining time: 0:10:00 |'
    log_string += f' learning rate: {lr:.6E} |'
    log_string += f' global batch size: {8:5d} |'
    if loss is not None:
        log_string += ' {}: {:.6E} |'.format("lm loss", loss)
    log_string += f' loss scale: {1.0:.1f} |'
    log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += f' number of skipped iterations: {0:3d} |'
    log_string += f' number of nan iterations: {nan_iters:3d} |'
    return log_string


def test_megatron_log_with_resume_and_nan(tmp_path):
    lines = ["using world size: 8, data-parallel size: 2", "> building GPT model ..."]
    lines += [_megatron_line(i, 100, 8 * i, 1e-4, 2.0 - 0.01 * i, 1.5) for i in range(1, 21)]
    lines += ["saving checkpoint at iteration      10", "loading checkpoint from /ckpt at iteration 10"]
    lines += [_megatron_line(i, 100, 8 * i, 1e-4, 2.0 - 0.01 * i + 1e-7, 1.5) for i in range(11, 16)]
    lines += [_megatron_line(16, 100, 128, 1e-4, None, 1.5, nan_iters=1)]
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "megatron"
    run = read_metrics(path)
    loss = run.require("loss")
    assert loss.name == "lm loss"
    assert loss.steps == tuple(range(1, 17))  # 17..20 of the first attempt were superseded by the resume
    assert [(r.from_step, r.to_step) for r in loss.restarts] == [(20, 11)]
    assert math.isnan(loss.value_at(16))
    assert loss.value_at(12) == pytest.approx(2.0 - 0.12 + 1e-7, rel=1e-6)
    assert run.require("grad_norm").value_at(3) == pytest.approx(1.5)
    assert run.require("lr").value_at(3) == pytest.approx(1e-4)
    assert run.require("samples").value_at(5) == 40
    with pytest.raises(SeriesError, match="goes back from step 20 to step 11"):
        read_metrics(path, policy="error")
    first = read_metrics(path, policy="first").require("loss")
    assert first.value_at(12) == pytest.approx(2.0 - 0.12, rel=1e-6)


def test_deepspeed_log_engine_and_pipeline_lines(tmp_path):
    lines = []
    for step in range(1, 6):
        lr, mom = [1e-4 * step], [(0.9, 0.999)]
        lines.append(f"[2026-01-01 12:00:00,000] [INFO] [logging.py:107:log_dist] [Rank 0] "
                     f"step={step}, skipped=0, lr={lr}, mom={mom}")
        lines.append(f'steps: {step} loss: {3.0 / step:0.4f} iter time (s): {0.5:0.3f} samples/sec: {64.0:0.3f}')
    path = tmp_path / "ds.log"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "deepspeed"
    run = read_metrics(path)
    assert run.require("loss").values == pytest.approx([3.0, 1.5, 1.0, 0.75, 0.6], abs=1e-4)
    assert run.require("lr").value_at(3) == pytest.approx(3e-4)
    assert run.series["skipped"].values == (0.0,) * 5


def test_tensorboard_written_by_summary_writer_with_restart(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "tb"
    first = SummaryWriter(str(logdir), filename_suffix=".a")
    for step in range(1, 11):
        first.add_scalar("lm loss", 3.0 - 0.1 * step, step)
        first.add_scalar("grad-norm", 1.0 + 0.01 * step, step)
        first.add_scalar("learning-rate", 1e-3, step)
    first.close()
    resumed = SummaryWriter(str(logdir), filename_suffix=".b")  # resume from the step-6 checkpoint
    for step in range(7, 13):
        resumed.add_scalar("lm loss", 3.0 - 0.1 * step - 0.001, step)
        resumed.add_scalar("grad-norm", 1.0 + 0.01 * step, step)
    resumed.close()
    assert detect_format(logdir) == "tensorboard"
    run = read_metrics(logdir)
    loss = run.require("loss")
    assert loss.steps == tuple(range(1, 13))
    assert loss.value_at(8) == pytest.approx(3.0 - 0.8 - 0.001, rel=1e-6)
    assert [(r.from_step, r.to_step) for r in loss.restarts] == [(10, 7)]
    assert len(loss.superseded) == 4
    assert run.require("grad_norm").value_at(12) == pytest.approx(1.12, rel=1e-6)


def test_jsonl_and_csv_and_deepspeed_csv_monitor(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "grad_norm": 2.0, "note": "x"}) + "\n"
                             for s in range(1, 6)) + '{"step": 6, "loss": NaN}\n')
    run = read_metrics(jsonl)
    assert len(run.require("loss")) == 6 and math.isnan(run.require("loss").value_at(6))
    assert "note" not in run.series
    table = tmp_path / "m.csv"
    table.write_text("step,train/loss,lr\n1,2.5,0.1\n2,2.4,0.1\n")
    assert read_metrics(table).require("loss").values == (2.5, 2.4)
    monitor = tmp_path / "monitor" / "job"  # DeepSpeed csv_monitor: one file per tag
    monitor.mkdir(parents=True)
    (monitor / "Train_Samples_train_loss.csv").write_text("step,train_loss\n8,2.0\n16,1.9\n")
    (monitor / "Train_Samples_lr.csv").write_text("step,lr\n8,0.001\n16,0.001\n")
    run = read_metrics(monitor)
    assert run.require("loss").steps == (8, 16) and run.require("lr").values == (0.001, 0.001)


def test_bad_inputs_name_the_file_and_what_was_expected(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"loss": 1.0}\n')
    with pytest.raises(SeriesError, match=r"bad.jsonl:1: no step key"):
        read_metrics(bad)
    text = tmp_path / "notes.txt"
    text.write_text("hello\nworld\n")
    with pytest.raises(SeriesError, match=r"notes.txt: unknown metric format; expected JSONL"):
        read_metrics(text)
    with pytest.raises(SeriesError, match="no such file"):
        read_metrics(tmp_path / "missing.jsonl")
    with pytest.raises(SeriesError, match="no loss series"):
        read_metrics(_write(tmp_path / "g.jsonl", {"step": 1, "grad_norm": 1.0})).require("loss")


def _write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record) + "\n")
    return path


def test_wandb_offline_run_written_by_wandb(tmp_path):
    from migrate.gate.sources import load_run

    script = textwrap.dedent(f"""
        import wandb
        run = wandb.init(project="gate-test", dir={str(tmp_path)!r}, mode="offline")
        for step in range(1, 8):
            run.log({{"train/loss": 2.0 / step, "train/grad_norm": 1.0 + step, "lr": 1e-3}}, step=step)
        run.log({{"train/loss": float("nan")}}, step=8)
        run.finish()
    """)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=120)
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    run = load_run(str(run_dirs[0]))
    loss = run.require("loss")
    assert loss.steps == tuple(range(1, 9))
    assert loss.values[:3] == pytest.approx([2.0, 1.0, 2.0 / 3])
    assert math.isnan(loss.value_at(8))
    assert run.require("grad_norm").value_at(4) == pytest.approx(5.0)
    assert load_run(f"wandb:{tmp_path / 'wandb'}").require("loss").steps == loss.steps
