"""One-call entry points: read (detect the format), plan, convert. Thin composition over the format table.

`read_index(path)` -> CheckpointIndex; `plan_conversion(index, to=..., dp=..., zero_stage=...)` ->
(ConversionPlan, Writer); `convert(src, dst, ...)` runs the plan (or only plans, with dry_run).
Formats come from `checkpoint.formats.FORMATS`; nothing here names a format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.execute import ExecutionResult, MapFn, Writer, check_destination, execute
from checkpoint.formats import FORMATS as FORMAT_TABLE
from checkpoint.formats import CheckpointFormat, ReadOptions, TargetOptions
from checkpoint.index import CheckpointIndex
from checkpoint.plan import ConversionPlan, make_plan

FORMATS: tuple[str, ...] = tuple(f.name for f in FORMAT_TABLE)
WRITABLE_FORMATS: tuple[str, ...] = tuple(f.name for f in FORMAT_TABLE if f.writable)


def get_format(name: str) -> CheckpointFormat:
    """The table entry named `name`; raises PlanError listing the known names."""
    for f in FORMAT_TABLE:
        if f.name == name:
            return f
    raise PlanError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")


def detect_format(path: str | Path) -> str:
    """The format of the checkpoint at `path`; raises CheckpointFormatError naming what was looked for."""
    for f in FORMAT_TABLE:
        if f.detect(Path(path)):
            return f.name
    raise CheckpointFormatError(f"{path}: no known checkpoint format found (looked for: {', '.join(FORMATS)})")


def read_index(path: str | Path, *, trust_checkpoint: bool = False, expect_dp: int | None = None,
               expect_stage: int | None = None, expect_tp: int | None = None, expect_pp: int | None = None,
               expect_ep: int | None = None, fmt: str | None = None) -> CheckpointIndex:
    """Index the checkpoint at `path` (format detected unless `fmt`) from metadata only, checking the
    declared layout when given."""
    spec = get_format(fmt) if fmt is not None else get_format(detect_format(path))
    return spec.read(Path(path), ReadOptions(trust_checkpoint=trust_checkpoint, dp=expect_dp,
                                             zero_stage=expect_stage, tp=expect_tp, pp=expect_pp, ep=expect_ep))


def plan_conversion(index: CheckpointIndex, *, to: str, dp: int | None = None, zero_stage: int | None = None,
                    tp: int | None = None, pp: int | None = None, ep: int | None = None, vpp: int | None = None,
                    arch: str | None = None, model_config: Mapping[str, Any] | None = None
                    ) -> tuple[ConversionPlan, Writer]:
    """Plan `index` into format `to` at the target layout (None: the source's, or the format's only choice).

    `model_config`: the architecture (ModelSpec-style fields) for targets that need one the source lacks."""
    spec = get_format(to)
    if spec.target is None or spec.writer is None:
        raise PlanError(f"format {to!r} is read-only; writable formats: {', '.join(WRITABLE_FORMATS)}")
    opts = TargetOptions(dp=dp, zero_stage=zero_stage, tp=tp, pp=pp, ep=ep, vpp=vpp, arch=arch,
                         model_config=model_config)
    target = spec.target(index, opts)
    writer = spec.writer
    if target.index.meta.get("writer_in_memory") and getattr(writer, "in_place", False):
        # the target's files hold values the writer derives (not copied from the source): assemble in memory
        writer = dataclasses.replace(writer, in_place=False)
    return make_plan(index, target), writer


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionOutcome:
    plan: ConversionPlan
    result: ExecutionResult | None  # None for a dry run


def convert(src: str | Path, dst: str | Path, *, to: str, dp: int | None = None, zero_stage: int | None = None,
            tp: int | None = None, pp: int | None = None, ep: int | None = None, vpp: int | None = None,
            arch: str | None = None, model_config: Mapping[str, Any] | None = None, dry_run: bool = False,
            map_fn: MapFn | None = None,
            trust_checkpoint: bool = False,
            expect_dp: int | None = None, expect_stage: int | None = None, expect_tp: int | None = None,
            expect_pp: int | None = None, expect_ep: int | None = None) -> ConversionOutcome:
    """Read `src`, plan for the target, and (unless dry_run) write `dst` atomically with a manifest."""
    if Path(dst).resolve() == Path(src).resolve():
        raise PlanError(f"destination {dst} is the source; choose another directory")
    index = read_index(src, trust_checkpoint=trust_checkpoint, expect_dp=expect_dp, expect_stage=expect_stage,
                       expect_tp=expect_tp, expect_pp=expect_pp, expect_ep=expect_ep)
    plan, writer = plan_conversion(index, to=to, dp=dp, zero_stage=zero_stage, tp=tp, pp=pp, ep=ep, vpp=vpp,
                                   arch=arch, model_config=model_config)
    if dry_run:
        check_destination(Path(dst))
        return ConversionOutcome(plan=plan, result=None)
    return ConversionOutcome(plan=plan, result=execute(plan, writer, dst, map_fn=map_fn,
                                                       trust_checkpoint=trust_checkpoint))
