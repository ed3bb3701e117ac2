"""What Megatron-LM's two checkpoint formats share in the built-in Megatron engine: the save directory's
layout (`iter_NNNNNNN/`, the tracker file), every rank's RNG state as Megatron-LM saves it, the Adam step
counters Megatron-Core does not restore by itself, and the data position check."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.formats.megatron_paths import TRACKER_FILE, iteration_dir_name
from migrate.workload.data import SamplerState



def iteration_dir(save_dir: str, step: int) -> str:
    """Megatron-LM's checkpoint directory name for iteration `step`."""
    return os.path.join(save_dir, iteration_dir_name(step))

def resolve_load_dir(path: str) -> str:
    """An `iter_*` dir as is, or the one a save dir's latest_checkpointed_iteration.txt names."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        return iteration_dir(path, int(open(tracker, encoding="utf-8").read().strip()))
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise FileNotFoundError(f"{path}: no {TRACKER_FILE} and no metadata.json; not a Megatron-Core dist checkpoint")

def seed_host_rng(seed: int) -> None:
    """Seed Python's and NumPy's generators as Megatron-LM's `_set_random_seed` does (seed + 100 * pp rank),
    so DP and TP peers start with one state and PP stages with distinct ones. The torch generators are
    left to `model_parallel_cuda_manual_seed(seed)` (the model's initialisation does not change)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)

def rank_rng_state(device_type: str) -> dict[str, Any]:
    """This rank's RNG states as Megatron-LM's `get_rng_state` collects them: Python, NumPy, torch CPU,
    the device generator (not on CPUs, where the adapter maps it onto the CPU generator) and the
    model-parallel RNG tracker's streams; NumPy's key as a list so that it loads with weights_only."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"random_rng_state": random.getstate(),
             "np_rng_state": (str(kind), [int(x) for x in key], int(pos), int(has_gauss), float(cached)),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {name: t.clone() for name, t in
                                    tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if device_type != "cpu":
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state

def gathered_rng(device_type: str) -> list:
    """The list the `rng_state` object holds (collective over the DP group): this rank's state when every
    DP peer holds the same one (Megatron-LM's default), else every DP rank's state in DP order."""
    from megatron.core import parallel_state as ps

    from checkpoint.state.rng import fingerprint, from_megatron

    mine = rank_rng_state(device_type)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    distinct = {fingerprint(from_megatron(g)) for g in gathered}
    return [mine] if len(distinct) == 1 else gathered

def restore_rng(saved: list, where: str, device_type: str) -> str:
    """Set this rank's generators and tracker streams from the `rng_state` list as Megatron-LM's load does
    (entry [dp rank] when it holds one state per DP rank, else [0]); returns how it was restored."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from checkpoint.state.rng import fingerprint, from_megatron

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    if len(saved) not in (1, dp):
        raise RuntimeError(f"{where}: rng_state holds {len(saved)} per-DP-rank states but this run has dp({dp}); "
                           "convert the checkpoint for this layout")
    state = saved[dp_rank] if len(saved) > 1 else saved[0]
    kind, key, pos, has_gauss, cached = state["np_rng_state"]
    random.setstate(state["random_rng_state"])
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None:
        if device_type == "cpu":
            raise RuntimeError(f"{where}: rng_state holds a device generator but this run is on the CPU")
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    trackers = state.get("rng_tracker_states") or {}
    if not trackers:
        raise RuntimeError(f"{where}: rng_state holds no model-parallel RNG tracker states")
    tensor_parallel.get_cuda_rng_tracker().set_states({name: t.clone() for name, t in trackers.items()})
    return f"restored ({fingerprint(from_megatron(state))})"

def rng_fingerprint(device_type: str) -> str:
    """Fingerprint of this rank's RNG state in the canonical form the converter reports (`state_report.json`)."""
    from checkpoint.state.rng import fingerprint, from_megatron

    return fingerprint(from_megatron(rank_rng_state(device_type)))

def write_tracker(save_dir: str, step: int) -> None:
    """After every rank wrote iteration `step`: rank 0 points `latest_checkpointed_iteration.txt` at it
    (collective; Megatron-LM's commit point for a checkpoint)."""
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, TRACKER_FILE), "w", encoding="utf-8") as f:
            f.write(str(step))
    dist.barrier()

