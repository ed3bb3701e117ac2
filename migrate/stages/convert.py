"""Convert stage: the source checkpoint rewritten for the target layout, then verified.

Reads `source.checkpoint` (or, when the job has none and lists the train stage, the
baseline checkpoint that stage wrote), checked against `source.layout`, writes `<work_dir>/convert/checkpoint`
in the target format at the target dp size and ZeRO stage (options, else `target.layout`, else the
source's), with local worker processes (Ray tasks when the target names a Ray cluster other than
the embedded one), and verifies every tensor against the source. Fails when
verification finds a difference.
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal
from collections.abc import Mapping

from pydantic import Field, field_validator

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome
from migrate.stages._target import target_layout as resolve_target_layout


class ConvertOptions(StageOptions):
    to_format: str | None = Field(default=None, description="target format (deepspeed, deepspeed-universal, megatron, "
                                                            "megatron-legacy, dcp, hf); default: the source's")

    @field_validator("to_format")
    @classmethod
    def _known(cls, value: str | None) -> str | None:
        from checkpoint.api import WRITABLE_FORMATS
        from checkpoint.formats import FORMAT_ALIASES

        value = FORMAT_ALIASES.get(value, value) if value else value  # the earlier spelling is noted by `deprecations`
        if value is not None and value not in WRITABLE_FORMATS:
            raise ValueError(f"to_format {value!r}: expected one of {', '.join(WRITABLE_FORMATS)}")
        return value
    dp: int | None = Field(default=None, ge=1, description="target dp size; default: target.layout, else the source's")
    zero_stage: int | None = Field(default=None, ge=1, le=3, description="target ZeRO stage; default as dp")
    workers: int = Field(default=1, ge=1, description="local processes writing target files")
    verify: bool = Field(default=True, description="compare every converted tensor with the source")
    trust_checkpoint: bool = Field(default=False, description="allow pickled classes outside the allow-list")
    strict: Literal["report", "refuse-loss", "refuse-change"] = Field(
        default="report", description="state that would not pass unchanged: report lists it; refuse-loss fails the "
                                      "stage when source state would not reach the target; refuse-change also when "
                                      "the target would hold state derived rather than copied (RNG)")


def source_checkpoint(job: Any, upstream: Mapping[str, Any]) -> Path:
    """The checkpoint to convert: the job's ``source.checkpoint`` (the folder of its ``step`` when set, checked
    against its ``format`` unless auto), else the baseline train run's."""
    stated = job.spec.source.checkpoint
    if stated is not None:
        path = job.resolve(stated.path)
        if stated.step is not None:
            path = checkpoint_at_step(path, stated.step)
        if stated.format != "auto":
            from checkpoint.api import detect_format
            from checkpoint.errors import CheckpointFormatError

            try:
                found = detect_format(path)
            except CheckpointFormatError:
                found = None  # the reader names what is missing
            if found is not None and found != stated.format:
                raise ValueError(f"source.checkpoint.format: the job says {stated.format!r}, but {path} is a "
                                 f"{found!r} checkpoint")
        return path
    train = upstream.get("train")
    if train is not None and "checkpoint_dir" in train.outputs:
        return Path(train.outputs["checkpoint_dir"])
    raise ValueError("no source checkpoint: set source.checkpoint.path, or list the train stage (side: baseline) before convert")


STEP_FOLDERS = ("global_step{step}", "iter_{step:07d}", "step-{step}", "checkpoint-{step}")
"""How DeepSpeed, Megatron-LM, torchtitan and the HF Trainer name the folder of one saved step."""


def checkpoint_at_step(root: Path, step: int) -> Path:
    """The folder of saved step `step` in the save directory `root` (or `root` itself when it is that folder);
    ValueError naming the folders looked for and the steps that are there."""
    names = [pattern.format(step=step) for pattern in STEP_FOLDERS]
    if root.name in names:
        return root
    for name in names:
        if (root / name).is_dir():
            return root / name
    pattern = re.compile(r"^(?:global_step|iter_|step-|checkpoint-)(\d+)$")
    saved = sorted(int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
                   if p.is_dir() and (m := pattern.match(p.name)))
    raise ValueError(f"source.checkpoint.step: step {step} is not saved in {root} (looked for {', '.join(names)}); "
                     f"saved steps there: {saved or 'none'}")


