"""One-call entry points: read (detect the format), plan, convert. Thin composition of the modules.

`read_index(path)` -> CheckpointIndex; `plan_conversion(index, to=..., dp=..., zero_stage=...)` ->
(ConversionPlan, Writer); `convert(src, dst, ...)` runs the plan (or only plans, with dry_run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.execute import ExecutionResult, MapFn, Writer, check_destination, execute
from checkpoint.formats import deepspeed
from checkpoint.index import CheckpointIndex
from checkpoint.plan import ConversionPlan, make_plan

FORMATS = ("deepspeed",)


def detect_format(path: str | Path) -> str:
    """The format of the checkpoint at `path`; raises CheckpointFormatError naming what was looked for."""
    if deepspeed.is_deepspeed_checkpoint(path):
        return deepspeed.FORMAT
    raise CheckpointFormatError(f"{path}: no known checkpoint format found (looked for: {', '.join(FORMATS)})")


def read_index(path: str | Path, *, trust_checkpoint: bool = False, expect_dp: int | None = None,
               expect_stage: int | None = None) -> CheckpointIndex:
    """Index the checkpoint at `path` from metadata only, checking the declared layout when given."""
    fmt = detect_format(path)
    if fmt == deepspeed.FORMAT:
        return deepspeed.read_deepspeed(path, trust_checkpoint=trust_checkpoint, expect_dp=expect_dp,
                                        expect_stage=expect_stage)
    raise CheckpointFormatError(f"{path}: no reader for format {fmt!r}")


def plan_conversion(index: CheckpointIndex, *, to: str, dp: int | None = None,
                    zero_stage: int | None = None) -> tuple[ConversionPlan, Writer]:
    """Plan `index` into format `to` at the target layout (defaults: the source's dp and stage)."""
    if to == deepspeed.FORMAT:
        dp = dp if dp is not None else int(index.meta.get("dp", 1))
        stage = zero_stage if zero_stage is not None else int(index.meta.get("stage", 1))
        return make_plan(index, deepspeed.deepspeed_target(index, dp=dp, zero_stage=stage)), deepspeed.DeepSpeedWriter()
    raise PlanError(f"no writer for target format {to!r}; supported: {', '.join(FORMATS)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionOutcome:
    plan: ConversionPlan
    result: ExecutionResult | None  # None for a dry run


def convert(src: str | Path, dst: str | Path, *, to: str, dp: int | None = None, zero_stage: int | None = None,
            dry_run: bool = False, map_fn: MapFn | None = None, trust_checkpoint: bool = False,
            expect_dp: int | None = None, expect_stage: int | None = None) -> ConversionOutcome:
    """Read `src`, plan for the target, and (unless dry_run) write `dst` atomically with a manifest."""
    if Path(dst).resolve() == Path(src).resolve():
        raise PlanError(f"destination {dst} is the source; choose another directory")
    index = read_index(src, trust_checkpoint=trust_checkpoint, expect_dp=expect_dp, expect_stage=expect_stage)
    plan, writer = plan_conversion(index, to=to, dp=dp, zero_stage=zero_stage)
    if dry_run:
        check_destination(Path(dst))
        return ConversionOutcome(plan=plan, result=None)
    return ConversionOutcome(plan=plan, result=execute(plan, writer, dst, map_fn=map_fn,
                                                       trust_checkpoint=trust_checkpoint))
