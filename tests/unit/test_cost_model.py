"""The cost model: terms respond to the layout as physics says; calibration fits measured times."""
from __future__ import annotations

import random

import pytest

from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from parallel_search.cost import TERMS, Calibration, CostOptions, cost_terms, fit_calibration, mfu, predict
from parallel_search.profiles import load_profile
from parallel_search.space import Candidate, SpaceOptions, enumerate_space
from parallel_search.spec import ClusterShape, TrainingShape

LLAMA70B = ModelShape(architecture="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, vocab_size=128256, seq_length=4096, make_vocab_size_divisible_by=128)
TRAIN = TrainingShape(global_batch_size=1024)
CLUSTER = ClusterShape(device_count=512, devices_per_node=8)
NPU = load_profile("ascend-910b")


def terms(**kw):
    mbs = kw.pop("mbs", 1)
    c = Candidate(framework="megatron", layout=ParallelLayout(sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER, **kw),
                  micro_batch_size=mbs, sequence_parallel=kw.get("tp", 1) > 1)
    return cost_terms(LLAMA70B, TRAIN, CLUSTER, c, NPU)


def test_pipeline_bubble_shrinks_with_virtual_stages():
    plain, interleaved = terms(tp=8, pp=8, dp=8), terms(tp=8, pp=8, vpp=5, dp=8)
    assert interleaved.seconds["bubble"] == pytest.approx(plain.seconds["bubble"] / 5)
    assert terms(tp=8, pp=1, dp=64).seconds["bubble"] == 0


def test_tp_across_the_slower_link_costs_more():
    inside = ClusterShape(device_count=512, devices_per_node=8)
    outside = ClusterShape(device_count=512, devices_per_node=4)
    c = Candidate(framework="megatron", layout=ParallelLayout(tp=8, pp=8, dp=8), micro_batch_size=1)
    fast = cost_terms(LLAMA70B, TRAIN, inside, c, NPU).seconds["tp_comm"]
    slow = cost_terms(LLAMA70B, TRAIN, outside, c, NPU).seconds["tp_comm"]
    assert slow > 5 * fast


def test_compute_per_step_is_model_flops_at_peak():
    t = terms(tp=1, pp=1, dp=512)
    ideal = t.model_flops / (512 * NPU.peak_flops("bf16"))
    assert t.seconds["compute"] == pytest.approx(ideal, rel=0.1)
    assert mfu(t.model_flops, predict(t), 512, NPU, "bf16") <= 1.0


def test_overlap_hides_gradient_sync():
    c = Candidate(framework="megatron", layout=ParallelLayout(tp=8, pp=8, dp=8), micro_batch_size=1)
    exposed = cost_terms(LLAMA70B, TRAIN, CLUSTER, c, NPU).seconds["dp_allreduce"]
    hidden = cost_terms(LLAMA70B, TRAIN, CLUSTER, c, NPU, CostOptions(overlap_grad_reduce=True)).seconds["dp_allreduce"]
    assert 0 <= hidden < exposed


def test_zero2_and_zero3_reduce_every_micro_batch_zero1_once_per_step():
    """DeepSpeed ZeRO-2/3 reduce-scatter gradients in every micro-batch's backward, ZeRO-1 and the
    distributed optimizer once per step: with gradient accumulation the former cost m times more."""
    def rs(sharding, mbs):
        c = Candidate(framework="deepspeed", layout=ParallelLayout(tp=1, pp=1, dp=64, sharding=sharding),
                      micro_batch_size=mbs)
        return cost_terms(LLAMA70B, TRAIN, ClusterShape(device_count=64, devices_per_node=8), c, NPU).seconds

    m1, m4 = TRAIN.global_batch_size // 64, TRAIN.global_batch_size // (64 * 4)
    assert rs("zero1", 1)["dp_reduce_scatter"] == pytest.approx(rs("zero1", 4)["dp_reduce_scatter"])
    assert rs("zero2", 1)["dp_reduce_scatter"] == pytest.approx(rs("zero2", 4)["dp_reduce_scatter"] * m1 / m4)
    assert rs("zero3", 1)["zero3_gather"] > 0 == rs("zero2", 1)["zero3_gather"]
    assert rs("zero1", 1)["dp_allreduce"] == 0 < rs("none", 1)["dp_allreduce"]


def test_calibration_recovers_hidden_factors_and_improves_ranking():
    """Synthetic truth = analytic terms scaled by unknown factors; after fitting on a few samples the
    calibrated model predicts the others within a few percent (the uncalibrated one does not)."""
    model = ModelShape(architecture="llama", num_layers=8, hidden_size=1024, ffn_hidden_size=2816,
                       num_attention_heads=16, num_query_groups=8, vocab_size=32000, seq_length=2048,
                       make_vocab_size_divisible_by=128)
    train, device = TrainingShape(global_batch_size=64), load_profile("h100")
    cluster = ClusterShape(device_count=16, devices_per_node=8)
    space = enumerate_space(model, train, cluster, SpaceOptions(frameworks=("megatron",), recompute=("none",)))
    all_terms = [cost_terms(model, train, cluster, c, device) for c in space.valid]
    truth_factors = {t: 1.0 for t in TERMS} | {"compute": 1.6, "overhead_megatron": 3.0, "tp_comm": 1.4, "dp_allreduce": 0.7,
                                                "dp_reduce_scatter": 0.7, "dp_allgather": 0.7}
    truth = Calibration(factors=truth_factors)
    rng = random.Random(0)
    picked = rng.sample(range(len(all_terms)), 16)  # 9 free factors
    calibration = fit_calibration([(all_terms[i], predict(all_terms[i], truth)) for i in picked], ridge=1e-4)
    rest = [t for i, t in enumerate(all_terms) if i not in picked]
    raw = max(abs(predict(t) - predict(t, truth)) / predict(t, truth) for t in rest)
    fitted = max(abs(predict(t, calibration) - predict(t, truth)) / predict(t, truth) for t in rest)
    assert raw > 0.2
    assert fitted < 0.05
    assert calibration.fit_error is not None and calibration.fit_error < 0.02


def test_calibration_without_samples_is_the_prior_and_factors_stay_positive():
    assert Calibration().factors == fit_calibration([]).factors
    t = terms(tp=8, pp=8, dp=8)
    cal = fit_calibration([(t, predict(t) * 0.001)])
    assert all(v > 0 for v in cal.factors.values())
