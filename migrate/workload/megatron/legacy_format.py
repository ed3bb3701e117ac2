"""Megatron-LM's legacy per-rank checkpoint format (`--ckpt-format torch`) for the Megatron engine.

On disk (Megatron-LM's `get_checkpoint_name`): `<save_dir>/iter_<NNNNNNN>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/`
(the pp suffix only when pp > 1, the ep suffix only when ep > 1) holding
* `model_optim_rng.pt`: torch.save of {args (argparse.Namespace), checkpoint_version 3.0, iteration,
  model | model0, model1, ... (each chunk's `state_dict_for_save_checkpoint()`), optimizer
  (`optimizer.state_dict()`), opt_param_scheduler, rng_state (list), num_floating_point_operations_so_far,
  migrate (ours: sampler, step, data position, consumed tokens, model shape)}, written by the ranks whose
  data-parallel or expert-data-parallel rank is 0, and
* `distrib_optim.pt` (DistributedOptimizer only): `optimizer.save_parameter_state(filename)`, Megatron-Core's
  DP-rank-0 gather of the whole DP group's fp32 master / exp_avg / exp_avg_sq, one flat tensor per grad buffer.
`latest_checkpointed_iteration.txt` in the save dir names the iteration.

Load calls the same Megatron-Core methods, in the same order, as Megatron-LM's `load_checkpoint` does for this
format: `model.load_state_dict`, `optimizer.load_state_dict(state_dict['optimizer'])`,
`optimizer.load_parameter_state(distrib_optim.pt)`, then the RNG states. Files are read with
`torch.load(weights_only=True)` through `checkpoint.safe_load` (its allow-list holds `argparse.Namespace`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from migrate.workload.data import SamplerState
from checkpoint.formats.megatron_paths import (MODEL_FILE, OPTIM_FILE, RANK_DIR_RE, TRACKER_FILE, iteration_dir_name,
                                              rank_dir)
from migrate.workload.megatron.state import (check_data_position, gathered_rng, iteration_dir,
                                             keep_step_on_fully_reshardable_load, restore_adam_steps, restore_rng,
                                             saved_adam_steps, write_tracker)
from checkpoint.model_shape import ModelShape

def resolve_iteration(path: str | os.PathLike) -> Path:
    """An `iter_*` directory as is, or the one a save dir's latest_checkpointed_iteration.txt names."""
    path = Path(path)
    tracker = path / TRACKER_FILE
    if tracker.is_file():
        return path / iteration_dir_name(int(tracker.read_text(encoding='utf-8').strip()))
    return path


