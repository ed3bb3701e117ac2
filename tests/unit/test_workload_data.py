"""The training data: deterministic from its seed, and the same global order at any DP size."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from migrate.workload.data import (SamplerState, TokenDataset, epoch_permutation, global_batch_indices,
                                   rank_micro_batches)


def test_dataset_is_a_pure_function_of_seed_and_index():
    a = TokenDataset(seed=7, size=64, seq_length=16, vocab_size=50)
    b = TokenDataset(seed=7, size=64, seq_length=16, vocab_size=50)
    c = TokenDataset(seed=8, size=64, seq_length=16, vocab_size=50)
    assert np.array_equal(a.sample(5), b.sample(5))
    assert not np.array_equal(a.sample(5), c.sample(5))
    tokens, labels = a.batch(np.array([3, 9]))
    assert tokens.shape == (2, 16) and labels.shape == (2, 16)
    assert (tokens[:, 1:] == labels[:, :-1]).all()
    assert int(tokens.max()) < 50 and int(tokens.min()) >= 0


def test_dataset_follows_its_successor_table_mostly():
    data = TokenDataset(seed=1, size=8, seq_length=200, vocab_size=30)
    table = data.successors()
    tokens = data.sample(0)
    follows = np.mean(table[tokens[:-1]] == tokens[1:])
    assert 0.8 < follows < 0.98


def test_dataset_rejects_out_of_range_index():
    with pytest.raises(IndexError, match="index 10 outside"):
        TokenDataset(seed=1, size=10, seq_length=4, vocab_size=8).sample(10)


def test_sampler_walks_epochs_and_drops_the_incomplete_last_batch():
    state = SamplerState(seed=3, dataset_size=10, global_batch_size=4)
    assert state.samples_per_epoch == 8
    seen = []
    for _ in range(2):
        seen.extend(global_batch_indices(state).tolist())
        state = state.advance()
    assert state.epoch == 1 and state.consumed_samples == 8
    assert sorted(seen) == sorted(epoch_permutation(3, 0, 10)[:8].tolist())
    assert global_batch_indices(state).tolist() == epoch_permutation(3, 1, 10)[:4].tolist()


def test_sampler_state_round_trips_and_validates():
    state = SamplerState(seed=3, dataset_size=100, global_batch_size=8).advance(5)
    assert SamplerState.from_state_dict(state.state_dict()) == state
    with pytest.raises(ValueError, match=r"epoch\(1\) != consumed_samples\(8\)"):
        SamplerState(seed=3, dataset_size=100, global_batch_size=8, consumed_samples=8, epoch=1)
    with pytest.raises(ValueError, match="unexpected|expected"):
        SamplerState.from_state_dict({"seed": 1})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), steps=st.integers(0, 40), mbs=st.sampled_from([1, 2, 4]),
       dp_a=st.sampled_from([1, 2, 4, 8]), dp_b=st.sampled_from([1, 2, 4, 8]), dataset_size=st.integers(16, 200))
def test_global_batch_is_the_same_for_any_dp_size(seed, steps, mbs, dp_a, dp_b, dataset_size):
    gbs = 16
    state = SamplerState(seed=seed, dataset_size=dataset_size, global_batch_size=gbs).advance(steps)
    indices = global_batch_indices(state)
    assert len(indices) == gbs
    for dp in (dp_a, dp_b):
        if gbs % (dp * mbs):
            continue
        joined = np.concatenate([mb for r in range(dp) for mb in rank_micro_batches(indices, r, dp, mbs)])
        assert np.array_equal(joined, indices)
        assert all(len(mb) == mbs for mb in rank_micro_batches(indices, 0, dp, mbs))


def test_micro_batch_split_names_the_numbers_when_it_does_not_divide():
    with pytest.raises(ValueError, match=r"dp\(3\) \* micro_batch_size\(2\) = 6"):
        rank_micro_batches(np.arange(8), 0, 3, 2)
