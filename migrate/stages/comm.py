"""Comm: which collectives work on the target backend, which are wrong, what falls back, what bandwidth.

Runs on the job's target worker group: the capability/correctness matrix
(every collective x dtype x size against values computed without the backend),
the fallbacks for what training needs and the backend lacks (checked and
timed), the nccl-tests style bandwidth table, the mapping of the source job's
communication options to the target backend and, when ``compare_with`` names
the source cluster's result file, the source-vs-target comparison.

Fails when a collective returns wrong data, a fallback is wrong, or training
needs a collective that neither the backend nor a fallback provides.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from pydantic import Field, field_validator

from migrate.comm import bandwidth as bw
from migrate.comm import fallbacks as fb
from migrate.comm import matrix as mx
from migrate.comm.backends import FRAMEWORK_OPTIONS
from migrate.comm.report import read_json
from migrate.comm.suite import CommSuite, OptionInputs, run_suite, write_outputs
from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome

_PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class CommOptions(StageOptions):
    """Options of the comm stage (``stages: {comm: {...}}`` in the job)."""

    ops: tuple[str, ...] = Field(default=mx.ALL_CHECKS, description="collective families or checks")
    dtypes: tuple[str, ...] = Field(default=("fp32", "bf16", "fp16", "int32", "int64"),
                                    description="dtypes of the matrix: fp32, bf16, fp16, fp64, int32, int64, int8, uint8")
    sizes: tuple[int, ...] = Field(default=mx.DEFAULT_SIZES, description="elements per rank chunk")
    world_size: int | None = Field(default=None, ge=1, description="ranks; default target.device_count")
    fallbacks: bool = True
    """check the compositions that stand in for what the target lacks (e.g. uneven all_gather by padding) and time
    them next to the native op"""
    fallback_sizes: tuple[int, ...] = (7, 65_537)
    """elements per rank chunk of the fallback checks"""
    fallback_iters: int = Field(default=5, ge=1)
    """timed iterations of each fallback"""
    bandwidth: bool = True
    """measure bus and algorithm bandwidth per op and size (nccl-tests' definitions)"""
    bandwidth_ops: tuple[str, ...] = bw.BW_OPS
    """ops whose bandwidth is measured"""
    bandwidth_sizes: tuple[int, ...] = Field(default=bw.DEFAULT_SIZES_BYTES, description="S in bytes")
    bandwidth_dtype: str | None = Field(default=None, description="fp32, bf16 or fp16; default: the training precision")
    warmup: int = Field(default=5, ge=0)
    """untimed iterations before each bandwidth measurement"""
    iters: int = Field(default=20, ge=1)
    """timed iterations of each bandwidth measurement"""
    compare_with: str | None = Field(default=None, description="source cluster's comm_result.json")
    source_env: dict[str, str] = Field(default_factory=dict, description="source job's NCCL_*/HCCL_*/... settings")
    source_options: dict[str, Any] = Field(default_factory=dict, description="bucket sizes, overlap, timeouts")
    fail_on_missing: bool = True
    """fail when a collective that training needs at the job's precision neither works nor has a working fallback"""

    @field_validator("dtypes", "bandwidth_dtype")
    @classmethod
    def _dtypes(cls, value: Any) -> Any:
        names = (value,) if isinstance(value, str) else value or ()
        unknown = [n for n in names if n not in mx.SHORT_NAMES and n not in mx.DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; known: {[*mx.SHORT_NAMES, 'int32', 'int64', 'int8', 'uint8']}")
        return value  # torch's float names too: the earlier spelling, noted by `deprecations`

    @field_validator("ops")
    @classmethod
    def _ops(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        mx.expand_checks(value)
        return value

    @field_validator("source_options")
    @classmethod
    def _source_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(FRAMEWORK_OPTIONS))
        if unknown:
            raise ValueError(f"unknown source_options {unknown}; known: {sorted(FRAMEWORK_OPTIONS)}")
        return value


def _torch_names(names: Any) -> tuple[str, ...]:
    return tuple(mx.SHORT_NAMES.get(n, n) for n in names)


def build_suite(options: CommOptions, precision: str) -> CommSuite:
    """The plans the options describe (pure)."""
    train_dtype = _PRECISION_DTYPE[precision]
    return CommSuite(
        matrix=mx.MatrixPlan(checks=mx.expand_checks(options.ops), dtypes=tuple(_torch_names(options.dtypes)),
                             sizes=tuple(options.sizes)),
        fallbacks=fb.FallbackPlan(dtypes=tuple(dict.fromkeys((train_dtype, "float32"))),
                                  sizes=tuple(options.fallback_sizes), iters=options.fallback_iters)
        if options.fallbacks else None,
        bandwidth=bw.BandwidthPlan(ops=tuple(options.bandwidth_ops), sizes_bytes=tuple(options.bandwidth_sizes),
                                   dtype=_torch_names((options.bandwidth_dtype or train_dtype,))[0], warmup=options.warmup,
                                   iters=options.iters) if options.bandwidth else None,
        precision=precision,
    )


def judge(result: Any, fail_on_missing: bool) -> list[str]:
    """Reasons the comm result fails the job (empty: pass). Pure."""
    reasons: list[str] = []
    if result.matrix is not None:
        for cell in result.matrix.by_status("wrong"):
            reasons.append(f"{cell.check} {cell.dtype} n={cell.numel} returned wrong data: {cell.detail}")
    for f in result.fallbacks:
        if f.status == "wrong":
            reasons.append(f"fallback {f.fallback} {f.dtype} n={f.numel} is wrong: {f.detail}")
    if fail_on_missing:
        for c in result.fallback_choices:
            if c.fallback is None:
                reasons.append(f"training needs {c.check} {c.dtype}: {c.reason}")
    return reasons


def _fingerprint(job: Any, options: Any) -> Mapping[str, Any]:
    if not options.compare_with:
        return {}
    path = Path(job.resolve(options.compare_with))
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"
    return {"compare_with_sha256": digest}


def run(ctx: StageContext) -> StageOutcome:
    options: CommOptions = ctx.options  # type: ignore[assignment]
    spec = ctx.job.spec
    suite = build_suite(options, spec.training.precision)
    source = read_json(Path(ctx.job.resolve(options.compare_with))) if options.compare_with else None
    overrides = {"world_size": options.world_size} if options.world_size else {}
    option_inputs = OptionInputs(source_backend=spec.source.cluster.resolved_backend.split(",")[-1].split(":")[-1],
                                 env=options.source_env, framework=options.source_options)
    with ctx.worker_group(**overrides) as group:
        result = run_suite(group, suite, options=option_inputs)
    paths, comparison, text = write_outputs(result, ctx.work_dir, source=source)
    reasons = judge(result, options.fail_on_missing)
    counts = {s: len(result.matrix.by_status(s)) for s in ("ok", "wrong", "error", "n/a")} if result.matrix else {}
    metrics: dict[str, Any] = {"backend": result.backend, "world_size": result.world_size,
                               **{f"cells_{k.replace('/', '')}": v for k, v in counts.items()},
                               "fallbacks_chosen": sum(1 for c in result.fallback_choices if c.fallback),
                               "needs_unmet": sum(1 for c in result.fallback_choices if c.fallback is None)}
    ar = [r for r in result.bandwidth if r.op == "all_reduce" and r.busbw_gbps is not None]
    if ar:
        top = max(ar, key=lambda r: r.size_bytes)
        metrics["all_reduce_busbw_gbps"] = round(top.busbw_gbps or 0.0, 4)
        metrics["all_reduce_bytes"] = top.size_bytes
    if comparison is not None:
        metrics["lost_support"] = len(comparison.lost_support)
        metrics["correctness_changes"] = len(comparison.correctness)
        ratios = [r.busbw_ratio for r in comparison.bandwidth]
        if ratios:
            metrics["busbw_ratio_min"] = round(min(ratios), 4)
    ctx.log_metrics(0, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    if result.matrix:
        ctx.tracker.log_table("comm", "matrix", ["check", "dtype", "elements", "status", "detail"],
                              [[c.check, c.dtype, c.numel, c.status, c.detail] for c in result.matrix.cells])
    if reasons:
        text += "\nProblems:\n" + "\n".join(f"- {r}" for r in reasons) + "\n"
    return StageOutcome(verdict="fail" if reasons else "pass", metrics=metrics, outputs=paths,
                        reasons=tuple(reasons), summary_md=text)


STAGE = StageDefinition(
    name="comm",
    description="collective capability/correctness matrix, fallbacks, bandwidth and source comparison",
    run=run,
    options=CommOptions,
    depends_on=("preflight",),
    reads=("source", "target", "training"),
    fingerprint=_fingerprint,
)
