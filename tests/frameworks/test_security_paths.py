"""Paths stay inside the checkpoint; the source is never written; pointer files are checked.

Storage paths in DCP/Megatron `.metadata`, DeepSpeed's `latest`, Megatron-LM's tracker, param names that
become file names in universal checkpoints, symbolic links and our manifest's entries are each taken only
as relative paths inside the checkpoint. Every case runs the CLI a user runs and checks exit 2, one line
naming the file, nothing written and the source unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from checkpoint import safe_load
from checkpoint.manifest import verify_manifest
from migrate.cli import main as cli

pytestmark = pytest.mark.slow


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def dcp_copy(fsdp_checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fsdp_checkpoint(2).path, src)
    return src


@pytest.fixture
def ds_copy(deepspeed_checkpoint, tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(deepspeed_checkpoint(2, 2).path, src)
    return src


def _repoint(root: Path, new_path: str) -> None:
    """Point the first storage entry of `.metadata` at `new_path` (as a hostile checkpoint would)."""
    md = safe_load.read_dcp_metadata(root)
    idx = next(iter(md.storage_data))
    md.storage_data[idx] = dataclasses.replace(md.storage_data[idx], relative_path=new_path)
    (root / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("where", ["../outside/x.distcp", "/etc/passwd", "a/../../x.distcp"])
def test_dcp_storage_path_leaving_the_checkpoint_is_refused(dcp_copy, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(next(dcp_copy.glob("*.distcp")), outside / "x.distcp")
    _repoint(dcp_copy, where)
    before = digest(dcp_copy)
    runner = CliRunner()
    one_line_error(runner.invoke(cli, ["inspect", str(dcp_copy)]), ".metadata", where, "not a relative path inside")
    one_line_error(runner.invoke(cli, ["convert", str(dcp_copy), str(tmp_path / "out"), "--to", "dcp", "--verify"]),
                   ".metadata", where)
    assert not (tmp_path / "out").exists() and digest(dcp_copy) == before


def test_symlink_out_of_the_checkpoint_needs_the_flag(dcp_copy, tmp_path):
    data = next(dcp_copy.glob("*.distcp"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(data, elsewhere / data.name)
    os.symlink(elsewhere / data.name, data)
    runner = CliRunner()
    one_line_error(runner.invoke(cli, ["inspect", str(dcp_copy)]), data.name, "outside the checkpoint",
                   "--follow-symlinks")
    one_line_error(runner.invoke(cli, ["convert", str(dcp_copy), str(tmp_path / "out"), "--to", "dcp"]), data.name)
    assert not (tmp_path / "out").exists()
    followed = runner.invoke(cli, ["convert", str(dcp_copy), str(tmp_path / "out"), "--to", "dcp", "--dp", "1",
                                   "--follow-symlinks", "--verify"])
    assert followed.exit_code == 0, followed.output
    assert "every tensor equals the source" in followed.output


def test_symlink_inside_the_checkpoint_is_fine(dcp_copy, tmp_path):
    data = next(dcp_copy.glob("*.distcp"))
    (dcp_copy / "store").mkdir()
    shutil.move(data, dcp_copy / "store" / data.name)
    os.symlink(Path("store") / data.name, data)
    result = CliRunner().invoke(cli, ["inspect", str(dcp_copy)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("content,needle", [("../../etc", "names tag '../../etc'"), ("", "names tag ''"),
                                            ("global_step999", "global_step999"), ("a/b", "names tag 'a/b'")])
def test_latest_is_checked_and_named(ds_copy, tmp_path, content, needle):
    (ds_copy / "latest").write_text(content)
    runner = CliRunner()
    one_line_error(runner.invoke(cli, ["inspect", str(ds_copy)]), "latest", needle)
    one_line_error(runner.invoke(cli, ["convert", str(ds_copy), str(tmp_path / "out"), "--to", "deepspeed"]),
                   "latest")
    assert not (tmp_path / "out").exists()


def test_megatron_tracker_and_metadata_json_are_named(megatron_checkpoint, tmp_path):
    save = tmp_path / "save"
    ckpt = megatron_checkpoint(1, 1, 2).path
    shutil.copytree(ckpt.parent, save)
    runner = CliRunner()
    (save / "latest_checkpointed_iteration.txt").write_text("../../etc")
    one_line_error(runner.invoke(cli, ["inspect", str(save)]), "latest_checkpointed_iteration.txt", "'../../etc'")
    (save / "latest_checkpointed_iteration.txt").write_text("77")
    one_line_error(runner.invoke(cli, ["inspect", str(save)]), "latest_checkpointed_iteration.txt", "iter_0000077")
    (save / "latest_checkpointed_iteration.txt").write_text(ckpt.name.removeprefix("iter_").lstrip("0") or "0")
    (save / ckpt.name / "metadata.json").write_text("{not json")
    one_line_error(runner.invoke(cli, ["inspect", str(save)]), "metadata.json", "not valid JSON")
    (save / ckpt.name / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    one_line_error(runner.invoke(cli, ["inspect", str(save / ckpt.name)]), "metadata.json", "'zarr'")


def test_universal_param_name_cannot_leave_the_checkpoint(deepspeed_checkpoint, tmp_path):
    import torch

    from checkpoint.api import convert

    uni = tmp_path / "uni"
    convert(deepspeed_checkpoint(2, 2).path, uni, to="deepspeed_universal")
    model = next(uni.glob("*/mp_rank_00_model_states.pt"))
    state = torch.load(model, weights_only=False)
    groups = state["param_shapes"]
    first = next(iter(groups[0]))
    groups[0] = {("../../../evil" if k == first else k): v for k, v in groups[0].items()}
    torch.save(state, model)
    one_line_error(CliRunner().invoke(cli, ["inspect", str(uni)]), "../../../evil", "not a relative path inside")


def test_destination_inside_the_source_or_around_it_is_refused(ds_copy, tmp_path):
    before = digest(ds_copy)
    runner = CliRunner()
    one_line_error(runner.invoke(cli, ["convert", str(ds_copy), str(ds_copy / "converted"), "--to", "deepspeed"]),
                   "lies inside the source checkpoint")
    tag = next(p for p in ds_copy.iterdir() if p.is_dir())
    one_line_error(runner.invoke(cli, ["convert", str(tag), str(ds_copy / "x"), "--to", "deepspeed"]),
                   "lies inside the source checkpoint")
    one_line_error(runner.invoke(cli, ["convert", str(ds_copy), str(tmp_path), "--to", "deepspeed"]),
                   "contains the source checkpoint")
    assert digest(ds_copy) == before


def test_manifest_entries_outside_the_output_are_reported(ds_copy, tmp_path):
    from checkpoint.api import LayoutRequest, convert

    out = tmp_path / "out"
    convert(ds_copy, out, to="deepspeed", target=LayoutRequest(dp=1))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["../ds/latest"] = {"bytes": 1, "crc32": "00000000"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_manifest(out)
    assert any("../ds/latest" in p and "not a relative path inside" in p for p in problems), problems
