"""Per-rank RNG states: capture/restore (effects), derivation, and the carry-or-derive decision (pure).

A rank's state is plain data (ints, lists, hex strings), so it travels inside pickled client
states that the converter reads as metadata:
``{"python": {...}, "numpy": {...}, "torch": hex, "accelerator": [hex per device],
"trackers": {name: hex}}`` (trackers: Megatron's model-parallel RNG tracker streams).

Roles follow Megatron: the default generators are identical across TP and DP ranks and
distinct across PP stages (seed + 100 * pp_rank); the model-parallel tracker stream is distinct
per TP rank; the expert tracker per (TP, EP) rank. A target rank takes, in order of preference:
``carry`` the state of the source rank with the same coordinates (same dp/tp/pp/ep index and
sizes, hence the same layers and shards), bit-exactly; ``replicate`` the state of a DP peer with
the same model-parallel role when every such source peer holds the same state (the framework
keeps DP streams identical); else ``derive`` a fresh state from (seed, step, coordinates) with
the same distinctness rules.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from checkpoint.errors import PlanError

Policy = Literal["carry", "replicate", "derive"]
_STREAM_DEFAULT, _STREAM_TP, _STREAM_EP, _STREAM_DP = 0, 1, 2, 3
_PHILOX_STATE_BYTES = 16  # CUDA/NPU generator state: seed (8 bytes) + offset (8 bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRole:
    """A rank's coordinates and the sizes of its axes; ranks with equal `model_parallel_key` hold the
    same layers and shards, and equal `key` means the very same role."""

    rank: int
    dp: int
    tp: int = 0
    pp: int = 0
    ep: int = 0
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep"):
            index, size = getattr(self, axis), getattr(self, f"{axis}_size")
            if not 0 <= index < size:
                raise PlanError(f"rank {self.rank}: {axis} index {index} outside [0, {axis}_size({size}))")

    @property
    def model_parallel_key(self) -> tuple[int, ...]:
        return (self.tp, self.tp_size, self.pp, self.pp_size, self.ep, self.ep_size)

    @property
    def key(self) -> tuple[int, ...]:
        return (self.dp, *self.model_parallel_key)

    def describe(self) -> str:
        return f"dp{self.dp}/{self.dp_size} tp{self.tp}/{self.tp_size} pp{self.pp}/{self.pp_size} ep{self.ep}/{self.ep_size}"

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


def roles(*, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1) -> tuple[RankRole, ...]:
    """Every rank's role in Megatron's default order (tp fastest, then dp, then pp; ep inside dp)."""
    if dp % ep:
        raise PlanError(f"dp({dp}) is not divisible by ep({ep})")
    out = []
    for rank in range(tp * pp * dp):
        t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        out.append(RankRole(rank=rank, dp=d, tp=t, pp=p, ep=d % ep, dp_size=dp, tp_size=tp, pp_size=pp, ep_size=ep))
    return tuple(out)


def role_from_dict(d: Mapping[str, int]) -> RankRole:
    return RankRole(**{k: int(v) for k, v in d.items()})


# ---------------------------------------------------------------- effects: the process's generators

def state_hex(t: torch.Tensor) -> str:
    """A generator state tensor as the hex string the plain per-rank state holds."""
    return bytes(t.contiguous().view(torch.uint8).tolist()).hex()


def state_tensor(h: str) -> torch.Tensor:
    """The generator state tensor of a hex string (`state_hex`'s inverse)."""
    return torch.frombuffer(bytearray(bytes.fromhex(h)), dtype=torch.uint8).clone()


def capture_rng_state(trackers: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """This process's RNG states as plain data (Python, NumPy, torch CPU, every CUDA device, and the
    given tracker states)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    accelerator = [state_hex(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss},
        "numpy": {"key": [int(x) for x in np_state["state"]["key"]], "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "cached_gaussian": float(np_state["gauss"])},
        "torch": state_hex(torch.get_rng_state()),
        "accelerator": accelerator,
        "trackers": {name: state_hex(t) for name, t in sorted((trackers or {}).items())},
    }


def restore_rng_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Set this process's generators from `state`; returns the tracker states (the caller's framework
    sets them, e.g. Megatron's `get_cuda_rng_tracker().set_states`)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state_tensor(state["torch"]))
    devices = state.get("accelerator", [])
    if devices:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(devices):
            raise RuntimeError(f"RNG state holds {len(devices)} accelerator generator(s) but this process sees "
                               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)")
        torch.cuda.set_rng_state_all([state_tensor(h) for h in devices])
    return {name: state_tensor(h) for name, h in state.get("trackers", {}).items()}


# ---------------------------------------------------------------- Megatron-LM's per-rank form (pure)

MEGATRON_RNG_KEY = "rng_state"  # Megatron-LM's ShardedObject key: global shape (pp, tp), replicas over DP


def to_megatron(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` in Megatron-LM's per-rank form (`get_rng_state` in megatron/training/checkpointing.py):
    random/np/torch/cuda generator states and the tracker states, loadable with weights_only (NumPy's
    key as a list of ints; `cuda_rng_state` only when the state holds a device generator)."""
    py, n = state["python"], state["numpy"]
    out: dict[str, Any] = {
        "random_rng_state": (int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]),
        "np_rng_state": ("MT19937", [int(x) for x in n["key"]], int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])),
        "torch_rng_state": state_tensor(state["torch"]),
        "rng_tracker_states": {name: state_tensor(h) for name, h in sorted(state.get("trackers", {}).items())},
    }
    devices = state.get("accelerator", [])
    if len(devices) > 1:
        raise PlanError(f"RNG state holds {len(devices)} device generators; Megatron keeps the current device's only")
    if devices:
        out["cuda_rng_state"] = state_tensor(devices[0])
    return out


