"""What ``migrate run`` would do, and why, without running anything (``migrate run --dry-run``).

``preview(job, stages, force)`` takes the stages in execution order and asks the runner's own pure ``decide``
about each, with the results on disk; a stage whose upstream would run is predicted to run after it (its
inputs will change), and one whose upstream would be blocked is blocked by the same root cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from migrate.job.load import Job
from migrate.pipeline.runner import decide, input_hash, read_artifact
from migrate.stages import STAGES, execution_order


@dataclass(frozen=True)
class Preview:
    """One stage: whether it would run, be skipped or be blocked, and why."""

    stage: str
    action: Literal["run", "skip", "block"]
    reason: str


def preview(job: Job, stages: Sequence[str] | None = None, *, force: bool = False) -> list[Preview]:
    """The decision for each selected stage of `job`, in the order `run` takes them (pure apart from reading
    the stages' artifacts)."""
    listed = tuple(job.stage_options)
    selected = tuple(stages) if stages else listed
    out: list[Preview] = []
    predicted: dict[str, Preview] = {}
    for name in execution_order(selected):
        stage = STAGES[name]
        deps = stage.upstream_in(listed, job.stage_options.get(name))
        blocked = next((predicted[d] for d in deps if d in predicted and predicted[d].action == "block"), None)
        rerun = [d for d in deps if d in predicted and predicted[d].action == "run"]
        if blocked is not None:
            decision = Preview(name, "block", blocked.reason)
        elif rerun and not any(read_artifact(job, d) is None and d not in predicted for d in deps):
            decision = Preview(name, "run", f"after {', '.join(rerun)} {'runs' if len(rerun) == 1 else 'run'}: its "
                                            f"inputs will change")
        else:
            upstream = {d: read_artifact(job, d) for d in deps}
            digest, _ = input_hash(stage, job, {k: v for k, v in upstream.items() if v is not None})
            previous = read_artifact(job, stage.key(job.stage_options.get(name)))
            made = decide(stage=name, input_hash=digest, previous=previous, force=force, upstream=upstream)
            decision = Preview(name, made.action, made.reason)
        predicted[name] = decision
        out.append(decision)
    return out


def render(previews: Sequence[Preview]) -> str:
    """One line a stage: `stage  would run|skip|be blocked: reason`."""
    width = max((len(p.stage) for p in previews), default=0)
    verb = {"run": "would run", "skip": "would be skipped", "block": "would be blocked"}
    return "\n".join(f"{p.stage:<{width}}  {verb[p.action]}: {p.reason}" for p in previews)
