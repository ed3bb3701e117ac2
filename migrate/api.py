"""The Python API: what ``migrate run`` does, for notebooks and orchestration code.

    from migrate.api import load_job, plan_job, run_job
    job = load_job("job.yaml")
    for step in plan_job(job):             # what `migrate run --dry-run` prints
        print(step.stage, step.action, step.reason)
    result = run_job(job)                  # every stage, skipping what is unchanged
    print(result.ok, result.summary_path)

The libraries underneath have their own APIs: ``checkpoint.api`` (``convert``, ``read_index``,
``plan_conversion``), ``parallel_search`` (``plan_space``, ``rank_analytic``), ``convergence.gate``
(``evaluate``) and ``convergence.tolerances``.
"""
from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from collections.abc import Callable, Sequence

from migrate.job.load import Job, JobError, load_job
from migrate.pipeline.preview import Preview, preview
from migrate.pipeline.records import PipelineResult

__all__ = ["ClusterShortfall", "Job", "JobError", "PipelineResult", "Preview", "load_job", "plan_job", "run_job"]


class ClusterShortfall(RuntimeError):
    """The target cluster cannot place the worker groups of the stages that would run; ``problems`` lists
    every shortfall with its numbers. Nothing was run."""

    def __init__(self, job: Job, problems: Sequence[str]):
        self.problems = tuple(problems)
        stages = len({p.split(":")[0] for p in self.problems})
        self.headline = f"{job.path}: the cluster cannot run {stages} stage(s) of this job (nothing was run)"
        super().__init__(f"{self.headline}: " + "; ".join(self.problems))


def _job(job: Job | str | Path) -> Job:
    return job if isinstance(job, Job) else load_job(job)


def plan_job(job: Job | str | Path, *, stages: Sequence[str] | None = None, force: bool = False) -> list[Preview]:
    """What ``run_job`` would do with each selected stage (run, skip, block) and why; runs nothing. Raises
    JobError for an invalid job file and ValueError for stages the job does not list."""
    return preview(_job(job), stages, force=force)


def cluster_problems(job: Job, runtime: object, stages: Sequence[str]) -> list[str]:
    """Every worker group of `stages` that the target cluster cannot place (`migrate.runtime.resources`)."""
    from migrate.runtime.resources import shortfalls, stage_needs

    needs = stage_needs(job, stages)
    if not needs:
        return []
    return shortfalls(needs, runtime.resources(sorted({n.device_type for n in needs})))  # type: ignore[attr-defined]


def run_job(job: Job | str | Path, *, stages: Sequence[str] | None = None, force: bool = False,
            echo: Callable[[str], None] = lambda line: None) -> PipelineResult:
    """Run the job's stages (or ``stages``) in order on its target, with its tracking, skipping stages whose
    inputs are unchanged unless ``force``; ``echo`` receives the progress lines. Before anything runs, the
    stages that would run are checked against the cluster (ClusterShortfall; RayConnectionError when its Ray
    cannot be reached). Raises JobError for an invalid job file and ValueError for stages the job does not
    list; a stage that fails is in the result, not raised."""
    from migrate.pipeline.runner import run_pipeline
    from migrate.runtime.session import TargetRuntime
    from migrate.tracking.tracker import Tracker

    job = _job(job)
    with ExitStack() as stack:
        runtime = stack.enter_context(TargetRuntime(job.spec.target))
        would_run = [p.stage for p in preview(job, stages, force=force) if p.action == "run"]
        problems = cluster_problems(job, runtime, would_run)
        if problems:
            raise ClusterShortfall(job, problems)
        tracker = Tracker(job.work_dir, job.spec.tracking, run_name=job.name,
                          config=job.spec.model_dump(mode="json"))
        stack.callback(tracker.close)
        result = run_pipeline(job, stages=stages, force=force, tracker=tracker, start_group=runtime.start_group,
                              echo=echo)
        return dataclasses.replace(result, metrics_path=tracker.jsonl_path, wandb_dir=tracker.wandb_dir)
