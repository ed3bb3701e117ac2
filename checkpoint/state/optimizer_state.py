"""The optimizer's per-parameter state as open data: what a target can carry of it (pure functions).

Readers index every per-parameter state tensor under its own name (`index.state_kind`): Adam's moments and
step, SGD's and Muon's `momentum_buffer`, AdamW-amsgrad's `max_exp_avg_sq`, Lion's `exp_avg`, ... What a
target does with one depends only on its shape against its parameter's:

* **elementwise** (shaped like the parameter): resharded exactly like the parameter, whatever the layout;
* **scalar** (0-d, such as `step`): carried whole;
* **other** (Adafactor's factored row/column variances, Shampoo/SOAP preconditioners, 8-bit Adam's quantized
  blocks): no piece of it belongs to a piece of the parameter, so it is carried only where the target keeps
  the parameter whole and refused by name where the target splits or flattens it (`refuse_split_state`).

Targets whose optimizer files have fixed slots (Megatron-Core's distributed optimizer, DeepSpeed's universal
checkpoint) name what they hold; the rest is refused by name (`refuse_unplaced_state`), never dropped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import StrEnum

from checkpoint.errors import PlanError
from checkpoint.index import CheckpointIndex, Kind, TensorEntry, TensorKey, is_optimizer_state


ADAM_SLOTS = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.STEP)
"""What a target with Adam's fixed slots holds (Megatron-Core's distributed optimizer, DeepSpeed universal)."""


class StateShape(StrEnum):
    """How a per-parameter optimizer state tensor relates to its parameter's shape."""

    ELEMENTWISE = "elementwise"  # the parameter's shape: resharded like it
    SCALAR = "scalar"  # 0-d: carried whole
    OTHER = "other"  # any other shape (factored, quantized, preconditioners): only where the parameter stays whole


def param_shapes(index: CheckpointIndex) -> dict[str, tuple[int, ...]]:
    """The global shape of each parameter of `index` (from its weight, else its fp32 master)."""
    shapes = {e.key.name: e.shape for e in index.entries if e.key.kind is Kind.MASTER}
    shapes |= {e.key.name: e.shape for e in index.entries if e.key.kind is Kind.PARAM}
    return shapes


def state_shape(entry: TensorEntry, param_shape: tuple[int, ...] | None) -> StateShape:
    """The `StateShape` of an optimizer state `entry` whose parameter has `param_shape` (None: unknown)."""
    if entry.shape == ():
        return StateShape.SCALAR
    return StateShape.ELEMENTWISE if entry.shape == param_shape else StateShape.OTHER


def state_entries(index: CheckpointIndex) -> dict[TensorKey, StateShape]:
    """Every optimizer state tensor of `index` (in index order) with its `StateShape`."""
    shapes = param_shapes(index)
    return {e.key: state_shape(e, shapes.get(e.key.name)) for e in index.entries if is_optimizer_state(e.key.kind)}


def state_kinds(shapes: Mapping[TensorKey, StateShape], shape: StateShape) -> list[Kind | str]:
    """The kinds among `shapes` (`state_entries`) with `shape`, in the order first met."""
    return list(dict.fromkeys(k.kind for k, s in shapes.items() if s is shape))


def _listing(keys: Collection[TensorKey]) -> str:
    names = sorted({k.name for k in keys})
    return f"{len(names)} parameter(s), e.g. {names[0]}" if names else "no parameter"


def refuse_unplaced_state(source: CheckpointIndex, *, target: str, why: str,
                          holds: Collection[Kind | str] = ADAM_SLOTS) -> None:
    """Raise PlanError naming the source's optimizer state kinds that `target`'s files have no place for
    (`holds`: the kinds they keep; `why`: what the target's optimizer stores); a source without them passes."""
    by_kind: dict[Kind | str, list[TensorKey]] = {}
    for key in state_entries(source):
        if key.kind not in holds:
            by_kind.setdefault(key.kind, []).append(key)
    if by_kind:
        found = "; ".join(f"{kind} on {_listing(keys)}" for kind, keys in by_kind.items())
        raise PlanError(f"{target} target: the source's optimizer state {found} has no place there ({why}); it "
                        f"would be lost, so nothing is written: convert to dcp or deepspeed, which carry any "
                        f"per-parameter state")


def refuse_split_state(source: CheckpointIndex, *, target: str, how: str,
                       shapes: Mapping[TensorKey, StateShape] | None = None) -> None:
    """Raise PlanError naming the source's optimizer state that is neither shaped like its parameter nor 0-d,
    for a `target` that splits or flattens parameters (`how` says how)."""
    shapes = state_entries(source) if shapes is None else shapes
    others = [k for k, s in shapes.items() if s is StateShape.OTHER]
    if not others:
        return
    by_key = source.by_key()
    params = param_shapes(source)
    first = others[0]
    kinds = sorted({str(k.kind) for k in others})
    raise PlanError(f"{target} target: optimizer state {first} has shape {list(by_key[first].shape)}, not its "
                    f"parameter's {list(params.get(first.name, ()))} (state {', '.join(kinds)} on "
                    f"{_listing(others)}: factored or quantized state such as Adafactor's row/column variances); "
                    f"{how}, and no piece of such a state belongs to a piece of the parameter, so it is carried only "
                    f"to a layout that keeps each parameter whole")
