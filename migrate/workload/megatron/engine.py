"""The built-in decoder as Megatron-Core's GPTModel: TP, PP (virtual stages), EP, sequence
parallel, trained by Megatron-Core's DDP + DistributedOptimizer (or its plain optimizer),
checkpointed in Megatron-Core's dist format (torch_dist) with the optimizer state.

Call sequence per rank (`train_megatron(ctx, spec)` on every rank of a worker group):
initialize model parallel -> seed the RNG tracker -> build one GPTModel chunk per virtual
stage -> wrap in DDP -> `get_megatron_optimizer` -> optional `dist_checkpointing.load` ->
steps through `get_forward_backward_func()` (1F1B / interleaved when pp > 1) -> save
`<save_dir>/iter_<NNNNNNN>/` and `latest_checkpointed_iteration.txt` (Megatron-LM's layout).
On CPUs it runs inside `migrate.workload.megatron.cpu_adapter.cpu_device_adapter()`.

The checkpoint holds `model` (`model0`, `model1`, ... with virtual stages), `optimizer`
(sharding type `distrib_optim_sharding_type`, default 'dp_reshardable'; 0.16.1's default
fails on save), `iteration`, `checkpoint_version`, `rng_state` (every rank's RNG as Megatron-LM saves
it) and `migrate` (sampler state, step, data position, consumed tokens, model shape).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from checkpoint.model_shape import ModelShape
from migrate.workload.data import SamplerState, TokenDataset, rank_micro_batches
from migrate.workload.loop import StepOutcome, train_loop
from migrate.workload.megatron import dist_format, legacy_format
from migrate.workload.megatron.state import allow_empty_optimizers, rng_fingerprint, seed_host_rng
from migrate.workload.metrics import RankResult
from migrate.workload.run_spec import RunSpec, lr_at
from migrate.workload.train_state import StepTrace


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """How the engine saves and loads one of Megatron-LM's checkpoint formats (the same signatures)."""

    save: Any
    load: Any


CHECKPOINT_FORMATS = {
    "torch_dist": CheckpointFormat(save=dist_format.save_checkpoint, load=dist_format.load_checkpoint),
    "torch": CheckpointFormat(save=legacy_format.save_legacy_checkpoint, load=legacy_format.load_legacy_checkpoint),
}
"""`--ckpt-format` -> the engine's save and load (`RunSpec.checkpoint_format`)."""


