"""Adam's `step` for targets that keep it per parameter, from sources that keep it per param group (pure).

Megatron-Core's DistributedOptimizer (without Apex/TE) stores one `step` in each optimizer param group;
torch Adam/AdamW, which DeepSpeed (`torch_adam`) and FSDP2 + DCP run, keeps one per parameter: a 0-d
float32 tensor (`torch.tensor(step, dtype=_get_scalar_dtype())` when neither capturable nor fused),
which is also what Megatron-Core itself builds from the group value on load. A writer of such a
target calls `derived_step(source)`: None when the source carries per-parameter steps (they are
copied) or no Adam moments (nothing to derive); otherwise the step from the canonical train state.
"""

from __future__ import annotations

from typing import Any

import torch

from checkpoint.errors import PlanError
from checkpoint.index import CheckpointIndex, Kind

STEP_DTYPE = "float32"  # torch Adam's per-parameter step (non-capturable, non-fused)


def derived_step(source: CheckpointIndex) -> int | None:
    """The per-parameter Adam step a target must write for `source`, or None when nothing is derived.

    Raises PlanError when the source holds Adam moments, no per-parameter step and no train-state step."""
    kinds = {e.key.kind for e in source.entries}
    if Kind.STEP in kinds or Kind.EXP_AVG not in kinds:
        return None
    step = (source.meta.get("train_state") or {}).get("step")
    if step is None:
        raise PlanError(f"source {source.root} ({source.format}) holds Adam moments but neither a per-parameter "
                        f"`step` nor a train-state step to derive it from")
    return int(step)


def step_tensor(step: Any) -> torch.Tensor:
    """Adam's per-parameter step as torch Adam stores it: a 0-d float32 tensor."""
    return torch.tensor(float(step), dtype=getattr(torch, STEP_DTYPE))


def split_derived_steps(source: CheckpointIndex, target: CheckpointIndex) -> tuple[CheckpointIndex, list[str]]:
    """`target` without the per-parameter steps a writer derived for `source` (compare the rest with the
    source tensor by tensor), and the problems found checking each derived step: a 0-d float32 tensor
    holding `derived_step(source)`, one per parameter with Adam moments. Reads only those step tensors."""
    import dataclasses

    from checkpoint.materialize import read_tensor

    step = derived_step(source)
    if step is None:
        return target, []
    want = step_tensor(step)
    steps = [e for e in target.entries if e.key.kind is Kind.STEP]
    problems = []
    for e in steps:
        got = read_tensor(target, e)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"{e.key}: derived step is {got.dtype} {tuple(got.shape)} {got.tolist()}, want "
                            f"{want.dtype} () {want.item()}")
    moments = {e.key.name for e in target.entries if e.key.kind is Kind.EXP_AVG}
    problems += [f"{name}[step]: missing (the parameter has Adam moments)"
                 for name in sorted(moments - {e.key.name for e in steps})]
    rest = tuple(e for e in target.entries if e.key.kind is not Kind.STEP)
    return dataclasses.replace(target, entries=rest), problems
