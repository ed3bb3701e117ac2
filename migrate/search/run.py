"""One search of a job's target: problem from the job, profiler, cache, result files."""
from __future__ import annotations

from checkpoint.layout import OptimizerSharding

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from migrate.job.load import Job
from migrate.runtime.worker_group import WorkerGroup
from migrate.search.problem import cluster_shape, device_profile, model_shape, recipe, training_shape, workload_specs
from migrate.search.profiler import CommandProfiler, WorkloadProfiler
from parallel_search.cost import CostOptions
from parallel_search.emit import write_configs
from parallel_search.report import result_dict, summary_markdown
from parallel_search.search import Problem, ProfileCache, SearchConfig, SearchResult, plan_space, rank_analytic, run_search
from parallel_search.space import SpaceOptions

CACHE_FILE = "profiles.jsonl"


@dataclass(frozen=True, kw_only=True)
class SearchOutcome:
    result: SearchResult
    paths: dict[str, Path]
    reasons: list[str]
    summary: str


def job_problem(job: Job, options: Any) -> Problem:
    """The library's problem for the job's target and the stage options."""
    device = device_profile(job, options.device_profile)
    space = SpaceOptions(frameworks=tuple(options.frameworks), micro_batch_sizes=options.micro_batch_sizes,
                         max_micro_batch=options.max_micro_batch, recompute=tuple(options.recompute),
                         sequence_parallel=options.sequence_parallel, vpp=tuple(options.vpp),
                         context_parallel=tuple(options.context_parallel),
                         shardings=tuple(OptimizerSharding(x) for x in options.shardings) if options.shardings else None)
    return Problem(model=model_shape(job), train=training_shape(job), cluster=cluster_shape(job, device), device=device,
                   space=space, cost=CostOptions(overlap_grad_reduce=options.overlap_grad_reduce))


def _told(profile: Callable[[Any, int], Any], status: Callable[..., None]) -> Callable[[Any, int], Any]:
    """`profile` that tells `status` which candidate it measures, and how the last one went."""
    done: list[str] = []

    def run(cand: Any, steps: int) -> Any:
        last = f"; last: {done[-1]}" if done else ""
        status(f"profiling candidate {len(done) + 1}: {cand.label()} for {steps} step(s){last}")
        measured = profile(cand, steps)
        step = f"{statistics.median(measured.step_times_s):.3g} s/step" if measured.ok and measured.step_times_s else \
            f"failed ({(measured.reason or '')[:80]})"
        done.append(f"{cand.label()} {step}")
        return measured

    return run


def search_job(job: Job, options: Any, work_dir: Path, start_group: Callable[[], WorkerGroup],
               status: Callable[..., None] = lambda *a, **k: None) -> SearchOutcome:
    """Run the search (resuming from ``work_dir/profiles.jsonl``) and write the table and configs; `status`
    is told each candidate profiled."""
    problem = job_problem(job, options)
    plan = plan_space(problem)
    workload = options.command or "builtin"
    cache = ProfileCache(work_dir / CACHE_FILE, problem.fingerprint(workload))
    config = SearchConfig(max_trials=options.max_trials, max_fraction=options.max_fraction,
                          min_steps=options.min_steps, max_steps=max(options.max_steps, options.min_steps),
                          max_seconds=options.max_seconds, target_mfu=options.target_mfu)
    if not options.profile:
        result = rank_analytic(problem, plan)
    elif options.command:
        profiler = CommandProfiler(options.command, problem.model, problem.train, warmup=options.warmup_steps,
                                   workdir=work_dir / "runs")
        result = run_search(problem, _told(profiler, status), cache, config, plan)
    else:
        model, train = workload_specs(job)
        builtin = WorkloadProfiler(start_group, model, train, warmup=options.warmup_steps,
                                   timeout_s=job.spec.target.timeout_s)
        try:
            result = run_search(problem, _told(builtin, status), cache, config, plan)
        finally:
            builtin.close()
    paths: dict[str, Path] = {}
    reasons: list[str] = []
    if result.chosen is None:
        reasons.append(f"no candidate ran: {result.feasible} of {result.space_size} fit in memory, "
                       f"{result.profiled} profiled, none succeeded")
    else:
        paths |= write_configs(work_dir / "chosen", problem.model, problem.train, result.chosen.candidate,
                               overlap_grad_reduce=options.overlap_grad_reduce, recipe=recipe(job),
                               devices_per_node=problem.cluster.devices_per_node)
    if options.profile and options.target_mfu and not result.target_met:
        reasons.append(next((e for e in result.events if e.startswith("target MFU")),
                            f"target MFU {options.target_mfu} not reached"))
    summary = summary_markdown(result)
    paths["ranking_json"] = work_dir / "ranking.json"
    paths["ranking_json"].write_text(json.dumps(result_dict(result), indent=2, default=str))
    paths["ranking_md"] = work_dir / "ranking.md"
    paths["ranking_md"].write_text(summary)
    paths["cache"] = work_dir / CACHE_FILE
    return SearchOutcome(result=result, paths=paths, reasons=reasons, summary=summary)