def from_megatron(state: Mapping[str, Any], *, where: str = "rng_state") -> dict[str, Any]:
    """The plain-data state of one rank from Megatron-LM's per-rank form (inverse of `to_megatron`)."""
    missing = {"random_rng_state", "np_rng_state", "torch_rng_state"} - set(state)
    if missing:
        raise PlanError(f"{where}: Megatron RNG state lacks {sorted(missing)} (has {sorted(state)})")
    version, internal, gauss = state["random_rng_state"]
    kind, key, pos, has_gauss, cached = state["np_rng_state"]
    if kind != "MT19937":
        raise PlanError(f"{where}: NumPy RNG state of kind {kind!r}, expected 'MT19937'")
    cuda = state.get("cuda_rng_state")
    return {
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss},
        "numpy": {"key": [int(x) for x in key], "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": state_hex(state["torch_rng_state"]),
        "accelerator": [state_hex(cuda)] if cuda is not None else [],
        "trackers": {name: state_hex(t) for name, t in sorted((state.get("rng_tracker_states") or {}).items())},
    }


def megatron_rng_objects(states: Sequence[Mapping[str, Any]],
                         roles_: Sequence[RankRole]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Per (pp, tp): the list Megatron-LM stores in its `rng_state` ShardedObject, in plain-data form:
    one state when every DP rank of that (pp, tp) holds the same one (Megatron's default), else one
    per DP rank in DP order (as with `data_parallel_random_init`, or distinct expert streams); pure."""
    groups: dict[tuple[int, int], dict[int, Mapping[str, Any]]] = {}
    for state, role in zip(states, roles_, strict=True):
        groups.setdefault((role.pp, role.tp), {})[role.dp] = state
    out = {}
    for key, by_dp in sorted(groups.items()):
        ordered = [dict(by_dp[d]) for d in sorted(by_dp)]
        same = len({fingerprint(s) for s in ordered}) == 1
        out[key] = ordered[:1] if same else ordered
    return out


def expand_megatron_rng(objects: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]],
                        roles_: Sequence[RankRole], *, where: str = "rng_state") -> list[dict[str, Any]]:
    """Every rank's state from the per-(pp, tp) lists (one state for all DP ranks, or one per DP rank);
    raises PlanError naming the missing (pp, tp) or a list of another DP size."""
    out = []
    for role in roles_:
        states = objects.get((role.pp, role.tp))
        if states is None:
            raise PlanError(f"{where}: no RNG state for pp {role.pp} tp {role.tp} (saved for {sorted(objects)})")
        if len(states) not in (1, role.dp_size):
            raise PlanError(f"{where}: pp {role.pp} tp {role.tp} holds {len(states)} RNG states, neither 1 nor "
                            f"dp({role.dp_size})")
        out.append(dict(states[0] if len(states) == 1 else states[role.dp]))
    return out


# ---------------------------------------------------------------- pure: derivation and fingerprints

def fingerprint(state: Mapping[str, Any]) -> str:
    """A short stable digest of a state (16 hex digits of sha256 over its canonical JSON)."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def generator_state_like(example_hex: str, seed: int) -> str:
    """A generator state seeded with `seed`, in the byte format of `example_hex` (CPU Mersenne
    twister, or the 16-byte Philox seed+offset of CUDA/NPU generators)."""
    if len(example_hex) == 2 * _PHILOX_STATE_BYTES:
        return (seed.to_bytes(8, "little") + (0).to_bytes(8, "little")).hex()
    return state_hex(torch.Generator().manual_seed(seed).get_state())


def derive_rng_state(*, seed: int, step: int, role: RankRole, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A fresh state from (seed, step, role); pure. The default generators depend on (seed, step, pp)
    only (identical across TP and DP, as Megatron seeds them); tracker streams named in `like` (or
    none) add the TP index ("model-parallel" streams) or TP and EP indices (expert streams), except
    Megatron's "data-parallel" stream, which like the default generator depends on pp only.
    `like` also fixes the number and byte format of accelerator and tracker states."""
    like = like or {}
    base = _seed(seed, step, _STREAM_DEFAULT, role.pp)
    version, internal, gauss = random.Random(base).getstate()
    np_state = np.random.RandomState(base).get_state(legacy=False)
    trackers = {}
    for name, example in sorted(like.get("trackers", {}).items()):
        stream = _STREAM_EP if "expert" in name else _STREAM_DP if "data-parallel" in name else _STREAM_TP
        coords = {_STREAM_EP: (role.pp, role.tp, role.ep), _STREAM_DP: (role.pp,)}.get(stream, (role.pp, role.tp))
        trackers[name] = generator_state_like(example, _seed(seed, step, stream, *coords))
    return {
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss},
        "numpy": {"key": [int(x) for x in np_state["state"]["key"]], "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "cached_gaussian": float(np_state["gauss"])},
        "torch": state_hex(torch.Generator().manual_seed(base).get_state()),
        "accelerator": [generator_state_like(h, base) for h in like.get("accelerator", [])],
        "trackers": trackers,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class RngDecision:
    """How target rank `target_rank`'s state was obtained, from which source rank, and why."""

    target_rank: int
    role: str
    policy: Policy
    source_rank: int | None
    reason: str
    fingerprint: str

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def plan_rng(source_states: Sequence[Mapping[str, Any]], source_roles: Sequence[RankRole],
             target_roles: Sequence[RankRole], *, seed: int, step: int) -> tuple[list[dict[str, Any]], tuple[RngDecision, ...]]:
    """The target ranks' states and the decision for each (see the module docstring); pure."""
    if len(source_states) != len(source_roles):
        raise PlanError(f"RNG: {len(source_states)} source states for {len(source_roles)} source ranks")
    by_key = {r.key: i for i, r in enumerate(source_roles)}
    peers: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(source_roles):
        peers.setdefault(r.model_parallel_key, []).append(i)
    states: list[dict[str, Any]] = []
    decisions: list[RngDecision] = []
    policy: Policy
    for role in target_roles:
        same = by_key.get(role.key)
        group = peers.get(role.model_parallel_key, [])
        distinct = {fingerprint(source_states[i]) for i in group}
        if same is not None:
            state, policy, src = dict(source_states[same]), "carry", same
            reason = f"source rank {same} has the same role ({role.describe()}): carried bit-exactly"
        elif group and len(distinct) == 1:
            state, policy, src = dict(source_states[group[0]]), "replicate", group[0]
            reason = (f"no source rank at dp{role.dp}/{role.dp_size}; its DP peers with the same model-parallel role "
                      f"(source ranks {group}) all hold one state, which the framework keeps identical: copied "
                      f"from rank {group[0]}")
        else:
            why = (f"the DP peers with its model-parallel role (source ranks {group}) hold {len(distinct)} different "
                   "states" if group else "no source rank holds the same layers and shards (tp/pp/ep changed)")
            state = derive_rng_state(seed=seed, step=step, role=role, like=source_states[0] if source_states else None)
            policy, src = "derive", None
            reason = f"{why}: derived from (seed={seed}, step={step}, {role.describe()})"
        states.append(state)
        decisions.append(RngDecision(target_rank=role.rank, role=role.describe(), policy=policy, source_rank=src,
                                     reason=reason, fingerprint=fingerprint(state)))
    return states, tuple(decisions)
