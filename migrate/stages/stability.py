"""Stability: the target trains on from the converted checkpoint for a long while, and survives failures.

Call sequence: check the converted checkpoint (its manifest, its pickles) -> attempt 1 trains at the
target layout from it for ``steps`` (or ``minutes``), checkpointing every ``save_every`` steps; every
rank records each step's time, host RSS and device memory (`migrate.workload.long_run`) -> a rank that
dies or fails ends the attempt (the worker group names it) -> `decide_recovery` (pure): a new group (new
processes, same layout) resumes from the newest committed checkpoint, within ``max_restarts`` -> at the
end an uninterrupted reference run from the first recovery's checkpoint (``verify_recovery``) ->
`judge` (pure, `convergence.stability`): memory growth per 1,000 steps with its confidence interval,
step-time tails and periodic slowdowns, loss health (the gate's rules), recomputed steps and the
reference equal to the recovered run -> ``stability.json``, plots, ``summary.md``.

``faults`` kill ranks on purpose (``kill_rank`` at the ``at_step``-th step of this run);
``leak_bytes_per_step`` and ``stall_every``/``stall_s`` are documented test hooks that inject a
memory leak and a periodic stall into the workload, so the checks can be seen to fail.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from migrate.pipeline.stage import StageContext, StageDefinition, StageOutcome
from migrate.stages._stability_model import (DEFAULT_STEPS, MIB, Attempt, KillFault, RecoveryDecision, RunPlan,
                                             StabilityOptions, decide_recovery, judge, memory_segments,
                                             merged_steps, recoveries, worst_trend)
from migrate.stages._stability_report import write_outputs
from migrate.workload.run_spec import Kill

__all__ = ["Attempt", "DEFAULT_STEPS", "KillFault", "RecoveryDecision", "RunPlan", "STAGE", "StabilityOptions",
           "decide_recovery", "judge", "memory_segments", "merged_steps", "recoveries", "run", "worst_trend"]


def _failure_text(exc: Any) -> tuple[str, tuple[int, ...]]:
    """One line naming each failed rank, its node and the cause (root causes first)."""
    root = exc.failures[0].kind  # sorted root causes first: a death explains its peers' connection errors
    causes = [f for f in exc.failures if f.kind == root]
    return "; ".join(f.describe() for f in causes[:4]), tuple(f.rank for f in causes)


def _drop_uncommitted(save_dir: Path, committed: Sequence[tuple[int, str]]) -> list[str]:
    """Remove checkpoint folders a failure left half written (not committed); return their names."""
    keep = {str(Path(p)) for _, p in committed}
    dropped = []
    if save_dir.is_dir():
        for entry in sorted(save_dir.iterdir()):
            if entry.is_dir() and str(entry) not in keep:
                shutil.rmtree(entry, ignore_errors=True)
                dropped.append(entry.name)
    return dropped


def _prune(committed: Sequence[tuple[int, str]], keep: int, protected: Sequence[str]) -> None:
    """Keep the newest `keep` committed checkpoints of the run (0: all) and the `protected` ones."""
    if not keep:
        return
    for _, path in list(committed)[:-keep]:
        if path not in protected:
            shutil.rmtree(path, ignore_errors=True)


def _select(record: dict[str, Any]) -> dict[str, Any]:
    """What the tracker logs of a rank-0 line: training metrics and memory in MiB."""
    out: dict[str, Any] = {k: record[k] for k in ("loss", "grad_norm", "lr", "step_time_s") if k in record}
    for key in ("host_rss_bytes", "device_allocated_bytes", "device_reserved_bytes"):
        if key in record:
            out[key.replace("_bytes", "_mib")] = record[key] / MIB
    return out


def _run_attempt(ctx: StageContext, plan: RunPlan, options: StabilityOptions, *, index: int, load: tuple[int, str],
                 kills: tuple[Kill, ...], protected: tuple[str, ...]) -> Attempt:
    from migrate.runtime.worker_group import WorkerGroupError
    from migrate.stages.train import MetricsFollower
    from migrate.workload.engines import rank_entry
    from migrate.workload.from_job import run_spec
    from migrate.workload.long_run import RANK_FILE, read_records
    from migrate.workload.run_spec import LongRun

    job = ctx.job.spec
    directory = ctx.work_dir / f"attempt{index}"
    shutil.rmtree(directory, ignore_errors=True)
    records_dir = directory / "ranks"
    spec = run_spec(job, plan.layout, engine=plan.engine, steps=plan.end_step, save_dir=str(plan.save_dir),
                    load_dir=load[1], save_every=options.save_every, metrics_path=str(directory / "metrics.jsonl"),
                    micro_batch_size=plan.micro_batch_size)
    long_run = LongRun(records_dir=str(records_dir), deadline=plan.deadline, keep_checkpoints=options.keep_checkpoints,
                       protected=protected, kills=kills, leak_bytes_per_step=options.leak_bytes_per_step,
                       stall_every=options.stall_every, stall_s=options.stall_s)
    spec = dataclasses.replace(spec, long_run=long_run, print_loaded_state=False)
    remaining = plan.end_step - load[0]
    limit = job.target.timeout_s + options.step_timeout_s * remaining
    if plan.deadline is not None:
        limit = min(limit, max(0.0, plan.deadline - time.time()) + job.target.timeout_s + options.step_timeout_s)
    env = {"DS_ACCELERATOR": job.target.device_type, "OMP_NUM_THREADS": "1"}
    started = time.time()
    failure, stopped = "", None
    failed_ranks: tuple[int, ...] = ()
    total = remaining if plan.deadline is None else None
    try:
        with ctx.worker_group(world_size=plan.layout.world_size, env=env) as group:
            with MetricsFollower(records_dir / RANK_FILE.format(rank=0), ctx, total=total, select=_select):
                results = group.run(rank_entry(plan.engine), spec, timeout_s=limit)
        stopped = results[0].stopped
    except WorkerGroupError as exc:
        failure, failed_ranks = _failure_text(exc)
    return Attempt(index=index, loaded_step=load[0], loaded=load[1], started_at=started, ended_at=time.time(),
                   records=read_records(records_dir, plan.layout.world_size), failure=failure,
                   failed_ranks=failed_ranks, stopped=stopped)


def _run_attempts(ctx: StageContext, plan: RunPlan, options: StabilityOptions,
                  start: tuple[int, str]) -> tuple[list[Attempt], list[RecoveryDecision]]:
    """Attempts until the run ends or recovery is given up; the decisions taken after each."""
    attempts: list[Attempt] = []
    decisions: list[RecoveryDecision] = []
    committed: list[tuple[int, str]] = [start]
    load, kills = start, plan.kills
    while True:
        protected = tuple(a.loaded for a in attempts) + (load[1],)
        attempt = _run_attempt(ctx, plan, options, index=len(attempts) + 1, load=load, kills=kills,
                               protected=protected)
        attempts.append(attempt)
        committed += [(step, path) for step, path, _ in attempt.records.checkpoints]
        decision = decide_recovery(attempt, restarts=len(attempts) - 1, max_restarts=options.max_restarts,
                                   committed=committed)
        decisions.append(decision)
        if attempt.failure:
            ctx.log_metrics(attempt.last_step, {"failures": sum(1 for a in attempts if a.failure)})
        if decision.action != "restart":
            if attempt.failure:
                sys.stderr.write(f"[stability] {decision.reason}\n")
            return attempts, decisions
        assert decision.load is not None
        dropped = _drop_uncommitted(plan.save_dir, committed)
        sys.stderr.write(f"[stability] {decision.reason} (restart {len(attempts)} of {options.max_restarts})"
                         + (f"; removed the half-written {', '.join(dropped)}" if dropped else "") + "\n")
        load = decision.load
        _prune(committed[1:], options.keep_checkpoints, protected + (load[1],))
        reached = attempt.last_step + 1  # a kill planned at or before the step that failed has fired
        kills = tuple(k for k in kills if k.step > reached)

def _reference_run(ctx: StageContext, plan: RunPlan, options: StabilityOptions, load: tuple[int, str],
                   last: int) -> list[dict[str, Any]]:
    """An uninterrupted run from `load` to `last` (or `verify_steps` after it): no faults, no checkpoints."""
    from migrate.workload.engines import rank_entry
    from migrate.workload.from_job import run_spec
    from migrate.workload.run_spec import LongRun
    from migrate.workload.long_run import read_records

    job = ctx.job.spec
    end = min(last, load[0] + options.verify_steps) if options.verify_steps else last
    directory = ctx.work_dir / "reference"
    shutil.rmtree(directory, ignore_errors=True)
    spec = run_spec(job, plan.layout, engine=plan.engine, steps=end, save_dir=None, load_dir=load[1], save_every=0,
                    metrics_path=str(directory / "metrics.jsonl"), micro_batch_size=plan.micro_batch_size)
    spec = dataclasses.replace(spec, long_run=LongRun(records_dir=str(directory / "ranks")), print_loaded_state=False)
    env = {"DS_ACCELERATOR": job.target.device_type, "OMP_NUM_THREADS": "1"}
    with ctx.worker_group(world_size=plan.layout.world_size, env=env) as group:
        group.run(rank_entry(plan.engine), spec,
                  timeout_s=job.target.timeout_s + options.step_timeout_s * max(1, end - load[0]))
    return list(read_records(directory / "ranks", plan.layout.world_size).steps(0))


def run(ctx: StageContext) -> StageOutcome:
    from checkpoint.safe_load import check_pickles
    from migrate.stages._target import target_layout, target_micro_batch
    from migrate.stages.resume import checkpoint_step, manifest_problems
    from migrate.workload.from_job import default_engine

    options: StabilityOptions = ctx.options  # type: ignore[assignment]
    job = ctx.job.spec
    converted = Path(ctx.upstream["convert"].outputs["checkpoint"])
    damaged = manifest_problems(converted)
    if damaged:
        return StageOutcome(verdict="fail", metrics={"manifest_problems": len(damaged), "passed": 0},
                            reasons=tuple(f"converted checkpoint differs from its manifest: {p}" for p in damaged[:20]),
                            summary_md=f"The converted checkpoint `{converted}` is not what the conversion wrote; "
                                       "nothing was run.\n")
    check_pickles(converted)  # the frameworks' loaders unpickle freely: refuse what is not allowed
    layout, layout_from = target_layout(ctx.job, ctx.upstream)
    micro_batch, _ = target_micro_batch(ctx.job, ctx.upstream)
    outside = [f"kill_rank {f.kill_rank}" for f in options.faults if f.kill_rank >= layout.world_size]
    if outside:
        raise ValueError(f"stages.stability.faults: {', '.join(outside)} outside the target's {layout.world_size} "
                         f"rank(s) (layout {layout.describe()})")
    start = checkpoint_step(converted)
    planned = options.planned_steps
    save_dir = ctx.work_dir / "checkpoints"
    shutil.rmtree(save_dir, ignore_errors=True)
    shutil.rmtree(ctx.work_dir / "reference", ignore_errors=True)
    for old in ctx.work_dir.glob("attempt*"):
        shutil.rmtree(old, ignore_errors=True)
    plan = RunPlan(engine=options.engine or default_engine(job, layout), layout=layout, micro_batch_size=micro_batch,
                   start_step=start, end_step=start + (planned if planned is not None else 10**9),
                   deadline=time.time() + options.minutes * 60 if options.minutes else None, save_dir=save_dir,
                   kills=tuple(Kill(rank=f.kill_rank, step=start + f.at_step) for f in options.faults))
    attempts, decisions = _run_attempts(ctx, plan, options, (start, str(converted)))
    steps = merged_steps(attempts)
    last = int(steps[-1]["step"]) if steps else start
    reference, reference_from = None, None
    if options.verify_recovery and len(attempts) > 1 and last > attempts[1].loaded_step:
        reference_from = attempts[1].loaded_step
        reference = _reference_run(ctx, plan, options, (reference_from, attempts[1].loaded), last)
    _prune([(s, p) for a in attempts for s, p, _ in a.records.checkpoints], options.keep_checkpoints, ())
    verdict = judge(attempts, decisions, plan, options, reference, reference_from)

    return write_outputs(ctx, plan, options, attempts, decisions, verdict, steps, reference, reference_from,
                         layout_from=layout_from)


STAGE = StageDefinition(
    name="stability",
    description="a long run of the target from the converted checkpoint: memory growth, step-time tails, "
                "failures survived",
    run=run,
    options=StabilityOptions,
    depends_on=("convert",),
    after=("resume", "search"),
    reads=("source", "target", "model", "training"),
)
