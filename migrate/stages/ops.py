"""Ops stage: operator numerics, coverage and layer drift on one target device.

Runs :func:`convergence.ops.suite.run_suite` inside a one-rank worker group on the
job's target (so it measures the target's kernels), with the job's model for the
coverage scan and the drift comparison (target device in the job's precision vs CPU
fp32). Writes ``ops.json``; fails when an operator, the coverage or the drift fails.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


DtypeName = Literal["fp32", "bf16", "fp16"]


class CustomOperator(StageOptions):
    """One of the user's operators (see `convergence.ops.registry`); implementations as 'module:function'
    or 'path/to/file.py:function' (relative to the job file)."""

    name: str
    """the operator's name in reports and dumps"""
    reference: str = Field(description="the operator's reference implementation (the mathematics, plain torch)")
    targets: dict[str, str | list[str]] = Field(default_factory=dict, description="backend (cpu, cuda, npu, ...) -> "
                                                "its implementation(s), in preference order")
    inputs: str | dict[str, dict[str, Any]] = Field(description="'module:function' (generator, case) -> {name: "
                                                    "tensor}, or {input: {shape, dtype, low, high, p}}")
    cases: list[str] | dict[str, dict[str, dict[str, Any]] | None] = Field(
        default_factory=lambda: ["typical"], description="input cases (with declared inputs: per-case overrides)")
    outputs: list[int] | None = Field(default=None, description="compared outputs by index (default: all)")
    grad: list[str] | None = Field(default=None, description="inputs whose gradients are compared (default: the "
                                                             "floating ones)")
    dtypes: list[DtypeName] | None = Field(default=None, description="dtypes it runs in (default: the stage's)")
    tolerances: dict[DtypeName, dict[str, float]] = Field(default_factory=dict, description="per dtype: cosine_min, "
                                                          "max_abs_eps, max_rel_eps, mean_ulp")
    max_error_ratio: float = Field(default=2.0, gt=0, description="allowed error as a multiple of the reference's "
                                                                 "in the same dtype")


class OpsOptions(StageOptions):
    dtypes: tuple[str, ...] = Field(default=("fp32", "bf16", "fp16"), description="dtypes to test")
    operators: tuple[str, ...] | None = Field(default=None, description="built-in operators to test; default: all")
    drift_dtype: str | None = Field(default=None, description="dtype of the drift run; default: training.precision")
    model: bool = Field(default=True, description="scan the job's model for coverage and layer drift")
    custom: list[CustomOperator] = Field(default_factory=list, description="the user's operators and their "
                                                                           "implementations per backend")
    registry: list[str] = Field(default_factory=list, description="modules or .py files defining OPERATORS")
    allow_fallback: bool = Field(default=True, description="an operator with no implementation for the target's "
                                                          "backend passes when the reference runs there")
    model_factory: str | None = Field(default=None, description="'module:function' returning {model_factory, batch, "
                                                                "loss_fn}: the model to scan instead of the job's")
    dump: str | None = Field(default=None, description="record operators and the model step here (safetensors)")
    compare: str | None = Field(default=None, description="replay a dump made on another cluster and compare")
    compare_dtype: DtypeName | None = Field(default=None, description="dtype of the replay (default: as dumped; "
                                                                      "the model step: drift_dtype)")
    world_size: int = Field(default=1, ge=1, description="data-parallel ranks that run the compared model step")

    @model_validator(mode="after")
    def _one_direction(self) -> OpsOptions:
        if self.dump and self.compare:
            raise ValueError(f"dump ({self.dump}) and compare ({self.compare}): one run either records or compares")
        return self