def transformer_config(model: ModelShape, spec: RunSpec, world_size: int) -> Any:
    """Megatron-Core TransformerConfig of the run (dropout off, no fused kernels, CPU init)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = torch.bfloat16 if spec.train.precision == "bf16" else torch.float32
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_top_k,
                   moe_ffn_hidden_size=model.expert_ffn_hidden_size,
                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
                   moe_router_load_balancing_type="none", moe_permute_fusion=False)
    config_class = TransformerConfig
    attention: dict[str, Any] = dict(num_query_groups=model.num_query_groups, kv_channels=model.head_dim)
    if model.is_mla:  # DeepSeek-V3: MLA with its q/kv norms, first-k dense layers, shared experts, sigmoid router
        config_class = MLATransformerConfig
        attention = dict(q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank,
                         qk_head_dim=model.qk_head_dim, qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
                         v_head_dim=model.v_head_dim, rope_type="rope", rotary_base=model.rotary_base)
        moe |= dict(moe_layer_freq=model.moe_layer_freq, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                    moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size or None)
    return config_class(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, **attention,
        normalization="RMSNorm" if model.gated_ffn else "LayerNorm",
        layernorm_epsilon=model.norm_eps, gated_linear_unit=model.gated_ffn,
        activation_func=F.silu if model.gated_ffn else F.gelu, add_bias_linear=False,
        add_qkv_bias=model.qkv_bias, qk_layernorm=model.qk_norm or model.is_mla,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        expert_model_parallel_size=spec.ep, sequence_parallel=spec.sequence_parallel and spec.tp > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, **moe)

def _build_chunks(model: ModelShape, spec: RunSpec, config: Any) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from migrate.workload.megatron_norm import gpt_block_spec

    chunks = []
    for vp_stage in range(spec.vpp):
        stage = vp_stage if spec.vpp > 1 else None
        # Local-spec layers whose norms are torch norms marked for sequence parallel (megatron_norm.py).
        block_spec = gpt_block_spec(config, num_experts=model.num_experts if model.is_moe else None,
                                    normalization="RMSNorm" if model.gated_ffn else "LayerNorm", vp_stage=stage,
                                    qk_layernorm=model.qk_norm or model.is_mla, moe_layers=model.moe_layer_freq,
                                    multi_latent_attention=model.is_mla)
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

@dataclasses.dataclass
class _RngTrace(StepTrace):
    """StepTrace whose per-step RNG fingerprint includes the device generator and the tracker streams."""

    device_type: str = "cpu"

    def record(self, global_indices: Any) -> None:
        if not self.enabled:
            return
        self.samples.append([int(i) for i in global_indices])
        self.rng.append(rng_fingerprint(self.device_type))

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
        from migrate.workload.megatron.cpu_adapter import cpu_device_adapter
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
        allow_empty_optimizers(optimizer)
        config.finalize_model_grads_func = finalize_model_grads
        sampler = SamplerState(seed=train.seed, dataset_size=train.dataset_size,
                               global_batch_size=train.global_batch_size)
        start_step = 0
        if spec.load_dir:
            load = CHECKPOINT_FORMATS["torch" if legacy_format.is_legacy_checkpoint(spec.load_dir)  # mp_rank_* dirs
                                      else "torch_dist"].load
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
    dataset = TokenDataset(seed=train.dataset_seed, size=train.dataset_size, seq_length=model_spec.seq_length,
                           vocab_size=model_spec.vocab_size)
    device = "cpu" if ctx.device_type == "cpu" else ctx.device
    steps = MegatronSteps(chunks=chunks, optimizer=optimizer, forward_backward=forward_backward, spec=spec,
                          dataset=dataset, device=device, device_type=ctx.device_type, dp_rank=dp_rank, dp=dp)
    return train_loop(ctx, spec, steps, name="megatron", sampler=sampler, start_step=start_step,
                      trace=_RngTrace(device_type=ctx.device_type, enabled=spec.long_run is None), device=device,
                      extra={"tp": spec.tp, "pp": spec.pp, "ep": spec.ep, "vpp": spec.vpp, "dp": dp,
                             "distributed_optimizer": spec.distributed_optimizer, "state_print": state_print})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronSteps:
    """`EngineSteps` of Megatron-Core model chunks: the LR set on the optimizer's groups each step, the
    pipeline schedule's forward/backward over every micro-batch, the optimizer's own step (it reports a
    skipped update and the grad norm), the checkpoint format of `spec.checkpoint_format`."""

    chunks: list
    optimizer: Any
    forward_backward: Any
    spec: RunSpec
    dataset: TokenDataset
    device: str
    device_type: str
    dp_rank: int
    dp: int

    def learning_rate(self, step: int) -> float:
        lr = lr_at(self.spec.train.lr_schedule, self.spec.train.optimizer.lr, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, global_indices: Any) -> StepOutcome:
        from megatron.core import parallel_state as ps

        train, chunks = self.spec.train, self.chunks
        batches = _micro_batches(self.dataset, rank_micro_batches(global_indices, self.dp_rank, self.dp,
                                                                  train.micro_batch_size))
        if self.device != "cpu":
            batches = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = [iter(batches) for _ in chunks]
        losses = self.forward_backward(
            forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=train.grad_accumulation(self.dp),
            seq_length=self.spec.model.seq_length, micro_batch_size=train.micro_batch_size, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        # Every rank of the last pipeline stage holds its DP shard's losses; average them all.
        summed = torch.zeros(2, dtype=torch.float64)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            summed[0] = sum(float(item["lm loss"]) for item in losses)
            summed[1] = len(losses)
        dist.all_reduce(summed)
        return StepOutcome(loss=float(summed[0] / summed[1]),
                           grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), skipped=not updated)

    def save(self, step: int, sampler: SamplerState) -> str:
        save = CHECKPOINT_FORMATS[self.spec.checkpoint_format].save
        return save(self.chunks, self.optimizer, step, sampler, str(self.spec.save_dir), model=self.spec.model,
                    micro_batch_size=self.spec.train.micro_batch_size, device_type=self.device_type)
