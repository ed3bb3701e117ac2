"""Step-time cost model: one term per effect, each scaled by a factor fitted to measured steps.

Terms (seconds per optimizer step on the slowest rank):

* ``compute``: matmul and attention FLOPs of the steady micro-batches at the device's peak;
* ``bubble``: the pipeline fill/drain, (pp - 1) / vpp micro-batch slots of the slowest stage;
* ``overhead_megatron``, ``overhead_deepspeed``: a fixed launch/dispatch cost per layer and
  micro-batch slot, one term per engine (their Python paths differ, and calibration must be
  able to learn that from a measurement of each);
* ``tp_comm``, ``cp_comm``, ``ep_comm``, ``pp_comm``: tensor/context/expert-parallel
  collectives and pipeline sends on the critical path;
* data-parallel synchronisation, one term per collective pattern, the part not hidden behind
  backward when ``overlap_grad_reduce`` is on: ``dp_allreduce`` (unsharded gradients, once per
  step), ``dp_reduce_scatter`` (sharded gradients: once per step for the distributed optimizer
  and ZeRO-1, once per micro-batch for ZeRO-2/3, which reduce during every backward),
  ``dp_allgather`` (updated parameters after a sharded step) and ``zero3_gather`` (ZeRO-3's
  parameter gathers in forward and backward of every micro-batch);
* ``optimizer``: the optimizer step as a memory-bound pass over the rank's state.

``predict(terms, calibration)`` is the sum of ``factor * term``; :func:`fit_calibration`
fits the factors to measured step times (relative least squares, ridge towards the prior of
1, factors kept positive), so that every measurement sharpens the next ranking. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence

import numpy as np

from checkpoint.layout import OptimizerSharding
from checkpoint.model_shape import ModelShape
from parallel_search.memory import stage_params, state_bytes
from parallel_search.profiles import DeviceProfile
from parallel_search.space import Candidate
from parallel_search.spec import ClusterShape, TrainingShape

TERMS = ("compute", "bubble", "overhead_megatron", "overhead_deepspeed", "tp_comm", "cp_comm", "ep_comm", "pp_comm",
         "dp_allreduce", "dp_reduce_scatter", "dp_allgather", "zero3_gather", "optimizer")
DP_TERMS = ("dp_allreduce", "dp_reduce_scatter", "dp_allgather", "zero3_gather")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostOptions:
    """Engine behaviour the terms depend on."""

    overlap_grad_reduce: bool = False
    flash_attention: bool | None = None  # None: on for accelerators, off on the CPU


@dataclass(frozen=True, kw_only=True, slots=True)
class CostTerms:
    """Uncalibrated seconds per step for each term, plus the model FLOPs of one step."""

    seconds: Mapping[str, float]
    model_flops: float

    def vector(self) -> np.ndarray:
        return np.array([self.seconds[t] for t in TERMS], dtype=np.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """One factor per term (1.0: trust the analytic term as is) and the measurements behind them."""

    factors: Mapping[str, float] = field(default_factory=lambda: {t: 1.0 for t in TERMS})
    samples: int = 0
    fit_error: float | None = None  # mean relative error of the fitted model on its samples

    def to_dict(self) -> dict[str, object]:
        return {"factors": dict(self.factors), "samples": self.samples, "fit_error": self.fit_error}


def _ring_time(bytes_: float, ranks: int, bw_gbps: float, latency_us: float, factor: float) -> float:
    """One collective over ``ranks``: factor * bytes / bandwidth + per-hop latency."""
    if ranks <= 1 or bytes_ <= 0:
        return 0.0
    return factor * bytes_ / (bw_gbps * 1e9) + (ranks - 1) * latency_us * 1e-6


def _bandwidth(device: DeviceProfile, cluster: ClusterShape, span: int) -> float:
    """Link bandwidth for a group whose ranks spread over ``span`` consecutive ranks."""
    return device.intra_node_bandwidth_gbps if span <= cluster.per_node else device.inter_node_bandwidth_gbps


def flops_per_token(model: ModelShape) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention scores,
    attention counted causal (half the s x s products), as MFU is usually defined."""
    h, s = model.hidden_size, model.seq_length
    experts = model.moe_top_k if model.is_moe else 1
    per_layer = 2 * (model.attention_params_per_layer + experts * model.ffn_params_per_expert) + 2 * s * h
    return 3.0 * (model.num_layers * per_layer + 2 * h * model.vocab_size)


