"""Per-rank memory model: weights, gradients, optimizer state, activations, in-flight micro-batches.

For each pipeline stage the model sums what one rank of that stage holds, then reports the
largest stage (the first stage usually: embeddings and the most in-flight micro-batches; the
last: output layer and logits). Activation counts follow Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), per tensor kept for backward,
with grouped-query attention, gated FFNs, MoE routing and context parallelism added. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass

from checkpoint.layout import OptimizerSharding
from checkpoint.model_shape import ModelShape
from parallel_search.profiles import DeviceProfile
from parallel_search.space import Candidate
from parallel_search.spec import TrainingShape

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "transient")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Bytes one rank of the worst stage needs; ``total`` includes fragmentation and reserved memory."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    reserved: float
    fragmentation: float
    in_flight_microbatches: int

    @property
    def tensors(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.transient

    @property
    def total(self) -> float:
        return self.tensors * (1.0 + self.fragmentation) + self.reserved

    def to_dict(self) -> dict[str, float]:
        return {"stage": self.stage, "weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "transient": self.transient, "reserved": self.reserved,
                "fragmentation": self.fragmentation, "in_flight_microbatches": self.in_flight_microbatches,
                "total": self.total}


def stage_params(model: ModelShape, cand: Candidate, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of pipeline ``stage`` holds, after TP and EP splits."""
    lay = cand.layout
    layers = model.num_layers / lay.pp
    tp = lay.tp
    attention = model.attention_params_per_layer / tp + model.norm_params_per_layer
    dense_ffn = 0.0 if model.is_moe else model.ffn_params_per_expert / tp
    router = model.hidden_size * model.num_experts if model.is_moe else 0.0
    dense = layers * (attention + dense_ffn + router)
    experts = layers * (model.num_experts / lay.ep) * model.ffn_params_per_expert / tp if model.is_moe else 0.0
    vocab = model.padded_vocab_size(tp) * model.hidden_size / tp
    first, last = stage == 0, stage == lay.pp - 1
    if first:
        dense += vocab
    if last:
        dense += model.hidden_size  # final norm
        if not model.tied_embeddings or lay.pp > 1:
            dense += vocab  # output layer (a tied copy lives on the last stage when pp > 1)
    return dense, experts


