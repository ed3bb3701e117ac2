"""Map a validated job onto the built-in workloads' specs (pure)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from checkpoint.layout import OptimizerSharding, ParallelLayout
from migrate.job.schema import JobSpec
from migrate.workload.run_spec import Engine, LRScheduleSpec, OptimizerSpec, RunSpec, TrainSpec

Side = Literal["baseline", "target"]

_ENGINE_OF_FORMAT: dict[str, Engine] = {"deepspeed": "deepspeed", "megatron": "megatron", "megatron-legacy": "megatron",
                                        "dcp": "fsdp"}


def train_spec(job: JobSpec) -> TrainSpec:
    t = job.training
    if t.precision == "fp16":
        raise ValueError("training.precision 'fp16': the built-in engines train fp32 or bf16 (fp16 needs loss scaling)")
    opt = t.optimizer
    return TrainSpec(
        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, precision=t.precision,
        optimizer=OptimizerSpec(name=opt.name, lr=opt.lr, weight_decay=opt.weight_decay, beta1=opt.beta1,
                                beta2=opt.beta2, eps=opt.eps, clip_grad=opt.grad_clip),
        lr_schedule=LRScheduleSpec(kind=t.lr_schedule.decay, warmup_steps=t.lr_schedule.warmup_steps,
                                   decay_steps=t.lr_schedule.decay_steps or t.train_steps,
                                   min_lr_ratio=opt.min_lr / opt.lr),
        seed=t.seed,
    )


def side_layout(job: JobSpec, side: Side) -> ParallelLayout:
    """The layout a side trains at: the source's, or the target's (which must be set)."""
    if side == "baseline":
        return job.source.layout.to_layout()
    if job.target.layout is None:
        raise ValueError("target.layout is not set: give it in the job, or run the search stage first")
    return job.target.layout.to_layout()


def default_engine(job: JobSpec, layout: ParallelLayout) -> Engine:
    """The engine matching the source checkpoint's format, else the layout's optimizer sharding."""
    ckpt = job.source.checkpoint
    if ckpt is not None and ckpt.format in _ENGINE_OF_FORMAT:
        return _ENGINE_OF_FORMAT[ckpt.format]
    if layout.sharding in (OptimizerSharding.ZERO1, OptimizerSharding.ZERO2, OptimizerSharding.ZERO3):
        return "deepspeed"
    if layout.sharding is OptimizerSharding.FSDP:
        return "fsdp"
    return "megatron"


def run_spec(
    job: JobSpec, layout: ParallelLayout, *, engine: Engine, steps: int, save_dir: str | None,
    load_dir: str | None, save_every: int, metrics_path: str | None, sequence_parallel: bool = False,
    micro_batch_size: int | None = None,
) -> RunSpec:
    """The RunSpec that trains ``job``'s model at ``layout`` with ``engine`` (and ``micro_batch_size``,
    default the job's training one); checks the pairing.

    fsdp runs dp x tp (FSDP2 on dp, DTensor TP on tp, TP ranks adjacent as in the layout order
    tp before dp); `sequence_parallel` applies at tp > 1 for megatron and fsdp."""
    if engine == "deepspeed" and (layout.tp > 1 or layout.pp > 1 or layout.ep > 1):
        raise ValueError(f"engine deepspeed runs data parallel only (ZeRO); layout {layout.describe()} needs megatron")
    if engine == "fsdp" and (layout.pp > 1 or layout.ep > 1):
        raise ValueError(f"engine fsdp runs dp x tp (FSDP2 + DTensor TP); layout {layout.describe()} has "
                         f"pp({layout.pp}) ep({layout.ep}) and needs megatron")
    if engine == "fsdp" and layout.tp > 1:
        axes = layout.order.split("-")
        if axes.index("tp") > axes.index("dp"):
            raise ValueError(f"engine fsdp puts the TP ranks of a replica next to each other; layout order "
                             f"{layout.order!r} places dp before tp")
        from migrate.workload.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(job.model.to_shape(), layout.tp, sequence_parallel)
    return RunSpec(
        engine=engine, model=job.model.to_shape(), steps=steps,
        train=dataclasses.replace(train_spec(job), micro_batch_size=micro_batch_size or job.training.micro_batch_size),
        tp=layout.tp, pp=layout.pp, ep=layout.ep, vpp=layout.vpp,
        zero_stage=layout.zero_stage if engine == "deepspeed" else 0,
        distributed_optimizer=engine == "megatron" and layout.distributed_optimizer,
        save_dir=save_dir, load_dir=load_dir, save_every=save_every, metrics_path=metrics_path,
        sequence_parallel=sequence_parallel and layout.tp > 1,
    )
