"""A job that fixes ``target.layout`` and also runs the search: the later stages use the job's layout, and
where the search chose another one the user is told so, on the console, in the search's report and in the
job's verdict line, instead of the search's choice being dropped silently."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from tests.cli_process import run_migrate

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, layout: dict | None) -> tuple[subprocess.CompletedProcess, Path]:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    work = tmp_path / "work"
    data["work_dir"] = str(work)
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    data["stages"] = {"search": {"profile": False}}
    data["target"].pop("layout", None)
    if layout is not None:
        data["target"]["layout"] = layout
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_migrate(["run", str(path)], timeout=300, cwd=tmp_path)
    return run, work


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> dict:
    """The layout the analytic search chooses for the demo's target when the job leaves it open."""
    run, work = _run(tmp_path_factory.mktemp("open"), None)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "warning" not in run.stderr
    return yaml.safe_load((work / "search" / "chosen" / "target_layout.yaml").read_text())["target"]["layout"]


def test_a_fixed_layout_other_than_the_searched_one_is_named_on_console_report_and_verdict(searched, tmp_path):
    other = dict(searched) | {"tp": searched.get("tp", 1) * searched.get("dp", 1), "dp": 1}
    if other == searched:  # the search chose dp1: move the devices to data parallel instead
        other = dict(searched) | {"dp": searched.get("tp", 1), "tp": 1}
    run, work = _run(tmp_path, other)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    from checkpoint.layout import ParallelLayout

    fixed, chosen = ParallelLayout.from_dict(other).describe(), ParallelLayout.from_dict(searched).describe()
    warning = f"[search] warning: the job's target.layout {fixed} overrides the search's choice {chosen}"
    assert warning in run.stderr
    assert f"target layout {fixed} from target.layout, not the search's choice" in run.stdout
    assert f"overrides the search's choice {chosen}" in (work / "summary.md").read_text()


def test_a_fixed_layout_equal_to_the_searched_one_gives_no_warning(searched, tmp_path):
    run, _ = _run(tmp_path, searched)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "warning" not in run.stderr and "not the search's choice" not in run.stdout
