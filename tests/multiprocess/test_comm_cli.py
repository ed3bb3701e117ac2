"""`migrate comm --backend gloo --world-size 2 ...` and the job's comm stage, end to end on local Gloo."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from migrate.comm import bandwidth as bw
from migrate.comm import matrix as mx
from migrate.comm.report import CommResult, read_json, write_json
from migrate.commands.comm import command
from migrate.job.load import load_job
from migrate.pipeline.stage import StageContext
from migrate.runtime.session import group_spec
from migrate.runtime.worker_group import start_worker_group
from migrate.stages.comm import STAGE, CommOptions

REPO = Path(__file__).resolve().parents[2]


def _source_file(tmp_path: Path) -> Path:
    """A source cluster's result where uneven all_gather worked and all_reduce was 10x faster."""
    cells = (mx.MatrixCell(check="all_gather.uneven", dtype="float32", numel=7, status="ok"),
             mx.MatrixCell(check="all_reduce.sum", dtype="float32", numel=7, status="ok"))
    row = bw.BandwidthRow(op="all_reduce", mode="in_place", dtype="float32", world_size=2, size_bytes=4096,
                          count=1024, time_us=1.0, algbw_gbps=4.096, busbw_gbps=4.096)
    src = CommResult(backend="nccl", device_type="cuda", world_size=2, torch_version="2.13.0",
                     matrix=mx.CommMatrix(backend="nccl", device_type="cuda", world_size=2, torch_version="2.13.0",
                                          cells=cells), bandwidth=(row,))
    return write_json(src, tmp_path / "source.json")


def test_standalone_command_writes_results_and_compares_with_the_source(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(command, [
        "--backend", "gloo", "--world-size", "2", "--ops", "all_reduce.sum,all_gather,barrier",
        "--dtypes", "float32,bfloat16", "--sizes", "1,7", "--bw-ops", "all_reduce,all_gather_into_tensor",
        "--bw-sizes", "4K", "--warmup", "1", "--iters", "2", "--precision", "fp32", "--no-fallbacks",
        "--out-dir", str(out), "--json", str(tmp_path / "target.json"), "--compare", str(_source_file(tmp_path)),
    ])
    assert result.exit_code == 1, result.output  # fp32 training needs avg/all_to_all_single..., not checked here
    assert "training needs all_reduce.avg float32: not checked in this matrix" in result.output
    res = read_json(tmp_path / "target.json")
    assert res.backend == "gloo" and res.world_size == 2 and res.matrix is not None
    assert {c.status for c in res.matrix.cells} == {"ok"}
    assert len(res.bandwidth) == 3
    text = (out / "comm.md").read_text()
    assert "Checked on the source only (not compared): `all_gather.uneven` float32" in text
    assert "| all_reduce | in_place | 4096 |" in text
    assert (out / "bandwidth.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "bandwidth.csv").read_text().count("\n") == 4


def test_bad_input_is_exit_code_2() -> None:
    runner = CliRunner()
    assert runner.invoke(command, ["--backend", "gloo"]).exit_code == 2
    bad = runner.invoke(command, ["--backend", "nccl", "--world-size", "2"])
    assert bad.exit_code == 2 and "nccl" in bad.output
    assert runner.invoke(command, ["--backend", "gloo", "--world-size", "2", "--ops", "allreduce"]).exit_code == 2


class _Tracker:
    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log_metrics(self, step: int, metrics: dict, prefix: str) -> None:
        self.logged.append({"step": step, "prefix": prefix, **metrics})

    def log_table(self, stage: str, name: str, columns: list, rows: list) -> None:
        self.logged.append({"table": f"{stage}/{name}", "columns": columns, "rows": len(rows)})


def test_comm_stage_on_the_demo_job_passes_and_maps_the_source_options(tmp_path: Path) -> None:
    job = load_job(REPO / "configs" / "demo_cpu.yaml")
    job = dataclasses.replace(job, work_dir=tmp_path)
    options = CommOptions(sizes=(1, 7), fallback_sizes=(5,), fallback_iters=1, bandwidth_sizes=(4096,), warmup=1,
                          iters=2, source_env={"GLOO_SOCKET_IFNAME": "lo"},
                          source_options={"timeout_s": 600, "overlap_comm": True})
    tracker = _Tracker()
    ctx = StageContext(job=job, options=options, work_dir=tmp_path / "comm", upstream={}, tracker=tracker,
                       start_group=lambda **kw: start_worker_group(group_spec(job.spec.target, mode="local", **kw)),
                       stage="comm")
    (tmp_path / "comm").mkdir()
    outcome = STAGE.run(ctx)
    assert outcome.verdict == "pass", outcome.reasons
    assert outcome.metrics["cells_wrong"] == 0 and outcome.metrics["needs_unmet"] == 0
    assert outcome.metrics["world_size"] == job.spec.target.device_count
    assert outcome.metrics["all_reduce_busbw_gbps"] > 0
    saved = json.loads(Path(outcome.outputs["result"]).read_text())
    assert saved["format"] == "migrate.comm.result/1"
    assert {o["key"] for o in saved["option_mapping"]} == {"GLOO_SOCKET_IFNAME", "timeout_s", "overlap_comm"}
    assert tracker.logged and tracker.logged[0]["prefix"] == "comm"
    assert "## Fallback correctness and cost" in outcome.summary_md


def test_stage_options_reject_unknown_collectives_and_options() -> None:
    with pytest.raises(ValueError, match="unknown collective 'allgather'"):
        CommOptions(ops=("allgather",))
    with pytest.raises(ValueError, match=r"unknown source_options \['bucket'\]"):
        CommOptions(source_options={"bucket": 1})


@pytest.mark.slow
def test_comm_stage_runs_in_the_pipeline_after_preflight_and_is_skipped_when_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    import migrate.stages as stages_pkg
    from migrate.pipeline.runner import run_pipeline
    from migrate.tracking.tracker import Tracker

    monkeypatch.setitem(stages_pkg.STAGES, "comm", STAGE)  # the lead registers it in migrate/stages/__init__.py
    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    data["stages"] = {"preflight": {}, "comm": {"sizes": [1, 7], "fallback_sizes": [5], "fallback_iters": 1,
                                                "bandwidth_sizes": [4096], "warmup": 1, "iters": 2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    job = load_job(tmp_path / "job.yaml")

    def run() -> object:
        tracker = Tracker(job.work_dir, job.spec.tracking, run_name=job.name)
        try:
            return run_pipeline(job, tracker=tracker, start_group=lambda **kw: start_worker_group(
                group_spec(job.spec.target, mode="local", **kw)))
        finally:
            tracker.close()

    first = run()
    assert first.ok  # type: ignore[attr-defined]
    artifact = json.loads((job.work_dir / "comm" / "result.json").read_text())
    assert artifact["status"] == "succeeded" and artifact["verdict"] == "pass"
    assert Path(artifact["outputs"]["bandwidth_png"]).exists()
    second = run()
    decisions = {r.artifact.stage: r.decision.action for r in second.records}  # type: ignore[attr-defined]
    assert decisions == {"preflight": "skip", "comm": "skip"}
