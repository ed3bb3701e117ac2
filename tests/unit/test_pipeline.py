"""Stage pipeline: dependency order, skip when unchanged, re-run on change, failure propagation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from pydantic import Field

import migrate.stages as stages_pkg
from migrate.job.load import JobError, load_job
from migrate.pipeline.runner import Decision, decide, run_pipeline
from migrate.pipeline.stage import StageArtifact, StageDefinition, StageOptions, StageOutcome, StageStatus
from migrate.tracking.tracker import Tracker

REPO = Path(__file__).resolve().parents[2]


class CountOptions(StageOptions):
    value: int = 1
    fail: bool = False
    verdict: str = Field(default="pass")


@pytest.fixture
def fake_stages(monkeypatch):
    """Three stages: a, b (depends on a) and c (independent, reads only `model`)."""
    calls: list[str] = []

    def make(name):
        def run(ctx):
            calls.append(name)
            if ctx.options.fail:
                raise RuntimeError(f"{name} broke on value {ctx.options.value}")
            upstream = {k: v.metrics.get("value") for k, v in ctx.upstream.items()}
            (ctx.work_dir / "out.txt").write_text(str(ctx.options.value))
            return StageOutcome(
                verdict=ctx.options.verdict, metrics={"value": ctx.options.value, "upstream": upstream},
                outputs={"out": str(ctx.work_dir / "out.txt")},
                reasons=(f"{name} verdict {ctx.options.verdict}",) if ctx.options.verdict == "fail" else (),
                summary_md=f"stage {name} saw {upstream}",
            )
        return run

    defs = {
        "a": StageDefinition(name="a", description="first", run=make("a"), options=CountOptions),
        "b": StageDefinition(name="b", description="needs a", run=make("b"), options=CountOptions, depends_on=("a",)),
        "c": StageDefinition(name="c", description="alone", run=make("c"), options=CountOptions, reads=("model",)),
    }
    for name, d in defs.items():
        monkeypatch.setitem(stages_pkg.STAGES, name, d)
    return calls


def _job(tmp_path, stages, **edits):
    data = copy.deepcopy(yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text()))
    data["work_dir"] = str(tmp_path / "work")
    data["stages"] = stages
    data["tracking"] = {"tensorboard": False, "wandb": {"enabled": False}}
    for dotted, value in edits.items():
        section, key = dotted.split("__")
        data[section][key] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_job(path)


def _run(job, **kwargs):
    tracker = Tracker(job.work_dir, job.spec.tracking, run_name=job.name)
    try:
        return run_pipeline(job, tracker=tracker, start_group=lambda **kw: pytest.fail("no group needed"), **kwargs)
    finally:
        tracker.close()


def _status(result):
    return {r.artifact.stage: r.artifact.status.value for r in result.records}


def test_dependency_order_and_artifacts(tmp_path, fake_stages):
    job = _job(tmp_path, {"b": {"value": 2}, "c": {}, "a": {"value": 1}})
    result = _run(job)
    assert fake_stages == ["a", "b", "c"]
    assert result.ok
    artifact = json.loads((job.work_dir / "b" / "result.json").read_text())
    assert artifact["status"] == "succeeded" and artifact["verdict"] == "pass"
    assert artifact["metrics"] == {"value": 2, "upstream": {"a": 1}}
    assert set(artifact) >= {"input_hash", "inputs", "outputs", "metrics", "verdict", "started_at", "finished_at", "duration_s"}
    assert (job.work_dir / "summary.md").read_text().count("| ok |") == 3
    assert json.loads((job.work_dir / "summary.json").read_text())["ok"] is True
    events = [json.loads(line) for line in (job.work_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in events if e["kind"] == "stage"] == ["a", "b", "c"]


def test_rerun_skips_unchanged_and_reruns_what_changed(tmp_path, fake_stages):
    _run(_job(tmp_path, {"a": {}, "b": {}, "c": {}}))
    fake_stages.clear()
    again = _run(_job(tmp_path, {"a": {}, "b": {}, "c": {}}))
    assert fake_stages == []
    assert [r.decision.action for r in again.records] == ["skip", "skip", "skip"]
    # An option of a changes: a re-runs, and b because its upstream result changed; c stays.
    _run(_job(tmp_path, {"a": {"value": 5}, "b": {}, "c": {}}))
    assert fake_stages == ["a", "b"]
    fake_stages.clear()
    # A job section only a and b read changes (training); c reads only `model`.
    _run(_job(tmp_path, {"a": {"value": 5}, "b": {}, "c": {}}, training__seed=99))
    assert fake_stages == ["a", "b"]
    fake_stages.clear()
    _run(_job(tmp_path, {"a": {"value": 5}, "b": {}, "c": {}}, training__seed=99), force=True)
    assert fake_stages == ["a", "b", "c"]


def test_failed_stage_blocks_dependents_and_says_why(tmp_path, fake_stages):
    result = _run(_job(tmp_path, {"a": {"fail": True, "value": 7}, "b": {}, "c": {}}))
    assert _status(result) == {"a": "failed", "b": "blocked", "c": "succeeded"}
    assert fake_stages == ["a", "c"]
    a, b = result.records[0].artifact, result.records[1].artifact
    assert "RuntimeError: a broke on value 7" in a.reasons[0]
    assert "Traceback" in a.error
    assert b.reasons == ("dependency 'a' failed: RuntimeError: a broke on value 7",)
    assert not result.ok
    summary = (tmp_path / "work" / "summary.md").read_text()
    assert "NOT PASSED" in summary and "blocked" in summary
    # Fixed: the failed stage and its dependent run again; the success is skipped.
    fake_stages.clear()
    fixed = _run(_job(tmp_path, {"a": {"value": 7}, "b": {}, "c": {}}))
    assert fake_stages == ["a", "b"] and fixed.ok


def test_fail_verdict_blocks_dependents(tmp_path, fake_stages):
    result = _run(_job(tmp_path, {"a": {"verdict": "fail"}, "b": {}}))
    assert _status(result) == {"a": "failed", "b": "blocked"}
    assert result.records[1].artifact.reasons == ("dependency 'a' failed: a verdict fail",)


def test_selected_stage_uses_its_dependency_result_or_is_blocked(tmp_path, fake_stages):
    job = _job(tmp_path, {"a": {}, "b": {}})
    blocked = _run(job, stages=["b"])
    assert _status(blocked) == {"b": "blocked"}
    assert "needs stage 'a', which has no result yet" in blocked.records[0].artifact.reasons[0]
    _run(job, stages=["a"])
    fake_stages.clear()
    ran = _run(job, stages=["b"])
    assert fake_stages == ["b"] and ran.ok


def test_job_must_list_dependencies(tmp_path, fake_stages):
    with pytest.raises(JobError, match="stage 'b' depends on 'a', which the job does not list"):
        _job(tmp_path, {"b": {}})


def test_cli_exit_codes(tmp_path, fake_stages):
    job = _job(tmp_path, {"a": {"fail": True}, "b": {}})
    runner = CliRunner()
    assert runner.invoke(__import__("migrate.cli", fromlist=["main"]).main, ["run", str(job.path)]).exit_code == 1
    job = _job(tmp_path, {"a": {}, "b": {}})
    from migrate.cli import main

    assert runner.invoke(main, ["run", str(job.path)]).exit_code == 0
    status = runner.invoke(main, ["status", "--json", str(job.path)])
    rows = {r["stage"]: r for r in json.loads(status.output)["stages"]}
    assert rows["a"]["status"] == "succeeded" and rows["a"]["current"] is True


def _artifact(status: StageStatus, input_hash="h", reasons=()):
    return StageArtifact(stage="x", status=status, verdict=None, input_hash=input_hash, inputs={}, outputs={}, metrics={},
                         reasons=reasons, started_at="t0", finished_at="t1", duration_s=0.0)


@pytest.mark.parametrize(
    "previous, force, upstream, expected",
    [
        (None, False, {}, Decision("run", "no previous result")),
        (_artifact(StageStatus.SUCCEEDED), False, {}, Decision("skip", "inputs unchanged since t1")),
        (_artifact(StageStatus.SUCCEEDED, "old"), False, {}, Decision("run", "inputs changed")),
        (_artifact(StageStatus.SUCCEEDED), True, {}, Decision("run", "forced")),
        (_artifact(StageStatus.FAILED), False, {}, Decision("run", "previous run failed")),
        (None, True, {"d": _artifact(StageStatus.BLOCKED, reasons=("x",))}, Decision("block", "dependency 'd' blocked: x")),
    ],
)
def test_decide_is_a_pure_rule(previous, force, upstream, expected):
    assert decide(stage="x", input_hash="h", previous=previous, force=force, upstream=upstream) == expected


def test_a_chain_of_blocked_stages_names_the_root_cause_once(tmp_path, fake_stages, monkeypatch):
    import migrate.stages as stages_pkg

    for name, dep in (("d", "b"), ("e", "d")):
        monkeypatch.setitem(stages_pkg.STAGES, name, StageDefinition(name=name, description=f"needs {dep}",
                                                                     run=lambda ctx: None, options=CountOptions,
                                                                     depends_on=(dep,)))
    result = _run(_job(tmp_path, {"a": {"fail": True, "value": 7}, "b": {}, "d": {}, "e": {}}))
    reasons = {r.artifact.stage: r.artifact.reasons for r in result.records}
    root = "dependency 'a' failed: RuntimeError: a broke on value 7"
    assert reasons["b"] == (root,)
    assert reasons["d"] == (f"dependency 'b' blocked: {root}",)
    assert reasons["e"] == (f"dependency 'd' blocked: {root}",)  # not "... 'd' blocked: dependency 'b' blocked: ..."


def test_run_dry_run_says_what_would_run_and_why(tmp_path, fake_stages):
    from migrate.pipeline.preview import preview, render

    job = _job(tmp_path, {"a": {}, "b": {}, "c": {}})
    first = {p.stage: (p.action, p.reason) for p in preview(job)}
    assert first == {"a": ("run", "no previous result"), "b": ("run", "after a runs: its inputs will change"),
                     "c": ("run", "no previous result")}
    _run(job)
    assert fake_stages == ["a", "b", "c"]
    changed = _job(tmp_path, {"a": {"value": 5}, "b": {}, "c": {}})
    again = {p.stage: p.action for p in preview(changed)}
    assert again == {"a": "run", "b": "run", "c": "skip"} and fake_stages == ["a", "b", "c"]  # nothing ran
    assert "c  would be skipped: inputs unchanged since" in render(preview(changed))
