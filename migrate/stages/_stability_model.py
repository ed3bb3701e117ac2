"""The stability stage's options, the record of its attempts and its verdict: pure functions over what the
ranks recorded (`judge`, `decide_recovery`, the memory trends), shared by the stage (`stability`) and its
outputs (`_stability_report`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Mapping, Sequence

from pydantic import Field, model_validator

from convergence.checks import CheckResult
from convergence.stability import (HealthLimits, Recovery, Segment, StabilityVerdict, Trend, check_growth,
                                   check_health, check_periodic, check_tails, compare_steps, fit_trend,
                                   periodic_slowdown, step_times)
from checkpoint.layout import ParallelLayout
from migrate.pipeline.stage import StageOptions
from migrate.workload.run_spec import Engine, Kill

if TYPE_CHECKING:
    from migrate.workload.long_run import RunRecords

MIB = 2**20
DEFAULT_STEPS = 200


class KillFault(StageOptions):
    """Kill one rank's process (SIGKILL) at the start of the `at_step`-th step of the stability run."""

    kill_rank: int = Field(ge=0, description="the global rank whose process is killed")
    at_step: int = Field(ge=1, description="the n-th step of this run (1: the first after the converted checkpoint)")


class StabilityOptions(StageOptions):
    steps: int | None = Field(default=None, ge=1, description=f"steps after the converted checkpoint (default "
                                                               f"{DEFAULT_STEPS} when minutes is not set)")
    minutes: float | None = Field(default=None, gt=0, description="train for this long (wall clock, recoveries "
                                                                  "included); with steps, whichever ends first")
    save_every: int = Field(default=50, ge=1, description="checkpoint every K steps (recovery resumes from the newest)")
    keep_checkpoints: int = Field(default=2, ge=0, description="keep the newest N of this run's checkpoints (0: all)")
    warmup_steps: int = Field(default=20, ge=0, description="steps after each (re)start left out of the trends")
    faults: list[KillFault] = Field(default_factory=list, description="ranks to kill on purpose")
    max_restarts: int = Field(default=3, ge=0, description="recoveries allowed before the stage fails")
    step_timeout_s: float = Field(default=300.0, gt=0, description="a step slower than this is a hang (the attempt "
                                                                   "is ended and recovered)")
    verify_recovery: bool = Field(default=True, description="after a recovery: an uninterrupted reference run from "
                                                            "the same checkpoint must give the same losses")
    verify_steps: int | None = Field(default=None, ge=1, description="steps the reference run covers (default: to "
                                                                     "the end of the run)")
    recovery_rtol: float = Field(default=0.0, ge=0, description="relative tolerance of recomputed and reference "
                                                               "steps (0: bit for bit, deterministic engines)")
    confidence: float = Field(default=0.99, gt=0, lt=1, description="confidence of the trend intervals")
    host_memory_growth_mib: float = Field(default=64.0, ge=0, description="limit: host RSS growth per rank, "
                                                                         "MiB per 1,000 steps")
    device_memory_growth_mib: float = Field(default=16.0, ge=0, description="limit: device memory growth (allocated "
                                                                           "and reserved) per rank, MiB per 1,000 steps")
    max_jitter: float = Field(default=1.5, ge=1, description="limit: step time P99 / P50")
    max_periodic_slowdown: float = Field(default=0.1, ge=0, description="limit: a periodic phase's median excess "
                                                                        "as a fraction of the other steps' median")
    periodic_alpha: float = Field(default=0.01, gt=0, lt=1, description="significance of a periodic slowdown")
    max_period: int = Field(default=200, ge=2, description="longest period (steps) tested for slowdowns")
    max_nonfinite_steps: int = Field(default=0, ge=0, description="NaN/Inf loss or grad norm steps allowed")
    max_skipped_fraction: float = Field(default=0.01, ge=0, le=1, description="optimizer steps skipped (overflow) allowed")
    max_loss_spikes: int = Field(default=0, ge=0, description="loss spikes allowed (the gate's spike rule)")
    spike_window: int = Field(default=20, ge=3)
    """steps before a point whose median and spread judge it (the gate's spike rule)"""
    spike_z: float = Field(default=6.0, gt=0)
    """a spike lies more than this many robust standard deviations from that median"""
    engine: Literal["deepspeed", "megatron", "fsdp"] | None = Field(
        default=None, description="default: from the source format / layout")
    leak_bytes_per_step: int = Field(default=0, ge=0, description="test hook: every rank keeps this many more bytes per step")
    stall_every: int = Field(default=0, ge=0, description="test hook: every rank sleeps stall_s in every K-th step")
    stall_s: float = Field(default=0.0, ge=0, description="test hook: the stall's length in seconds")

    @model_validator(mode="after")
    def _consistent(self) -> StabilityOptions:
        if self.steps is not None:
            late = [f"rank {f.kill_rank} at step {f.at_step}" for f in self.faults if f.at_step > self.steps]
            if late:
                raise ValueError(f"faults {', '.join(late)} lie after the run's last step (steps {self.steps})")
        if bool(self.stall_every) != bool(self.stall_s):
            raise ValueError(f"stall_every({self.stall_every}) and stall_s({self.stall_s}) go together: set both or neither")
        return self

    @property
    def planned_steps(self) -> int | None:
        """Steps to run, or None when only the time limit ends the run."""
        if self.steps is None and self.minutes is None:
            return DEFAULT_STEPS
        return self.steps


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One worker group's part of the run: where it resumed, what its ranks recorded, how it ended."""

    index: int
    loaded_step: int
    loaded: str
    started_at: float
    ended_at: float
    records: RunRecords
    failure: str = ""
    failed_ranks: tuple[int, ...] = ()
    stopped: str | None = None  # the engine stopped by itself (non-finite metrics)

    @property
    def last_step(self) -> int:
        """The last step every rank finished (the loaded step when none)."""
        done = [rows[-1]["step"] for rows in self.records.ranks.values() if rows]
        return int(min(done)) if done and len(done) == len(self.records.ranks) else self.loaded_step

    @property
    def first_step_at(self) -> float | None:
        rows = self.records.steps(0)
        return float(rows[0]["wall_time"]) if rows else None

    @property
    def last_step_at(self) -> float | None:
        times = [float(rows[-1]["wall_time"]) for rows in self.records.ranks.values() if rows]
        return max(times) if times else None


