"""Train: real training steps of the job's model on the worker group.

``side: baseline`` trains at the source layout (the CPU demo makes its own baseline run
and checkpoints this way); ``side: target`` at the target layout. The built-in engines
(Megatron-Core, DeepSpeed, FSDP2) or the user's own launch line (``command``) run on one
worker group; per-step metrics stream to the tracker while training runs, land in
``<stage>/<side>/metrics.jsonl`` (the gate's input) and the checkpoints in
``<stage>/<side>/checkpoints`` in the framework's own format.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from pathlib import Path
from typing import Any, Literal
from collections.abc import Callable

from pydantic import Field

from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


class TrainOptions(StageOptions):
    side: Literal["baseline", "target"] = "baseline"
    """baseline: the source layout; target: the target layout (the job's or the search's)"""
    steps: int | None = Field(default=None, ge=1, description="optimizer steps; default training.train_steps")
    save_every: int = Field(default=0, ge=0, description="checkpoint every K steps (0: only at the end)")
    load: str | None = Field(default=None, description="checkpoint to resume from (relative to the job file)")
    engine: Literal["deepspeed", "megatron", "fsdp"] | None = Field(
        default=None, description="default: from the source format / layout")
    command: str | None = Field(
        default=None, description="external launch line with {tp} {pp} {dp} {load} {save} ... placeholders")


class MetricsFollower:
    """Tails rank 0's per-step JSONL while training runs: progress bar and live tracking of what `select`
    takes from each line (default: every value but the step)."""

    def __init__(self, path: Path, ctx: StageContext, total: int | None,
                 select: Callable[[dict[str, Any]], dict[str, Any]] | None = None, side: str | None = None):
        self.path, self.ctx, self.total, self.side = path, ctx, total, side
        self.select = select or (lambda record: {k: v for k, v in record.items() if k != "step"})
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MetricsFollower:
        from tqdm import tqdm

        self.ctx.status(None)  # the bar says it
        self._bar = tqdm(total=self.total, desc=f"[{self.ctx.stage}] steps", leave=False, dynamic_ncols=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            fh.seek(self._offset)
            for line in fh:
                if not line.endswith("\n"):
                    break
                self._offset += len(line)
                record = json.loads(line)
                self.ctx.log_metrics(int(record["step"]), self.select(record), side=self.side)
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}")

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._poll()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        self._bar.close()
        self.ctx.status("running")


def _summary(records: list[dict[str, Any]], world: int, label: str, stopped: str | None) -> tuple[dict[str, Any], str]:
    losses = [r["loss"] for r in records]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    tokens = [r.get("tokens", 0) for r in records]
    metrics: dict[str, Any] = {
        "steps": len(records),
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "world_size": world,
    }
    if times:
        median = statistics.median(times)
        metrics["step_time_s_median"] = round(median, 4)
        metrics["tokens_per_s"] = round(statistics.median(tokens) / median, 1) if median > 0 else None
    peaks = [r["peak_memory_bytes"] for r in records if "peak_memory_bytes" in r]
    if peaks:
        metrics["peak_memory_mib"] = round(max(peaks) / 2**20, 1)
    rows = "\n".join(
        f"| {r['step']} | {r['loss']:.6f} | {r.get('grad_norm', float('nan')):.4f} | {r.get('lr', float('nan')):.3g} |"
        for r in records[-10:]
    )
    summary = (
        f"{label}: {len(records)} step(s) on {world} rank(s); loss {metrics['first_loss']} -> {metrics['final_loss']}.\n\n"
        "| step | loss | grad norm | lr |\n|---|---|---|---|\n" + rows + "\n"
    )
    if stopped:
        summary += f"\nStopped early: {stopped}\n"
    return metrics, summary


def _run_builtin(ctx: StageContext, options: TrainOptions, side_dir: Path) -> StageOutcome:
    from migrate.workload.engines import rank_entry
    from migrate.workload.from_job import default_engine, run_spec

    job = ctx.job.spec
    layout = _layout(ctx, options)
    engine = options.engine or default_engine(job, layout)
    steps = options.steps or job.training.train_steps
    metrics_path = side_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    if options.load:  # the frameworks' loaders unpickle freely: refuse what is not on the allow-lists first
        from checkpoint.safe_load import check_pickles

        check_pickles(ctx.job.resolve(options.load))
    spec = run_spec(
        job, layout, engine=engine, steps=steps, save_dir=str(side_dir / "checkpoints"),
        load_dir=str(ctx.job.resolve(options.load)) if options.load else None,
        save_every=options.save_every, metrics_path=str(metrics_path), micro_batch_size=_micro_batch(ctx, options),
    )
    env = {"DS_ACCELERATOR": job.target.device_type, "OMP_NUM_THREADS": "1"}
    with ctx.worker_group(world_size=layout.world_size, env=env) as group:
        with MetricsFollower(metrics_path, ctx, total=steps, side=options.side):
            results = group.run(rank_entry(engine), spec)
    main = results[0]
    records = [m.as_dict() for m in main.metrics]
    label = (f"{options.side} run, {engine} at {layout.describe()}"
             + (f", resumed from step {main.start_step}" if main.start_step else ""))
    metrics, summary = _summary(records, layout.world_size, label, main.stopped)
    metrics.update({"engine": engine, "start_step": main.start_step, "layout": layout.describe(), "side": options.side})
    reasons = []
    if main.stopped:
        reasons.append(f"training stopped: {main.stopped}")
    nonfinite = [r["step"] for r in records if not all(math.isfinite(r[k]) for k in ("loss", "grad_norm"))]
    if nonfinite:
        reasons.append(f"non-finite loss or grad norm at step(s) {nonfinite[:10]}")
    outputs = {"metrics": str(metrics_path)}
    if main.checkpoints:
        outputs["checkpoint"] = main.checkpoints[-1]
        outputs["checkpoint_dir"] = str(side_dir / "checkpoints")
    (side_dir / "rank0.json").write_text(json.dumps({"start_step": main.start_step, "checkpoints": list(main.checkpoints),
                                                     "stopped": main.stopped, "extra": main.extra}, indent=2, default=str))
    return StageOutcome(verdict="fail" if reasons else "pass", metrics=metrics, outputs=outputs,
                        reasons=tuple(reasons), summary_md=summary)


def _run_external(ctx: StageContext, options: TrainOptions, side_dir: Path) -> StageOutcome:
    from convergence.readers import read_metrics
    from migrate.workload.external import render_command, run_external

    job = ctx.job.spec
    layout = _layout(ctx, options)
    steps = options.steps or job.training.train_steps
    per_node = job.target.devices_per_node or layout.world_size
    values = {
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "vpp": layout.vpp,
        "world_size": layout.world_size, "load": str(ctx.job.resolve(options.load)) if options.load else "",
        "save": str(side_dir / "checkpoints"), "steps": steps, "seed": job.training.seed,
        "global_batch_size": job.training.global_batch_size, "micro_batch_size": _micro_batch(ctx, options),
        "nproc_per_node": min(per_node, layout.world_size), "nnodes": max(1, layout.world_size // per_node),
    }
    argv = render_command(options.command or "", values)
    log_dir = side_dir / "logs"
    with ctx.worker_group(world_size=layout.world_size, init_distributed=False) as group:
        results = group.run(run_external, argv, str(log_dir))
    failed = [r for r in results if r.returncode != 0]
    run = read_metrics(results[0].log_path) if Path(results[0].log_path).exists() else None
    loss = run.find("loss") if run else None
    records = []
    if loss is not None and run is not None:
        others = {name: run.find(name) for name in ("grad_norm", "lr")}
        for step, value in zip(loss.steps, loss.values):
            record = {"step": int(step), "loss": float(value)}
            for name, series in others.items():
                found = series.value_at(step) if series is not None else None
                if found is not None:
                    record[name] = float(found)
            records.append(record)
            ctx.log_metrics(int(step), {k: v for k, v in record.items() if k != "step"}, side=options.side)
    metrics_path = side_dir / "metrics.jsonl"
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics, summary = _summary(records, layout.world_size, f"{options.side} run, external command at {layout.describe()}", None)
    reasons = [f"rank {r.rank} exited with code {r.returncode} (log {r.log_path})" for r in failed]
    if not records:
        reasons.append(f"no training metrics found in {results[0].log_path}")
    return StageOutcome(verdict="fail" if reasons else "pass", metrics=metrics, reasons=tuple(reasons), summary_md=summary,
                        outputs={"metrics": str(metrics_path), "logs": str(log_dir),
                                 "checkpoint_dir": str(side_dir / "checkpoints")})


def _micro_batch(ctx: StageContext, options: TrainOptions) -> int:
    """The baseline's training micro batch; for the target, the job's target one or the search stage's choice."""
    if options.side == "baseline":
        return ctx.job.spec.training.micro_batch_size
    from migrate.pipeline.records import read_artifact
    from migrate.stages._target import target_micro_batch

    search = ctx.upstream.get("search") or read_artifact(ctx.job, "search")
    return target_micro_batch(ctx.job, {"search": search} if search is not None else {})[0]


