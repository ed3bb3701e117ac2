"""The built-in decoder as Megatron-Core's GPTModel: TP, PP (virtual stages), EP, sequence
parallel, trained by Megatron-Core's DDP + DistributedOptimizer (or its plain optimizer),
checkpointed in Megatron-Core's dist format (torch_dist) with the optimizer state.

Call sequence per rank (`train_megatron(ctx, spec)` on every rank of a worker group):
initialize model parallel -> seed the RNG tracker -> build one GPTModel chunk per virtual
stage -> wrap in DDP -> `get_megatron_optimizer` -> optional `dist_checkpointing.load` ->
steps through `get_forward_backward_func()` (1F1B / interleaved when pp > 1) -> save
`<save_dir>/iter_<NNNNNNN>/` and `latest_checkpointed_iteration.txt` (Megatron-LM's layout).
On CPUs it runs inside `migrate.device.cpu_device_adapter()`.

The checkpoint holds `model` (`model0`, `model1`, ... with virtual stages), `optimizer`
(sharding type `distrib_optim_sharding_type`, default 'dp_reshardable'; 0.16.1's default
fails on save), `iteration`, `checkpoint_version`, `rng_state` (every rank's RNG as Megatron-LM saves
it) and `migrate` (sampler state, step, data position, consumed tokens, model spec).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from migrate.workload.data import SamplerState, TokenDataset, global_batch_indices, rank_micro_batches
from migrate.workload.long_run import StepProbe
from migrate.workload.metrics import MetricsLog, RankResult, StepMetrics, peak_memory_bytes
from migrate.workload.model_spec import ModelSpec, RunSpec, lr_at
from migrate.workload.train_state import StepTrace

OPTIMIZER_SHARDING_TYPE = "dp_reshardable"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(save_dir: str, step: int) -> str:
    """Megatron-LM's checkpoint directory name for iteration `step`."""
    return os.path.join(save_dir, f"iter_{step:07d}")


def resolve_load_dir(path: str) -> str:
    """An `iter_*` dir as is, or the one a save dir's latest_checkpointed_iteration.txt names."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        return iteration_dir(path, int(open(tracker, encoding="utf-8").read().strip()))
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise FileNotFoundError(f"{path}: no {TRACKER_FILE} and no metadata.json; not a Megatron-Core dist checkpoint")


def transformer_config(model: ModelSpec, spec: RunSpec, world_size: int) -> Any:
    """Megatron-Core TransformerConfig of the run (dropout off, no fused kernels, CPU init)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if spec.train.precision == "bf16" else torch.float32
    moe = {}
    if model.is_moe:
        moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_top_k,
                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
                   moe_router_load_balancing_type="none", moe_permute_fusion=False)
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim, normalization="RMSNorm" if model.gated_ffn else "LayerNorm",
        layernorm_epsilon=model.norm_eps, gated_linear_unit=model.gated_ffn,
        activation_func=F.silu if model.gated_ffn else F.gelu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        expert_model_parallel_size=spec.ep, sequence_parallel=spec.sequence_parallel and spec.tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, **moe)


def _build_chunks(model: ModelSpec, spec: RunSpec, config: Any) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from migrate.workload.megatron_norm import gpt_block_spec

    chunks = []
    for vp_stage in range(spec.vpp):
        stage = vp_stage if spec.vpp > 1 else None
        # Local-spec layers whose norms are torch norms marked for sequence parallel (megatron_norm.py).
        block_spec = gpt_block_spec(config, num_experts=model.num_experts if model.is_moe else None,
                                    normalization="RMSNorm" if model.gated_ffn else "LayerNorm", vp_stage=stage)
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=block_spec, vocab_size=model.padded_vocab_size(spec.tp),
            max_sequence_length=model.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=model.tied_embeddings, position_embedding_type="rope",
            rotary_base=int(model.rotary_base), vp_stage=stage))
    return chunks


def _loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss_func


def _micro_batches(dataset: TokenDataset, indices: list) -> list[dict]:
    out = []
    for mb in indices:
        tokens, labels = dataset.batch(mb)
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()
        out.append({"tokens": tokens, "labels": labels, "position_ids": position_ids})
    return out