@dataclass(frozen=True)
class RecoveryDecision:
    """What the stage does after an attempt: ``done``, ``restart`` from ``load`` (step, path), or ``fail``."""

    action: Literal["done", "restart", "fail"]
    reason: str
    load: tuple[int, str] | None = None


def decide_recovery(attempt: Attempt, *, restarts: int, max_restarts: int,
                    committed: Sequence[tuple[int, str]]) -> RecoveryDecision:
    """Pure: an attempt that ended normally is done; a failed one restarts from the newest committed
    checkpoint (`committed`, oldest first: the run's start and every checkpoint saved since) while the
    retry budget lasts, else the stage fails naming the rank, its node and the cause."""
    if not attempt.failure:
        return RecoveryDecision("done", "the run ended" + (f": {attempt.stopped}" if attempt.stopped else ""))
    if restarts >= max_restarts:
        return RecoveryDecision("fail", f"not recovered: {restarts} restart(s) used of max_restarts {max_restarts}; "
                                        f"attempt {attempt.index} failed after step {attempt.last_step}: {attempt.failure}")
    step, path = committed[-1]
    return RecoveryDecision("restart", f"attempt {attempt.index} failed after step {attempt.last_step} "
                                       f"({attempt.failure}); restarting from the checkpoint of step {step}", (step, path))


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """The fixed inputs of the run's attempts."""

    engine: Engine
    layout: ParallelLayout
    micro_batch_size: int
    start_step: int
    end_step: int
    deadline: float | None
    save_dir: Path
    kills: tuple[Kill, ...]  # at global steps


def recoveries(attempts: Sequence[Attempt]) -> list[Recovery]:
    """Each failure and how the next attempt recovered from it."""
    out = []
    for failed, after in zip(attempts, attempts[1:]):
        last, first = failed.last_step_at, after.first_step_at
        out.append(Recovery(failed_at_step=failed.last_step, resumed_from_step=after.loaded_step,
                            seconds_to_recover=(first - (last or failed.started_at)) if first is not None else None,
                            cause=failed.failure))
    return out


def _by_step(rows: Sequence[Mapping[str, Any]], lo: int, hi: int) -> dict[int, dict[str, float]]:
    return {int(r["step"]): {k: float(r[k]) for k in ("loss", "grad_norm", "lr") if k in r}
            for r in rows if lo < int(r["step"]) <= hi}


def merged_steps(attempts: Sequence[Attempt]) -> list[dict[str, Any]]:
    """Rank 0's lines of the whole run, one per step: a later attempt's replace what it recomputed."""
    final: dict[int, dict[str, Any]] = {}
    for attempt in attempts:
        for row in attempt.records.steps(0):
            if int(row["step"]) > attempt.loaded_step:
                final[int(row["step"])] = row
    return [final[s] for s in sorted(final)]


def memory_segments(attempts: Sequence[Attempt], rank: int, key: str, warmup: int) -> list[Segment]:
    """One segment per attempt of rank `rank`'s `key` (bytes, as MiB), without its first `warmup` steps."""
    segments = []
    for attempt in attempts:
        rows = [r for r in attempt.records.steps(rank) if key in r]
        if rows:
            seg = Segment(steps=tuple(int(r["step"]) for r in rows), values=tuple(r[key] / MIB for r in rows))
            segments.append(seg.after_warmup(warmup))
    return segments


