"""`migrate convert` / `migrate inspect` on real DeepSpeed checkpoints, including broken ones."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from ds_checkpoint_fixtures import DSCheckpointSpec, deepspeed_checkpoints  # noqa: F401

from checkpoint.api import LayoutRequest, convert
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError
from migrate.commands.convert import command as convert_cmd
from migrate.commands.inspect import command as inspect_cmd

pytestmark = pytest.mark.slow
SPEC = DSCheckpointSpec(world_size=3, stage=2, dtype="bf16")


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def source_copy(deepspeed_checkpoints, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(deepspeed_checkpoints(SPEC), dst)
    return dst


def test_inspect_reports_format_layout_and_state(deepspeed_checkpoints):
    result = CliRunner().invoke(inspect_cmd, [str(deepspeed_checkpoints(SPEC)), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["format"] == "deepspeed" and info["layout"]["dp"] == 3 and info["layout"]["zero_stage"] == 2
    assert info["global_step"] == 3 and info["params"] == 7 and info["model_dtype"] == "bfloat16"
    assert info["state"] == {"param": 7, "fp32_master": 7, "exp_avg": 7, "exp_avg_sq": 7, "step": 7}


def test_dry_run_prints_plan_per_rank_and_writes_nothing(deepspeed_checkpoints, tmp_path):
    result = CliRunner().invoke(convert_cmd, [str(deepspeed_checkpoints(SPEC)), str(tmp_path / "out"), "--to",
                                              "deepspeed", "--dp", "4", "--zero-stage", "3", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert all(f"rank {r}: 2 files" in result.output for r in range(4))
    assert not (tmp_path / "out").exists()


def test_convert_with_verify_succeeds(deepspeed_checkpoints, tmp_path):
    result = CliRunner().invoke(convert_cmd, [str(deepspeed_checkpoints(SPEC)), str(tmp_path / "out"), "--to",
                                              "deepspeed", "--dp", "2", "--zero-stage", "1", "--verify"])
    assert result.exit_code == 0, result.output
    assert "verify: every tensor equals the source" in result.output


def test_missing_shard_is_named_and_nothing_written(source_copy, tmp_path):
    (source_copy / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    before = _digest(source_copy)
    with pytest.raises(CheckpointFormatError, match=r"dp_world_size=3 but optimizer shards for ranks \[1\] are missing"):
        convert(source_copy, tmp_path / "out", to="deepspeed", target=LayoutRequest(dp=2))
    assert not (tmp_path / "out").exists() and _digest(source_copy) == before


def test_truncated_shard_is_named(source_copy, tmp_path):
    shard = source_copy / "global_step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    result = CliRunner().invoke(convert_cmd, [str(source_copy), str(tmp_path / "out"), "--to", "deepspeed"])
    assert result.exit_code == 2
    assert "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt" in result.output and "truncated" in result.output
    assert not (tmp_path / "out").exists()


def test_pipeline_or_moe_deepspeed_files_are_refused_by_name(source_copy, tmp_path):
    """DeepSpeed's pipeline engine saves one file per layer; a layout this reader does not model is named."""
    (source_copy / "global_step3" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    result = CliRunner().invoke(convert_cmd, [str(source_copy), str(tmp_path / "out"), "--to", "deepspeed"])
    assert result.exit_code == 2, result.output
    assert "layer_01-model_00-model_states.pt" in result.output and "pipeline-parallel" in result.output
    assert not (tmp_path / "out").exists()


def test_legacy_non_zip_torch_file_is_named_with_the_fix(source_copy, tmp_path):
    model = source_copy / "global_step3" / "mp_rank_00_model_states.pt"
    torch.save(torch.load(model, weights_only=False), model, _use_new_zipfile_serialization=False)
    result = CliRunner().invoke(convert_cmd, [str(source_copy), str(tmp_path / "out"), "--to", "deepspeed"])
    assert result.exit_code == 2, result.output
    assert "mp_rank_00_model_states.pt: saved in torch's legacy non-zip format" in result.output
    assert not (tmp_path / "out").exists()


def test_declared_layout_must_match(deepspeed_checkpoints, tmp_path):
    with pytest.raises(LayoutMismatchError, match=r"declared dp=4 but the checkpoint was saved at dp=3"):
        convert(deepspeed_checkpoints(SPEC), tmp_path / "out", to="deepspeed", expect=LayoutRequest(dp=4))
    with pytest.raises(LayoutMismatchError, match=r"declared zero stage 3 but the checkpoint is stage 2"):
        convert(deepspeed_checkpoints(SPEC), tmp_path / "out", to="deepspeed", expect=LayoutRequest(zero_stage=3))


def test_non_empty_destination_is_refused(deepspeed_checkpoints, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    result = CliRunner().invoke(convert_cmd, [str(deepspeed_checkpoints(SPEC)), str(tmp_path / "out"), "--to",
                                              "deepspeed"])
    assert result.exit_code == 2 and "not empty" in result.output
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old"]
