"""Checkpoints written the way Megatron-LM writes them, and Megatron-LM's load decisions as the judge.

`save_megatron_lm(run, save_dir)` trains a tiny GPTModel with Megatron-Core's own objects (DDP, the
DistributedOptimizer from `get_megatron_optimizer`, `OptimizerParamScheduler`) on `run.world_size` Gloo ranks
and saves it following `megatron/training/checkpointing.py` step by step: `generate_state_dict` (`args`, the
run's argparse.Namespace as `parse_args` builds it; `checkpoint_version` 3.0; `iteration`; `model` from
`sharded_state_dict(metadata=...)`; `optimizer` from `optimizer.sharded_state_dict(state_dict, metadata=...)`;
`opt_param_scheduler`; `rng_state` as `get_rng_state` collects it, NumPy's state as NumPy returns it, in a
ShardedObject over (pp, tp) with the DP rank as replica id), `num_floating_point_operations_so_far`, then
`dist_checkpointing.save` with the fully parallel save strategy over the DP group and `content_metadata`
from `_build_sharded_state_dict_metadata`, and rank 0 writes `latest_checkpointed_iteration.txt` last. With
`ckpt_format="torch"` it takes the LEGACY branch instead: `optimizer.save_parameter_state` into each
`mp_rank_TT[_PPP][_EEE]/distrib_optim.pt`, and `model_optim_rng.pt` (`state_dict_for_save_checkpoint`,
`optimizer.state_dict()`, the scheduler, the RNG list) torch.save'd by the DP-rank-0 ranks. The
built-in engine's own `migrate` entry is not written. Beside it, `reference/` holds the same in-memory state
saved fully reshardable by Megatron-Core: `plain_state(reference)` (Megatron-Core's `load_plain_tensors`) is
the source's truth.

`load_megatron_lm(run, save_dir)` loads a checkpoint at `run`'s layout following `load_checkpoint`: the
tracker file (`read_metadata`), the common state's `args` and `content_metadata`, the refusal of a TP/PP
change for a sharding type that is not fully reshardable, RNG loaded only at the saved TP/PP, the
`check_checkpoint_args` comparisons, `dist_checkpointing.load` of the generated state dict, then model,
optimizer, scheduler and RNG restored. It returns per rank what was restored and saves the loaded state fully
reshardable into `<out>` so that `plain_state(out)` compares with the source's truth tensor by tensor.
A legacy checkpoint is loaded by `load_checkpoint`'s LEGACY branch (this rank's `model_optim_rng.pt`,
`load_parameter_state(distrib_optim.pt)`, RNG entry [0]). `megatron_logits` is Megatron-Core's own forward on a
checkpoint's weights, the reference an HF conversion's logits are judged by.
On CPUs without Apex/TE the built-in engine's load workarounds for 0.16.1's optimizer are applied (see
`migrate.workload.megatron.engine`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import torch

from checkpoint.model_shape import ModelShape
from migrate.workload.run_spec import RunSpec, TrainSpec
from migrate.workload.megatron.dist_format import fork_writer_results_queue

# Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp; 128 rows at 64 stay 128 at
# tp 1 and 2, so the unpadded size (which Megatron-LM's args do not record) is not needed there.
LLAMA = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=128, seq_length=32, make_vocab_size_divisible_by=64)
MIXTRAL = dataclasses.replace(LLAMA, architecture="mixtral", ffn_hidden_size=96, num_experts=4, moe_top_k=2)
GPT = dataclasses.replace(LLAMA, architecture="gpt", num_query_groups=4, norm_eps=1e-6, rotary_base=50000.0)
# DeepSeek-V3 class: MLA, a dense first layer, 4 routed experts top-2 and a shared one, the router's expert bias
DEEPSEEK = ModelShape(architecture="deepseek_v3", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=4, vocab_size=128, seq_length=32,
                      make_vocab_size_divisible_by=64, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                      q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                      first_k_dense=1, shared_expert_ffn_hidden_size=32, norm_eps=1e-6)
FLOPS_SO_FAR = 1.25e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronLMRun:
    """One Megatron-LM run's layout and recipe."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    moe: bool = False
    gpt: bool = False  # GELU + LayerNorm (--normalization LayerNorm, no --swiglu) instead of the llama family
    precision: str = "fp32"  # fp32 | bf16
    sharding: str = "dp_reshardable"  # distrib_optim_sharding_type: dp_reshardable | fully_reshardable
    steps: int = 2
    global_batch_size: int = 8
    bucket_size: int | None = None  # --overlap-grad-reduce --ddp-bucket-size N: several grad buckets per buffer
    distributed_optimizer: bool = True  # --use-distributed-optimizer
    ckpt_format: str = "torch_dist"  # --ckpt-format: torch_dist | torch (legacy: mp_rank_* dirs, distrib_optim.pt)
    model: ModelShape | None = None  # another model than the family's tiny default
    override_opt_param_scheduler: bool = False  # --override-opt_param-scheduler: the run's own LR schedule
    first_pipeline_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_pipeline_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        buckets = f"_bucket{self.bucket_size}" if self.bucket_size else ""
        optimizer = self.sharding if self.distributed_optimizer else "plain"
        family = "moe_" if self.moe else "gpt_" if self.gpt else ""
        legacy = "_legacy" if self.ckpt_format == "torch" else ""
        stages = "".join(f"_{end}{n}" for end, n in (("first", self.first_pipeline_stage_layers),
                                                    ("last", self.last_pipeline_stage_layers)) if n is not None)
        return f"tp{self.tp}pp{self.pp}dp{self.dp}{ep}{stages}_{family}{self.precision}_{optimizer}{buckets}{legacy}"

    def spec(self) -> RunSpec:
        model = self.model or (MIXTRAL if self.moe else GPT if self.gpt else LLAMA)
        return RunSpec(engine="megatron", model=model, steps=self.steps, tp=self.tp,
                       pp=self.pp, ep=self.ep, distributed_optimizer=self.distributed_optimizer,
                       sequence_parallel=model.is_moe and self.tp > 1,
                       train=TrainSpec(global_batch_size=self.global_batch_size, precision=self.precision))


