"""The candidate space: framework divisibility rules, every invalid candidate with its reasons."""
from __future__ import annotations

from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from parallel_search.space import Candidate, SpaceOptions, candidate_problems, enumerate_space
from parallel_search.spec import ClusterShape, TrainingShape

LLAMA70B = ModelShape(architecture="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, vocab_size=128256, seq_length=4096, make_vocab_size_divisible_by=128)
TINY_MOE = ModelShape(architecture="mixtral", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, vocab_size=128, seq_length=32, num_experts=4, moe_top_k=2,
                      make_vocab_size_divisible_by=128)


def test_every_valid_candidate_obeys_the_rules_and_covers_the_world():
    space = enumerate_space(LLAMA70B, TrainingShape(global_batch_size=1024), ClusterShape(device_count=512, devices_per_node=8))
    assert space.valid and space.rejected
    for cand in space.valid:
        lay = cand.layout
        assert lay.world_size == 512 and lay.tp <= 8 and 8 % lay.tp == 0
        assert 80 % (lay.pp * lay.vpp) == 0
        assert 1024 % (cand.micro_batch_size * lay.dp) == 0
    keys = [c.key for c in space.valid]
    assert len(keys) == len(set(keys))


def test_rejected_candidates_keep_every_reason():
    cand = Candidate(framework="megatron", layout=ParallelLayout(tp=16, pp=3, dp=2), micro_batch_size=3)
    problems = candidate_problems(LLAMA70B, TrainingShape(global_batch_size=1024),
                                  ClusterShape(device_count=96, devices_per_node=8), cand)
    text = "\n".join(problems)
    assert "tp across nodes: tp(16) > devices per node (8)" in text
    assert "tp(16) does not divide num_query_groups(8)" in text
    assert "pp(3) * vpp(1) = 3 does not divide num_layers(80)" in text
    assert "micro_batch_size(3) * dp(2) = 6" in text


def test_deepspeed_candidates_are_data_parallel_only():
    train, cluster = TrainingShape(global_batch_size=16), ClusterShape(device_count=4, devices_per_node=4)
    space = enumerate_space(TINY_MOE, train, cluster, SpaceOptions(recompute=("none",)))
    for cand in space.valid:
        if cand.framework == "deepspeed":
            assert (cand.layout.tp, cand.layout.pp, cand.layout.ep, cand.layout.cp) == (1, 1, 1, 1)
    reasons = {r for item in space.rejected for r in item.reasons}
    assert any(r.startswith("deepspeed is data parallel") for r in reasons)


def test_moe_space_has_expert_parallel_candidates_and_dense_has_none():
    train, cluster = TrainingShape(global_batch_size=16), ClusterShape(device_count=4, devices_per_node=4)
    moe = enumerate_space(TINY_MOE, train, cluster, SpaceOptions(recompute=("none",)))
    assert {c.layout.ep for c in moe.valid} == {1, 2, 4}
    dense = ModelShape(architecture="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128, seq_length=32, make_vocab_size_divisible_by=128)
    assert {c.layout.ep for c in enumerate_space(dense, train, cluster).valid} == {1}


def test_sharding_over_a_single_rank_is_reported_as_redundant():
    cand = Candidate(framework="megatron", layout=ParallelLayout(tp=4, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER),
                     micro_batch_size=1, sequence_parallel=True)
    cluster = ClusterShape(device_count=4, devices_per_node=4)
    problems = candidate_problems(TINY_MOE, TrainingShape(global_batch_size=8), cluster, cand)
    assert any("shards nothing" in p for p in problems)


def test_candidate_round_trips_through_its_dict():
    cand = Candidate(framework="megatron", layout=ParallelLayout(tp=2, pp=2, vpp=2, dp=2), micro_batch_size=2,
                     recompute="selective", sequence_parallel=True)
    assert Candidate.from_dict(cand.to_dict()) == cand
