"""Deterministic token data and a global-batch sampler whose order ignores the DP size.

The dataset is generated from a seed: sample `i` is a pure function of (seed, i), so every
rank builds the same data with no files. Tokens follow a fixed random successor table with
10% noise, which a tiny model learns within a few steps (the loss visibly falls).

The sample order is a pure function of (seed, epoch, consumed samples, global batch):
epoch `e` visits `permutation(seed, e)` in global batches of `global_batch_size`; a DP rank
takes its contiguous slice of each global batch and splits it into micro-batches, so the
concatenation of all ranks' micro-batches of a step is the global batch for any dp that
divides it. `SamplerState` is what a checkpoint stores.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

NOISE = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenDataset:
    """`size` samples of `seq_length + 1` token ids in [0, vocab_size), from `seed`."""

    seed: int
    size: int
    seq_length: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.seq_length < 1 or self.vocab_size < 2:
            raise ValueError(f"TokenDataset: size({self.size}) and seq_length({self.seq_length}) must be >= 1 "
                             f"and vocab_size({self.vocab_size}) >= 2")

    def successors(self) -> np.ndarray:
        """The fixed successor table the data follows (a permutation of the vocabulary)."""
        return np.random.default_rng([self.seed, 0x5EED]).permutation(self.vocab_size)

    def sample(self, index: int, successors: np.ndarray | None = None) -> np.ndarray:
        """Tokens of sample `index` (int64, length seq_length + 1); pure in (seed, index)."""
        if not 0 <= index < self.size:
            raise IndexError(f"TokenDataset: index {index} outside [0, {self.size})")
        table = self.successors() if successors is None else successors
        rng = np.random.default_rng([self.seed, 1, index])
        length = self.seq_length + 1
        noise = rng.random(length) < NOISE
        random_tokens = rng.integers(0, self.vocab_size, size=length)
        tokens = np.empty(length, dtype=np.int64)
        tokens[0] = random_tokens[0]
        for t in range(1, length):
            tokens[t] = random_tokens[t] if noise[t] else table[tokens[t - 1]]
        return tokens

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of shape (len(indices), seq_length); labels are inputs shifted by one."""
        table = self.successors()
        rows = np.stack([self.sample(int(i), table) for i in indices])
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    """Position in the global sample order; saved with every checkpoint.

    `consumed_samples` counts every sample consumed since the start of training (all
    epochs); `epoch` is derived from it and stored for readers and as a consistency check.
    """

    seed: int
    dataset_size: int
    global_batch_size: int
    consumed_samples: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.dataset_size < self.global_batch_size:
            raise ValueError(f"SamplerState: dataset_size({self.dataset_size}) must be >= "
                             f"global_batch_size({self.global_batch_size}) >= 1")
        if self.consumed_samples < 0 or self.consumed_samples % self.global_batch_size:
            raise ValueError(f"SamplerState: consumed_samples({self.consumed_samples}) is not a non-negative "
                             f"multiple of global_batch_size({self.global_batch_size})")
        expected = self.consumed_samples // self.samples_per_epoch
        if self.epoch != expected:
            raise ValueError(f"SamplerState: epoch({self.epoch}) != consumed_samples({self.consumed_samples}) // "
                             f"samples_per_epoch({self.samples_per_epoch}) = {expected}")

    @property
    def samples_per_epoch(self) -> int:
        """Samples visited per epoch: the incomplete last global batch is dropped."""
        return (self.dataset_size // self.global_batch_size) * self.global_batch_size

    @property
    def step(self) -> int:
        return self.consumed_samples // self.global_batch_size

    def advance(self, steps: int = 1) -> SamplerState:
        consumed = self.consumed_samples + steps * self.global_batch_size
        return replace(self, consumed_samples=consumed, epoch=consumed // self.samples_per_epoch)

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> SamplerState:
        """Inverse of state_dict; unknown or missing keys are errors that name them."""
        expected = {"seed", "dataset_size", "global_batch_size", "consumed_samples", "epoch"}
        if set(state) != expected:
            raise ValueError(f"sampler state keys {sorted(state)} != expected {sorted(expected)}")
        return cls(**{k: int(v) for k, v in state.items()})


def epoch_permutation(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """Order of the dataset in `epoch`; pure in (seed, epoch, dataset_size)."""
    return np.random.default_rng([seed, 2, epoch]).permutation(dataset_size)


def global_batch_indices(state: SamplerState) -> np.ndarray:
    """Dataset indices of the global batch that starts at `state.consumed_samples`."""
    offset = state.consumed_samples % state.samples_per_epoch
    order = epoch_permutation(state.seed, state.epoch, state.dataset_size)
    return order[offset: offset + state.global_batch_size]


def rank_micro_batches(global_indices: np.ndarray, dp_rank: int, dp_size: int,
                       micro_batch_size: int) -> list[np.ndarray]:
    """DP rank `dp_rank`'s micro-batches: its contiguous slice of the global batch, in order."""
    gbs = len(global_indices)
    if dp_size < 1 or gbs % (dp_size * micro_batch_size):
        raise ValueError(f"global batch of {gbs} samples is not divisible by dp({dp_size}) * "
                         f"micro_batch_size({micro_batch_size}) = {dp_size * micro_batch_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank({dp_rank}) outside [0, dp({dp_size}))")
    per_rank = gbs // dp_size
    mine = global_indices[dp_rank * per_rank: (dp_rank + 1) * per_rank]
    return [mine[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