def megatron_lm_args(run: MegatronLMRun, *, iteration: int) -> argparse.Namespace:
    """The Namespace Megatron-LM's `parse_args` + `validate_args` build for this run (the fields its
    checkpointing and model building read, with their types: torch dtypes, enums, None for unset)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    spec = run.spec()
    m, t = spec.model, spec.train
    bf16 = run.precision == "bf16"
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=m.num_query_groups != m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.head_dim, swiglu=m.gated_ffn,
        normalization="RMSNorm" if m.gated_ffn else "LayerNorm",
        norm_epsilon=m.norm_eps, add_bias_linear=False, add_qkv_bias=m.qkv_bias, qk_layernorm=m.qk_norm or m.is_mla,
        untie_embeddings_and_output_weights=not m.tied_embeddings, vocab_size=None,
        padded_vocab_size=m.padded_vocab_size(run.tp), make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        position_embedding_type="rope", add_position_embedding=True, rotary_base=int(m.rotary_base), rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, apply_layernorm_1p=False, squared_relu=False,
        openai_gelu=False,
        seq_length=m.seq_length, max_position_embeddings=m.seq_length, tokenizer_type="HuggingFaceTokenizer",
        vocab_file=None, num_experts=m.num_experts or None, moe_ffn_hidden_size=m.expert_ffn_hidden_size if m.is_moe else None,
        moe_router_topk=m.moe_top_k, moe_layer_freq=m.moe_layer_freq if m.is_mla else 1,
        moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size or None,
        moe_router_enable_expert_bias=m.is_mla, moe_router_score_function="sigmoid" if m.is_mla else "softmax",
        multi_latent_attention=m.is_mla, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank or None,
        qk_head_dim=m.qk_head_dim or None, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim or None,
        v_head_dim=m.v_head_dim or None, mtp_num_layers=None,
        tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None, decoder_first_pipeline_num_layers=run.first_pipeline_stage_layers,
        decoder_last_pipeline_num_layers=run.last_pipeline_stage_layers, pipeline_model_parallel_layout=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        expert_model_parallel_size=run.ep, expert_tensor_parallel_size=run.tp, context_parallel_size=1,
        sequence_parallel=spec.sequence_parallel, data_parallel_size=run.dp, world_size=run.world_size,
        use_distributed_optimizer=run.distributed_optimizer, overlap_grad_reduce=run.bucket_size is not None,
        overlap_param_gather=False,
        ddp_bucket_size=run.bucket_size, ddp_num_buckets=None, overlap_param_gather_with_optimizer_step=False,
        ckpt_format=run.ckpt_format, use_dist_ckpt=run.ckpt_format != "torch", ckpt_fully_parallel_save=True,
        dist_ckpt_optim_fully_reshardable=run.sharding == "fully_reshardable",
        distrib_optim_fully_reshardable_mem_efficient=False, no_save_optim=None, no_save_rng=None,
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float, main_grads_dtype=torch.float32,
        accumulate_allreduce_grads_in_fp32=True, attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, train_iters=100, consumed_train_samples=iteration * t.global_batch_size,
        skipped_train_samples=0, consumed_valid_samples=0, lr=t.optimizer.lr, min_lr=t.optimizer.lr / 10,
        lr_decay_style="cosine", lr_warmup_iters=0, weight_decay=t.optimizer.weight_decay,
        adam_beta1=t.optimizer.beta1, adam_beta2=t.optimizer.beta2, adam_eps=t.optimizer.eps,
        clip_grad=t.optimizer.clip_grad, seed=t.seed, data_parallel_random_init=False, iteration=iteration,
        exit_signal=signal.SIGTERM, save=None, load=None, data_path=None)


# ---------------------------------------------------------------- per rank (run inside the worker group)

def _setup(ctx: Any, run: MegatronLMRun) -> tuple[list, Any, Any, RunSpec]:
    """Model chunks in DDP, the DistributedOptimizer and Megatron-LM's OptimizerParamScheduler at `run`."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from migrate.workload.megatron.engine import _build_chunks, transformer_config
    from migrate.workload.megatron.state import allow_empty_optimizers
    from migrate.workload.megatron.state import seed_host_rng

    spec = run.spec()
    ps.initialize_model_parallel(tensor_model_parallel_size=run.tp, pipeline_model_parallel_size=run.pp,
                                 expert_model_parallel_size=run.ep)
    seed_host_rng(spec.train.seed)
    model_parallel_cuda_manual_seed(spec.train.seed)
    config = transformer_config(spec.model, spec, ctx.world_size)
    config.batch_p2p_comm = False
    # Megatron-LM's core_transformer_config_from_args: --decoder-first/last-pipeline-num-layers
    config.num_layers_in_first_pipeline_stage = run.first_pipeline_stage_layers
    config.num_layers_in_last_pipeline_stage = run.last_pipeline_stage_layers
    overlap = run.bucket_size is not None
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               bucket_size=run.bucket_size,
                                               use_distributed_optimizer=run.distributed_optimizer)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c)
              for c in _build_chunks(spec.model, spec, config)]
    if overlap:  # Megatron-LM's setup: grads reduced once per step, not per micro-batch
        config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    o = spec.train.optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.lr / 10, weight_decay=o.weight_decay, adam_beta1=o.beta1, adam_beta2=o.beta2,
        adam_eps=o.eps, clip_grad=o.clip_grad, bf16=run.precision == "bf16", params_dtype=config.params_dtype,
        use_distributed_optimizer=run.distributed_optimizer), chunks)
    allow_empty_optimizers(optimizer)  # the built-in engine's workaround (a pipeline stage without experts, no Apex/TE)
    config.finalize_model_grads_func = finalize_model_grads
    gbs = spec.train.global_batch_size
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.lr / 10,
                                        lr_warmup_steps=gbs, lr_decay_steps=100 * gbs, lr_decay_style="cosine",
                                        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=100 * gbs,
                                        wd_incr_style="constant",
                                        override_opt_param_scheduler=run.override_opt_param_scheduler,
                                        use_checkpoint_opt_param_scheduler=not run.override_opt_param_scheduler)
    return chunks, optimizer, scheduler, spec


