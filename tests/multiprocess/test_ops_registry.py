"""A user registers their own kernels (torch.library custom operators with their own autograd) and the
substitutes they wrote for the target, in the job; `migrate ops` reports each native, fallback, missing or
wrong with the numbers; a dump made on one configuration is compared on another (fp32 -> bf16, one process
-> two Gloo ranks) and names the first operator and layer that drift."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from migrate.commands.ops import command as ops_command

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parents[1] / "custom_ops_fixtures.py"


def _ref(name: str) -> str:
    return f"{FIXTURES}:{name}"


ROPE = {"name": "fused_rope", "reference": _ref("rope_reference"), "targets": {"cpu": _ref("fused_rope")},
        "inputs": _ref("rope_inputs"), "cases": ["typical", "odd", "empty", "large"], "grad": ["x"]}
SWIGLU_BUGGY = {"name": "fused_swiglu", "reference": _ref("swiglu_reference"),
                "targets": {"cpu": _ref("swiglu_buggy_backward"), "cuda": _ref("fused_swiglu")},
                "inputs": {"x": {"shape": [2, 16, 64], "low": -4, "high": 4}},
                "cases": {"typical": {}, "odd": {"x": {"shape": [3, 5, 14]}}, "large": {"x": {"low": -60, "high": 60}}}}
MASKED_SOFTMAX = {"name": "masked_softmax", "reference": _ref("masked_softmax"), "targets": {"npu": _ref("masked_softmax")},
                  "inputs": {"x": {"shape": [2, 4, 16, 16], "low": -5, "high": 5},
                             "mask": {"shape": [2, 4, 16, 16], "dtype": "bool", "p": 0.85}},
                  "cases": {"typical": {}, "mostly_masked": {"mask": {"p": 0.2}}}, "grad": ["x"]}


def _job(tmp_path: Path, ops: dict) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["stages"] = {"ops": ops}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ops(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(ops_command, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_registered_kernels_are_reported_native_wrong_and_fallback_with_their_numbers(tmp_path):
    job = _job(tmp_path, {"dtypes": ["fp32", "bf16"], "model": False,
                          "custom": [ROPE, SWIGLU_BUGGY, MASKED_SOFTMAX]})
    code, output = _ops(str(job), "--op", "gelu", "--report", str(tmp_path / "report"))
    assert code == 1, output
    result = json.loads((tmp_path / "report" / "ops.json").read_text())
    status = {v["name"]: v for v in result["custom"]}
    rope = status["fused_rope"]
    assert rope["status"] == "native" and rope["chosen"] == "migrate_tests::fused_rope"
    assert {(r["dtype"], r["case"]) for r in rope["runs"] if r["implementation"] == rope["chosen"]} == {
        (d, c) for d in ("fp32", "bf16") for c in ("typical", "odd", "empty", "large")}
    assert all(r["status"] == "pass" for r in rope["runs"])
    swiglu = status["fused_swiglu"]
    assert swiglu["status"] == "wrong" and swiglu["chosen"] == "reference"  # the device falls back to the reference
    bad = [r for r in swiglu["runs"] if r["implementation"].endswith(":swiglu_buggy_backward")]
    assert bad and all(r["status"] == "fail" for r in bad)
    for run in bad:  # the forward is right; the backward is what is wrong, named with its first wrong element
        tensors = {t["name"]: t for t in run["tensors"]}
        assert tensors["out.0"]["passed"] and not tensors["grad.x"]["passed"]
        assert tensors["grad.x"]["first_wrong"].startswith("grad.x[")
        assert tensors["grad.x"]["error_ratio"] > 10
    assert "first wrong grad.x[" in swiglu["reason"]
    assert status["masked_softmax"]["status"] == "fallback"  # an npu kernel only; the reference runs on the CPU
    assert any(r.startswith("fused_swiglu wrong on cpu:") for r in result["reasons"])
    assert len(result["reasons"]) == 1
    table = (tmp_path / "report" / "ops.md").read_text()
    assert "| fused_rope | native | migrate_tests::fused_rope | 8 |" in table
    assert "| fused_swiglu | wrong | reference |" in table and "| masked_softmax | fallback | reference |" in table


def test_a_bf16_kernel_is_judged_against_what_the_reference_does_in_bf16(tmp_path):
    tight = {"bf16": {"max_abs_eps": 0.25, "mean_ulp": 0.05}}  # tighter than bf16 rounding: float64 alone fails all
    job = _job(tmp_path, {"dtypes": ["bf16"], "model": False, "custom": [
        {**ROPE, "name": "rope_composed", "targets": {"cpu": _ref("rope_composed")}, "tolerances": tight},
        {**ROPE, "name": "rope_float8", "targets": {"cpu": _ref("rope_through_float8")}, "tolerances": tight}]})
    code, output = _ops(str(job), "--op", "gelu", "--report", str(tmp_path / "report"))
    result = json.loads((tmp_path / "report" / "ops.json").read_text())
    status = {v["name"]: v for v in result["custom"]}
    composed = [t for r in status["rope_composed"]["runs"] if r["implementation"].endswith("rope_composed")
                for t in r["tensors"] if r["case"] == "typical"]
    assert status["rope_composed"]["status"] == "native", status["rope_composed"]["reason"]
    assert any(t["reasons"] for t in composed) and all(t["error_ratio"] <= 2 for t in composed)
    assert status["rope_float8"]["status"] == "wrong"
    assert "the same-dtype reference's error" in status["rope_float8"]["reason"]
    assert code == 1


@pytest.mark.slow
def test_a_dump_in_fp32_compares_in_bf16_on_two_gloo_ranks_and_names_what_drifts(tmp_path):
    ops = {"dtypes": ["fp32"], "operators": ["linear", "softmax"], "drift_dtype": "fp32",
           "model_factory": _ref("decoder"), "custom": [ROPE]}
    dump = tmp_path / "dump"
    code, output = _ops(str(_job(tmp_path, ops)), "--dump", str(dump))
    assert code == 0, output
    manifest = json.loads((dump / "manifest.json").read_text())
    assert manifest["format"] == "migrate.ops.dump/1" and manifest["model"]["dtype"] == "fp32"
    assert {e["name"] for e in manifest["operators"]} == {"fused_rope", "builtin.linear", "builtin.softmax"}
    assert len(manifest["model"]["calls"]) > 100 and (dump / "model.safetensors").stat().st_size > 0

    same = tmp_path / "same"
    same.mkdir()
    code, output = _ops(str(_job(same, ops)), "--compare", str(dump), "--compare-dtype", "bf16", "--world-size", "2",
                        "--report", str(same / "report"))
    assert code == 0, output
    compared = json.loads((same / "report" / "ops.json").read_text())["compare"]
    assert compared["first_operator"] is None and len(compared["operators"]) == 6
    assert compared["model"]["passed"] and compared["model"]["here"] == {"device": "cpu", "dtype": "bf16", "world_size": 2}
    assert compared["model"]["limit"] == 0.1 and compared["model"]["calls_compared"] > 100

    broken = tmp_path / "broken"
    broken.mkdir()
    drifting = {**ops, "model_factory": _ref("decoder_with_drifting_mlp"),
                "custom": [{**ROPE, "targets": {"cpu": _ref("rope_flipped_sin")}}]}
    code, output = _ops(str(_job(broken, drifting)), "--compare", str(dump), "--world-size", "2",
                        "--report", str(broken / "report"))
    assert code == 1
    result = json.loads((broken / "report" / "ops.json").read_text())
    compared = result["compare"]
    assert compared["first_operator"] == "fused_rope [fp32, typical]"
    model = compared["model"]
    assert model["first_layer"] == "layers.1.mlp.down_proj"
    assert model["first_call"]["module"] == "layers.1.mlp.down_proj"
    assert "first drifting layer: layers.1.mlp.down_proj (activation" in model["summary"]
    assert any(r.startswith("compare: fused_rope [fp32, typical] here (") for r in result["reasons"])


def test_the_coverage_scan_names_custom_operators_the_registry_does_not_check(tmp_path):
    job = _job(tmp_path, {"dtypes": ["fp32"], "operators": ["gelu"], "model_factory": _ref("custom_model"),
                          "custom": [ROPE]})
    code, output = _ops(str(job), "--report", str(tmp_path / "report"))
    result = json.loads((tmp_path / "report" / "ops.json").read_text())
    custom = {o["op"]: o["registered"] for o in result["coverage"]["ops"] if o["custom"]}
    assert custom == {"migrate_tests::fused_rope": "fused_rope", "migrate_tests::fused_swiglu": None}
    assert result["reasons"] == ["coverage: custom operator migrate_tests::fused_swiglu runs in the model but no "
                                 "registry entry checks it"]
    assert code == 1 and "migrate_tests::fused_rope (checked as fused_rope)" in output


def test_a_registry_module_defines_operators_as_data(tmp_path):
    module = tmp_path / "team_ops.py"
    module.write_text(f"OPERATORS = [{ROPE!r}]\n")
    code, output = _ops("--registry", str(module), "--op", "gelu", "--dtype", "fp32")
    assert code == 0, output
    assert "| fused_rope | native | migrate_tests::fused_rope | 4 |" in output


@pytest.mark.parametrize("entry,message", [
    ({**ROPE, "reference": "no_colon_here"}, "operator 'fused_rope'.reference: 'no_colon_here': expected 'module:function'"),
    ({**ROPE, "reference": _ref("nope")}, "has no attribute 'nope'"),
    ({**ROPE, "targets": {"cpu": "missing_file.py:fn"}}, "missing_file.py: no such Python file"),
])
def test_a_bad_registry_entry_is_one_line_naming_the_operator(tmp_path, entry, message):
    job = _job(tmp_path, {"dtypes": ["fp32"], "model": False, "custom": [entry]})
    result = CliRunner().invoke(ops_command, [str(job), "--op", "gelu"])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_the_job_refuses_unknown_fields_of_an_operator(tmp_path):
    from migrate.job.load import JobError, load_job

    with pytest.raises(JobError, match=r"stages\.ops\.custom\[0\]\.kernel: unknown field"):
        load_job(_job(tmp_path, {"custom": [{**ROPE, "kernel": "x"}]}))


@pytest.mark.slow
def test_the_ops_stage_compares_a_dump_on_the_jobs_worker_group(tmp_path):
    from migrate.job.load import load_job
    from migrate.pipeline.runner import run_pipeline
    from migrate.runtime.session import group_spec
    from migrate.runtime.worker_group import start_worker_group
    from migrate.tracking.tracker import Tracker

    ops = {"dtypes": ["fp32"], "operators": ["gelu"], "drift_dtype": "fp32", "model_factory": _ref("decoder"),
           "custom": [ROPE]}
    code, output = _ops(str(_job(tmp_path, ops)), "--dump", str(tmp_path / "dump"))
    assert code == 0, output
    stage = tmp_path / "stage"
    stage.mkdir()
    job = load_job(_job(stage, {**ops, "compare": "../dump", "world_size": 2}))  # relative to the job file
    tracker = Tracker(job.work_dir, job.spec.tracking, run_name=job.name)
    try:
        result = run_pipeline(job, tracker=tracker, start_group=lambda **kw: start_worker_group(
            group_spec(job.spec.target, mode="local", **kw)))
    finally:
        tracker.close()
    artifact = result.records[0].artifact
    assert artifact.status.value == "succeeded", artifact.reasons
    assert artifact.metrics["custom_native"] == 1 and artifact.metrics["compare_operators_differing"] == 0
    saved = json.loads((job.work_dir / "ops" / "ops.json").read_text())
    assert saved["compare"]["model"]["here"]["world_size"] == 2 and saved["compare"]["model"]["passed"]
