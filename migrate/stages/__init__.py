"""The checklist stages, in their natural order; each module defines ``STAGE``."""

from __future__ import annotations

from importlib import import_module

from migrate.pipeline.stage import StageDefinition

# Registry order is the default execution order among independent stages.
_STAGE_MODULES = ("preflight", "comm", "ops", "search", "train", "convert", "resume", "stability", "gate")

STAGES: dict[str, StageDefinition] = {}
for _module in _STAGE_MODULES:
    _stage = import_module(f"migrate.stages.{_module}").STAGE
    STAGES[_stage.name] = _stage


def stage_order_problems(listed: tuple[str, ...]) -> list[str]:
    """Dependencies of listed stages that the job does not list (empty: consistent)."""
    problems = []
    for name in listed:
        stage = STAGES.get(name)
        for dep in stage.depends_on if stage else ():
            if dep not in listed:
                problems.append(f"stage {name!r} depends on {dep!r}, which the job does not list")
    return problems


def execution_order(names: tuple[str, ...] | list[str]) -> list[str]:
    """``names`` sorted so that every stage comes after the stages it uses (registry order otherwise)."""
    wanted = set(names)
    ordered: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in ordered or name not in wanted:
            return
        if name in visiting:
            raise ValueError(f"stage dependency cycle through {name!r}")
        visiting.add(name)
        for dep in STAGES[name].upstream_in(tuple(wanted)):
            visit(dep)
        visiting.discard(name)
        ordered.append(name)

    for name in STAGES:
        visit(name)
    return ordered