def _metadata(sharding: str | None) -> dict[str, Any]:
    """`_build_sharded_state_dict_metadata` for the torch_dist format (`sharding` None: no distributed optimizer)."""
    from megatron.core import parallel_state as ps

    md: dict[str, Any] = {} if sharding is None else {"distrib_optim_sharding_type": sharding}
    if sharding == "fully_reshardable":
        md["distrib_optim_fully_reshardable_mem_efficient"] = False
    md |= {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
           "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    return md


def _rng_state() -> Any:
    """Megatron-LM's `get_rng_state` for torch_dist (data_parallel_random_init off: one state per (pp, tp))."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state],
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _state_dict(args: Any, chunks: list, optimizer: Any, scheduler: Any, metadata: dict, *, iteration: int,
                rng: Any, loading: bool) -> dict[str, Any]:
    """`generate_state_dict` for ckpt_format torch_dist, of the unwrapped model (`unwrap_model`: no DDP prefix)."""
    from megatron.core.utils import unwrap_model

    sd: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    model = unwrap_model(chunks)
    if len(model) == 1:
        sd["model"] = model[0].sharded_state_dict(metadata=metadata)
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = chunk.sharded_state_dict(metadata=metadata)
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=loading, metadata=metadata)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    if rng is not None:
        sd["rng_state"] = rng
    return sd


def _save(sd: dict[str, Any], path: str, metadata: dict) -> None:
    """`save_checkpoint`'s torch_dist branch: fully parallel save over the DP group, content metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                ps.get_data_parallel_group(with_context_parallel=True))
    fork_writer_results_queue()  # the same queue, without spawning a fresh interpreter per saving rank
    dist_checkpointing.save(sd, path, strategy, content_metadata=_clean_metadata_for_serialization(metadata))


def _write_tracker(save_dir: str, iteration: int) -> None:
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def _legacy_rank_dir(path: str) -> str:
    """`get_checkpoint_name`'s directory for this rank: mp_rank_TT[_PPP][_EEE]."""
    from megatron.core import parallel_state as ps

    from checkpoint.formats.megatron_paths import rank_dir

    return os.path.join(path, rank_dir(tp_rank=ps.get_tensor_model_parallel_rank(),
                                            pp_rank=ps.get_pipeline_model_parallel_rank(),
                                            ep_rank=ps.get_expert_model_parallel_rank(),
                                            pp=ps.get_pipeline_model_parallel_world_size(),
                                            ep=ps.get_expert_model_parallel_world_size()))


def _legacy_rng_state() -> list[dict[str, Any]]:
    """`get_rng_state` for ckpt_format torch (data_parallel_random_init off): a list of this rank's one state."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]


def _save_legacy(args: Any, chunks: list, optimizer: Any, scheduler: Any, path: str, run: MegatronLMRun) -> None:
    """`save_checkpoint`'s LEGACY branch: `optimizer.save_parameter_state(distrib_optim.pt)` on every rank (DP
    rank 0 writes), then `generate_state_dict` with `state_dict_for_save_checkpoint` and `optimizer.state_dict()`
    torch.save'd by the ranks whose DP or expert-DP rank is 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    rank_dir = _legacy_rank_dir(path)
    rng = _legacy_rng_state()
    os.makedirs(rank_dir, exist_ok=True)
    torch.distributed.barrier()
    if run.distributed_optimizer:
        optimizer.save_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        sd: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": run.steps}
        model = unwrap_model(chunks)
        for i, chunk in enumerate(model):
            sd["model" if len(model) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
        sd["optimizer"] = optimizer.state_dict()
        sd["opt_param_scheduler"] = scheduler.state_dict()
        sd["rng_state"] = rng
        sd["num_floating_point_operations_so_far"] = FLOPS_SO_FAR
        torch.save(sd, os.path.join(rank_dir, "model_optim_rng.pt"))
    torch.distributed.barrier()


def _save_reference(chunks: list, optimizer: Any, path: str) -> None:
    """The in-memory model and optimizer state saved fully reshardable (global tensors, any layout)."""
    from megatron.core.utils import unwrap_model

    md = _metadata("fully_reshardable")
    model = unwrap_model(chunks)
    sd = {"model": model[0].sharded_state_dict(metadata=md)} if len(model) == 1 else {
        f"model{i}": c.sharded_state_dict(metadata=md) for i, c in enumerate(model)}
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=False, metadata=md)
    _save(sd, path, md)