def stage_flops(model: ModelShape, cand: Candidate, last: bool, causal: bool) -> float:
    """Forward FLOPs of one micro-batch on one rank of a stage (after TP/CP/EP splits)."""
    lay = cand.layout
    b, s_full = cand.micro_batch_size, model.seq_length
    tokens = b * s_full / lay.cp
    routed = model.moe_top_k if model.is_moe else 1
    layer_matmul = 2 * tokens * (model.attention_params_per_layer + routed * model.ffn_params_per_expert) / lay.tp
    attention = 2 * 2 * tokens * s_full * model.hidden_size / lay.tp * (0.5 if causal else 1.0)
    layers = model.num_layers / lay.pp
    flops = layers * (layer_matmul + attention)
    if last:
        flops += 2 * tokens * model.hidden_size * model.padded_vocab_size(lay.tp) / lay.tp
    return flops


def cost_terms(model: ModelShape, train: TrainingShape, cluster: ClusterShape, cand: Candidate,
               device: DeviceProfile, options: CostOptions = CostOptions()) -> CostTerms:
    """Uncalibrated per-term seconds for one optimizer step of ``cand``."""
    lay = cand.layout
    flash = device.device_type != "cpu" if options.flash_attention is None else options.flash_attention
    m = cand.num_microbatches(train.global_batch_size)
    dtype = train.precision
    peak = device.peak_flops(dtype)
    fwd = max(stage_flops(model, cand, last=True, causal=flash), stage_flops(model, cand, last=False, causal=flash))
    passes = 3.0 + (1.0 if cand.recompute == "full" else 0.0)
    mb_compute = fwd * passes / peak
    if cand.recompute == "selective" and not flash:
        mb_compute += 2 * 2 * cand.micro_batch_size * model.seq_length ** 2 / lay.cp * model.hidden_size / lay.tp \
            * model.num_layers / lay.pp / peak
    slots = (lay.pp - 1) / lay.vpp
    layers = model.num_layers / lay.pp
    per_mb_overhead = layers * device.layer_overhead_us * 1e-6
    e = train.bytes_per_element
    tokens = cand.micro_batch_size * model.seq_length / lay.cp
    lat = device.collective_latency_us
    # Tensor parallel: 2 all-reduces forward, 2 backward per layer (sequence parallel: all-gather +
    # reduce-scatter, the same bytes on the wire).
    tp_bw = _bandwidth(device, cluster, lay.tp)
    tp_one = _ring_time(tokens * model.hidden_size * e, lay.tp, tp_bw, lat, 2 * (lay.tp - 1) / max(lay.tp, 1))
    tp_mb = 4 * layers * tp_one
    # Context parallel: ring exchange of K and V ((cp - 1) steps forward, twice that backward).
    cp_bw = _bandwidth(device, cluster, lay.tp * lay.cp)
    kv_bytes = 2 * tokens * model.kv_size / lay.tp * e
    cp_mb = 3 * layers * (lay.cp - 1) * _ring_time(kv_bytes, 2, cp_bw, lat, 1.0)
    # Expert parallel: dispatch and combine all-to-all, forward and backward.
    ep_mb = 0.0
    if model.is_moe and lay.ep > 1:
        ep_bw = _bandwidth(device, cluster, lay.tp * lay.cp * lay.ep)
        a2a = tokens * model.moe_top_k * model.hidden_size * e
        ep_mb = 4 * layers * _ring_time(a2a, lay.ep, ep_bw, lat, (lay.ep - 1) / lay.ep)
    # Pipeline: activation forward and gradient backward per micro-batch and chunk boundary.
    pp_mb = 0.0
    if lay.pp > 1:
        pp_bw = _bandwidth(device, cluster, lay.tp * lay.cp * lay.dp * 2)
        act = tokens * model.hidden_size * e / (lay.tp if cand.sequence_parallel else 1)
        pp_mb = 2 * lay.vpp * _ring_time(act, 2, pp_bw, lat, 1.0)
    # Data parallel gradient sync (dense over dp * cp, experts over expert-dp).
    dense, experts = stage_params(model, cand, 0)
    dense_last, experts_last = stage_params(model, cand, lay.pp - 1)
    dense, experts = max(dense, dense_last), max(experts, experts_last)
    dp_ranks = lay.dp * lay.cp
    expert_dp = max(dp_ranks // lay.ep, 1)
    dp_bw = _bandwidth(device, cluster, lay.tp * lay.cp * lay.dp)
    grad_b = 4.0 if cand.framework == "megatron" else float(e)
    sharded = lay.sharding is not OptimizerSharding.NONE
    # ZeRO-2/3 reduce-scatter during every micro-batch's backward; the others once per step.
    reductions = m if lay.zero_stage >= 2 else 1
    dp = dict.fromkeys(DP_TERMS, 0.0)
    for params, ranks in ((dense, dp_ranks), (experts, expert_dp)):
        if ranks <= 1 or params <= 0:
            continue
        if sharded:  # reduce-scatter gradients, all-gather updated parameters
            dp["dp_reduce_scatter"] += reductions * _ring_time(params * grad_b, ranks, dp_bw, lat, (ranks - 1) / ranks)
            dp["dp_allgather"] += _ring_time(params * e, ranks, dp_bw, lat, (ranks - 1) / ranks)
        else:
            dp["dp_allreduce"] += _ring_time(params * grad_b, ranks, dp_bw, lat, 2 * (ranks - 1) / ranks)
        if lay.zero_stage >= 3:  # parameters gathered in forward and backward of every micro-batch
            dp["zero3_gather"] += 2 * m * _ring_time(params * e, ranks, dp_bw, lat, (ranks - 1) / ranks)
    if options.overlap_grad_reduce:  # gradient reduction hides behind two thirds of the backward
        hideable = dp["dp_allreduce"] + dp["dp_reduce_scatter"]
        if hideable > 0:
            exposed = max(0.0, hideable - 2.0 / 3.0 * mb_compute) / hideable
            dp["dp_allreduce"] *= exposed
            dp["dp_reduce_scatter"] *= exposed
    weights, gradients, optimizer = state_bytes(train, cand, dense, experts)
    opt_time = (2 * optimizer + weights + gradients) / (device.memory_bandwidth_gbps * 1e9)
    seconds = {
        "compute": m * mb_compute,
        "bubble": slots * mb_compute,
        "overhead_megatron": (m + slots) * per_mb_overhead if cand.framework == "megatron" else 0.0,
        "overhead_deepspeed": (m + slots) * per_mb_overhead if cand.framework == "deepspeed" else 0.0,
        "tp_comm": (m + slots) * tp_mb,
        "cp_comm": (m + slots) * cp_mb,
        "ep_comm": (m + slots) * ep_mb,
        "pp_comm": (m + slots) * pp_mb if lay.pp > 1 else 0.0,
        **dp,
        "optimizer": opt_time,
    }
    flops = flops_per_token(model) * train.global_batch_size * model.seq_length
    return CostTerms(seconds=seconds, model_flops=flops)


def predict(terms: CostTerms, calibration: Calibration = Calibration()) -> float:
    """Calibrated seconds per step."""
    return float(sum(calibration.factors.get(t, 1.0) * terms.seconds[t] for t in TERMS))


def mfu(model_flops: float, step_time_s: float, world_size: int, device: DeviceProfile, dtype: str) -> float:
    """Model FLOPs utilisation: model FLOPs per second over the cluster's peak in ``dtype``."""
    return model_flops / step_time_s / (world_size * device.peak_flops(dtype))


def fit_calibration(samples: Sequence[tuple[CostTerms, float]], ridge: float = 0.05,
                    bounds: tuple[float, float] = (0.02, 200.0)) -> Calibration:
    """Factors minimising sum(((pred - measured) / measured)^2) + ridge * sum(share_j * (factor_j - 1)^2),
    share_j being term j's mean squared share of the measured step times.

    Terms absent from every sample keep 1.0. Factors are clipped to ``bounds`` and the free
    ones re-solved (a small active-set loop), so every factor stays positive.
    """
    if not samples:
        return Calibration()
    x = np.array([t.vector() / y for t, y in samples])  # relative: each row in units of its step time
    target = np.ones(len(samples))
    k = len(TERMS)
    fixed: dict[int, float] = {j: 1.0 for j in range(k) if x[:, j].max() <= 0}
    factors = np.ones(k)
    for _ in range(k + 1):
        free = [j for j in range(k) if j not in fixed]
        rhs = target - sum((x[:, j] * v for j, v in fixed.items()), np.zeros(len(samples)))
        a = x[:, free]
        # Ridge on each term's share of the step (not on the bare factor): a term worth 2% of the step
        # may grow 20x when the measurements ask for it, a dominant one is held close to its prior.
        weight = ridge * np.maximum(np.mean(a ** 2, axis=0), 1e-6)
        solved = np.linalg.solve(a.T @ a + np.diag(weight), a.T @ rhs + weight)
        factors[free] = solved
        out = [(j, v) for j, v in zip(free, solved) if not bounds[0] <= v <= bounds[1]]
        if not out:
            break
        for j, v in out:
            fixed[j] = float(np.clip(v, *bounds))
    for j, v in fixed.items():
        factors[j] = v
    fitted = {t: float(factors[i]) for i, t in enumerate(TERMS)}
    calibration = Calibration(factors=fitted, samples=len(samples))
    errors = [abs(predict(t, calibration) - y) / y for t, y in samples]
    return Calibration(factors=fitted, samples=len(samples), fit_error=float(np.mean(errors)))
