"""Real framework checkpoints for tests of other components (conversion, resume, gate).

Each helper starts a local Gloo worker group, trains the tiny built-in model with the real
engine and returns where the engine wrote its checkpoint. Launches cost 5-30 s: share the
results through session-scoped pytest fixtures (tests/workload_fixtures.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from checkpoint.model_shape import ModelShape
from migrate.workload.metrics import RankResult
from migrate.workload.run_spec import Precision, RunSpec, TrainSpec

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


def launch(spec: RunSpec, world_size: int, timeout_s: float = 600.0) -> list[RankResult]:
    """Run a built-in engine on a fresh local Gloo worker group; per-rank results."""
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules, rank_entry

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    group_spec = WorkerGroupSpec(world_size=world_size, mode="local", backend="gloo", env=env, timeout_s=timeout_s,
                                 preload=engine_modules(spec.engine))
    with start_worker_group(group_spec) as group:
        return group.run(rank_entry(spec.engine), spec)


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