def _adam_steps(optimizer: Any) -> list[float]:
    return sorted({float(s["step"]) for sub in getattr(optimizer, "chained_optimizers", [optimizer])
                   for s in sub.optimizer.state.values() if "step" in s})


def _rank_save(ctx: Any, run: MegatronLMRun, save_dir: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from migrate.workload.megatron.cpu_adapter import cpu_device_adapter
    from migrate.workload.data import SamplerState
    from migrate.workload.megatron.engine import _loop

    torch.set_num_threads(1)
    with cpu_device_adapter():
        chunks, optimizer, scheduler, spec = _setup(ctx, run)
        try:
            t = spec.train
            sampler = SamplerState(seed=t.seed, dataset_size=t.dataset_size, global_batch_size=t.global_batch_size)
            result = _loop(ctx, spec, chunks, optimizer, sampler, 0, get_forward_backward_func())
            for _ in range(run.steps):
                scheduler.step(increment=t.global_batch_size)
            md = _metadata(run.sharding if run.distributed_optimizer else None)
            path = os.path.join(save_dir, f"iter_{run.steps:07d}")
            args = megatron_lm_args(run, iteration=run.steps)
            if run.ckpt_format == "torch":
                _save_legacy(args, chunks, optimizer, scheduler, path, run)
            else:
                sd = _state_dict(args, chunks, optimizer, scheduler, md, iteration=run.steps, rng=_rng_state(),
                                 loading=False)
                sd["num_floating_point_operations_so_far"] = FLOPS_SO_FAR
                _save(sd, path, md)
            _write_tracker(save_dir, run.steps)
            _save_reference(chunks, optimizer, os.path.join(save_dir, "reference"))
            return {"losses": result.losses, "adam_steps": _adam_steps(optimizer),
                    "scheduler_num_steps": scheduler.num_steps, "lr": [g["lr"] for g in optimizer.param_groups],
                    "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}
        finally:
            ps.destroy_model_parallel()


def _checkpoint_dir(load_dir: str) -> tuple[str, int]:
    """`read_metadata` of the tracker file: the iteration directory and its iteration."""
    with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt")) as f:
        text = f.read().strip()
    iteration = int(text)
    return os.path.join(load_dir, f"iter_{iteration:07d}"), iteration


def _check_checkpoint_args(ckpt_args: Any, args: Any) -> None:
    """`check_checkpoint_args` with `vocab_file` set (the comparisons a resume makes)."""
    names = ["num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
             "make_vocab_size_divisible_by", "tokenizer_type"]
    for name in names:
        got, want = getattr(ckpt_args, name), getattr(args, name)
        assert got == want, f"{name} value from checkpoint ({got}) is not equal to the input argument value ({want})."
    assert getattr(ckpt_args, "add_position_embedding", True) == args.add_position_embedding


def _rank_load_legacy(ctx: Any, run: MegatronLMRun, load_dir: str, out: str) -> dict[str, Any]:
    """`load_checkpoint` for ckpt_format torch: this rank's model_optim_rng.pt (`torch.load`, as Megatron-LM does
    it), `check_checkpoint_args`, then model, `optimizer.load_state_dict`, `load_parameter_state(distrib_optim.pt)`,
    the scheduler and RNG entry [0]. The file must be at this rank's TP/PP/EP (Megatron-LM cannot reshard it)."""
    from megatron.core import parallel_state as ps

    from checkpoint.state.rng import fingerprint, from_megatron
    from migrate.workload.megatron.cpu_adapter import cpu_device_adapter
    from migrate.workload.megatron.state import (keep_step_on_fully_reshardable_load, rank_rng_state,
                                                 restore_adam_steps, restore_rng, saved_adam_steps)

    torch.set_num_threads(1)
    with cpu_device_adapter():
        chunks, optimizer, scheduler, spec = _setup(ctx, run)
        try:
            path, tracker_iteration = _checkpoint_dir(load_dir)
            rank_dir = _legacy_rank_dir(path)
            state = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
            ckpt_args = state["args"]
            saved = (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size)
            assert saved == (run.tp, run.pp), f"{rank_dir}: saved at (tp, pp) {saved}, loading at {(run.tp, run.pp)}"
            _check_checkpoint_args(ckpt_args, megatron_lm_args(run, iteration=0))
            if len(chunks) == 1:
                chunks[0].module.load_state_dict(state["model"], strict=True)
            else:
                for i, chunk in enumerate(chunks):
                    chunk.module.load_state_dict(state[f"model{i}"], strict=True)
            steps = saved_adam_steps(state["optimizer"])
            with torch.no_grad():
                optimizer.load_state_dict(state["optimizer"])
                if run.distributed_optimizer:
                    keep_step_on_fully_reshardable_load(optimizer)
                    optimizer.load_parameter_state(os.path.join(rank_dir, "distrib_optim.pt"))
            if steps:
                restore_adam_steps(optimizer, max(steps))
            scheduler.load_state_dict(state["opt_param_scheduler"])
            restore_rng(state["rng_state"], rank_dir, "cuda")
            _save_reference(chunks, optimizer, out)
            return {"iteration": int(state["iteration"]), "tracker_iteration": tracker_iteration,
                    "consumed_train_samples": getattr(ckpt_args, "consumed_train_samples", 0),
                    "flops": state.get("num_floating_point_operations_so_far", 0),
                    "adam_steps": _adam_steps(optimizer), "saved_adam_steps": sorted(steps),
                    "scheduler_num_steps": scheduler.num_steps, "rng_loaded": True,
                    "rng_fingerprint": fingerprint(from_megatron(rank_rng_state("cuda"))), "sharding": "legacy",
                    "ckpt_args_layout": (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size,
                                         getattr(ckpt_args, "data_parallel_size", None),
                                         getattr(ckpt_args, "world_size", None)),
                    "ckpt_format": getattr(ckpt_args, "ckpt_format", None),
                    "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}
        finally:
            ps.destroy_model_parallel()


def _rank_load(ctx: Any, run: MegatronLMRun, load_dir: str, out: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from checkpoint.state.rng import fingerprint, from_megatron
    from migrate.workload.megatron.cpu_adapter import cpu_device_adapter
    from migrate.workload.megatron.state import (keep_step_on_fully_reshardable_load, prime_adam_state,
                                                 rank_rng_state, restore_adam_steps, restore_rng, saved_adam_steps)

    torch.set_num_threads(1)
    with cpu_device_adapter():
        chunks, optimizer, scheduler, spec = _setup(ctx, run)
        try:
            path, tracker_iteration = _checkpoint_dir(load_dir)
            common = dist_checkpointing.load_common_state_dict(path)
            ckpt_args = common["args"]
            ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                          getattr(ckpt_args, "pipeline_model_parallel_size", 1))
            # as Megatron-LM decides: the RNG state is loaded at the same TP/PP unless the checkpoint has none
            load_rng = ckpt_tp_pp == (run.tp, run.pp) and not getattr(ckpt_args, "no_save_rng", False)
            content = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
            sharding = content["distrib_optim_sharding_type"]
            if not load_rng and sharding not in DistributedOptimizer.checkpoint_fully_reshardable_formats:
                raise RuntimeError(f"(TP, PP) mismatch after resume ({(run.tp, run.pp)} vs {ckpt_tp_pp} from "
                                   f"checkpoint): not supported for DistributedOptimizer with sharding type {sharding}")
            args = megatron_lm_args(run, iteration=0)
            _check_checkpoint_args(ckpt_args, args)
            md = {**content, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
            prime_adam_state(optimizer)
            template = _state_dict(args, chunks, optimizer, scheduler, md, iteration=0,
                                   rng=_rng_state() if load_rng else None, loading=True)
            template.pop("args")
            loaded = dist_checkpointing.load(template, path)
            if len(chunks) == 1:
                chunks[0].load_state_dict(loaded["model"], strict=True)
            else:
                for i, chunk in enumerate(chunks):
                    chunk.load_state_dict(loaded[f"model{i}"], strict=True)
            steps = saved_adam_steps(loaded["optimizer"])
            if sharding == "fully_reshardable":
                keep_step_on_fully_reshardable_load(optimizer)
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            if steps:
                restore_adam_steps(optimizer, max(steps))
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
            restored = None
            if load_rng:
                restore_rng(loaded["rng_state"], path, "cuda")
                restored = fingerprint(from_megatron(rank_rng_state("cuda")))
            _save_reference(chunks, optimizer, out)
            return {"iteration": int(loaded["iteration"]), "tracker_iteration": tracker_iteration,
                    "consumed_train_samples": getattr(ckpt_args, "consumed_train_samples", 0),
                    "flops": loaded.get("num_floating_point_operations_so_far", 0), "adam_steps": _adam_steps(optimizer),
                    "saved_adam_steps": sorted(steps), "scheduler_num_steps": scheduler.num_steps,
                    "rng_loaded": load_rng, "rng_fingerprint": restored, "sharding": sharding,
                    "ckpt_args_layout": (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size,
                                         getattr(ckpt_args, "data_parallel_size", None),
                                         getattr(ckpt_args, "world_size", None)),
                    "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}
        finally:
            ps.destroy_model_parallel()


# ---------------------------------------------------------------- driver side

def _group(world_size: int):
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules

    env = {"OMP_NUM_THREADS": "1"}
    return start_worker_group(WorkerGroupSpec(world_size=world_size, mode="local", backend="gloo", env=env,
                                              timeout_s=300, preload=engine_modules("megatron")))


def save_megatron_lm(run: MegatronLMRun, save_dir: str | Path) -> list[dict[str, Any]]:
    """Train `run` and save it as Megatron-LM does into `save_dir` (plus `save_dir/reference`); per rank results."""
    with _group(run.world_size) as group:
        return group.run(_rank_save, run, str(save_dir))


def finetune_logits(run: MegatronLMRun, load_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Load `load_dir` at `run`'s layout (pp 1) as Megatron-LM's `load_checkpoint` does with --finetune (the model
    only: no optimizer, scheduler or RNG state; iteration 0) and return the logits of `tokens`, gathered over TP."""
    with _group(run.world_size) as group:
        return group.run(_rank_model_logits, run, str(load_dir), tokens)[0]


def _rank_model_logits(ctx: Any, run: MegatronLMRun, load_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """The model alone loaded from a save dir (its tracker) or an iteration dir, eval-mode logits over TP."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.utils import unwrap_model

    from migrate.workload.megatron.cpu_adapter import cpu_device_adapter

    torch.set_num_threads(1)
    with cpu_device_adapter():
        chunks, _, _, _ = _setup(ctx, run)
        try:
            tracked = os.path.isfile(os.path.join(load_dir, "latest_checkpointed_iteration.txt"))
            path = _checkpoint_dir(load_dir)[0] if tracked else load_dir
            model = unwrap_model(chunks)[0]
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=_metadata(None))}, path)
            model.load_state_dict(loaded["model"], strict=True)
            model.eval()
            positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()
            with torch.no_grad():
                return gather_from_tensor_model_parallel_region(model(tokens, positions, None)).float()
        finally:
            ps.destroy_model_parallel()


def assert_megatron_gives_hf_logits(hf: Any, hf_dir: Path, dst: Path, model: ModelShape, layout: dict[str, int]
                                    ) -> None:
    """Convert the transformers model `hf` saved at `hf_dir` to Megatron at `layout` (into `dst`): Megatron-Core's
    forward on the result gives `hf`'s logits."""
    from checkpoint.api import LayoutRequest, convert

    convert(hf_dir, dst, to="megatron", target=LayoutRequest(**layout))
    tokens = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
    got = megatron_logits(MegatronLMRun(model=model, **layout), dst, tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def saved_runs(tmp_path_factory: Any, runs: dict[str, MegatronLMRun], prefix: str):
    """`get(name)` -> (save dir written as Megatron-LM does, save results, the source's truth from `reference/`):
    each of `runs` trained and saved once, the first time a test asks for it."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            save_dir = tmp_path_factory.mktemp(f"{prefix}{name}")
            saved = save_megatron_lm(runs[name], save_dir)
            cache[name] = save_dir, saved, plain_state(save_dir / "reference")
        return cache[name]

    return get


def load_megatron_lm(run: MegatronLMRun, load_dir: str | Path, out: str | Path) -> list[dict[str, Any]]:
    """Load `load_dir` at `run`'s layout as Megatron-LM's `load_checkpoint` does; the loaded state is saved fully
    reshardable into `out` (`plain_state(out)`); per rank what was restored."""
    with _group(run.world_size) as group:
        return group.run(_rank_load_legacy if run.ckpt_format == "torch" else _rank_load, run, str(load_dir),
                         str(out))


def assert_loads_with_every_state_equal(run: MegatronLMRun, load_dir: str | Path, out: str | Path,
                                        truth: dict[str, torch.Tensor], *, what: str) -> list[dict[str, Any]]:
    """Load `load_dir` at `run`'s layout as Megatron-LM does (`load_megatron_lm`): every rank restored Adam step
    `run.steps`, and every tensor of the loaded state (weights, buffers, fp32 master, Adam moments) equals `truth`
    (the source's `plain_state`) in dtype and value. Per rank what was restored."""
    loaded = load_megatron_lm(run, load_dir, out)
    assert all(r["adam_steps"] == [float(run.steps)] for r in loaded), loaded
    got = plain_state(out)
    assert sorted(got) == sorted(truth)
    unequal = [k for k in truth if truth[k].dtype != got[k].dtype or not torch.equal(truth[k], got[k])]
    assert not unequal, f"differ from {what} after Megatron-LM's load at {run.name}: {unequal}"
    return loaded


def assert_synthesized_metadata_is_megatrons(iteration_dir: str | Path, layout: Any, *,
                                             model_dtype: str = "float32") -> None:
    """The metadata the planner synthesizes for `layout` (`checkpoint.formats.megatron_synth`) has the DCP keys,
    global sizes and dtypes of the checkpoint Megatron-Core wrote in `iteration_dir`, and reads to the same index."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from checkpoint.api import read_index
    from checkpoint.formats.megatron_synth import synthesize_metadata, synthetic_index

    real_index = read_index(iteration_dir)
    arch = ModelShape.from_dict(dict(real_index.meta["arch"]))
    md, _ = synthesize_metadata(arch, layout, model_dtype=model_dtype)
    real = FileSystemReader(str(iteration_dir)).read_metadata()

    def tensors(m: Any) -> dict[str, tuple]:
        return {k: (tuple(v.size), v.properties.dtype) for k, v in m.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}

    assert tensors(md) == tensors(real)
    synth = synthetic_index(arch, layout, model_dtype=model_dtype)
    assert {(e.key, e.shape, e.dtype) for e in synth.entries} == {(e.key, e.shape, e.dtype) for e in real_index.entries}


def megatron_logits(run: MegatronLMRun, load_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits Megatron-Core's GPTModel gives for `tokens` (batch, seq) with the weights of the torch_dist save
    dir (or iteration dir) `load_dir`, built at tp 1, pp 1 in fp32 (bf16 weights load exactly into it) on one
    rank, in eval mode."""
    one = dataclasses.replace(run, tp=1, pp=1, dp=1, ep=1, precision="fp32", bucket_size=None,
                              first_pipeline_stage_layers=None, last_pipeline_stage_layers=None)
    with _group(1) as group:
        return group.run(_rank_model_logits, one, str(load_dir), tokens)[0]


def plain_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint as one global tensor (Megatron-Core's `load_plain_tensors`,
    on one rank)."""
    with _group(1) as group:
        return group.run(_rank_plain, str(path))[0]


def _rank_plain(ctx: Any, path: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from migrate.workload.megatron.cpu_adapter import cpu_device_adapter

    with cpu_device_adapter():
        loaded = dist_checkpointing.load_plain_tensors(path)
    return {k: v for k, v in _flatten(loaded) if isinstance(v, torch.Tensor)}


def _flatten(d: Any, prefix: str = ""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d
