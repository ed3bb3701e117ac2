"""`migrate resume job.yaml` resumes only the files the conversion wrote: a converted checkpoint changed,
truncated or missing a file since the `convert` stage fails the stage at once, naming each file and what
differs, before any rank starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from migrate.cli import main


def _job(tmp_path: Path, checkpoint: Path) -> Path:
    job = {
        "name": "resume-manifest", "work_dir": str(tmp_path / "work"),
        "source": {"checkpoint": {"path": str(checkpoint)}, "layout": {"dp": 2, "sharding": "zero1"},
                   "cluster": {"device_type": "cpu", "device_count": 2, "backend": "gloo"}},
        "target": {"device_type": "cpu", "device_count": 2, "backend": "gloo", "layout": {"dp": 2, "sharding": "zero2"}},
        "model": {"architecture": "llama", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 128, "seq_length": 32},
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "stages": {"convert": {}, "resume": {"steps": 1}},
        "tracking": {"tensorboard": False, "wandb": {"enabled": False}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _damage_truncate(ckpt: Path) -> str:
    victim = sorted(ckpt.rglob("*optim_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:-16])
    return f"{victim}: {victim.stat().st_size} bytes != manifest {victim.stat().st_size + 16}"


def _damage_flip(ckpt: Path) -> str:
    victim = sorted(ckpt.rglob("*model_states.pt"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return f"{victim}: crc32 "


def _damage_remove(ckpt: Path) -> str:
    victim = sorted(ckpt.rglob("*optim_states.pt"))[-1]
    victim.unlink()
    return f"{victim}: missing"


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_remove], ids=["truncated", "flipped", "missing"])
def test_resume_refuses_a_converted_checkpoint_that_differs_from_its_manifest(tmp_path, deepspeed_checkpoint, damage,
                                                                             ray_session):
    source = deepspeed_checkpoint(2, 1)
    job = _job(tmp_path, source.path)
    runner = CliRunner()
    converted = runner.invoke(main, ["run", str(job), "--stages", "convert"])
    assert converted.exit_code == 0, converted.output
    expected = damage(tmp_path / "work" / "convert" / "checkpoint")

    resumed = runner.invoke(main, ["resume", str(job)])
    assert resumed.exit_code == 1, resumed.output
    result = json.loads((tmp_path / "work" / "resume" / "result.json").read_text())
    assert result["verdict"] == "fail"
    reasons = result["reasons"]
    assert reasons[0].startswith(f"converted checkpoint differs from its manifest: {expected}"), reasons
    victim = expected.split(": ")[0]
    assert all(victim in r for r in reasons), reasons  # the damaged file only (a truncation: its size and its crc32)
    assert not (tmp_path / "work" / "resume" / "metrics.jsonl").exists()  # no rank ran
