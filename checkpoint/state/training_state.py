"""The training state saved next to the weights, converted for the target layout, with its report (pure).

The built-in workloads keep it under `CLIENT_STATE_KEY` (DeepSpeed: in the client state, i.e. the
top level of `mp_rank_00_model_states.pt`), schema version 1:
``{"step", "consumed_tokens", "sampler": {seed, dataset_size, global_batch_size, consumed_samples,
epoch}, "data": {"micro_batch_size", "dp", "consumed_samples_per_rank": [...]}, "rng": [state per
rank], "roles": [RankRole per rank]}``. Framework counters next to it (the LR scheduler, step and
sample counters) are layout-independent and carried unchanged; the report says so for each.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkpoint.errors import PlanError
from checkpoint.state.data_position import DataPosition, convert_position, from_global_counts
from checkpoint.state.rng import RankRole, plan_rng, role_from_dict, roles

CLIENT_STATE_KEY = "migrate"


def our_client_state(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """The built-in engines' entry (`migrate`) in a checkpoint index's canonical client state; empty when none."""
    client = ((meta.get("train_state") or {}).get("client") or {}).get(CLIENT_STATE_KEY) or {}
    return client if isinstance(client, Mapping) else {}

STATE_REPORT_FILE = "state_report.json"
COUNTERS: dict[str, str] = {
    "lr_scheduler": "LR scheduler state (the optimizer step count) does not depend on the layout",
    "global_steps": "optimizer step counter: one per global batch at any layout",
    "global_samples": "samples consumed: a global count, the same at any layout",
    "skipped_steps": "steps skipped for overflow: a global count",
    "iteration": "iteration counter: one per global batch at any layout",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class StateEntry:
    """One line of the conversion report: which state, the policy applied, and why."""

    state: str
    policy: str
    reason: str
    fields: dict[str, Any] = field(default_factory=dict)  # machine-readable details (rank, source rank, fingerprint)

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "policy": self.policy, "reason": self.reason, **self.fields}


def source_roles(client: Mapping[str, Any]) -> tuple[RankRole, ...]:
    """The saved ranks' roles (data-parallel only when the state predates `roles`)."""
    if "roles" in client:
        return tuple(role_from_dict(r) for r in client["roles"])
    return roles(dp=len(client.get("rng", [])) or int(client.get("data", {}).get("dp", 1)))


def convert_client_state(client: Mapping[str, Any], target_roles: Sequence[RankRole], *,
                         micro_batch_size: int | None = None) -> tuple[dict[str, Any], list[StateEntry]]:
    """`client` (schema above) for the ranks `target_roles`; raises DataPositionError on per-rank
    positions that disagree and PlanError on a malformed state."""
    out = copy.deepcopy(dict(client))
    report: list[StateEntry] = []
    step = int(client.get("step", 0))
    target_dp = max(r.dp for r in target_roles) + 1
    src_roles = source_roles(client)
    sampler = client.get("sampler")
    if sampler is not None:
        gbs = int(sampler["global_batch_size"])
        data = client.get("data", {})
        # a state without "data" predates it: only the global count is known (micro batch and dp taken as 1)
        src_dp = int(data.get("dp", 1))
        src_mbs = int(data.get("micro_batch_size", 1))
        per_rank = data.get("consumed_samples_per_rank")
        if per_rank is not None:
            position = from_global_counts(dict(enumerate(int(c) for c in per_rank)), global_batch_size=gbs,
                                          micro_batch_size=src_mbs, dp=len(per_rank))
        else:
            position = DataPosition(consumed_samples=int(sampler["consumed_samples"]), global_batch_size=gbs,
                                    micro_batch_size=src_mbs, dp=src_dp)
        if position.consumed_samples != int(sampler["consumed_samples"]):
            raise PlanError(f"{CLIENT_STATE_KEY}.data.consumed_samples_per_rank ({per_rank}) disagrees with "
                            f"{CLIENT_STATE_KEY}.sampler.consumed_samples ({sampler['consumed_samples']})")
        if position.step != step:
            raise PlanError(f"{CLIENT_STATE_KEY}: consumed_samples({position.consumed_samples}) / global_batch_size"
                            f"({gbs}) = step {position.step} but the saved step is {step}")
        decision = convert_position(position, dp=target_dp, micro_batch_size=micro_batch_size)
        out["data"] = {"micro_batch_size": decision.target.micro_batch_size, "dp": target_dp,
                       "consumed_samples_per_rank": [decision.target.consumed_samples] * target_dp}
        report.append(StateEntry(state="data position", policy="global order continued", reason=decision.reason))
    if "rng" in client:
        rng = client["rng"]
        seed = int(sampler["seed"]) if sampler is not None else int(client.get("seed", 0))
        states, decisions = plan_rng(rng, src_roles, target_roles, seed=seed, step=step)
        out["rng"] = states
        out["roles"] = [r.as_dict() for r in target_roles]
        report += [StateEntry(state=f"rng rank {d.target_rank} ({d.role})", policy=d.policy,
                              reason=f"{d.reason}; fingerprint {d.fingerprint}",
                              fields={"target_rank": d.target_rank, "source_rank": d.source_rank,
                                      "fingerprint": d.fingerprint}) for d in decisions]
    else:
        report.append(StateEntry(state="rng", policy="absent",
                                 reason="the checkpoint holds no RNG state; the framework seeds the target afresh"))
    for key in ("step", "consumed_tokens"):
        if key in client:
            report.append(StateEntry(state=f"{CLIENT_STATE_KEY}.{key}", policy="carry",
                                     reason=f"{client[key]}: a global counter, the same at any layout"))
    return out, report


def convert_model_state(model_state: Mapping[str, Any], target_roles: Sequence[RankRole], *,
                        micro_batch_size: int | None = None) -> tuple[dict[str, Any], list[StateEntry]]:
    """A framework's non-tensor model state (e.g. DeepSpeed's model_states minus the module) for the
    target ranks: the client state converted, the counters carried; with the report."""
    out = dict(model_state)
    report: list[StateEntry] = []
    if CLIENT_STATE_KEY in model_state:
        out[CLIENT_STATE_KEY], report = convert_client_state(model_state[CLIENT_STATE_KEY], target_roles,
                                                             micro_batch_size=micro_batch_size)
    else:
        report.append(StateEntry(state=CLIENT_STATE_KEY, policy="absent",
                                 reason="no training state of the built-in workloads (RNG, data position) saved"))
    for key, why in COUNTERS.items():
        if model_state.get(key) is not None:
            report.append(StateEntry(state=key, policy="carry", reason=f"{_short(model_state[key])}: {why}"))
    return out, report


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def report_dict(report: Sequence[StateEntry], *, source: str, target: str) -> dict[str, Any]:
    """The report as written next to the converted checkpoint (`STATE_REPORT_FILE`)."""
    return {"version": 1, "source_layout": source, "target_layout": target, "states": [e.as_dict() for e in report]}
