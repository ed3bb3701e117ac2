"""How strictly a conversion holds the source's state: what passes unchanged, what is lost, what is made up.

`differences(plan)` lists, from the plan alone, each state that does not pass unchanged from the source to
the target: source tensors no target tensor is read from (an optimizer state the target format has no
place for, fp32 masters a weights-only format drops), training state the target's state report drops or
does not write, and state the target holds that the source did not give as is (RNG derived for a rank whose
role changed). `check(plan, strictness)` refuses by it.
Pure: reads the plan's indexes and the target's meta, nothing on disk.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint.errors import PlanError
from checkpoint.index import Kind, TensorKey
from checkpoint.plan import ConversionPlan

LOST_POLICIES = frozenset({"dropped", "not written"})  # state-report policies: the target does not hold it
CHANGED_POLICIES = frozenset({"derive"})  # the target holds a state computed, not copied, from the source's


class Strictness(enum.Enum):
    """What `convert` does with state that does not pass unchanged from the source to the target.

    Every member is decided from the plan before a byte is written, so none costs any I/O (unlike
    Megatron-Core's `StrictHandling`, whose checking members cost an extra disk access before the load and,
    for missing keys, a metadata exchange between ranks); re-reading what was written is the separate
    `verify` check, which costs a full read of the source and the output."""

    REPORT = "report"
    """Carry what the target format holds and name the rest in the plan summary and the target's state
    report. The default: a conversion to HF drops the optimizer by design."""
    REFUSE_LOSS = "refuse-loss"
    """Refuse, naming each state, when anything the source holds would not reach the target: a tensor or
    optimizer state the target has no place for, per-rank RNG a DCP target drops, a dataloader state not
    written."""
    REFUSE_CHANGE = "refuse-change"
    """Also refuse when the target would hold state the source did not give as is: RNG derived (from the
    seed, the step and the rank's role) for a rank whose role has no source rank. What passes is then an
    exact continuation of the source."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateDifference:
    """One state that does not pass unchanged: `lost` (the source's, not in the target) or changed."""

    state: str
    policy: str
    reason: str
    lost: bool

    def describe(self) -> str:
        return f"{self.state}: {self.policy} ({self.reason})"


def differences(plan: ConversionPlan) -> tuple[StateDifference, ...]:
    """Every state of `plan` that does not pass unchanged, lost ones first. Tensors are compared through the
    plan's sources (a plan given as fixed copy items lists none); training state through the target's state
    report and Trainer RNG decisions."""
    lost = list(_tensors_not_read(plan))
    changed: list[StateDifference] = []
    meta = plan.target.index.meta
    report = meta.get("state_report") or {}
    rows: list[Mapping[str, Any]] = list(report.get("states", ()) if isinstance(report, Mapping) else ())
    rows += [{"state": f"Trainer RNG file of process {d.get('target_rank')}", **d}
             for d in meta.get("trainer_rng") or () if isinstance(d, Mapping)]
    for row in rows:
        policy = str(row.get("policy", ""))
        if policy in LOST_POLICIES or policy in CHANGED_POLICIES:
            (lost if policy in LOST_POLICIES else changed).append(StateDifference(
                state=str(row.get("state", "?")), policy=policy, reason=str(row.get("reason", "")),
                lost=policy in LOST_POLICIES))
    return tuple(lost + changed)


def check(plan: ConversionPlan, strictness: Strictness) -> tuple[StateDifference, ...]:
    """The plan's differences; raises PlanError listing those `strictness` refuses (none under REPORT)."""
    found = differences(plan)
    refused = [d for d in found if strictness is Strictness.REFUSE_CHANGE or
               (strictness is Strictness.REFUSE_LOSS and d.lost)]
    if refused:
        raise PlanError(f"{strictness.value}: {plan.source.format} -> {plan.target.index.format} would "
                        f"{'lose or change' if strictness is Strictness.REFUSE_CHANGE else 'lose'} {len(refused)} "
                        f"state(s): " + "; ".join(d.describe() for d in refused))
    return found


def _tensors_not_read(plan: ConversionPlan) -> Iterable[StateDifference]:
    """The source tensors no target tensor is read from, one difference per kind (count and an example name).

    Read counts as carried: a bf16 param whose fp32 master the target's param is cast from; an fp32 master
    whose float32 param the target reads (the same precision, as formats without a separate master keep it);
    a 0-d state (a step) of a kind the target reads one of (formats keep one step per parameter group)."""
    if plan.fixed_items is not None:
        return
    read: set[TensorKey] = set()
    for (source, cast) in plan.sources.values():
        read.add(source.key)
        if cast and source.key.kind is Kind.MASTER:
            read.add(TensorKey(name=source.key.name, kind=Kind.PARAM))
        if source.key.kind is Kind.PARAM and source.dtype == "float32":
            read.add(TensorKey(name=source.key.name, kind=Kind.MASTER))
    scalar_kinds_read = {source.key.kind for (source, _) in plan.sources.values() if source.shape == ()}
    by_kind: dict[str, list[str]] = defaultdict(list)
    for entry in plan.source.entries:
        if entry.key not in read and not (entry.shape == () and entry.key.kind in scalar_kinds_read):
            by_kind[str(entry.key.kind)].append(entry.key.name)
    for kind, names in sorted(by_kind.items()):
        yield StateDifference(state=f"{kind} of {len(names)} tensor(s) (e.g. {sorted(names)[0]})", policy="dropped",
                              lost=True, reason=f"the {plan.target.index.format} target has no place for them")