def prime_adam_state(optimizer: Any) -> None:
    """Give every Adam parameter a zero state with a `step` before a load.

    Without Apex/TE, 0.16.1's DistributedOptimizer.state_dict() reads `step` from the inner
    torch Adam's state, which a fresh optimizer does not have yet (AssertionError `len(steps)
    == 1`); its own init_state_fn adds only exp_avg/exp_avg_sq. The load overwrites all of it.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}

def allow_empty_optimizers(optimizer: Any) -> None:
    """Let a DistributedOptimizer that holds no parameter on this rank give its state dict.

    A pipeline stage without MoE layers (DeepSeek-V3's dense first layers) still gets an expert optimizer under
    expert parallelism, with an empty param group. Without Apex/TE, 0.16.1's `state_dict()` asserts that the
    inner torch Adam's state holds exactly one `step`, and an empty one holds none (AssertionError on save and
    load). Such an optimizer's `state_dict` gives its param groups without `params` and with `step` 0 (no
    parameter reads it; its `load_state_dict` needs a number). With Apex/TE nothing is changed."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None or any(group["params"] for group in inner.param_groups):
            continue

        def state_dict(inner: Any = inner, sub: Any = sub) -> dict[str, Any]:
            groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0}
                      for g in inner.state_dict()["param_groups"]]
            out: dict[str, Any] = {"optimizer": {"param_groups": groups}}
            if sub.grad_scaler:
                out["grad_scaler"] = sub.grad_scaler.state_dict()
            return out

        sub.state_dict = state_dict


def saved_adam_steps(optimizer_state: Any) -> set[int]:
    """Every `step` stored in the param_groups of a loaded (possibly chained) optimizer state."""
    found: set[int] = set()
    if isinstance(optimizer_state, dict):
        for group in optimizer_state.get("param_groups", []) if isinstance(optimizer_state.get("param_groups"), list) else []:
            if isinstance(group, dict) and "step" in group:
                found.add(int(group["step"]))
        for value in optimizer_state.values():
            if isinstance(value, (dict, list)):
                found |= saved_adam_steps(value)
    elif isinstance(optimizer_state, list):
        for value in optimizer_state:
            found |= saved_adam_steps(value)
    return found

def restore_adam_steps(optimizer: Any, step: int) -> None:
    """Give each parameter its own Adam `step` tensor holding the saved `step`.

    Without Apex/TE, 0.16.1's DistributedOptimizer.load_state_dict puts one shared `step`
    tensor into every parameter's state and the dp_reshardable parameter-state load then
    overwrites it with the freshly initialised value (0); torch Adam also increments a
    shared tensor once per parameter. Both corrupt the bias correction of every later step.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            if "step" in state or "exp_avg" in state:
                state["step"] = torch.tensor(float(step))

def keep_step_on_fully_reshardable_load(optimizer: Any) -> None:
    """Let 0.16.1 load 'fully_reshardable' optimizer state without Apex/TE.

    Its load_state_dict puts `step` (from param_groups) into every inner Adam state, then copies
    every inner state key from the loaded parameter state, which never holds `step` in this form
    (KeyError 'step'). Per optimizer instance, a missing `step` keeps the value just set.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param: Any, tensors: dict, _sub: Any = sub, _original: Any = original) -> None:
            if "step" not in tensors:
                group_index, group_order = _sub.model_param_group_index_map[model_param]
                main_param = _sub.optimizer.param_groups[group_index]["params"][group_order]
                step = _sub.optimizer.state[main_param].get("step")
                if step is not None:
                    tensors = {**tensors, "step": step.clone()}
            _original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = set_states

def check_data_position(ours: dict, sampler: SamplerState, where: str) -> None:
    """Refuse a saved data position whose per-DP-rank counts disagree with each other or with the sampler."""
    data = ours.get("data")
    if data is None:
        return
    per_rank = [int(c) for c in data.get("consumed_samples_per_rank", [])]
    if set(per_rank) != {sampler.consumed_samples}:
        raise ValueError(f"{where}: inconsistent data position: migrate.data.consumed_samples_per_rank {per_rank} "
                         f"vs migrate.sampler.consumed_samples {sampler.consumed_samples}")