def _state_dict(chunks: list, optimizer: Any, step: int, sampler: SamplerState, loading: bool,
                model: ModelSpec | None = None, sharding_type: str = OPTIMIZER_SHARDING_TYPE,
                rng: list | None = None, data: dict | None = None, consumed_tokens: int | None = None) -> dict:
    """The sharded state dict Megatron-LM writes: model chunk(s), optimizer, iteration, the RNG states as
    Megatron-LM's `rng_state` ShardedObject (global shape (pp, tp), one replica per DP rank; `rng` is the
    list it holds: one state, or one per DP rank when they differ), ours (sampler, step, data position,
    consumed tokens and the model spec, so converters know the architecture from the checkpoint alone)."""
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


def _gathered_rng(device_type: str) -> list:
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


def _restore_rng(saved: list, where: str, device_type: str) -> str:
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


@dataclasses.dataclass
class _RngTrace(StepTrace):
    """StepTrace whose per-step RNG fingerprint includes the device generator and the tracker streams."""

    device_type: str = "cpu"

    def record(self, global_indices: Any) -> None:
        if not self.enabled:
            return
        self.samples.append([int(i) for i in global_indices])
        self.rng.append(rng_fingerprint(self.device_type))


def save_checkpoint(chunks: list, optimizer: Any, step: int, sampler: SamplerState, save_dir: str,
                    model: ModelSpec | None = None, micro_batch_size: int | None = None,
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
    rng = _gathered_rng(device_type)
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
    dist_checkpointing.save(_state_dict(chunks, optimizer, step, sampler, loading=False, model=model, rng=rng,
                                        data=data, consumed_tokens=tokens), path)
    write_tracker(save_dir, step)
    return path


def write_tracker(save_dir: str, step: int) -> None:
    """After every rank wrote iteration `step`: rank 0 points `latest_checkpointed_iteration.txt` at it
    (collective; Megatron-LM's commit point for a checkpoint)."""
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, TRACKER_FILE), "w", encoding="utf-8") as f:
            f.write(str(step))
    dist.barrier()


def _prime_adam_state(optimizer: Any) -> None:
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


def _restore_adam_steps(optimizer: Any, step: int) -> None:
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


def _keep_step_on_fully_reshardable_load(optimizer: Any) -> None:
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


def _check_data_position(ours: dict, sampler: SamplerState, where: str) -> None:
    """Refuse a saved data position whose per-DP-rank counts disagree with each other or with the sampler."""
    data = ours.get("data")
    if data is None:
        return
    per_rank = [int(c) for c in data.get("consumed_samples_per_rank", [])]
    if set(per_rank) != {sampler.consumed_samples}:
        raise ValueError(f"{where}: inconsistent data position: migrate.data.consumed_samples_per_rank {per_rank} "
                         f"vs migrate.sampler.consumed_samples {sampler.consumed_samples}")


def load_checkpoint(chunks: list, optimizer: Any, sampler: SamplerState, load_dir: str,
                    device_type: str = "cpu") -> tuple[int, SamplerState]:
    """Load model, optimizer, this rank's RNG (when saved for this (pp, tp) grid) and our state with
    dist_checkpointing; (step, sampler state). Refuses another global batch size and an inconsistent
    data position."""
    from megatron.core import dist_checkpointing

    path = resolve_load_dir(load_dir)
    _prime_adam_state(optimizer)
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
        _keep_step_on_fully_reshardable_load(optimizer)
    with torch.no_grad():  # fp32 main params are views of the model's leaf params
        optimizer.load_state_dict(loaded["optimizer"])
    if steps:
        _restore_adam_steps(optimizer, steps.pop())
    ours = loaded["migrate"]
    if int(loaded["iteration"]) != int(ours["step"]):
        raise RuntimeError(f"{path}: iteration({loaded['iteration']}) != migrate step({ours['step']})")
    saved = SamplerState.from_state_dict(ours["sampler"])
    if saved.global_batch_size != sampler.global_batch_size:
        raise ValueError(f"{path}: saved global_batch_size({saved.global_batch_size}) != run's "
                         f"({sampler.global_batch_size}); the global sample order would change")
    _check_data_position(ours, saved, path)
    if rng_key:
        from checkpoint.state.rng import MEGATRON_RNG_KEY

        _restore_rng(loaded[MEGATRON_RNG_KEY], f"{path} ({rng_key})", device_type)
    return int(ours["step"]), saved


