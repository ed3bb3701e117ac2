"""The built-in decoder trained with PyTorch FSDP2 (`fully_shard`) and checkpointed with DCP,
torchtitan-style (`<save_dir>/step-<N>/`), on a worker group.

Per rank: build the decoder -> `fully_shard` each layer and the root (bf16 params with fp32
reductions when precision is bf16) -> AdamW -> optional `dcp.load` -> steps -> `dcp.save` of
{"model", "optimizer", "lr_scheduler", "migrate"} where "migrate" holds the sampler state and
the step. Every rank is a DP (sharding) rank.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from migrate.workload.data import SamplerState, TokenDataset, global_batch_indices, rank_micro_batches
from migrate.workload.metrics import MetricsLog, RankResult, ScheduledLR, StepMetrics, peak_memory_bytes
from migrate.workload.model_spec import RunSpec
from migrate.workload.torch_model import build_decoder
from migrate.workload.train_state import StepTrace


def step_dir(save_dir: str, step: int) -> str:
    """torchtitan's checkpoint folder name for step `step`."""
    return os.path.join(save_dir, f"step-{step}")


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: ScheduledLR,
           sampler: SamplerState, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
            "lr_scheduler": scheduler.state_dict(), "migrate": {"sampler": sampler.state_dict(), "step": step}}


def train_fsdp(ctx: Any, spec: RunSpec) -> RankResult:
    """Per-rank entry point (`ctx` is the worker group's RankContext): train, checkpoint, report."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if spec.engine != "fsdp" or spec.tp != 1 or spec.pp != 1 or spec.ep != 1:
        raise ValueError(f"train_fsdp runs engine 'fsdp' with tp=pp=ep=1, got engine={spec.engine!r} "
                         f"tp({spec.tp}) pp({spec.pp}) ep({spec.ep})")
    torch.set_num_threads(1)
    train, model_spec = spec.train, spec.model
    dp, rank = ctx.world_size, ctx.rank
    device = "cpu" if ctx.device_type == "cpu" else ctx.device
    model = build_decoder(model_spec, train.seed).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if train.precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = train.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay, foreach=False)
    scheduler = ScheduledLR(optimizer, train.lr_schedule, opt.lr)
    sampler = SamplerState(seed=train.seed, dataset_size=train.dataset_size, global_batch_size=train.global_batch_size)
    start_step = 0
    if spec.load_dir:
        # get_optimizer_state_dict initialises the (empty) Adam state, so DCP has targets to load into.
        state = _state(model, optimizer, scheduler, sampler, 0)
        dcp.load(state, checkpoint_id=spec.load_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
        sampler = SamplerState.from_state_dict(state["migrate"]["sampler"])
        start_step = int(state["migrate"]["step"])
    dataset = TokenDataset(seed=train.seed, size=train.dataset_size, seq_length=model_spec.seq_length,
                           vocab_size=model_spec.vocab_size)
    log = MetricsLog(spec.metrics_path, enabled=rank == 0)
    metrics: list[StepMetrics] = []
    checkpoints: list[str] = []
    stopped = None
    trace = StepTrace()
    try:
        for step in range(start_step, spec.steps):
            began = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            global_indices = global_batch_indices(sampler)
            trace.record(global_indices)
            micro = rank_micro_batches(global_indices, rank, dp, train.micro_batch_size)
            total = torch.zeros((), dtype=torch.float64)
            for indices in micro:
                tokens, labels = dataset.batch(indices)
                loss = model(tokens.to(device), labels.to(device))
                (loss / len(micro)).backward()
                total += loss.detach().to("cpu", torch.float64)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_grad)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            dist.all_reduce(total)
            sampler = sampler.advance()
            record = StepMetrics(
                step=step + 1, loss=float(total) / (dp * len(micro)), grad_norm=float(grad_norm), lr=lr,
                tokens=train.global_batch_size * model_spec.seq_length, consumed_samples=sampler.consumed_samples,
                step_time_s=time.perf_counter() - began, peak_memory_bytes=peak_memory_bytes(device))
            metrics.append(record)
            message = log.write(record)
            if spec.save_dir and (step + 1 == spec.steps or (spec.save_every and (step + 1) % spec.save_every == 0)):
                path = step_dir(spec.save_dir, step + 1)
                dcp.save(_state(model, optimizer, scheduler, sampler, step + 1), checkpoint_id=path)
                checkpoints.append(path)
            if message and spec.stop_on_nonfinite:
                stopped = message
                break
    finally:
        log.close()
    return RankResult(rank=rank, engine="fsdp", start_step=start_step, metrics=tuple(metrics),
                      checkpoints=tuple(checkpoints), stopped=stopped, extra=trace.extra())
