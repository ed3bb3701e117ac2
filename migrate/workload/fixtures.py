"""Real framework checkpoints for tests of other components (conversion, resume, gate).

Each helper trains the tiny built-in model with the real engine on a local Gloo worker group (kept
warm between runs: `run_warm`) and returns where the engine wrote its checkpoint. Launches cost
1-30 s: share the results through session-scoped pytest fixtures (tests/workload_fixtures.py).
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable

from checkpoint.model_shape import ModelShape
from migrate.workload.metrics import RankResult
from migrate.workload.run_spec import Precision, RunSpec, TrainSpec

if TYPE_CHECKING:
    from migrate.runtime.worker_group import WorkerGroup

R = TypeVar("R")

TINY_LLAMA = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=2, vocab_size=128, seq_length=32)
TINY_MIXTRAL = ModelShape(architecture="mixtral", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                         num_attention_heads=4, num_query_groups=2, vocab_size=128, seq_length=32,
                         num_experts=4, moe_top_k=2)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedCheckpoint:
    """A checkpoint written by a real engine: `path` is what the engine loads from
    (DeepSpeed: the save dir with `latest`; Megatron-Core / DCP: the checkpoint dir)."""

    path: Path
    spec: RunSpec
    world_size: int
    results: tuple[RankResult, ...]

    @property
    def losses(self) -> list[float]:
        return self.results[0].losses


# Local Gloo worker groups kept between runs, one per world size: a rank that trained or loaded once has
# imported and initialised its framework, so the next run on it takes a fraction of the time.
_WARM_GROUPS: dict[int, WorkerGroup] = {}
_WARM_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def run_warm(world_size: int, fn: Callable[..., R], *args: Any, timeout_s: float = 600.0) -> list[R]:
    """``fn(ctx, *args)`` on every rank of this process's local Gloo worker group of `world_size` ranks (started
    on first use, with the environment and import path of that moment); results in rank order.

    The group is kept for the next run at that world size, so `fn` must leave its rank as it found it (the
    built-in engines do: seeds set per run, model-parallel state destroyed). A run that fails closes the group,
    as does one after which a rank holds more than MAX_RANK_THREADS threads: the next run starts on fresh ranks.
    The groups close when this process exits (`close_warm_groups`)."""
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules

    group = _WARM_GROUPS.get(world_size)
    if group is None:
        if not _WARM_GROUPS:
            atexit.register(close_warm_groups)
        env = dict(_WARM_ENV)
        if "TORCH_EXTENSIONS_DIR" in os.environ:
            env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        preload = tuple(m for engine in ("deepspeed", "megatron", "fsdp") for m in engine_modules(engine))
        group = _WARM_GROUPS[world_size] = start_worker_group(WorkerGroupSpec(
            world_size=world_size, mode="local", backend="gloo", env=env, timeout_s=600.0, preload=preload))
    try:
        results = group.run(_counting_threads, fn, *args, timeout_s=timeout_s)
    except BaseException:
        del _WARM_GROUPS[world_size]
        group.close()
        raise
    if max(threads for _, threads in results) > MAX_RANK_THREADS:
        del _WARM_GROUPS[world_size]
        group.close()
    return [value for value, _ in results]


# A rank keeps the threads of every process group a run created on it (two Gloo threads or more per group; a
# Megatron run creates about 50): past this many the group is closed after its run and the next starts anew.
MAX_RANK_THREADS = 64


def _counting_threads(ctx: Any, fn: Callable[..., R], *args: Any) -> tuple[R, int]:
    """``fn(ctx, *args)`` and how many threads the rank has after it (0 where /proc is missing)."""
    value = fn(ctx, *args)
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = 0
    return value, threads


def close_warm_groups() -> None:
    """Stop the worker groups `run_warm` kept."""
    while _WARM_GROUPS:
        _, group = _WARM_GROUPS.popitem()
        group.close()


def launch(spec: RunSpec, world_size: int, timeout_s: float = 600.0) -> list[RankResult]:
    """Run a built-in engine at `world_size` ranks on a warm local Gloo worker group (`run_warm`); per-rank
    results."""
    from migrate.workload.engines import rank_entry

    return run_warm(world_size, rank_entry(spec.engine), spec, timeout_s=timeout_s)


def make_deepspeed_checkpoint(directory: str | os.PathLike, world_size: int, zero_stage: int,
                              dtype: Precision = "fp32", steps: int = 2, model: ModelShape = TINY_LLAMA,
                              global_batch_size: int = 8) -> TrainedCheckpoint:
    """Train `steps` DeepSpeed steps at DP=`world_size`, ZeRO `zero_stage`, `dtype` (fp32|bf16)
    and save with `engine.save_checkpoint(directory, tag="global_step<steps>")`."""
    spec = RunSpec(engine="deepspeed", model=model, steps=steps, zero_stage=zero_stage, save_dir=str(directory),
                   train=TrainSpec(precision=dtype, global_batch_size=global_batch_size))
    results = launch(spec, world_size)
    return TrainedCheckpoint(path=Path(directory), spec=spec, world_size=world_size, results=tuple(results))


def make_megatron_checkpoint(directory: str | os.PathLike, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                             moe: bool = False, steps: int = 2, distributed_optimizer: bool = True,
                             dtype: Precision = "fp32", global_batch_size: int = 8) -> TrainedCheckpoint:
    """Train `steps` Megatron-Core steps at tp x pp x dp (ep divides dp; `moe` uses TINY_MIXTRAL) with
    the DistributedOptimizer and save a torch_dist checkpoint; `.path` is `<directory>/iter_<steps>`."""
    from migrate.workload.megatron.state import iteration_dir

    spec = RunSpec(engine="megatron", model=TINY_MIXTRAL if moe else TINY_LLAMA, steps=steps, tp=tp, pp=pp, ep=ep,
                   distributed_optimizer=distributed_optimizer, save_dir=str(directory),
                   train=TrainSpec(precision=dtype, global_batch_size=global_batch_size))
    results = launch(spec, tp * pp * dp)
    return TrainedCheckpoint(path=Path(iteration_dir(str(directory), steps)), spec=spec, world_size=tp * pp * dp,
                             results=tuple(results))


def make_fsdp_checkpoint(directory: str | os.PathLike, *, world_size: int, steps: int = 2,
                         dtype: Precision = "fp32") -> TrainedCheckpoint:
    """Train `steps` FSDP2 steps at `world_size` ranks and save with DCP; `.path` is `<directory>/step-<steps>`."""
    from migrate.workload.fsdp_engine import step_dir

    spec = RunSpec(engine="fsdp", model=TINY_LLAMA, steps=steps, save_dir=str(directory),
                   train=TrainSpec(precision=dtype))
    results = launch(spec, world_size)
    return TrainedCheckpoint(path=Path(step_dir(str(directory), steps)), spec=spec, world_size=world_size,
                             results=tuple(results))
