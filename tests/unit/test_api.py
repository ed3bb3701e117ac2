"""The Python API (`migrate.api`): plan a job, run it, and the cluster check before anything runs, as
`migrate run` does them."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from migrate.api import ClusterShortfall, JobError, load_job, plan_job, run_job

REPO = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, **target) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    data["stages"] = {"search": {"profile": False}}
    data["target"].update(target)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_plan_then_run_then_a_rerun_skips(tmp_path):
    path = _job(tmp_path)
    assert [(p.stage, p.action) for p in plan_job(path)] == [("search", "run")]
    lines: list[str] = []
    result = run_job(path, echo=lines.append)
    assert result.ok and [r.artifact.stage for r in result.records] == ["search"]
    assert result.summary_path.is_file() and result.metrics_path.is_file() and result.wandb_dir is None
    assert any("[search]" in line for line in lines)
    assert [(p.stage, p.action) for p in plan_job(load_job(path))] == [("search", "skip")]
    assert run_job(path).records[0].decision.action == "skip"


def test_a_cluster_that_cannot_place_the_job_raises_before_anything_runs(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["target"].update(device_type="npu", backend="hccl", device_profile="ascend-910b")
    data["stages"] = {"preflight": {}}
    path = tmp_path / "npu.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ClusterShortfall) as raised:
        run_job(path)
    assert raised.value.problems and all("npu" in p.lower() for p in raised.value.problems)
    assert not (tmp_path / "work" / "preflight").exists()
    with pytest.raises(JobError):
        run_job(tmp_path / "missing.yaml")