def state_bytes(train: TrainingShape, cand: Candidate, dense: float, experts: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes for the given parameter counts under the candidate's sharding.

    Megatron: bf16/fp16 params, fp32 main grads, fp32 master + Adam moments (12 B) sharded over
    dp (experts over expert-dp) by the distributed optimizer; fp32 runs keep no master copy.
    DeepSpeed ZeRO: stage 1 shards the optimizer, 2 also gradients, 3 also parameters.
    """
    lay = cand.layout
    low = train.precision != "fp32"
    param_b = train.bytes_per_element
    opt_b = 12.0 if low else 8.0
    dp = lay.dp
    expert_dp = max(lay.dp * lay.cp // lay.ep, 1)
    sharding = lay.sharding
    if cand.framework == "megatron":
        grad_b = 4.0
        weights = (dense + experts) * param_b
        gradients = (dense + experts) * grad_b
        if sharding is OptimizerSharding.DISTRIBUTED_OPTIMIZER:
            optimizer = dense * opt_b / (dp * lay.cp) + experts * opt_b / expert_dp
        else:
            optimizer = (dense + experts) * opt_b
        return weights, gradients, optimizer
    stage = sharding.zero_stage
    params = dense + experts
    weights = params * param_b / (dp if stage >= 3 else 1)
    if stage == 0:
        # Plain DDP: gradients in the parameter dtype, fp32 master and moments (master only when low precision).
        return weights, params * param_b, params * opt_b
    # ZeRO keeps an fp32 master partition even for fp32 runs (single_partition_of_fp32_groups), the
    # full-size gradients of the backward pass plus their fp32 partition, and partitioned moments.
    gradients = params * param_b + params * 4.0 / dp
    optimizer = params * (4.0 + 8.0) / dp
    return weights, gradients, optimizer


def layer_activation_bytes(model: ModelShape, train: TrainingShape, cand: Candidate, flash_attention: bool) -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch on one rank (no recompute)."""
    lay = cand.layout
    b, tp, cp = cand.micro_batch_size, lay.tp, lay.cp
    s = model.seq_length / cp
    tokens = s * b
    h, f, kv = model.hidden_size, model.layer_ffn_hidden_size, model.kv_size
    e = train.bytes_per_element
    sp = tp if cand.sequence_parallel else 1
    # norm1 input and output, norm2 input and output: replicated over TP unless sequence parallel
    replicated = 4 * tokens * h / sp
    qkv = tokens * (h + 2 * kv) / tp  # projections
    rotary = tokens * (h + kv) / tp  # rotated q and k kept for the score matmul
    context = tokens * h / tp  # attention output, input of the output projection
    heads = model.num_attention_heads / tp
    if flash_attention:
        scores = b * heads * s * 4 / e  # log-sum-exp only (fp32)
    elif cand.recompute == "selective":
        scores = 0.0  # the score/softmax block is recomputed in backward
    else:
        scores = 2 * b * heads * s * s  # scores and softmax output
    ffn_tensors = 4 if model.gated_ffn else 2
    routed = model.moe_top_k if model.is_moe else 1
    ffn = routed * ffn_tensors * tokens * f / tp
    dispatch = 2 * routed * tokens * h if model.is_moe else 0.0  # permuted tokens before and after the experts
    router = tokens * model.num_experts if model.is_moe else 0.0
    return e * (replicated + qkv + rotary + context + scores + ffn + dispatch + router)


def in_flight(cand: Candidate, num_microbatches: int, stage: int) -> int:
    """Micro-batches (micro-batch chunks under interleaving) whose activations ``stage`` holds at its peak.

    1F1B keeps pp - stage micro-batches; the interleaved schedule keeps its warm-up chunks
    ((pp - stage - 1) * 2 + (vpp - 1) * pp, Megatron-Core's count) plus one, each one chunk deep.
    """
    lay = cand.layout
    if lay.pp == 1:
        return 1
    if lay.vpp == 1:
        return min(lay.pp - stage, num_microbatches)
    warmup = (lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp
    return min(warmup + 1, num_microbatches * lay.vpp)


def estimate_memory(model: ModelShape, train: TrainingShape, cand: Candidate, device: DeviceProfile,
                    flash_attention: bool | None = None, allocated: bool | None = None) -> MemoryEstimate:
    """Peak bytes per rank over the pipeline stages (the worst stage is reported). `allocated` counts every
    byte allocated, as an accelerator's allocator does (default on accelerators); off, buffers allocated but
    never written count only as far as they are touched, as the CPU's resident memory does (default there)."""
    flash = device.device_type != "cpu" if flash_attention is None else flash_attention
    lay = cand.layout
    m = cand.num_microbatches(train.global_batch_size)
    per_layer = layer_activation_bytes(model, train, cand, flash)
    b, s = cand.micro_batch_size, model.seq_length / lay.cp
    e = train.bytes_per_element
    layer_input = b * s * model.hidden_size * e / (lay.tp if cand.sequence_parallel else 1)
    layers_per_stage = model.num_layers / lay.pp
    best: MemoryEstimate | None = None
    for stage in range(lay.pp):
        dense, experts = stage_params(model, cand, stage)
        weights, gradients, optimizer = state_bytes(train, cand, dense, experts)
        count = in_flight(cand, m, stage)
        chunk_layers = layers_per_stage / lay.vpp if lay.vpp > 1 else layers_per_stage
        if cand.recompute == "full":
            kept = count * chunk_layers * layer_input + per_layer  # inputs only, one layer rebuilt at a time
        else:
            kept = count * chunk_layers * per_layer
        if stage == 0:
            kept += count * layer_input  # embedding output
        transient = 2 * per_layer  # activation gradients of the layer in backward
        if stage == lay.pp - 1:
            logits = b * s * model.padded_vocab_size(lay.tp) / lay.tp
            transient += 3 * logits * 4  # fp32 logits, softmax and its gradient in the loss
        if lay.zero_stage >= 3:
            transient += 2 * (dense + experts) * train.bytes_per_element  # gathered parameters of the live modules
        if cand.framework == "deepspeed" and lay.zero_stage >= 1:
            transient += ipg_bucket_bytes(dense + experts, train, device, lay.zero_stage,
                                          allocated=device.device_type != "cpu" if allocated is None else allocated)
        estimate = MemoryEstimate(stage=stage, weights=weights, gradients=gradients, optimizer=optimizer,
                                  activations=kept, transient=transient, reserved=device.memory_reserved_gb * 1e9,
                                  fragmentation=device.memory_fragmentation, in_flight_microbatches=count)
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None
    return best


DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default zero_optimization.reduce_bucket_size


def ipg_bucket_bytes(params: float, train: TrainingShape, device: DeviceProfile, zero_stage: int = 2, *,
                     allocated: bool = True) -> float:
    """DeepSpeed ZeRO-1/2/3's contiguous gradient bucket: a `torch.empty` of reduce_bucket_size elements per
    backward (ZeRO-1/2: `DeepSpeedZeroOptimizer.setup_buckets`, fp32 for ZeRO-1, which stages the fp32
    accumulator, the parameters' dtype for ZeRO-2; ZeRO-3: `__ipg_bucket_flat_buffer`). An allocator counts
    all of it; resident memory holds only the pages the gradients are written to (at most the parameters)."""
    elements = DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    if not allocated:
        elements = min(elements, params)
    return elements * (4.0 if zero_stage == 1 else train.bytes_per_element)


def fits(estimate: MemoryEstimate, device: DeviceProfile) -> str | None:
    """None when the estimate fits the device, else the reason with both numbers."""
    if estimate.total <= device.memory_bytes:
        return None
    return (f"out of memory (predicted): stage {estimate.stage} needs {estimate.total / 1e9:.2f} GB > "
            f"{device.name} {device.memory_gb:g} GB (weights {estimate.weights / 1e9:.2f}, grads "
            f"{estimate.gradients / 1e9:.2f}, optimizer {estimate.optimizer / 1e9:.2f}, activations "
            f"{estimate.activations / 1e9:.2f} GB)")