def model_inputs(model_section: dict[str, Any], seed: int) -> dict[str, Any]:
    """model_factory / batch / loss_fn for the job's decoder (the workload's own model)."""
    import torch

    from checkpoint.model_shape import ModelShape
    from migrate.workload.torch_model import build_decoder

    names = {f.name for f in dataclasses.fields(ModelShape)}
    spec = ModelShape(**{k: v for k, v in model_section.items() if k in names})
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length + 1), generator=gen)
    return {"model_factory": lambda: build_decoder(spec, seed), "batch": (tokens[:, :-1], tokens[:, 1:]),
            "loss_fn": lambda model, batch: model(*batch)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpsRequest:
    """What one run of the suite needs, as plain data a worker can unpickle (paths absolute)."""

    options: dict[str, Any]
    model_section: dict[str, Any] | None
    seed: int
    drift_dtype: str
    base: str  # the job file's folder: relative module files and dump folders are resolved against it


def suite_inputs(request: OpsRequest) -> dict[str, Any]:
    """The registry and the model of a request (imports the user's code: call it where the suite runs)."""
    from pathlib import Path

    from convergence.ops.registry import load_registry, resolve

    options, base = request.options, Path(request.base)
    custom = load_registry(options["custom"], options["registry"], base=base)
    model: dict[str, Any] = {}
    if options["model_factory"]:
        made = resolve(options["model_factory"], base=base, where="stages.ops.model_factory")()
        model = {k: made[k] for k in ("model_factory", "batch", "loss_fn")}
    elif request.model_section is not None:
        model = model_inputs(request.model_section, request.seed)
    return {"custom": custom, **model}


def probe(ctx: Any, request: OpsRequest) -> dict[str, Any] | None:
    """On every worker of the group: rank 0 runs the suite on its device; with a compare at world size > 1
    every rank first runs its share of the compared model step (module-level so worker groups can pickle it)."""
    from convergence.ops.suite import run_suite

    options = request.options
    inputs = suite_inputs(request)
    captures = None
    if options["compare"] and ctx.world_size > 1 and "model_factory" in inputs:
        from convergence.ops.dump import data_parallel_capture

        captures = data_parallel_capture(inputs["model_factory"], options["compare"], inputs["loss_fn"],
                                         device=ctx.device, dtype=options["compare_dtype"] or request.drift_dtype)
    if ctx.rank != 0:
        return None
    return run_suite(ctx.device, options["dtypes"], ops=options["operators"], drift_dtype=request.drift_dtype,
                     allow_fallback=options["allow_fallback"], dump=options["dump"], compare=options["compare"],
                     compare_dtype=options["compare_dtype"], layer_captures=captures, world_size=ctx.world_size,
                     **inputs)


def ops_request(job: Any, options: OpsOptions, base: Path) -> OpsRequest:
    """The request of a stage's options: the dump and compare folders made absolute against `base`."""
    data = options.model_dump(mode="json")
    for key in ("dump", "compare"):
        if data[key]:
            data[key] = str((base / data[key]).resolve())
    return OpsRequest(options=data, model_section=job.model.model_dump() if options.model else None,
                      seed=job.training.seed, drift_dtype=options.drift_dtype or job.training.precision, base=str(base))


def run(ctx: StageContext) -> StageOutcome:
    from convergence.ops.suite import summary_markdown

    options: OpsOptions = ctx.options  # type: ignore[assignment]
    request = ops_request(ctx.job.spec, options, ctx.job.path.parent)
    with ctx.worker_group(world_size=options.world_size if options.compare else 1,
                          init_distributed=bool(options.compare) and options.world_size > 1) as group:
        result = group.run(probe, request)[0]
    assert result is not None  # rank 0 returns the suite's result
    path = ctx.work_dir / "ops.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    statuses = [r["status"] for r in result["operators"]]
    metrics: dict[str, Any] = {"operators": len(statuses), "passed": statuses.count("pass"), "failed": statuses.count("fail"),
               "unsupported": statuses.count("unsupported")}
    for status in ("native", "fallback", "missing", "wrong"):
        metrics[f"custom_{status}"] = sum(1 for v in result["custom"] if v["status"] == status)
    if "coverage" in result:
        metrics["coverage_missing"] = len(result["coverage"]["missing"])
        metrics["coverage_fallback"] = len(result["coverage"]["fallback"])
    if "compare" in result:
        metrics["compare_operators_differing"] = sum(1 for r in result["compare"]["operators"] if not r["passed"])
    ctx.log_metrics(0, metrics)
    outputs = {"ops": str(path)}
    if options.dump:
        outputs["dump"] = request.options["dump"]
    return StageOutcome(verdict="pass" if result["passed"] else "fail", metrics=metrics, outputs=outputs,
                        reasons=tuple(result["reasons"]), summary_md=summary_markdown(result))


def _fingerprint(job: Any, options: Any) -> dict[str, Any]:
    """The user's operator code (its .py files) and a compared dump's manifest are inputs too."""
    import hashlib

    base = job.path.parent
    refs = [*(c.reference for c in options.custom), *(t for c in options.custom for v in c.targets.values()
                                                     for t in ([v] if isinstance(v, str) else v)),
            *(c.inputs for c in options.custom if isinstance(c.inputs, str)), *options.registry,
            *([options.model_factory] if options.model_factory else [])]
    found: dict[str, Any] = {}
    for ref in refs:
        file = ref.rpartition(":")[0] if ":" in ref else ref
        path = (base / file) if file.endswith(".py") else None
        if path is not None and path.is_file():
            found[file] = hashlib.sha256(path.read_bytes()).hexdigest()
    if options.compare:
        manifest = (base / options.compare / "manifest.json")
        found["compare"] = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
    return found


STAGE = StageDefinition(
    name="ops",
    description="operator numerics vs float64, coverage scan and layer drift on the target device",
    run=run,
    options=OpsOptions,
    reads=("target", "model", "training"),
    fingerprint=_fingerprint,
    version="2",
)
