"""A job's model, recipe and target mapped onto the search library's and the workloads' values."""
from __future__ import annotations

from pathlib import Path

from checkpoint.model_shape import ModelShape
from migrate.job.load import Job
from migrate.workload.run_spec import LRScheduleSpec, OptimizerSpec, TrainSpec
from parallel_search.emit import Recipe
from parallel_search.profiles import DeviceProfile, load_profile
from parallel_search.spec import ClusterShape, TrainingShape


def model_shape(job: Job) -> ModelShape:
    return job.spec.model.to_shape()


def training_shape(job: Job) -> TrainingShape:
    t = job.spec.training
    return TrainingShape(global_batch_size=t.global_batch_size, precision=t.precision)


def cluster_shape(job: Job, device: DeviceProfile) -> ClusterShape:
    """Devices per node: the job's, else the profile's (all local ranks share one node on a CPU)."""
    target = job.spec.target
    per_node = target.devices_per_node or (target.device_count if target.device_type == "cpu"
                                           else min(device.devices_per_node, target.device_count))
    return ClusterShape(device_count=target.device_count, devices_per_node=per_node)


def device_profile(job: Job, override: str | None = None) -> DeviceProfile:
    """The profile named by ``override``, else ``target.device_profile`` (a shipped name or a path
    relative to the job file), else the shipped profile of the target's device type."""
    name = override or job.spec.target.device_profile
    if name is None:
        name = {"cpu": "cpu", "cuda": "h100", "npu": "ascend-910b"}.get(job.spec.target.device_type, "cpu")
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        return load_profile(path if path.is_absolute() else job.resolve(name))
    return load_profile(name)


def workload_specs(job: Job, dataset_size: int = 4096) -> tuple[ModelShape, TrainSpec]:
    """The built-in workload's model and recipe for the job (fp16 runs as bf16: the engines have no fp16)."""
    t = job.spec.training
    model = job.spec.model.to_shape()
    opt = t.optimizer
    train = TrainSpec(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                      precision="fp32" if t.precision == "fp32" else "bf16",
                      optimizer=OptimizerSpec(name=opt.name, lr=opt.lr, weight_decay=opt.weight_decay, beta1=opt.beta1,
                                              beta2=opt.beta2, eps=opt.eps, clip_grad=opt.grad_clip),
                      lr_schedule=LRScheduleSpec(kind=t.lr_schedule.decay, warmup_steps=t.lr_schedule.warmup_steps,
                                                 decay_steps=t.lr_schedule.decay_steps or t.train_steps),
                      seed=t.seed, dataset_size=max(dataset_size, t.global_batch_size))
    return model, train


def recipe(job: Job) -> Recipe:
    """The job's optimizer, schedule, clipping, iterations, seed and model constants, for emitted configs."""
    t, m = job.spec.training, job.spec.model
    opt = t.optimizer
    return Recipe(lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay, beta1=opt.beta1, beta2=opt.beta2,
                  eps=opt.eps, clip_grad=opt.grad_clip, warmup_iters=t.lr_schedule.warmup_steps,
                  decay_iters=t.lr_schedule.decay_steps, decay_style=t.lr_schedule.decay, train_iters=t.train_steps,
                  seed=t.seed, rotary_base=m.rotary_base, norm_eps=m.norm_eps)
