"""The one training loop of the built-in engines (DeepSpeed, FSDP2, Megatron-Core); each engine brings
only what differs: how it sets the learning rate, how it runs one optimizer step over its micro-batches,
and how it saves.

Per step, in this order (the order the engines' bit-identical resume tests rely on)::

    probe.before_step(step)                     # a long run may kill this rank, stall or grow a leak
    lr = engine.learning_rate(step)             # read (DeepSpeed, FSDP) or set (Megatron) for this step
    indices = global_batch_indices(sampler)     # the global batch, the same on every rank
    trace.record(indices)                       # the batch and the RNG fingerprint at the step's start
    outcome = engine.train_step(indices)        # forward, backward, optimizer step: mean loss, grad norm
    sampler = sampler.advance()
    record -> metrics log (rank 0) -> probe.after_step(record, skipped)
    engine.save(step, sampler) when `should_save`; probe.saved(step, path)
    stop on a non-finite loss (`stop_on_nonfinite`) or when a long run's time is out
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from migrate.workload.data import SamplerState, global_batch_indices
from migrate.workload.long_run import StepProbe
from migrate.workload.metrics import MetricsLog, RankResult, StepMetrics, peak_memory_bytes
from migrate.workload.run_spec import RunSpec
from migrate.workload.train_state import StepTrace


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """One optimizer step as the loop records it: the loss averaged over the global batch, the gradient norm
    before clipping (NaN where the engine has none), and whether the optimizer skipped the update."""

    loss: float
    grad_norm: float
    skipped: bool = False


class EngineSteps(Protocol):
    """What an engine plugs into `train_loop`."""

    def learning_rate(self, step: int) -> float:
        """The learning rate of 0-based step `step`, applied to the optimizer where the engine sets it."""
        ...

    def train_step(self, global_indices: Any) -> StepOutcome:
        """Forward, backward and the optimizer step over this rank's share of the global batch."""
        ...

    def save(self, step: int, sampler: SamplerState) -> str:
        """Checkpoint after 1-based step `step` (collective); the path written."""
        ...


def should_save(spec: RunSpec, step: int) -> bool:
    """Whether to checkpoint after optimizer step `step` (1-based): the last step and every `save_every`."""
    if not spec.save_dir:
        return False
    return step == spec.steps or (spec.save_every > 0 and step % spec.save_every == 0)


def train_loop(ctx: Any, spec: RunSpec, engine: EngineSteps, *, name: str, sampler: SamplerState, start_step: int,
               trace: StepTrace, device: str, extra: dict[str, Any]) -> RankResult:
    """Steps `start_step`..`spec.steps` of `engine` on this rank (`ctx`: the worker group's RankContext); the
    rank's result, its `extra` being the trace's samples and RNG fingerprints plus `extra`."""
    train, model = spec.train, spec.model
    log = MetricsLog(spec.metrics_path, enabled=ctx.rank == 0)
    probe = StepProbe(ctx, spec.long_run, device)
    metrics: list[StepMetrics] = []
    checkpoints: list[str] = []
    stopped = None
    try:
        for step in range(start_step, spec.steps):
            began = time.perf_counter()
            probe.before_step(step + 1)
            lr = engine.learning_rate(step)
            global_indices = global_batch_indices(sampler)
            trace.record(global_indices)
            outcome = engine.train_step(global_indices)
            sampler = sampler.advance()
            record = StepMetrics(
                step=step + 1, loss=outcome.loss, grad_norm=outcome.grad_norm, lr=lr,
                tokens=train.global_batch_size * model.seq_length, consumed_samples=sampler.consumed_samples,
                step_time_s=time.perf_counter() - began, peak_memory_bytes=peak_memory_bytes(device))
            metrics.append(record)
            message = log.write(record)
            probe.after_step(record, skipped=outcome.skipped)
            if should_save(spec, step + 1):
                checkpoints.append(engine.save(step + 1, sampler))
                probe.saved(step + 1, checkpoints[-1])
            if message and spec.stop_on_nonfinite:
                stopped = message
                break
            if probe.out_of_time():
                break
    finally:
        log.close()
        probe.close()
    return RankResult(rank=ctx.rank, engine=name, start_step=start_step, metrics=tuple(metrics),
                      checkpoints=tuple(checkpoints), stopped=stopped, extra=trace.extra(**extra))
