"""Where the dataloader stands, and its conversion to another DP size or micro-batch size (pure).

Frameworks keep the position in one of two ways: a global count of consumed samples held by
every rank (Megatron's `consumed_train_samples`, the built-in workloads' sampler state,
DeepSpeed's `global_samples`), or one count per DP rank of the samples that rank's sampler
yielded (torch `DistributedSampler` resumed by offset, torchdata `StatefulDataLoader`
`samples_yielded`). Both describe one point of the global sample order when they agree; they
are converted through the global count, so after a change of DP size, micro-batch size or
gradient accumulation that keeps the global batch, the next global batch is the very one the
source run would have drawn: no sample repeated, none skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from checkpoint.errors import PlanError


class DataPositionError(PlanError):
    """The saved data position is inconsistent across ranks or cannot be expressed at the target."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPosition:
    """A point of the global sample order: `consumed_samples` since the start, in global batches of
    `global_batch_size` = `micro_batch_size` * `dp` * gradient accumulation."""

    consumed_samples: int
    global_batch_size: int
    micro_batch_size: int
    dp: int

    def __post_init__(self) -> None:
        if min(self.global_batch_size, self.micro_batch_size, self.dp) < 1 or self.consumed_samples < 0:
            raise DataPositionError(f"data position: consumed_samples({self.consumed_samples}) must be >= 0 and "
                                    f"global_batch_size({self.global_batch_size}), micro_batch_size("
                                    f"{self.micro_batch_size}), dp({self.dp}) >= 1")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise DataPositionError(f"global_batch_size({self.global_batch_size}) is not a multiple of "
                                    f"micro_batch_size({self.micro_batch_size}) * dp({self.dp}) = "
                                    f"{self.micro_batch_size * self.dp}")
        if self.consumed_samples % self.global_batch_size:
            raise DataPositionError(f"consumed_samples({self.consumed_samples}) is not a multiple of "
                                    f"global_batch_size({self.global_batch_size}): the checkpoint is mid-step")

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def step(self) -> int:
        return self.consumed_samples // self.global_batch_size

    def per_rank_samples(self) -> list[int]:
        """Samples each DP rank's own sampler has yielded (a per-rank loader's position)."""
        return [self.consumed_samples // self.dp] * self.dp

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


def from_global_counts(counts: Mapping[int, int], *, global_batch_size: int, micro_batch_size: int,
                       dp: int, what: str = "consumed_samples") -> DataPosition:
    """The position from every rank's copy of a global count; ranks that disagree are refused."""
    _check_ranks(counts, dp, what)
    values = sorted(set(counts.values()))
    if len(values) != 1:
        by_value = {v: sorted(r for r, c in counts.items() if c == v) for v in values}
        raise DataPositionError(f"inconsistent data position: ranks disagree on {what}: "
                                + "; ".join(f"ranks {rs} at {v}" for v, rs in by_value.items()))
    return DataPosition(consumed_samples=values[0], global_batch_size=global_batch_size,
                        micro_batch_size=micro_batch_size, dp=dp)


def from_per_rank_counts(counts: Mapping[int, int], *, global_batch_size: int, micro_batch_size: int,
                         dp: int, what: str = "samples_yielded") -> DataPosition:
    """The position from per-DP-rank counts of yielded samples (each rank takes gbs/dp per step);
    every rank must be at the same step, else the checkpoint is refused."""
    _check_ranks(counts, dp, what)
    values = sorted(set(counts.values()))
    if len(values) != 1:
        by_value = {v: sorted(r for r, c in counts.items() if c == v) for v in values}
        raise DataPositionError(f"inconsistent data position: DP ranks yielded different numbers of samples ({what}): "
                                + "; ".join(f"ranks {rs} at {v}" for v, rs in by_value.items())
                                + f"; each rank takes global_batch_size({global_batch_size}) / dp({dp}) per step")
    return DataPosition(consumed_samples=values[0] * dp, global_batch_size=global_batch_size,
                        micro_batch_size=micro_batch_size, dp=dp)


def _check_ranks(counts: Mapping[int, int], dp: int, what: str) -> None:
    if sorted(counts) != list(range(dp)):
        raise DataPositionError(f"data position ({what}) is saved for DP ranks {sorted(counts)}, expected 0..{dp - 1}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PositionDecision:
    """The converted position and why it continues the source's global sample order."""

    source: DataPosition
    target: DataPosition
    reason: str


def convert_position(source: DataPosition, *, dp: int, micro_batch_size: int | None = None,
                     global_batch_size: int | None = None) -> PositionDecision:
    """The same point of the global order at `dp` ranks and `micro_batch_size` (default: the source's).

    The global batch must stay: a different one would change which samples form each step."""
    gbs = source.global_batch_size if global_batch_size is None else global_batch_size
    if gbs != source.global_batch_size:
        raise DataPositionError(f"global batch size changes from {source.global_batch_size} to {gbs}: the global "
                                "sample order and the optimizer step would change; keep the global batch")
    mbs = source.micro_batch_size if micro_batch_size is None else micro_batch_size
    target = DataPosition(consumed_samples=source.consumed_samples, global_batch_size=gbs, micro_batch_size=mbs, dp=dp)
    reason = (f"consumed_samples {source.consumed_samples} (step {source.step}) kept; global batch {gbs} = "
              f"mbs {mbs} x dp {dp} x grad accumulation {target.grad_accumulation} (was mbs {source.micro_batch_size}"
              f" x dp {source.dp} x {source.grad_accumulation}); DP rank r of the target takes slice r of each "
              f"global batch, so the next global batch is the one the source would have drawn")
    return PositionDecision(source=source, target=target, reason=reason)


def first_difference(target: Sequence[Sequence[int]], baseline: Sequence[Sequence[int]]) -> int | None:
    """Index of the first step whose consumed sample indices differ (or that only one side has); None if equal."""
    for i in range(max(len(target), len(baseline))):
        if i >= len(target) or i >= len(baseline) or list(target[i]) != list(baseline[i]):
            return i
    return None