def _layout(ctx: StageContext, options: TrainOptions) -> Any:
    """The source layout for the baseline; for the target, the job's layout or the search stage's choice."""
    if options.side == "baseline":
        return ctx.job.spec.source.layout.to_layout()
    from migrate.pipeline.records import read_artifact
    from migrate.stages._target import target_layout

    search = ctx.upstream.get("search") or read_artifact(ctx.job, "search")
    return target_layout(ctx.job, {"search": search} if search is not None else {})[0]


def run(ctx: StageContext) -> StageOutcome:
    options: TrainOptions = ctx.options  # type: ignore[assignment]
    side_dir = ctx.work_dir / options.side
    side_dir.mkdir(parents=True, exist_ok=True)
    if options.command:
        return _run_external(ctx, options, side_dir)
    return _run_builtin(ctx, options, side_dir)


def _fingerprint(job: Any, options: Any) -> dict[str, Any]:
    """A resumed run depends on the checkpoint it loads (its files' sizes and times); a target
    run without ``target.layout`` on the search stage's result."""
    found: dict[str, Any] = {}
    if options.side == "target" and job.spec.target.layout is None:
        from migrate.pipeline.records import read_artifact

        search = read_artifact(job, "search")
        found["search"] = search.result_digest if search is not None else None
    if not options.load:
        return found
    root = job.resolve(options.load)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.exists() else []
    found["load"] = {str(p.relative_to(root) if root.is_dir() else p.name): [p.stat().st_size, p.stat().st_mtime_ns]
                     for p in files}
    return found


STAGE = StageDefinition(
    name="train",
    description="real training steps of the job's model (baseline at the source layout, or target)",
    run=run,
    options=TrainOptions,
    reads=("source", "target", "model", "training"),
    fingerprint=_fingerprint,
    artifact_key=lambda options: ("train" if (side := getattr(options, "side", "baseline")) == "baseline"
                                  else f"train/{side}"),
)
