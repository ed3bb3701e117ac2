"""`migrate ops` on this machine's CPU, with and without the job's model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from click.testing import CliRunner

from migrate.commands.ops import command as ops_command

DEMO = Path(__file__).parents[2] / "configs" / "demo_cpu.yaml"


def test_ops_cli_operators_only(tmp_path):
    result = CliRunner().invoke(ops_command, ["--dtype", "bf16", "--op", "softmax", "--op", "rms_norm",
                                              "--op", "dropout", "--report", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "ops.json").read_text())
    assert [(r["op"], r["status"]) for r in data["operators"]] == [("softmax", "pass"), ("rms_norm", "pass"),
                                                                   ("dropout", "pass")]
    assert "| softmax | bf16 | pass |" in (tmp_path / "ops.md").read_text()


def test_ops_cli_with_the_demo_model_scans_coverage_and_drift(tmp_path):
    # `migrate ops job.yaml`, as the README writes it (`--job job.yaml` is the same)
    result = CliRunner().invoke(ops_command, [str(DEMO), "--dtype", "fp32", "--op", "linear",
                                              "--drift-dtype", "bf16", "--report", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "ops.json").read_text())
    assert data["coverage"]["dispatch_key"] == "CPU" and data["coverage"]["passed"]
    assert any(o["op"] == "aten::mm" for o in data["coverage"]["ops"])
    drift = data["drift"]
    assert drift["first_drift"] is None and drift["a"]["dtype"] == "torch.bfloat16"
    assert any(x["layer"].startswith("layers.0") for x in drift["layers"])


def test_ops_cli_refuses_two_different_jobs(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(DEMO.read_text())
    result = CliRunner().invoke(ops_command, [str(DEMO), "--job", str(other)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: two jobs given: {DEMO} and --job {other}; give one"


def test_ops_stage_probe_runs_on_the_worker_device():
    import yaml

    from migrate.stages.ops import OpsOptions, OpsRequest, probe

    job = yaml.safe_load(DEMO.read_text())
    options = OpsOptions(dtypes=("fp16",), operators=("gelu", "embedding"))
    request = OpsRequest(options=options.model_dump(mode="json"), model_section=job["model"], seed=1234,
                         drift_dtype="fp32", base=str(DEMO.parent))
    result = probe(SimpleNamespace(device="cpu", rank=0, world_size=1), request)
    assert result["passed"], result["reasons"]
    assert [r["op"] for r in result["operators"]] == ["gelu", "embedding"]
    assert result["drift"]["first_drift"] is None


def test_ops_cli_rejects_a_bad_device():
    result = CliRunner().invoke(ops_command, ["--device", "warp9", "--op", "gelu"])
    assert result.exit_code == 2 and "warp9" in result.output
