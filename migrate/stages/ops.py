"""Ops stage: operator numerics, coverage and layer drift on one target device.

Runs :func:`convergence.ops.suite.run_suite` inside a one-rank worker group on the
job's target (so it measures the target's kernels), with the job's model for the
coverage scan and the drift comparison (target device in the job's precision vs CPU
fp32). Writes ``ops.json``; fails when an operator, the coverage or the drift fails.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import Field

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


class OpsOptions(StageOptions):
    dtypes: tuple[str, ...] = Field(default=("fp32", "bf16", "fp16"), description="dtypes to test")
    operators: tuple[str, ...] | None = Field(default=None, description="operators to test; default: all")
    drift_dtype: str | None = Field(default=None, description="dtype of the drift run; default: training.precision")
    model: bool = Field(default=True, description="scan the job's model for coverage and layer drift")


def model_inputs(model_section: dict[str, Any], seed: int) -> dict[str, Any]:
    """model_factory / batch / loss_fn for the job's decoder (the workload's own model)."""
    import torch

    from migrate.workload.model_spec import ModelSpec
    from migrate.workload.torch_model import build_decoder

    names = {f.name for f in dataclasses.fields(ModelSpec)}
    spec = ModelSpec(**{k: v for k, v in model_section.items() if k in names})
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length + 1), generator=gen)
    return {"model_factory": lambda: build_decoder(spec, seed), "batch": (tokens[:, :-1], tokens[:, 1:]),
            "loss_fn": lambda model, batch: model(*batch)}


def probe(ctx: Any, options: dict[str, Any], model_section: dict[str, Any] | None, seed: int,
          drift_dtype: str) -> dict[str, Any]:
    """On one worker: the suite on the worker's device (module-level so worker groups can pickle it)."""
    from convergence.ops.suite import run_suite

    kwargs = model_inputs(model_section, seed) if model_section is not None else {}
    return run_suite(ctx.device, options["dtypes"], ops=options["operators"], drift_dtype=drift_dtype, **kwargs)


def run(ctx: StageContext) -> StageOutcome:
    from convergence.ops.suite import summary_markdown

    options: OpsOptions = ctx.options  # type: ignore[assignment]
    job = ctx.job.spec
    drift_dtype = options.drift_dtype or job.training.precision
    with ctx.worker_group(world_size=1, init_distributed=False) as group:
        (result,) = group.run(probe, options.model_dump(), job.model.model_dump() if options.model else None,
                              job.training.seed, drift_dtype)
    path = ctx.work_dir / "ops.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    statuses = [r["status"] for r in result["operators"]]
    metrics = {"operators": len(statuses), "passed": statuses.count("pass"), "failed": statuses.count("fail"),
               "unsupported": statuses.count("unsupported")}
    if "coverage" in result:
        metrics["coverage_missing"] = len(result["coverage"]["missing"])
        metrics["coverage_fallback"] = len(result["coverage"]["fallback"])
    ctx.log_metrics(0, metrics)
    return StageOutcome(verdict="pass" if result["passed"] else "fail", metrics=metrics, outputs={"ops": str(path)},
                        reasons=tuple(result["reasons"]), summary_md=summary_markdown(result))


STAGE = StageDefinition(
    name="ops",
    description="operator numerics vs float64, coverage scan and layer drift on the target device",
    run=run,
    options=OpsOptions,
    reads=("target", "model", "training"),
)