def check_sequence_parallel(spec: RunSpec, device_type: str) -> None:
    """Check a sequence-parallel layout before Megatron-Core is started, on any device.

    Sequence parallel runs on the CPU too: the norms are torch norms marked for it
    (`megatron_norm.SequenceParallelTorchNorm`; 0.16.1's own torch fallback asserts it off).
    It needs tp > 1 and a sequence length tp divides (Gloo refuses uneven all-gathers);
    Megatron-Core wants it whenever experts are split at tp > 1, so MoE at ep > 1 and tp > 1
    without it is refused here rather than warned about.
    """
    if spec.sequence_parallel and spec.tp > 1 and spec.model.seq_length % spec.tp:
        raise ValueError(f"sequence_parallel: tp({spec.tp}) does not divide model.seq_length({spec.model.seq_length}) "
                         f"(device {device_type})")
    if spec.model.is_moe and spec.ep > 1 and spec.tp > 1 and not spec.sequence_parallel:
        raise ValueError(f"MoE with ep({spec.ep}) and tp({spec.tp}) needs sequence_parallel "
                         "(Megatron-Core's alltoall dispatcher expects sequence-parallel tokens)")


def train_megatron(ctx: Any, spec: RunSpec) -> RankResult:
    """Per-rank entry point (`ctx` is the worker group's RankContext): train, checkpoint, report."""
    if spec.engine != "megatron":
        raise ValueError(f"train_megatron got a RunSpec for engine {spec.engine!r}")
    spec.data_parallel_size(ctx.world_size)
    check_sequence_parallel(spec, ctx.device_type)
    torch.set_num_threads(1)
    adapter: contextlib.AbstractContextManager = contextlib.nullcontext()
    if ctx.device_type == "cpu":
        from migrate.device.cpu_adapter import cpu_device_adapter
        adapter = cpu_device_adapter()
    with adapter:
        return _train(ctx, spec)


def _train(ctx: Any, spec: RunSpec) -> RankResult:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    train, model_spec = spec.train, spec.model
    ps.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        expert_model_parallel_size=spec.ep)
    try:
        seed_host_rng(train.seed)
        model_parallel_cuda_manual_seed(train.seed)
        config = transformer_config(model_spec, spec, ctx.world_size)
        if ctx.backend == "gloo":
            # Gloo matches point-to-point messages between two ranks by tag only: in a batch_isend_irecv of
            # the interleaved (virtual pipeline) schedule, a forward activation and a backward gradient of
            # the same shape can be swapped, which corrupts later micro-batches silently. One op at a time.
            config.batch_p2p_comm = False
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=spec.distributed_optimizer)
        chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
                  for chunk in _build_chunks(model_spec, spec, config)]
        opt = train.optimizer
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.beta1, adam_beta2=opt.beta2,
            adam_eps=opt.eps, clip_grad=opt.clip_grad, bf16=train.precision == "bf16",
            params_dtype=config.params_dtype, use_distributed_optimizer=spec.distributed_optimizer), chunks)
        config.finalize_model_grads_func = finalize_model_grads
        sampler = SamplerState(seed=train.seed, dataset_size=train.dataset_size,
                               global_batch_size=train.global_batch_size)
        start_step = 0
        if spec.load_dir:
            from migrate.workload.megatron_legacy import is_legacy_checkpoint, load_legacy_checkpoint

            load = load_legacy_checkpoint if is_legacy_checkpoint(spec.load_dir) else load_checkpoint  # mp_rank_* dirs
            start_step, sampler = load(chunks, optimizer, sampler, spec.load_dir, device_type=ctx.device_type)
        loaded = None
        if spec.load_dir and spec.print_loaded_state:
            from migrate.workload.state_print import megatron_state_print

            loaded = megatron_state_print(chunks, optimizer, vocab_size=model_spec.vocab_size,
                                          distributed_optimizer=spec.distributed_optimizer,
                                          values={"iteration": start_step, "data": sampler.state_dict()}).as_dict()
        return _loop(ctx, spec, chunks, optimizer, sampler, start_step, get_forward_backward_func(), loaded)
    finally:
        ps.destroy_model_parallel()


