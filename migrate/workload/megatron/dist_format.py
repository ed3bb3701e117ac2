"""Megatron-Core's dist checkpoint format (`--ckpt-format torch_dist`) for the built-in Megatron engine: the
sharded state dict (`model`/`model0..`, `optimizer` with its sharding type, `iteration`, `rng_state`,
`migrate`), saved and loaded with `megatron.core.dist_checkpointing` into `<save_dir>/iter_NNNNNNN/`."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Any

import torch
import torch.distributed as dist

from migrate.workload.data import SamplerState
from migrate.workload.megatron.state import (check_data_position, gathered_rng, iteration_dir,
                                             keep_step_on_fully_reshardable_load, prime_adam_state, rank_rng_state,
                                             resolve_load_dir, restore_adam_steps, restore_rng, saved_adam_steps,
                                             write_tracker)
from checkpoint.model_shape import ModelShape


OPTIMIZER_SHARDING_TYPE = "dp_reshardable"

def _state_dict(chunks: list, optimizer: Any, step: int, sampler: SamplerState, loading: bool,
                model: ModelShape | None = None, sharding_type: str = OPTIMIZER_SHARDING_TYPE,
                rng: list | None = None, data: dict | None = None, consumed_tokens: int | None = None) -> dict:
    """The sharded state dict Megatron-LM writes: model chunk(s), optimizer, iteration, the RNG states as
    Megatron-LM's `rng_state` ShardedObject (global shape (pp, tp), one replica per DP rank; `rng` is the
    list it holds: one state, or one per DP rank when they differ), ours (sampler, step, data position,
    consumed tokens and the model shape, so converters know the architecture from the checkpoint alone)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from checkpoint.state.rng import MEGATRON_RNG_KEY

    ours: dict[str, Any] = {"sampler": sampler.state_dict(), "step": step}
    if data is not None:
        ours["data"] = data
    if consumed_tokens is not None:
        ours["consumed_tokens"] = consumed_tokens
    if model is not None:
        ours["model"] = dataclasses.asdict(model)
    state: dict[str, Any] = {"iteration": step, "checkpoint_version": 3.0, "migrate": ours}
    if rng is not None:
        state[MEGATRON_RNG_KEY] = ShardedObject(
            MEGATRON_RNG_KEY, rng,
            (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    if len(chunks) == 1:
        state["model"] = chunks[0].module.sharded_state_dict()
    else:
        for i, chunk in enumerate(chunks):
            state[f"model{i}"] = chunk.module.sharded_state_dict()
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=loading, metadata={"distrib_optim_sharding_type": sharding_type})
    return state

def fork_writer_results_queue() -> None:
    """Give Megatron-Core's torch_dist writer, in this process, a results queue served by a process forked
    from this one.

    Its own (`filesystem_async._get_write_results_queue`) is served by a Manager it spawns: a fresh interpreter
    that imports torch to unpickle the write results, 2.5 s of CPU and 3 s of waiting in every process's first
    save. A forked server has torch already; the queue, and so what is written, is the same. Megatron-Core forks
    its own file writers from the same process. A no-op once the queue exists, or where this Megatron-Core
    version keeps it elsewhere."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()

def save_checkpoint(chunks: list, optimizer: Any, step: int, sampler: SamplerState, save_dir: str,
                    model: ModelShape | None = None, micro_batch_size: int | None = None,
                    device_type: str = "cpu") -> str:
    """Write `iter_<step>` with dist_checkpointing (torch_dist) and update the tracker file (collective).

    Besides model and optimizer it saves every rank's RNG (`rng_state`) and, in ours, the data position
    (each DP rank's consumed samples, a global count equal on every rank; micro batch and dp) and the
    consumed tokens."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    path = iteration_dir(save_dir, step)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    rng = gathered_rng(device_type)
    dp = ps.get_data_parallel_world_size()
    consumed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(consumed, (ps.get_data_parallel_rank(), sampler.consumed_samples))
    by_dp = dict(sorted(set(consumed)))
    if sorted(by_dp) != list(range(dp)) or len(set(consumed)) != dp:
        raise RuntimeError(f"inconsistent data position at save: (dp rank, consumed samples) per rank {consumed}")
    data = None if micro_batch_size is None else {
        "micro_batch_size": micro_batch_size, "dp": dp, "consumed_samples_per_rank": list(by_dp.values())}
    tokens = None if model is None else sampler.consumed_samples * model.seq_length
    dist.barrier()
    fork_writer_results_queue()
    dist_checkpointing.save(_state_dict(chunks, optimizer, step, sampler, loading=False, model=model, rng=rng,
                                        data=data, consumed_tokens=tokens), path)
    write_tracker(save_dir, step)
    return path

def saved_sharding_type(path: str) -> str:
    """The DistributedOptimizer sharding type a checkpoint was written in (converters write
    'fully_reshardable', which loads at any layout); OPTIMIZER_SHARDING_TYPE when it names none."""
    from megatron.core import dist_checkpointing

    optim = dist_checkpointing.load_common_state_dict(path).get("optimizer", {})
    first = optim.get(0, optim) if isinstance(optim, dict) else {}
    return first.get("param_state_sharding_type", OPTIMIZER_SHARDING_TYPE) if isinstance(first, dict) \
        else OPTIMIZER_SHARDING_TYPE

def _saved_rng_key(path: str) -> str | None:
    """The unique key of this rank's `rng_state` object when the checkpoint holds it (None when it was saved
    without RNG or for another (pp, tp) grid, which Megatron-LM ignores too: "RNG state will be ignored")."""
    from megatron.core import parallel_state as ps

    from checkpoint.safe_load import read_dcp_metadata
    from checkpoint.state.rng import MEGATRON_RNG_KEY

    key = (f"{MEGATRON_RNG_KEY}/shard_{ps.get_pipeline_model_parallel_rank()}.{ps.get_tensor_model_parallel_rank()}_"
           f"{ps.get_pipeline_model_parallel_world_size()}.{ps.get_tensor_model_parallel_world_size()}")
    return key if key in read_dcp_metadata(path).state_dict_metadata else None

def load_checkpoint(chunks: list, optimizer: Any, sampler: SamplerState, load_dir: str,
                    device_type: str = "cpu") -> tuple[int, SamplerState]:
    """Load model, optimizer, this rank's RNG (when saved for this (pp, tp) grid) and our state with
    dist_checkpointing; (step, sampler state). Refuses another global batch size and an inconsistent
    data position."""
    from megatron.core import dist_checkpointing

    path = resolve_load_dir(load_dir)
    prime_adam_state(optimizer)
    sharding_type = saved_sharding_type(path)
    rng_key = _saved_rng_key(path)
    template = _state_dict(chunks, optimizer, 0, sampler, loading=True, sharding_type=sharding_type,
                           rng=[rank_rng_state(device_type)] if rng_key else None)
    loaded = dist_checkpointing.load(template, path)
    if len(chunks) == 1:
        chunks[0].module.load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"])
    steps = saved_adam_steps(loaded["optimizer"])
    if len(steps) > 1:
        raise RuntimeError(f"{path}: optimizer param_groups hold different Adam steps {sorted(steps)}")
    if sharding_type == "fully_reshardable":
        keep_step_on_fully_reshardable_load(optimizer)
    with torch.no_grad():  # fp32 main params are views of the model's leaf params
        optimizer.load_state_dict(loaded["optimizer"])
    if steps:
        restore_adam_steps(optimizer, steps.pop())
    ours = loaded["migrate"]
    if int(loaded["iteration"]) != int(ours["step"]):
        raise RuntimeError(f"{path}: iteration({loaded['iteration']}) != migrate step({ours['step']})")
    saved = SamplerState.from_state_dict(ours["sampler"])
    if saved.global_batch_size != sampler.global_batch_size:
        raise ValueError(f"{path}: saved global_batch_size({saved.global_batch_size}) != run's "
                         f"({sampler.global_batch_size}); the global sample order would change")
    check_data_position(ours, saved, path)
    if rng_key:
        from checkpoint.state.rng import MEGATRON_RNG_KEY

        restore_rng(loaded[MEGATRON_RNG_KEY], f"{path} ({rng_key})", device_type)
    return int(ours["step"]), saved
