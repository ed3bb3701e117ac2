"""A user converts a checkpoint's per-rank RNG states to another layout: each target rank carries the
state of the source rank with its role bit-exactly, copies a DP peer's when DP streams are identical, or
gets one derived from (seed, step, coordinates), distinct per TP rank where Megatron needs it."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from checkpoint.state.rng import (RankRole, capture_rng_state, derive_rng_state, fingerprint, plan_rng,
                                  restore_rng_state, roles)


def _state(seed, trackers=()):
    role = RankRole(rank=0, dp=0)
    like = {"trackers": {name: torch.Generator().manual_seed(1).get_state().numpy().tobytes().hex()
                         for name in trackers}}
    return derive_rng_state(seed=seed, step=0, role=role, like=like)


def test_capture_restore_round_trip_is_bit_exact():
    before = capture_rng_state()
    try:
        restore_rng_state(_state(7))
        saved = capture_rng_state()
        expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
        random.random(), np.random.rand(), torch.rand(())  # move every stream on
        restore_rng_state(saved)
        assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
        restore_rng_state(saved)
        assert fingerprint(capture_rng_state()) == fingerprint(saved)
    finally:
        restore_rng_state(before)


def test_roles_follow_megatron_order():
    rs = roles(tp=2, pp=2, dp=2)
    assert [(r.tp, r.dp, r.pp) for r in rs] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0),
                                                (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    with pytest.raises(Exception, match=r"dp\(3\) is not divisible by ep\(2\)"):
        roles(dp=3, ep=2)


def test_dp_shrink_carries_same_role_states_bit_exactly():
    src = [_state(100 + r) for r in range(4)]  # distinct per DP rank: only exact roles may be carried
    states, decisions = plan_rng(src, roles(dp=4), roles(dp=2), seed=1, step=5)
    assert [d.policy for d in decisions] == ["carry", "carry"]
    assert [d.source_rank for d in decisions] == [0, 1]
    assert states == src[:2]


def test_dp_grow_replicates_identical_peers_else_derives():
    same = [_state(9)] * 2
    states, decisions = plan_rng(same, roles(dp=2), roles(dp=4), seed=1, step=5)
    assert [d.policy for d in decisions] == ["carry", "carry", "replicate", "replicate"]
    assert all(s == same[0] for s in states)
    distinct = [_state(9), _state(10)]
    states, decisions = plan_rng(distinct, roles(dp=2), roles(dp=4), seed=1, step=5)
    assert [d.policy for d in decisions] == ["carry", "carry", "derive", "derive"]
    assert "hold 2 different states" in decisions[2].reason
    assert states[2] == states[3] == derive_rng_state(seed=1, step=5, role=roles(dp=4)[2], like=distinct[0])


def test_tp_change_derives_streams_distinct_per_tp_rank_identical_across_dp():
    src = [_state(3, trackers=("model-parallel-rng",)) for _ in range(2)]  # tp2 source
    states, decisions = plan_rng(src, roles(tp=2), roles(tp=4, dp=2), seed=1234, step=10)
    assert {d.policy for d in decisions} == {"derive"}
    assert "tp/pp/ep changed" in decisions[0].reason
    tracker = [s["trackers"]["model-parallel-rng"] for s in states]
    default = [s["torch"] for s in states]
    assert len(set(default)) == 1  # default generators identical across TP and DP
    assert len(set(tracker[:4])) == 4 and tracker[:4] == tracker[4:]  # distinct per TP rank, same per DP peer
    again, _ = plan_rng(src, roles(tp=2), roles(tp=4, dp=2), seed=1234, step=10)
    assert again == states  # deterministic
    later, _ = plan_rng(src, roles(tp=2), roles(tp=4, dp=2), seed=1234, step=11)
    assert later[0]["torch"] != states[0]["torch"]  # the step enters the derivation


def test_pp_stages_get_distinct_default_streams():
    a = derive_rng_state(seed=1, step=0, role=roles(pp=2)[0])
    b = derive_rng_state(seed=1, step=0, role=roles(pp=2)[1])
    assert a["torch"] != b["torch"] and a["python"] != b["python"]