def is_legacy_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` (an iter dir or a save dir with a tracker file) holds `mp_rank_*` directories."""
    root = resolve_iteration(path)
    try:
        return any(RANK_DIR_RE.match(p.name) and p.is_dir() for p in root.iterdir())
    except OSError:
        return False


def megatron_args(model: ModelShape, *, tp: int, pp: int, vpp: int, ep: int, dp: int, step: int,
                  consumed_samples: int, global_batch_size: int, micro_batch_size: int | None,
                  distributed_optimizer: bool, params_dtype: torch.dtype) -> argparse.Namespace:
    """The subset of Megatron-LM's arguments its loader and converters read from a legacy checkpoint."""
    return argparse.Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        group_query_attention=model.num_query_groups != model.num_attention_heads, kv_channels=model.head_dim,
        swiglu=model.gated_ffn, normalization="RMSNorm" if model.gated_ffn else "LayerNorm",
        norm_epsilon=model.norm_eps, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=int(model.rotary_base), add_position_embedding=False,
        untie_embeddings_and_output_weights=not model.tied_embeddings, vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size(tp), make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        max_position_embeddings=model.seq_length, seq_length=model.seq_length,
        num_experts=model.num_experts if model.is_moe else None, moe_router_topk=model.moe_top_k,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep,
        data_parallel_size=dp, world_size=tp * pp * dp, use_distributed_optimizer=distributed_optimizer,
        ckpt_format="torch", use_dist_ckpt=False, iteration=step, consumed_train_samples=consumed_samples,
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=False,
        data_parallel_random_init=False)


def _scheduler_state(step: int, global_batch_size: int) -> dict[str, Any]:
    """`opt_param_scheduler` as plain data: the engine derives the LR from the step (`lr_at`); Megatron-LM's
    OptimizerParamScheduler counts samples in `num_steps`."""
    return {"num_steps": step * global_batch_size, "iteration": step}


def save_legacy_checkpoint(chunks: list, optimizer: Any, step: int, sampler: SamplerState, save_dir: str,
                           model: ModelShape | None = None, micro_batch_size: int | None = None,
                           device_type: str = "cpu") -> str:
    """Write `iter_<step>/mp_rank_*/model_optim_rng.pt` (+ `distrib_optim.pt`) as Megatron-LM's
    `save_checkpoint` does for `--ckpt-format torch`, and update the tracker file (collective).
    Same signature as `dist_format.save_checkpoint`; returns the iteration directory."""
    from megatron.core import parallel_state as ps


    if model is None:
        raise ValueError("save_legacy_checkpoint needs the model shape (converters read the architecture from it)")
    tp, pp, ep = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_expert_model_parallel_world_size())
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    path = iteration_dir(save_dir, step)
    rank_path = os.path.join(path, rank_dir(tp_rank=ps.get_tensor_model_parallel_rank(),
                                            pp_rank=ps.get_pipeline_model_parallel_rank(),
                                            ep_rank=ps.get_expert_model_parallel_rank(), pp=pp, ep=ep))
    rng = gathered_rng(device_type)
    consumed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(consumed, (dp_rank, sampler.consumed_samples))
    by_dp = dict(sorted(set(consumed)))
    if sorted(by_dp) != list(range(dp)) or len(set(consumed)) != dp:
        raise RuntimeError(f"inconsistent data position at save: (dp rank, consumed samples) per rank {consumed}")
    os.makedirs(rank_path, exist_ok=True)
    dist.barrier()
    distributed = hasattr(optimizer, "save_parameter_state") and any(
        hasattr(o, "get_parameter_state_dp_zero") for o in getattr(optimizer, "chained_optimizers", [optimizer]))
    if distributed:  # every rank takes part in the DP gather; DP rank 0 writes
        optimizer.save_parameter_state(os.path.join(rank_path, OPTIM_FILE))
    if dp_rank == 0 or edp_rank == 0:
        params_dtype = next(chunks[0].module.parameters()).dtype
        ours: dict[str, Any] = {"sampler": sampler.state_dict(), "step": step,
                                "consumed_tokens": sampler.consumed_samples * model.seq_length,
                                "model": dataclasses.asdict(model)}
        if micro_batch_size is not None:
            ours["data"] = {"micro_batch_size": micro_batch_size, "dp": dp,
                            "consumed_samples_per_rank": list(by_dp.values())}
        state: dict[str, Any] = {
            "args": megatron_args(model, tp=tp, pp=pp, vpp=len(chunks), ep=ep, dp=dp, step=step,
                                  consumed_samples=sampler.consumed_samples,
                                  global_batch_size=sampler.global_batch_size, micro_batch_size=micro_batch_size,
                                  distributed_optimizer=distributed, params_dtype=params_dtype),
            "checkpoint_version": 3.0, "iteration": step}
        for i, chunk in enumerate(chunks):
            state["model" if len(chunks) == 1 else f"model{i}"] = chunk.module.state_dict_for_save_checkpoint()
        state["optimizer"] = optimizer.state_dict()
        state["opt_param_scheduler"] = _scheduler_state(step, sampler.global_batch_size)
        state["rng_state"] = rng
        state["num_floating_point_operations_so_far"] = 0
        state["migrate"] = ours
        _save_atomic(state, os.path.join(rank_path, MODEL_FILE))
    write_tracker(save_dir, step)
    return path


def _save_atomic(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rank_files(load_dir: str | os.PathLike) -> tuple[Path, Path]:
    """This rank's (model_optim_rng.pt, distrib_optim.pt) paths (model parallel state initialized)."""
    from megatron.core import parallel_state as ps

    root = resolve_iteration(load_dir)
    name = rank_dir(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                    ep_rank=ps.get_expert_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_world_size(),
                    ep=ps.get_expert_model_parallel_world_size())
    return root / name / MODEL_FILE, root / name / OPTIM_FILE


def _check_layout(args: Any, where: Path, *, tp: int, pp: int, ep: int, vpp: int) -> None:
    """Megatron-LM's `check_checkpoint_args` for this format: the saved TP/PP (and EP, virtual stages) must be
    the run's; another layout needs `migrate convert` first."""
    saved = {"tp": getattr(args, "tensor_model_parallel_size", None),
             "pp": getattr(args, "pipeline_model_parallel_size", None),
             "ep": getattr(args, "expert_model_parallel_size", 1) or 1,
             "vpp": getattr(args, "virtual_pipeline_model_parallel_size", None) or 1}
    run = {"tp": tp, "pp": pp, "ep": ep, "vpp": vpp}
    diff = [f"{k}: saved {v}, run {run[k]}" for k in run if (v := saved[k]) is not None and int(v) != run[k]]
    if diff:
        raise RuntimeError(f"{where}: legacy checkpoint saved at another layout ({'; '.join(diff)}); convert it "
                           f"with `migrate convert --to megatron-legacy` for this layout")


def load_legacy_checkpoint(chunks: list, optimizer: Any, sampler: SamplerState, load_dir: str,
                           device_type: str = "cpu", trust_checkpoint: bool = False) -> tuple[int, SamplerState]:
    """Load this rank's legacy files in Megatron-LM's order; (step, sampler state). Refuses another layout,
    another global batch size and an inconsistent data position; names a missing or truncated rank file."""
    from megatron.core import parallel_state as ps

    from checkpoint import safe_load
    from checkpoint.errors import CheckpointError

    model_file, optim_file = rank_files(load_dir)
    distributed = any(hasattr(o, "load_parameter_state_from_dp_zero")
                      for o in getattr(optimizer, "chained_optimizers", [optimizer]))
    state: Any = None
    problem: str | None = None
    try:
        state = safe_load.load(model_file, trust_checkpoint=trust_checkpoint)
        if distributed and not optim_file.is_file():
            problem = f"{optim_file}: file is missing (the DistributedOptimizer's parameter state)"
    except CheckpointError as err:
        problem = str(err)
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)  # every rank raises the same error instead of hanging in a collective
    if any(problems):
        raise RuntimeError("cannot load the legacy checkpoint: " + "; ".join(sorted({p for p in problems if p})))
    _check_layout(state.get("args"), model_file, tp=ps.get_tensor_model_parallel_world_size(),
                  pp=ps.get_pipeline_model_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                  vpp=len(chunks))
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        if key not in state:
            raise RuntimeError(f"{model_file}: no {key!r} entry (holds {sorted(state)}); saved with other "
                               f"virtual stages?")
        chunk.module.load_state_dict(state[key])
    first = state["optimizer"][0] if isinstance(state.get("optimizer"), list) else state.get("optimizer")
    saved_plain = isinstance(first, dict) and ("state" in first or "fp32_from_fp16_params" in first)  # fp32 | bf16
    if saved_plain == distributed:
        raise RuntimeError(f"{model_file}: saved {'without' if saved_plain else 'with'} the DistributedOptimizer but "
                           f"this run uses {'it' if distributed else 'the plain optimizer'}; set "
                           f"distributed_optimizer={not saved_plain}")
    steps = saved_adam_steps(state["optimizer"])
    if len(steps) > 1:
        raise RuntimeError(f"{model_file}: optimizer param_groups hold different Adam steps {sorted(steps)}")
    with torch.no_grad():  # fp32 main params are views of the model's leaf params
        optimizer.load_state_dict(state["optimizer"])
        if distributed:
            keep_step_on_fully_reshardable_load(optimizer)  # 0.16.1 without Apex/TE: keep `step` on the dp_zero load
            optimizer.load_parameter_state(str(optim_file))
    if steps:
        restore_adam_steps(optimizer, steps.pop())
    ours = state.get("migrate") or {}
    if "sampler" not in ours:
        raise RuntimeError(f"{model_file}: no migrate.sampler entry; the data position is unknown")
    if int(state["iteration"]) != int(ours["step"]):
        raise RuntimeError(f"{model_file}: iteration({state['iteration']}) != migrate step({ours['step']})")
    saved = SamplerState.from_state_dict(ours["sampler"])
    if saved.global_batch_size != sampler.global_batch_size:
        raise ValueError(f"{model_file}: saved global_batch_size({saved.global_batch_size}) != run's "
                         f"({sampler.global_batch_size}); the global sample order would change")
    check_data_position(ours, saved, str(model_file))
    if state.get("rng_state"):
        restore_rng(state["rng_state"], f"{model_file} (rng_state)", device_type)
    return int(ours["step"]), saved
