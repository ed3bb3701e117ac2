"""RNG and data-position state of the built-in engines: seed, save (collective), restore, trace.

Schema: `checkpoint.state.training_state` (saved under `CLIENT_STATE_KEY`). Every rank's RNG
state is gathered into the one saved state, so a converter can hand each target rank the state
of the source rank with its role. `StepTrace` records, per step, the global batch the step
consumed and this rank's RNG fingerprint at the step's start: `RankResult.extra["samples"]`
and `extra["rng"]`, which the resume stage compares with the baseline's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

import torch.distributed as dist

from checkpoint.state.rng import RankRole, capture_rng_state, derive_rng_state, fingerprint, restore_rng_state
from checkpoint.state.training_state import CLIENT_STATE_KEY
from migrate.workload.data import SamplerState

__all__ = ["CLIENT_STATE_KEY", "StepTrace", "seed_rng", "gather_state", "restore_state"]


def seed_rng(seed: int, role: RankRole) -> None:
    """Seed a fresh run's generators from (seed, step 0, role) (identical across DP/TP, distinct per PP)."""
    restore_rng_state(derive_rng_state(seed=seed, step=0, role=role))


def gather_state(*, step: int, sampler: SamplerState, micro_batch_size: int, dp: int, role: RankRole,
                 consumed_tokens: int, group: Any = None) -> dict[str, Any]:
    """The state to save (collective over `group`, default the world): every rank's RNG, role and data position."""
    mine = {"rng": capture_rng_state(), "role": role.as_dict(), "consumed": sampler.consumed_samples}
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    by_dp: dict[int, int] = {}
    for g in gathered:
        by_dp.setdefault(int(g["role"]["dp"]), int(g["consumed"]))
    return {"sampler": sampler.state_dict(), "step": step, "consumed_tokens": consumed_tokens,
            "data": {"micro_batch_size": micro_batch_size, "dp": dp,
                     "consumed_samples_per_rank": [by_dp[d] for d in sorted(by_dp)]},
            "rng": [g["rng"] for g in gathered], "roles": [g["role"] for g in gathered]}


def restore_state(client: Mapping[str, Any], *, rank: int, role: RankRole, global_batch_size: int,
                  where: str) -> tuple[SamplerState, int, str]:
    """(sampler, step, how the RNG was restored) from a saved state; sets this rank's generators.

    Refuses a state saved for other ranks (convert it first) and per-rank positions that disagree."""
    sampler = SamplerState.from_state_dict(client["sampler"])
    if sampler.global_batch_size != global_batch_size:
        raise ValueError(f"{where}: saved global_batch_size({sampler.global_batch_size}) != run's "
                         f"({global_batch_size}); the global sample order would change")
    per_rank = client.get("data", {}).get("consumed_samples_per_rank")
    if per_rank is not None and set(per_rank) != {sampler.consumed_samples}:
        raise ValueError(f"{where}: inconsistent data position: consumed_samples_per_rank {per_rank} vs sampler "
                         f"{sampler.consumed_samples}")
    note = "absent: fresh seed"
    if "rng" in client:
        roles = client.get("roles")
        if roles is not None and (rank >= len(roles) or roles[rank] != role.as_dict()):
            saved = roles[rank] if rank < len(roles) else None
            raise ValueError(f"{where}: RNG state saved for {len(roles)} ranks, rank {rank} there is {saved} but "
                             f"this run's rank {rank} is {role.as_dict()}; convert the checkpoint for this layout")
        restore_rng_state(client["rng"][rank])
        note = f"restored ({fingerprint(client['rng'][rank])})"
    return sampler, int(client["step"]), note


@dataclass
class StepTrace:
    """Per step: the global batch consumed (dataset indices, in order) and the RNG fingerprint at its start.
    A long run (`enabled` False) records nothing: its memory would grow with every step."""

    samples: list[list[int]] = field(default_factory=list)
    rng: list[str] = field(default_factory=list)
    enabled: bool = True

    def record(self, global_indices: Any) -> None:
        if not self.enabled:
            return
        self.samples.append([int(i) for i in global_indices])
        self.rng.append(fingerprint(capture_rng_state()))

    def extra(self, **more: Any) -> dict[str, Any]:
        return {"samples": self.samples, "rng": self.rng, **more}
