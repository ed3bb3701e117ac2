"""`migrate validate` and `migrate run` on good and bad job files: every error names the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from migrate.cli import main

REPO = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())


def _write(tmp_path: Path, data, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _demo(tmp_path: Path) -> dict:
    data = copy.deepcopy(DEMO)
    data["work_dir"] = str(tmp_path / "work")
    return data


def _set(data: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(config):
    result = CliRunner().invoke(main, ["validate", str(REPO / "configs" / config)])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


# (what is wrong, edit to the demo job, fragments the error must contain)
BAD_JOBS = [
    ("unknown top-level key", ("stagess", {}), ["stagess: unknown field; allowed:", "stages"]),
    ("misspelt model field", ("model.num_layrs", 2), ["model.num_layrs: unknown field", "num_layers"]),
    ("missing required field", ("model.hidden_size", _DELETE), ["model.hidden_size: required field is missing"]),
    ("wrong type", ("training.global_batch_size", "eight"), ["training.global_batch_size", "'eight'"]),
    ("value outside the allowed set", ("training.precision", "fp8"), ["training.precision", "'fp32', 'bf16' or 'fp16'", "'fp8'"]),
    ("source layout does not cover the source cluster", ("source.layout.dp", 3),
     ["source", "tp(1) * cp(1) * dp(3) * pp(1) = 3 != cluster.device_count(4)"]),
    ("backend cannot drive the device", ("target.backend", "hccl"),
     ["target", "backend 'hccl' cannot drive device type 'cpu'", "gloo"]),
    ("layers not divisible by pipeline stages", ("target.layout", {"tp": 1, "pp": 2, "dp": 1}), None),
    ("global batch not divisible by micro batch x dp", ("training.global_batch_size", 6),
     ["training.global_batch_size(6) is not a multiple of micro_batch_size(1) * dp(4) = 4"]),
    ("unknown stage", ("stages", {"convrt": {}}), ["stages.convrt: unknown stage; allowed:", "preflight"]),
    ("bad stage option", ("stages", {"preflight": {"elements": 0}}), ["stages.preflight.elements", "(got 0)"]),
    ("unknown stage option", ("stages", {"preflight": {"elemnts": 5}}), ["stages.preflight.elemnts: unknown field", "elements"]),
    ("bad Ray address", ("target.ray.address", "localhost"), ["target.ray.address", "'localhost'", "ray://HOST:PORT"]),
    ("expert parallel without experts", ("target.layout", {"tp": 1, "pp": 1, "dp": 2, "ep": 2}),
     ["target.layout: ep(2) > 1 needs a MoE model"]),
    ("devices per node do not divide the count", ("target.devices_per_node", 3),
     ["device_count(2) is not a multiple of devices_per_node(3)"]),
    ("negative learning rate", ("training.optimizer.lr", -1.0), ["training.optimizer.lr", "greater than 0", "(got -1.0)"]),
    ("mixtral without experts", ("model.architecture", "mixtral"), ["architecture 'mixtral' needs num_experts >= 2, got 0"]),
]


@pytest.mark.parametrize("what, edit, fragments", BAD_JOBS, ids=[b[0] for b in BAD_JOBS])
def test_bad_job_is_rejected_with_the_field_named_and_nothing_runs(tmp_path, what, edit, fragments):
    data = _demo(tmp_path)
    if edit[0] == "target.layout" and edit[1].get("pp") == 2:
        data["model"]["num_layers"] = 3
        data["target"]["device_count"] = 2
        data["target"]["layout"] = {"tp": 1, "pp": 2, "dp": 1}
        fragments = ["target.layout: pp(2) * vpp(1) = 2 does not divide model.num_layers(3)"]
    else:
        _set(data, *edit)
    job = _write(tmp_path, data)
    runner = CliRunner()
    result = runner.invoke(main, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    for fragment in fragments:
        assert fragment in result.output, f"{what}: {fragment!r} not in:\n{result.output}"
    assert str(job) in result.output
    run = runner.invoke(main, ["run", str(job)])
    assert run.exit_code == 2
    assert not (tmp_path / "work").exists(), "a bad job must not start anything"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("name: a\nname: b\n", "key 'name' is given twice (first at line 1)"),
        ("name: [unclosed\n", "invalid YAML at line"),
        ("- just\n- a list\n", "must hold a mapping of sections, got list"),
        ("", "the file is empty"),
    ],
    ids=["duplicate key", "syntax error", "not a mapping", "empty file"],
)
def test_unparseable_job_files(tmp_path, text, fragment):
    job = _write(tmp_path, text)
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2
    assert fragment in result.output


def test_missing_job_file_names_the_path(tmp_path):
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "nope.yaml" in result.output and "file not found" in result.output


def test_validate_json_lists_every_problem(tmp_path):
    data = _demo(tmp_path)
    data["model"]["num_layrs"] = 1
    data["training"]["precision"] = "fp8"
    result = CliRunner().invoke(main, ["validate", "--json", str(_write(tmp_path, data))])
    assert result.exit_code == 2
    import json

    fields = {p["field"] for p in json.loads(result.output)["problems"]}
    assert {"model.num_layrs", "training.precision"} <= fields


def test_run_with_a_stage_the_job_does_not_list(tmp_path):
    result = CliRunner().invoke(main, ["run", "--stages", "preflight,gatee", str(_write(tmp_path, _demo(tmp_path)))])
    assert result.exit_code == 2
    assert "gatee" in result.output


def test_help_lists_only_working_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    listed = {line.split()[0] for line in result.output.split("Commands:")[1].strip().splitlines() if line.strip()}
    from migrate.stages import STAGES

    assert {"validate", "run", "status"} | set(STAGES) <= listed
    for name in listed:
        sub = CliRunner().invoke(main, [name, "--help"])
        assert sub.exit_code == 0, f"migrate {name} --help failed: {sub.output}"


@pytest.mark.parametrize("name", ["nosuch", "convert.x", "foo.bar", "_common"])
def test_an_unknown_command_is_one_line_and_exit_2(name):
    result = CliRunner().invoke(main, [name])
    assert result.exit_code == 2, result.exception  # a dotted name once reached importlib: a traceback, exit 1
    assert f"No such command '{name}'" in result.output
