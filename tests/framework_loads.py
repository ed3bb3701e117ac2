"""The target frameworks' own loads as judges of a converted checkpoint.

`deepspeed_loaded` builds the decoder in a DeepSpeed engine at the target DP size and ZeRO stage and calls
`engine.load_checkpoint` on the converted folder; `dcp_loaded` builds it under FSDP2 (`fully_shard` per layer, as
the FSDP workload does) with torch's AdamW and calls `torch.distributed.checkpoint.load` into the
`get_model_state_dict` / `get_optimizer_state_dict` templates, then `set_*_state_dict`. Both then read back, with
the framework's own accessors (DeepSpeed's `safe_get_full_*`, torch's full state dicts), every weight, fp32 master
and Adam moment per canonical parameter name, and the Adam step(s): {(name, kind): tensor} plus the steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from checkpoint.model_shape import ModelShape


def _group(world_size: int, engine: str):
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules

    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return start_worker_group(WorkerGroupSpec(world_size=world_size, mode="local", backend="gloo", env=env,
                                              timeout_s=300, preload=engine_modules(engine)))


def deepspeed_loaded(model: ModelShape, load_dir: str | Path, *, dp: int, zero_stage: int, precision: str
                     ) -> tuple[dict[tuple[str, str], torch.Tensor], list[float]]:
    """What DeepSpeed's `load_checkpoint` restores at `dp` ranks: ({(name, kind): full tensor}, Adam steps)."""
    with _group(dp, "deepspeed") as group:
        return group.run(_rank_deepspeed, model, str(load_dir), zero_stage, precision)[0]


def _rank_deepspeed(ctx: Any, model: ModelShape, load_dir: str, zero_stage: int, precision: str) -> Any:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from migrate.workload.deepspeed_engine import deepspeed_config, deepspeed_load_target
    from migrate.workload.run_spec import RunSpec, TrainSpec
    from migrate.workload.torch_model import build_decoder

    torch.set_num_threads(1)
    spec = RunSpec(engine="deepspeed", model=model, zero_stage=zero_stage, steps=1,
                   train=TrainSpec(global_batch_size=4 * ctx.world_size, precision=precision))
    module = build_decoder(model, 1)  # other weights than the checkpoint's: the load must replace every one
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=deepspeed_config(spec, ctx.world_size))
    directory, tag = deepspeed_load_target(load_dir)
    path, _ = engine.load_checkpoint(directory, tag=tag, load_module_strict=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {load_dir}")
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1/2 link the accessors to
        engine.optimizer._hp_optimizer_states_linked = False              # Adam's state at the next step only
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        out[(name, "fp32_master")] = safe_get_full_fp32_param(p).clone()
        out[(name, "exp_avg")] = safe_get_full_optimizer_state(p, "exp_avg").clone()
        out[(name, "exp_avg_sq")] = safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
        with deepspeed.zero.GatheredParameters([p], enabled=zero_stage == 3):
            out[(name, "param")] = p.data.detach().clone()
    steps = sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s})
    return out, steps


def dcp_loaded(model: ModelShape | dict[str, Any], load_dir: str | Path, *, dp: int, precision: str, layout: str = "nested"
               ) -> tuple[dict[tuple[str, str], torch.Tensor], list[float]]:
    """What DCP's load into FSDP2 + AdamW restores at `dp` ranks: ({(name, kind): full tensor}, Adam steps);
    the sharded parameters are the fp32 masters (bf16 is FSDP2's compute dtype). `layout` "torchtitan" loads
    the way torchtitan's CheckpointManager does: ModelWrapper's model keys at the top level, OptimizersContainer's
    flattened optimizer state, and TrainState's int32 step (returned under ("train_state", "step")). `model` is the
    built-in decoder's spec or {"hf_config": {...}}: a transformers model built from that config."""
    with _group(dp, "fsdp") as group:
        return group.run(_rank_dcp, model, str(load_dir), precision, layout)[0]


def _rank_dcp(ctx: Any, model: ModelShape, load_dir: str, precision: str, layout: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from migrate.workload.tensor_parallel import MeshShape, build_mesh
    from migrate.workload.torch_model import build_decoder

    torch.set_num_threads(1)
    mesh = build_mesh("cpu", MeshShape.of(ctx.world_size, 1))
    if isinstance(model, dict):  # a transformers model from its config: its own module names
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(model["hf_config"])
        module = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type", "llama"), **config))
        layers = module.model.layers
    else:
        module = build_decoder(model, 1)
        layers = module.layers
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=False)
    if layout == "torchtitan":
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state = {**get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer, options=flat),
                 "train_state": {"step": torch.tensor(0, dtype=torch.int32)}}
        dcp.load(state, checkpoint_id=os.fspath(load_dir))
        model_sd = {k: v for k, v in state.items() if k not in ("optimizer", "train_state")}
        set_model_state_dict(module, model_sd, options=StateDictOptions(strict=False))  # ModelWrapper
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=flat)  # OptimizersContainer
    else:
        state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}
        dcp.load(state, checkpoint_id=os.fspath(load_dir))
        set_model_state_dict(module, state["model"])
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module, options=full)
    optim = get_optimizer_state_dict(module, optimizer, options=full)
    out: dict[tuple[str, str], torch.Tensor] = {}
    steps = set()
    for name, tensor in weights.items():
        out[(name, "fp32_master")] = tensor.clone()
        moments = optim["state"][name]
        out[(name, "exp_avg")] = moments["exp_avg"].clone()
        out[(name, "exp_avg_sq")] = moments["exp_avg_sq"].clone()
        steps.add(float(moments["step"]))
    if layout == "torchtitan":
        out[("train_state", "step")] = state["train_state"]["step"].clone()
    return out, sorted(steps)