def _fingerprint(job: Any, options: Any) -> dict[str, Any]:
    """The source checkpoint's files (sizes and times): a changed source re-runs the conversion."""
    if job.spec.source.checkpoint is None:
        return {}  # the train stage's result is hashed as an upstream input
    root = job.resolve(job.spec.source.checkpoint.path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return {"source_files": {str(p.relative_to(root)): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}


def run(ctx: StageContext) -> StageOutcome:
    from checkpoint.api import LayoutRequest, convert, detect_format, read_index
    from checkpoint.strictness import Strictness
    from migrate.convert_ray import bytes_by_node
    from checkpoint.destination import Existing, State, state_of
    from checkpoint.errors import OtherPlanError
    from checkpoint.pools import local_map
    from checkpoint.plan import rank_summaries, summarize
    from checkpoint.verify import compare_indexes

    options: ConvertOptions = ctx.options  # type: ignore[assignment]
    job = ctx.job.spec
    src = source_checkpoint(ctx.job, ctx.upstream)
    source_layout = job.source.layout.to_layout()
    target_layout = resolve_target_layout(ctx.job, ctx.upstream)[0]
    dp = options.dp or (target_layout.dp if target_layout else None)
    stage = options.zero_stage or (target_layout.zero_stage if target_layout and target_layout.zero_stage else None)
    dest = ctx.work_dir / "checkpoint"
    # the stage owns this folder: a conversion killed midway is finished, an earlier one replaced
    existing = Existing.RESUME if state_of(dest) is State.UNFINISHED else Existing.OVERWRITE
    ray_address = job.target.ray.address
    with ExitStack() as stack:
        map_fn = local_map(options.workers)
        if ray_address != "embedded":  # a real cluster: every target file is a Ray task there
            from migrate.convert_ray import ray_map
            from migrate.runtime.ray_cluster import connect

            stack.enter_context(connect(ray_address))
            map_fn = ray_map(max_in_flight=options.workers, shared=(src, dest))
        from_format = detect_format(src)
        to_format = options.to_format or from_format
        # Megatron's layout rules need the architecture, which a DeepSpeed/DCP checkpoint written outside
        # migrate does not record: the job's model section states it (one that records another is refused).
        model_config = (job.model.model_dump() if to_format.startswith("megatron") and not from_format.startswith("megatron")
                        else None)
        target = LayoutRequest(dp=dp, tp=target_layout.tp, pp=target_layout.pp, ep=target_layout.ep,
                               vpp=target_layout.vpp, zero_stage=stage)
        expect = LayoutRequest(dp=source_layout.dp, tp=source_layout.tp, pp=source_layout.pp, ep=source_layout.ep,
                               zero_stage=source_layout.zero_stage or None)

        def run_conversion(existing: Existing) -> Any:
            return convert(src, dest, to=to_format, target=target, expect=expect, strict=Strictness(options.strict),
                           map_fn=map_fn, model_config=model_config, existing=existing,
                           trust_checkpoint=options.trust_checkpoint,
                           phase=lambda text, files=(): ctx.status(text, files=[str(dest / f) for f in files]))

        try:
            outcome = run_conversion(existing)
        except OtherPlanError:  # killed midway, then the job changed: start over
            outcome = run_conversion(Existing.OVERWRITE)
    result = outcome.result
    problems = compare_indexes(outcome.plan.source, read_index(dest)) if options.verify else []
    plan_text = summarize(outcome.plan)
    (ctx.work_dir / "plan.txt").write_text(plan_text + "\n")
    per_rank = [{"rank": s.rank, "files": list(s.files), "bytes_read": s.bytes_read, "bytes_written": s.bytes_written}
                for s in rank_summaries(outcome.plan)]
    differences = [d.describe() for d in outcome.differences]
    placed = list(getattr(map_fn, "placements", ()))  # Ray tasks: where each file was written
    placements = [{"path": p.path, "rank": p.rank, "planned_node": p.planned, "written_node": p.written}
                  for p in placed]
    nodes = [dataclasses.asdict(n) for n in bytes_by_node(outcome.plan, placed)] if placed else []
    (ctx.work_dir / "convert.json").write_text(json.dumps({"ranks": per_rank, "problems": problems,
                                                           "differences": differences, "placements": placements,
                                                           "nodes": nodes,
                                                           "storage_shared_by": list(getattr(map_fn, "shared_by", ()))},
                                                          indent=2))
    metrics = {"files": len(result.files), "bytes": result.nbytes, "seconds": round(result.seconds, 3),
               "tensors": len(outcome.plan.target.index.entries), "verify_problems": len(problems),
               "state_differences": len(outcome.differences),
               "target_dp": outcome.plan.target.index.meta.get("dp"),
               "target_zero_stage": outcome.plan.target.index.meta.get("stage")}
    ctx.log_metrics(0, metrics)
    summary = (f"Converted `{src}` to {to_format} dp={metrics['target_dp']} "
               f"ZeRO-{metrics['target_zero_stage']}: {metrics['files']} files, {result.nbytes / 2**20:.2f} MiB in "
               f"{result.seconds:.2f} s; verification: "
               + ("every tensor equals the source" if options.verify and not problems else
                  f"{len(problems)} problems" if problems else "skipped")
               + "".join(f"\n- not passed unchanged: {d}" for d in differences)
               + f"\n\n```\n{plan_text}\n```\n")
    return StageOutcome(verdict="fail" if problems else "pass", metrics=metrics,
                        outputs={"checkpoint": str(dest), "plan": str(ctx.work_dir / "plan.txt")},
                        reasons=tuple(problems[:20]), summary_md=summary)


STAGE = StageDefinition(
    name="convert",
    description="rewrite the source checkpoint for the target layout (streamed, atomic) and verify it",
    run=run,
    options=ConvertOptions,
    after=("train", "search"),
    reads=("source", "target"),
    fingerprint=_fingerprint,
)