def _loop(ctx: Any, spec: RunSpec, chunks: list, optimizer: Any, sampler: SamplerState, start_step: int,
          forward_backward: Any, state_print: dict | None = None) -> RankResult:
    from megatron.core import parallel_state as ps

    train, model_spec = spec.train, spec.model
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    num_micro = train.grad_accumulation(dp)
    dataset = TokenDataset(seed=train.dataset_seed, size=train.dataset_size, seq_length=model_spec.seq_length,
                           vocab_size=model_spec.vocab_size)
    device = "cpu" if ctx.device_type == "cpu" else ctx.device
    log = MetricsLog(spec.metrics_path, enabled=ctx.rank == 0)
    metrics: list[StepMetrics] = []
    checkpoints: list[str] = []
    stopped = None
    trace = _RngTrace(device_type=ctx.device_type, enabled=spec.long_run is None)
    probe = StepProbe(ctx, spec.long_run, device)
    try:
        for step in range(start_step, spec.steps):
            began = time.perf_counter()
            probe.before_step(step + 1)
            lr = lr_at(train.lr_schedule, train.optimizer.lr, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            global_indices = global_batch_indices(sampler)
            trace.record(global_indices)
            batches = _micro_batches(dataset, rank_micro_batches(global_indices, dp_rank, dp, train.micro_batch_size))
            if device != "cpu":
                batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            iterators = [iter(batches) for _ in chunks]
            losses = forward_backward(
                forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_micro,
                seq_length=model_spec.seq_length, micro_batch_size=train.micro_batch_size, forward_only=False)
            updated, grad_norm, _ = optimizer.step()
            # Every rank of the last pipeline stage holds its DP shard's losses; average them all.
            summed = torch.zeros(2, dtype=torch.float64)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                summed[0] = sum(float(item["lm loss"]) for item in losses)
                summed[1] = len(losses)
            dist.all_reduce(summed)
            sampler = sampler.advance()
            record = StepMetrics(
                step=step + 1, loss=float(summed[0] / summed[1]),
                grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr,
                tokens=train.global_batch_size * model_spec.seq_length, consumed_samples=sampler.consumed_samples,
                step_time_s=time.perf_counter() - began, peak_memory_bytes=peak_memory_bytes(device))
            metrics.append(record)
            message = log.write(record)
            probe.after_step(record, skipped=not updated)
            if spec.save_dir and (step + 1 == spec.steps or (spec.save_every and (step + 1) % spec.save_every == 0)):
                from migrate.workload.megatron_legacy import save_legacy_checkpoint

                save = save_legacy_checkpoint if spec.checkpoint_format == "torch" else save_checkpoint
                checkpoints.append(save(chunks, optimizer, step + 1, sampler, spec.save_dir,
                                                   model=model_spec, micro_batch_size=train.micro_batch_size,
                                                   device_type=ctx.device_type))
                probe.saved(step + 1, checkpoints[-1])
            if message and spec.stop_on_nonfinite:
                stopped = message
                break
            if probe.out_of_time():
                break
    finally:
        log.close()
        probe.close()
    return RankResult(rank=ctx.rank, engine="megatron", start_step=start_step, metrics=tuple(metrics),
                      checkpoints=tuple(checkpoints), stopped=stopped,
                      extra=trace.extra(tp=spec.tp, pp=spec.pp, ep=spec.ep, vpp=spec.vpp, dp=dp,
                                        distributed_optimizer=spec.distributed_optimizer, state_print=state_print))
