"""The job's `source.checkpoint` is honoured as written: `step` picks that step's folder out of a save directory
the way each framework names it (DeepSpeed `global_stepN`, Megatron-LM `iter_NNNNNNN`, torchtitan `step-N`, the
HF Trainer's `checkpoint-N`), a step that is not there is refused with the steps that are, and a `format` other
than `auto` must be what the folder holds."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from migrate.job.load import load_job
from migrate.stages.convert import source_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, checkpoint: dict):
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["source"]["checkpoint"] = checkpoint
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_job(path)


def test_step_picks_the_saved_steps_folder_of_each_framework(deepspeed_checkpoint, megatron_checkpoint, tmp_path):
    ds = deepspeed_checkpoint(2, 2).path  # the save dir: latest + global_step2
    mcore = megatron_checkpoint(1, 1, 2).path.parent  # the save dir: the tracker + iter_0000002
    assert source_checkpoint(_job(tmp_path, {"path": str(ds), "step": 2, "format": "deepspeed"}), {}) == \
        ds / "global_step2"
    assert source_checkpoint(_job(tmp_path, {"path": str(mcore), "step": 2}), {}) == mcore / "iter_0000002"
    assert source_checkpoint(_job(tmp_path, {"path": str(mcore / "iter_0000002"), "step": 2}), {}) == \
        mcore / "iter_0000002"
    assert source_checkpoint(_job(tmp_path, {"path": str(ds)}), {}) == ds  # no step: the latest, as saved
    for name in ("step-7", "checkpoint-7"):
        (tmp_path / "titan" / name).mkdir(parents=True)
    assert source_checkpoint(_job(tmp_path, {"path": str(tmp_path / "titan"), "step": 7}), {}).name == "step-7"


def test_a_step_not_saved_and_a_format_not_held_are_refused_naming_what_is_there(megatron_checkpoint, tmp_path):
    mcore = megatron_checkpoint(1, 1, 2).path.parent
    with pytest.raises(ValueError) as missing:
        source_checkpoint(_job(tmp_path, {"path": str(mcore), "step": 5}), {})
    assert str(missing.value) == (f"source.checkpoint.step: step 5 is not saved in {mcore} (looked for global_step5, "
                                  f"iter_0000005, step-5, checkpoint-5); saved steps there: [2]")
    with pytest.raises(ValueError, match=r"source.checkpoint.format: the job says 'deepspeed', but .*iter_0000002 "
                                         r"is a 'megatron' checkpoint"):
        source_checkpoint(_job(tmp_path, {"path": str(mcore), "step": 2, "format": "deepspeed"}), {})
