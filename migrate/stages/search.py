"""Search: the parallel plan for the target, chosen from measured steps.

Enumerates every layout of the model on the target's devices (rejected ones keep their
reasons), prunes what the memory model says cannot fit, ranks the rest with the calibrated
cost model and profiles the most promising ones for real on the target (warm-up + timed
steps of the built-in workload, or of the user's ``command``), with successive halving.
Measurements go to ``<work_dir>/search/profiles.jsonl`` first, so a stopped search resumes.
Writes ``ranking.json``, ``ranking.md`` and the chosen plan's runnable configs
(``megatron_args.txt``, ``deepspeed.json``, ``target_layout.yaml``).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Literal

from pydantic import Field

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


class SearchOptions(StageOptions):
    frameworks: tuple[Literal["megatron", "deepspeed"], ...] = ("megatron", "deepspeed")
    """the engines whose layouts are searched (their sharding and pipeline options differ)"""
    micro_batch_sizes: tuple[int, ...] | None = Field(default=None, description="None: powers of two up to max_micro_batch")
    max_micro_batch: int = Field(default=8, ge=1)
    """the largest micro batch tried when micro_batch_sizes is not given"""
    recompute: tuple[Literal["none", "selective", "full"], ...] = ("none",)
    """activation recomputation modes tried"""
    sequence_parallel: Literal["auto", "both", "off"] = "auto"
    """auto: on exactly when tp > 1 (Megatron's recommendation); both: try on and off; off: never"""
    vpp: tuple[int, ...] = (1, 2)
    """virtual pipeline sizes tried (where pp > 1 and the layers divide)"""
    context_parallel: tuple[int, ...] = (1,)
    """context-parallel sizes tried"""
    shardings: tuple[Literal["none", "zero1", "zero2", "zero3", "distributed_optimizer", "fsdp"], ...] | None = Field(
        default=None, description="optimizer shardings to consider; default: all the framework has")
    max_trials: int | None = Field(default=None, ge=1, description="distinct candidates profiled at most")
    max_fraction: float = Field(default=0.25, gt=0, le=1)
    """profile at most this share of the candidates that fit in memory (at least 2)"""
    max_seconds: float | None = Field(default=None, gt=0)
    """wall-clock budget for profiling; the best measured so far wins when it is spent"""
    min_steps: int = Field(default=2, ge=1)
    """timed steps per candidate in the first rung of successive halving"""
    max_steps: int = Field(default=8, ge=1)
    """timed steps in the last rung (each rung multiplies the steps by 2 and halves the candidates)"""
    warmup_steps: int = Field(default=1, ge=0)
    """untimed steps before a candidate's timed ones"""
    target_mfu: float = Field(default=0.0, ge=0, le=1)
    """when the best measured MFU is below this, more candidates are measured while the budget lasts, and the stage
    fails if none reaches it (0: no target)"""
    device_profile: str | None = Field(default=None, description="overrides target.device_profile")
    command: str | None = Field(default=None, description="the user's launch command template; None: built-in workloads")
    overlap_grad_reduce: bool = False
    """the cost model hides the data-parallel gradient reduction behind the backward (Megatron's --overlap-grad-
    reduce)"""
    profile: bool = Field(default=True, description="False: rank analytically only (no runs)")


def run(ctx: StageContext) -> StageOutcome:
    from migrate.search.run import search_job
    from migrate.stages._target import layout_override

    options: SearchOptions = ctx.options  # type: ignore[assignment]
    outcome = search_job(ctx.job, options, ctx.work_dir, start_group=lambda: ctx.worker_group(), status=ctx.status)
    result, paths, reasons = outcome.result, outcome.paths, outcome.reasons
    summary = outcome.summary
    fixed = ctx.job.spec.target.layout
    override = (layout_override(fixed.to_layout(), result.chosen.candidate.layout)
                if fixed is not None and result.chosen is not None else None)
    if override is not None:  # later stages use the job's layout: say so now, and in the report
        print(f"[search] warning: {override}", file=sys.stderr, flush=True)
        summary = f"> **Warning:** {override}.\n\n{summary}"
    metrics: dict[str, Any] = {"space": result.space_size, "rejected": result.rejected, "feasible": result.feasible,
               "profiled": result.profiled, "profiled_fraction": round(result.profiled_fraction, 4),
               "profile_calls": result.profile_calls, "cache_hits": result.cache_hits,
               "target_met": result.target_met}
    if result.chosen is not None:
        metrics |= {"chosen": result.chosen.candidate.key, "chosen_step_s": result.chosen.measured_s,
                    "chosen_mfu": result.chosen.measured_mfu, "overridden_by_job_layout": override is not None}
    ctx.log_metrics(0, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    ctx.tracker.log_table("search", "ranking", ["candidate", "status", "predicted_s", "measured_s", "predicted_memory_gb",
                                                "measured_mfu", "reason"],
                          [[r.candidate.label(), r.status, r.predicted_s, r.measured_s, r.memory.total / 1e9,
                            r.measured_mfu, r.reason or ""] for r in result.rows])
    (ctx.work_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return StageOutcome(verdict="fail" if reasons else "pass", metrics=metrics, reasons=tuple(reasons),
                        outputs={k: str(v) for k, v in paths.items()}, summary_md=summary)


STAGE = StageDefinition(
    name="search",
    description="choose the target's TP/PP/EP/DP plan from measured steps; emit runnable configs",
    run=run,
    options=SearchOptions,
    after=("preflight",),
    uses=lambda options: ("preflight",) if getattr(options, "profile", True) else (),  # analytic: no cluster
    reads=("target", "model", "training"),
)
