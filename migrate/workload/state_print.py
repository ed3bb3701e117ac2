"""The state each built-in engine holds right after its own load, printed per logical tensor.

Called on every rank (collective) after the framework loaded a checkpoint and before step 1;
returns the whole state's `StatePrint` (`checkpoint.state.fingerprint`), the same on every rank.
Names follow Megatron-Core's sharded keys: `model.<param>` for the weights as the model holds them
(Megatron: its own keys), `optimizer.state.fp32_param.<param>` for a separate fp32 master,
`optimizer.state.exp_avg.<param>` and `exp_avg_sq`; exact values: `optimizer.step` (every Adam
step the optimizer holds), `lr` (every param group's current LR), `lr_scheduler`, `iteration`,
`data` (the sampler's position).
* DeepSpeed (ZeRO 0-3): the full fp32 master and moments through DeepSpeed's own
  `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`, ZeRO-3 weights gathered;
* FSDP2 / DTensor: `get_model_state_dict` / `get_optimizer_state_dict`, each DTensor gathered;
* Megatron-Core: the chunks' and the optimizer's `sharded_state_dict` (the distributed optimizer in
  'fully_reshardable', its model-space form, gathered over DP as Megatron's own save does): every rank
  prints its main-replica chunks at their global offsets; vocabulary padding rows are left out (they
  depend on the TP size).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from checkpoint.state.fingerprint import StatePrint, TensorPrint, chunk_print, combine, gather_prints


def _whole(data: torch.Tensor) -> TensorPrint:
    return chunk_print(data, logical_shape=tuple(data.shape))


def _inner_torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers under a framework's wrapper (DeepSpeed's ZeRO, Megatron's chained ones)."""
    found = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        while not isinstance(sub, torch.optim.Optimizer) and hasattr(sub, "optimizer"):
            sub = sub.optimizer
        if isinstance(sub, torch.optim.Optimizer):
            found.append(sub)
    return found


def adam_steps(optimizer: Any) -> list[float]:
    """Every distinct Adam `step` the optimizer's states hold (sorted)."""
    steps = set()
    for inner in _inner_torch_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                step = state["step"]
                steps.add(float(step.item() if isinstance(step, torch.Tensor) else step))
    return sorted(steps)


def current_lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for inner in _inner_torch_optimizers(optimizer) for g in inner.param_groups]


def deepspeed_state_print(engine: Any, values: Mapping[str, Any]) -> StatePrint:
    """The state of a loaded DeepSpeed engine (collective: ZeRO gathers)."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    main = dist.get_rank() == 0
    mine: dict[str, TensorPrint] = {}
    # ZeRO 1/2 and bf16 link each parameter's fragments of the loaded moments on their first step; link now
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()
    plain_state = getattr(engine.optimizer, "state", None) or {}  # ZeRO 0 in fp32: the torch optimizer itself
    for name, param in engine.module.named_parameters():
        with GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            if main:
                mine[f"model.{name}"] = _whole(param.detach())
        master = safe_get_full_fp32_param(param)
        states = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        if master is None and param in plain_state:
            states = {key: plain_state[param].get(key) for key in ("exp_avg", "exp_avg_sq")}
        if not main:
            continue
        if master is not None:
            mine[f"optimizer.state.fp32_param.{name}"] = _whole(master)
        for key, tensor in states.items():
            if tensor is not None:
                mine[f"optimizer.state.{key}.{name}"] = _whole(tensor)
    lr_scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    exact = {"optimizer.step": adam_steps(engine.optimizer), "lr": current_lrs(engine.optimizer),
             "lr_scheduler": lr_scheduler, "iteration": int(engine.global_steps), **values}
    return gather_prints(mine, exact)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def fsdp_state_print(model: torch.nn.Module, optimizer: torch.optim.Optimizer, values: Mapping[str, Any]) -> StatePrint:
    """The state of a loaded FSDP2 (and DTensor TP) model and optimizer (collective: DTensors gathered)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    main = dist.get_rank() == 0
    mine: dict[str, TensorPrint] = {}
    for name, tensor in sorted(get_model_state_dict(model).items()):
        full = _full(tensor)  # type: ignore[arg-type]  # a model state dict holds tensors
        if main:
            mine[f"model.{name}"] = _whole(full)
    state: dict[str, Any] = get_optimizer_state_dict(model, optimizer)["state"]  # type: ignore[assignment]
    for fqn in sorted(state):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state[fqn]:
                full = _full(state[fqn][key])
                if main:
                    mine[f"optimizer.state.{key}.{fqn}"] = _whole(full)
    exact = {"optimizer.step": adam_steps(optimizer), "lr": current_lrs(optimizer), **values}
    return gather_prints(mine, exact)


_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _sharded_tensors(state: Any) -> Iterable[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return (v for v in nested_values(state) if isinstance(v, ShardedTensor))


def megatron_state_print(chunks: list, optimizer: Any, *, vocab_size: int, values: Mapping[str, Any],
                         distributed_optimizer: bool) -> StatePrint:
    """The state of loaded Megatron-Core chunks and optimizer, from their own sharded state dicts (collective)."""
    from megatron.core.dist_checkpointing.mapping import apply_factories, is_main_replica

    model: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        model[f"model{i}"] = chunk.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if distributed_optimizer else None
    state = {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=False, metadata=metadata)}
    apply_factories(state)
    parts = []
    for sh in _sharded_tensors(state):
        if not is_main_replica(sh.replica_id):
            continue
        shape = tuple(sh.global_shape)
        if sh.key.endswith(_VOCAB_ROWS):
            axis = sh.prepend_axis_num
            shape = (*shape[:axis], min(shape[axis], vocab_size), *shape[axis + 1:])
        name = sh.key if sh.key.startswith("optimizer.") else f"model.{sh.key}"
        parts.append({name: chunk_print(sh.data, logical_shape=shape, offset=sh.global_offset,
                                        flat_range=sh.flattened_range, local_shape=sh.local_shape)})
    exact = {"optimizer.step": adam_steps(optimizer), "lr": current_lrs(optimizer), **values}
    return gather_prints(combine(parts), exact)
