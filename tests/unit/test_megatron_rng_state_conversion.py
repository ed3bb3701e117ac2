"""A user's Megatron-LM RNG states (`rng_state` objects: Python, NumPy, torch, device generator and the
model-parallel tracker streams per (pp, tp), one per DP rank only when DP ranks differ) are read into
plain per-rank states, re-grouped for the target layout and written back in Megatron-LM's form,
bit-exactly and loadable with weights_only; derived streams follow Megatron's seeding rules."""
from __future__ import annotations

import io

import pytest
import torch

from checkpoint.errors import PlanError
from checkpoint.state.rng import (derive_rng_state, expand_megatron_rng, fingerprint, from_megatron,
                                  megatron_rng_objects, roles, to_megatron)

TRACKERS = ("data-parallel-rng", "expert-parallel-rng", "model-parallel-rng")


def _like(with_device: bool = False) -> dict:
    mt = torch.Generator().manual_seed(7).get_state()
    like = {"trackers": {name: mt.numpy().tobytes().hex() for name in TRACKERS}}
    if with_device:
        like["accelerator"] = [(123).to_bytes(8, "little").hex() + (0).to_bytes(8, "little").hex()]
    return like


def _state(seed: int, role, with_device: bool = False) -> dict:
    return derive_rng_state(seed=seed, step=3, role=role, like=_like(with_device))


@pytest.mark.parametrize("with_device", [False, True], ids=["cpu", "device"])
def test_megatron_form_round_trips_bit_exactly_through_weights_only_load(with_device):
    state = _state(5, roles(tp=2)[1], with_device)
    megatron = to_megatron(state)
    assert set(megatron) == {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} | (
        {"cuda_rng_state"} if with_device else set())
    buf = io.BytesIO()
    torch.save([[megatron]], buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)[0][0]
    assert from_megatron(loaded) == state
    assert fingerprint(from_megatron(loaded)) == fingerprint(state)


def test_objects_hold_one_state_per_pp_tp_unless_dp_ranks_differ():
    layout = roles(tp=2, pp=2, dp=2)
    same = [_state(1, layout[r.tp + 4 * r.pp]) for r in layout]  # each DP peer holds its dp0 peer's state
    objects = megatron_rng_objects(same, layout)
    assert sorted(objects) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(v) == 1 for v in objects.values())
    assert expand_megatron_rng(objects, layout) == same
    distinct = [_state(10 + r.dp, r) for r in layout]  # e.g. data_parallel_random_init
    objects = megatron_rng_objects(distinct, layout)
    assert all(len(v) == 2 for v in objects.values())
    assert expand_megatron_rng(objects, layout) == distinct


def test_a_state_list_of_another_dp_size_is_refused_by_name():
    objects = {(0, 0): [_state(1, r) for r in roles(dp=3)]}
    with pytest.raises(PlanError, match=r"pp 0 tp 0 holds 3 RNG states, neither 1 nor dp\(2\)"):
        expand_megatron_rng(objects, roles(dp=2))
    with pytest.raises(PlanError, match=r"no RNG state for pp 0 tp 1"):
        expand_megatron_rng({(0, 0): objects[(0, 0)][:1]}, roles(tp=2))


def test_derived_tracker_streams_follow_megatron_seeding():
    layout = roles(tp=2, pp=2, dp=2)
    states = {r.rank: derive_rng_state(seed=1, step=4, role=r, like=_like()) for r in layout}
    def stream(rank, name):
        return states[rank]["trackers"][name]
    # model-parallel: distinct per TP rank, identical across DP; data-parallel: identical across TP and DP
    assert stream(0, "model-parallel-rng") != stream(1, "model-parallel-rng")
    assert stream(0, "model-parallel-rng") == stream(2, "model-parallel-rng")
    assert stream(0, "data-parallel-rng") == stream(1, "data-parallel-rng") == stream(3, "data-parallel-rng")
    # every stream distinct across PP stages
    assert all(stream(0, n) != stream(4, n) for n in TRACKERS)
