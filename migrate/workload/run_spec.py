"""Frozen specs for the built-in workloads: the training recipe and one run (the model is the one
`checkpoint.model_shape.ModelShape`).

`TrainSpec` mirrors the job's `training` section; the stage maps the validated job onto it. Every
field is checked on construction and errors print every number involved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from checkpoint.model_shape import ModelShape

Precision = Literal["fp32", "bf16"]
Engine = Literal["deepspeed", "megatron", "fsdp"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """AdamW hyper-parameters (decoupled weight decay) and gradient clipping."""

    name: Literal["adamw", "adam"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LRScheduleSpec:
    """Linear warm-up, then constant, cosine or linear decay to min_lr_ratio * lr at decay_steps."""

    kind: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 2
    decay_steps: int = 100
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"lr_schedule: warmup_steps({self.warmup_steps}) must be >= 0 and "
                             f"decay_steps({self.decay_steps}) >= 1")


def lr_at(schedule: LRScheduleSpec, base_lr: float, step: int) -> float:
    """Learning rate used by optimizer step `step` (0-based). Pure; the same for every engine."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return base_lr * (step + 1) / schedule.warmup_steps
    if schedule.kind == "constant":
        return base_lr
    min_lr = base_lr * schedule.min_lr_ratio
    span = max(schedule.decay_steps - schedule.warmup_steps, 1)
    progress = min(max(step - schedule.warmup_steps, 0) / span, 1.0)
    if schedule.kind == "linear":
        return base_lr - (base_lr - min_lr) * progress
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """The training recipe: batch sizes, precision, optimizer, schedule, seed."""

    global_batch_size: int = 8
    micro_batch_size: int = 1
    precision: Precision = "fp32"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleSpec = field(default_factory=LRScheduleSpec)
    seed: int = 1234
    """Seeds the weight init, the data order and the RNG."""
    dataset_size: int = 4096
    data_seed: int | None = None
    """Seeds the synthetic dataset's content (None: `seed`); another `seed` with the same `data_seed` is
    another run of the same recipe on the same data, as seed-to-seed baselines are."""

    @property
    def dataset_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"training.precision={self.precision!r}: the built-in engines run fp32 or bf16")
        if self.micro_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"training.global_batch_size({self.global_batch_size}) is not a multiple of "
                             f"micro_batch_size({self.micro_batch_size})")
        if self.dataset_size < self.global_batch_size:
            raise ValueError(f"training.dataset_size({self.dataset_size}) < global_batch_size({self.global_batch_size})")

    def grad_accumulation(self, dp: int) -> int:
        """Micro-batches per rank per step; raises when gbs is not a multiple of mbs * dp."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ValueError(f"global_batch_size({self.global_batch_size}) is not a multiple of "
                             f"micro_batch_size({self.micro_batch_size}) * dp({dp}) = {per_step}")
        return self.global_batch_size // per_step


@dataclass(frozen=True, kw_only=True, slots=True)
class Kill:
    """Rank `rank` kills its own process (SIGKILL) at the start of optimizer step `step` (1-based, global)."""

    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"Kill(rank={self.rank}, step={self.step}): rank must be >= 0 and step >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class LongRun:
    """A run's long-run additions. `deadline` is a `time.time()` after which the run stops at the next step
    boundary; `keep_checkpoints` keeps the newest N checkpoints of this run (0: all) besides `protected`
    ones. `leak_bytes_per_step`, `stall_every` and `stall_s` are defects injected for tests: every rank
    keeps `leak_bytes_per_step` more bytes alive after each step (touched, so they are resident), and
    sleeps `stall_s` inside every `stall_every`-th step."""

    records_dir: str
    deadline: float | None = None
    keep_checkpoints: int = 0
    protected: tuple[str, ...] = ()
    kills: tuple[Kill, ...] = ()
    leak_bytes_per_step: int = 0
    stall_every: int = 0
    stall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.keep_checkpoints < 0 or self.leak_bytes_per_step < 0 or self.stall_every < 0 or self.stall_s < 0:
            raise ValueError(f"LongRun: keep_checkpoints({self.keep_checkpoints}), leak_bytes_per_step"
                             f"({self.leak_bytes_per_step}), stall_every({self.stall_every}) and stall_s"
                             f"({self.stall_s}) must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One training run of a built-in engine on a worker group.

    Runs optimizer steps `start_step .. steps-1` where start_step comes from `load_dir`
    (0 without one); saves a framework checkpoint every `save_every` steps (0: only at the
    end when `save_dir` is set) and at the last step. `metrics_path` (rank 0) receives one
    JSON line per step.
    """

    engine: Engine
    model: ModelShape
    train: TrainSpec
    steps: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    distributed_optimizer: bool = False
    save_dir: str | None = None
    load_dir: str | None = None
    save_every: int = 0
    metrics_path: str | None = None
    stop_on_nonfinite: bool = True
    checkpoint_format: Literal["torch_dist", "torch"] = "torch_dist"  # megatron: dist or legacy per-rank files
    print_loaded_state: bool = True  # after a load, before step 1: RankResult.extra["state_print"] (collective)
    long_run: LongRun | None = None  # per-rank step records, time limit, injected failures (the stability stage)

    def __post_init__(self) -> None:
        if self.checkpoint_format not in ("torch_dist", "torch"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}: expected 'torch_dist' (Megatron-Core dist "
                             f"checkpoint) or 'torch' (Megatron-LM's legacy per-rank files)")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.model.seq_length < 1:
            raise ValueError(f"model.seq_length={self.model.seq_length} must be >= 1 to train")
        for name in ("tp", "pp", "ep", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.zero_stage <= 3:
            raise ValueError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.save_every < 0:
            raise ValueError(f"save_every={self.save_every} must be >= 0")

    def data_parallel_size(self, world_size: int) -> int:
        """dp = world_size / (tp * pp); EP folds into dp as in Megatron-Core."""
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise ValueError(f"world_size({world_size}) is not divisible by tp({self.tp}) * pp({self.pp}) "
                             f"= {model_parallel}")
        dp = world_size // model_parallel
        if dp % self.ep:
            raise ValueError(f"dp({dp}) = world_size({world_size}) / (tp({self.tp}) * pp({self.pp})) "
                             f"is not divisible by ep({self.ep})")
        return dp