def worst_trend(attempts: Sequence[Attempt], ranks: Sequence[int], key: str, options: StabilityOptions
                 ) -> tuple[int, Trend | None, dict[int, Trend]]:
    """(rank, trend) of the rank whose growth is most significant (largest lower bound), and every rank's."""
    trends = {r: t for r in ranks if (t := fit_trend(memory_segments(attempts, r, key, options.warmup_steps),
                                                     confidence=options.confidence)) is not None}
    if not trends:
        return (ranks[0] if ranks else 0), None, {}
    rank = max(trends, key=lambda r: trends[r].lower)
    return rank, trends[rank], trends


def judge(attempts: Sequence[Attempt], decisions: Sequence[RecoveryDecision], plan: RunPlan, options: StabilityOptions,
          reference: Sequence[Mapping[str, Any]] | None, reference_from: int | None) -> StabilityVerdict:
    """Every check of the run (pure over what the attempts recorded)."""
    ranks = sorted({r for a in attempts for r in a.records.ranks})
    checks: list[CheckResult] = []
    details: dict[str, Any] = {"ranks": {}}
    final = decisions[-1]
    steps = merged_steps(attempts)
    last = int(steps[-1]["step"]) if steps else plan.start_step
    if final.action == "fail":
        checks.append(CheckResult(code="failures", passed=False, reason=final.reason))
    else:
        n = len(attempts) - 1
        checks.append(CheckResult(code="failures", passed=True,
                                  reason=f"{n} failure(s), each recovered" if n else "no failure"))
    stopped = attempts[-1].stopped
    if final.action == "done":
        short = plan.deadline is None and last < plan.end_step
        if stopped or short:
            checks.append(CheckResult(code="completed", passed=False,
                                      reason=f"stopped at step {last} of {plan.end_step}: {stopped or 'no reason given'}"))
    memory = [("host_memory_growth", "host_rss_bytes", "host RSS", options.host_memory_growth_mib),
              ("device_memory_growth", "device_allocated_bytes", "device memory allocated", options.device_memory_growth_mib),
              ("device_reserved_growth", "device_reserved_bytes", "device memory reserved", options.device_memory_growth_mib)]
    for code, key, what, limit in memory:
        if not any(key in row for a in attempts for row in a.records.steps(0)):
            continue
        rank, trend, per_rank = worst_trend(attempts, ranks, key, options)
        checks.append(check_growth(code, f"{what} of rank {rank}", trend, limit, "MiB"))
        for r, t in per_rank.items():
            details["ranks"].setdefault(str(r), {})[code] = {"slope": t.slope, "lower": t.lower, "upper": t.upper}
    timed = [(int(r["step"]), float(r["step_time_s"])) for a in attempts
             for r in a.records.steps(0)[options.warmup_steps:] if "step_time_s" in r]
    times = step_times([t for _, t in timed])
    checks.append(check_tails(times, options.max_jitter))
    checks.append(check_periodic(periodic_slowdown([s for s, _ in timed], [t for _, t in timed],
                                                   max_period=options.max_period),
                                 alpha=options.periodic_alpha, limit=options.max_periodic_slowdown))
    log_order = [r for a in attempts for r in a.records.steps(0) if int(r["step"]) > a.loaded_step]
    if log_order:
        checks += check_health(log_order, HealthLimits(
            max_nonfinite_steps=options.max_nonfinite_steps, max_skipped_fraction=options.max_skipped_fraction,
            spike_window=options.spike_window, spike_z=options.spike_z, max_loss_spikes=options.max_loss_spikes))
    for failed, after in zip(attempts, attempts[1:]):
        checks.append(compare_steps(
            "recomputed_steps", f"steps {after.loaded_step + 1}..{failed.last_step} recomputed after failure "
                                f"{failed.index} against their first computation",
            _by_step(after.records.steps(0), after.loaded_step, failed.last_step),
            _by_step(failed.records.steps(0), after.loaded_step, failed.last_step),
            keys=("loss", "grad_norm", "lr"), rtol=options.recovery_rtol))
    if reference is not None and reference_from is not None:
        checks.append(compare_steps(
            "recovery_reference", f"the recovered run against an uninterrupted run from the checkpoint of step "
                                  f"{reference_from}",
            _by_step(steps, reference_from, last), _by_step(reference, reference_from, last),
            keys=("loss", "grad_norm", "lr"), rtol=options.recovery_rtol))
    if times is not None:
        details["step_time"] = {"p50_s": times.p50, "p95_s": times.p95, "p99_s": times.p99, "jitter": times.jitter}
    return StabilityVerdict(checks=tuple(checks), details=details)
