"""A user changes DP size, micro batch or gradient accumulation at a checkpoint: the data position
converts so the global sample order continues exactly; inconsistent per-rank positions are refused."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpoint.state.data_position import (DataPosition, DataPositionError, convert_position, first_difference,
                                            from_global_counts, from_per_rank_counts)
from checkpoint.state.faults import reset_rng, shift_data
from checkpoint.state.rng import derive_rng_state, fingerprint, roles
from checkpoint.state.training_state import convert_client_state, convert_model_state
from migrate.workload.data import SamplerState, global_batch_indices, rank_micro_batches


def test_inconsistent_per_rank_positions_are_refused_naming_ranks():
    with pytest.raises(DataPositionError, match=r"ranks \[0, 1, 3\] at 24; ranks \[2\] at 36"):
        from_global_counts({0: 24, 1: 24, 2: 36, 3: 24}, global_batch_size=12, micro_batch_size=1, dp=4)
    with pytest.raises(DataPositionError, match=r"saved for DP ranks \[0, 1\], expected 0..3"):
        from_global_counts({0: 24, 1: 24}, global_batch_size=12, micro_batch_size=1, dp=4)
    with pytest.raises(DataPositionError, match="yielded different numbers"):
        from_per_rank_counts({0: 6, 1: 9}, global_batch_size=12, micro_batch_size=1, dp=2)
    with pytest.raises(DataPositionError, match="mid-step"):
        DataPosition(consumed_samples=30, global_batch_size=12, micro_batch_size=1, dp=4)


def test_per_rank_loader_counts_convert_through_the_global_count():
    pos = from_per_rank_counts({r: 9 for r in range(4)}, global_batch_size=12, micro_batch_size=1, dp=4)
    assert pos.consumed_samples == 36 and pos.step == 3
    target = convert_position(pos, dp=3).target
    assert target.per_rank_samples() == [12, 12, 12] and target.grad_accumulation == 4


def test_global_batch_change_is_refused():
    pos = DataPosition(consumed_samples=24, global_batch_size=12, micro_batch_size=1, dp=4)
    with pytest.raises(DataPositionError, match="global batch size changes from 12 to 24"):
        convert_position(pos, dp=2, global_batch_size=24)
    with pytest.raises(DataPositionError, match=r"micro_batch_size\(5\) \* dp\(2\)"):
        convert_position(pos, dp=2, micro_batch_size=5)


@given(src_dp=st.sampled_from([1, 2, 3, 4, 6]), dst_dp=st.sampled_from([1, 2, 3, 4, 6]),
       src_mbs=st.sampled_from([1, 2]), dst_mbs=st.sampled_from([1, 2]), step=st.integers(0, 700))
def test_after_conversion_the_next_global_batch_is_the_sources(src_dp, dst_dp, src_mbs, dst_mbs, step):
    gbs = 24
    pos = DataPosition(consumed_samples=step * gbs, global_batch_size=gbs, micro_batch_size=src_mbs, dp=src_dp)
    target = convert_position(pos, dp=dst_dp, micro_batch_size=dst_mbs).target
    sampler = SamplerState(seed=5, dataset_size=1000, global_batch_size=gbs)
    src_next = global_batch_indices(sampler.advance(pos.step))
    dst_next = global_batch_indices(sampler.advance(target.step))
    got = [i for r in range(dst_dp) for mb in rank_micro_batches(dst_next, r, dst_dp, dst_mbs) for i in mb]
    assert got == list(src_next)  # every sample of the next step exactly once, in the source's order


def _client(dp=4, consumed=36):
    return {"sampler": {"seed": 1234, "dataset_size": 4096, "global_batch_size": 12, "consumed_samples": consumed,
                        "epoch": 0}, "step": consumed // 12, "consumed_tokens": consumed * 32,
            "data": {"micro_batch_size": 1, "dp": dp, "consumed_samples_per_rank": [consumed] * dp},
            "rng": [derive_rng_state(seed=1234, step=0, role=r) for r in roles(dp=dp)],
            "roles": [r.as_dict() for r in roles(dp=dp)]}


def test_client_state_conversion_reports_policy_and_reason_per_state():
    out, report = convert_client_state(_client(), roles(dp=3), micro_batch_size=2)
    assert out["data"] == {"micro_batch_size": 2, "dp": 3, "consumed_samples_per_rank": [36, 36, 36]}
    assert out["sampler"] == _client()["sampler"] and len(out["rng"]) == 3
    states = {e.state: e for e in report}
    assert states["data position"].policy == "global order continued"
    assert "mbs 2 x dp 3 x grad accumulation 2" in states["data position"].reason
    assert [states[f"rng rank {r} (dp{r}/3 tp0/1 pp0/1 ep0/1)"].policy for r in range(3)] == ["carry"] * 3
    model_state, report = convert_model_state({"migrate": _client(), "lr_scheduler": {"last_step": 3},
                                               "global_steps": 3}, roles(dp=2))
    assert {e.state: e.policy for e in report}["lr_scheduler"] == "carry"
    assert model_state["global_steps"] == 3


def test_inconsistent_saved_positions_refuse_the_conversion():
    client = _client()
    client["data"]["consumed_samples_per_rank"] = [36, 36, 48, 36]
    with pytest.raises(DataPositionError, match=r"ranks \[2\] at 48"):
        convert_client_state(client, roles(dp=2))


def test_fault_hooks_shift_data_and_reset_rng():
    shifted = shift_data(_client(), 1)
    assert shifted["sampler"]["consumed_samples"] == 48 and shifted["step"] == 3
    reset = reset_rng(_client())
    assert {fingerprint(s) for s in reset["rng"]} != {fingerprint(s) for s in _client()["rng"]}
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 1
    assert first_difference([[1, 2]], [[1, 2]]) is None


def test_state_saved_before_data_and_rng_fields_still_converts():
    old = {"sampler": _client()["sampler"], "step": 3}
    out, report = convert_client_state(old, roles(dp=2))
    assert out["data"]["consumed_samples_per_rank"] == [36, 36]
    assert {e.state: e.policy for e in report}["rng"] == "absent"
