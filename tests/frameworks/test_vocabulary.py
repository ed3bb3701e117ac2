"""One vocabulary across the CLI and the job file (`deepspeed-universal`, `megatron-legacy`; comm's `--device`,
`--report`, `--json` to stdout, fp32/bf16/fp16): the earlier spellings still work until migrate 0.3, each with
a one-line note naming the current one, and mean exactly what the current spelling means."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from migrate.cli import main as cli

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, fmt: str, to_format: str) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["source"]["checkpoint"] = {"path": str(tmp_path / "ckpt"), "format": fmt}
    data["stages"] = {"convert": {"to_format": to_format}}
    path = tmp_path / f"job_{fmt}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_job_in_the_earlier_spelling_is_noted_and_converts_to_the_same_format(tmp_path):
    from migrate.job.load import load_job

    old, new = load_job(_job(tmp_path, "megatron_legacy", "megatron_legacy")), load_job(
        _job(tmp_path, "megatron-legacy", "megatron-legacy"))
    assert new.deprecations == ()
    assert old.deprecations == (
        "source.checkpoint.format: 'megatron_legacy' is deprecated, use 'megatron-legacy' (accepted until migrate 0.3)",
        "stages.convert.to_format: 'megatron_legacy' is deprecated, use 'megatron-legacy' (accepted until migrate 0.3)")
    # the convert stage writes what the option names: the earlier spelling used to be dropped there
    assert old.stage_options["convert"].to_format == new.stage_options["convert"].to_format == "megatron-legacy"
    assert old.spec.source.checkpoint.format == "megatron-legacy"
    result = CliRunner().invoke(cli, ["validate", str(_job(tmp_path, "megatron_legacy", "megatron_legacy"))])
    assert result.exit_code == 0, result.output
    assert "stages.convert.to_format: 'megatron_legacy' is deprecated, use 'megatron-legacy'" in result.output


def test_convert_to_the_earlier_universal_spelling_is_noted_and_writes_deepspeed_universal(deepspeed_checkpoint,
                                                                                           tmp_path):
    from checkpoint.api import detect_format

    src = deepspeed_checkpoint(2, 2).path
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "uni"), "--to", "deepspeed_universal"])
    assert result.exit_code == 0, result.output
    assert ("note: --to deepspeed_universal is deprecated, use --to deepspeed-universal (accepted until migrate 0.3)"
            in result.output)
    assert detect_format(tmp_path / "uni") == "deepspeed-universal"


def _comm(tmp_path: Path, *spelling: str) -> CliRunner:
    return CliRunner().invoke(cli, ["comm", "--backend", "gloo", "--world-size", "1", "--ops", "all_reduce.sum",
                                    "--sizes", "7", "--no-fallbacks", "--no-bandwidth", *spelling])


def test_comm_in_both_spellings_checks_the_same_and_notes_the_earlier_one(tmp_path):
    current = _comm(tmp_path, "--device", "cpu", "--dtypes", "fp32,bf16", "--report", str(tmp_path / "new"), "--json")
    # exit 1 in both: a bf16 job needs more collectives than this one-cell matrix checks
    assert current.exit_code == 1 and "training needs broadcast bfloat16" in current.output, current.output
    assert "note:" not in current.output
    printed = json.loads(current.output[current.output.index("{"):current.output.rindex("}") + 1])
    earlier = _comm(tmp_path, "--device-type", "cpu", "--dtypes", "float32,bfloat16", "--out-dir",
                    str(tmp_path / "old"), "--json", str(tmp_path / "old.json"))
    assert earlier.exit_code == 1 and "training needs broadcast bfloat16" in earlier.output, earlier.output
    for note in ("--device-type is deprecated, use --device", "--out-dir is deprecated, use --report",
                 "--json FILE is deprecated: --json prints the result on stdout, --report DIR writes it to DIR",
                 "dtype 'float32' is deprecated, use 'fp32'", "dtype 'bfloat16' is deprecated, use 'bf16'"):
        assert f"note: {note} (accepted until migrate 0.3)" in earlier.output
    def cells(res):
        return sorted((c["check"], c["dtype"], c["numel"], c["status"]) for c in res["matrix"]["cells"])

    written = json.loads((tmp_path / "old.json").read_text())
    assert cells(written) == cells(printed) and len(cells(printed)) == 2
    assert (tmp_path / "new" / "comm.md").is_file() and (tmp_path / "old" / "comm.md").is_file()


def test_the_comm_stage_takes_the_short_dtype_names_and_notes_torchs(tmp_path):
    from migrate.job.load import JobError, load_job
    from migrate.stages.comm import build_suite

    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["stages"] = {"preflight": {}, "comm": {"dtypes": ["fp32", "bfloat16", "int64"], "bandwidth_dtype": "float16"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    job = load_job(path)
    assert job.deprecations == (
        "stages.comm.dtypes: 'bfloat16' is deprecated, use 'bf16' (accepted until migrate 0.3)",
        "stages.comm.bandwidth_dtype: 'float16' is deprecated, use 'fp16' (accepted until migrate 0.3)")
    suite = build_suite(job.stage_options["comm"], "bf16")
    assert suite.matrix.dtypes == ("float32", "bfloat16", "int64") and suite.bandwidth.dtype == "float16"
    data["stages"]["comm"] = {"dtypes": ["fp8"]}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(JobError, match=r"stages.comm.dtypes.*unknown dtype\(s\) \['fp8'\]"):
        load_job(path)
