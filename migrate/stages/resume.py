"""Resume stage: the converted checkpoint trained on at the target layout, compared with the baseline.

Call sequence: check the converted checkpoint (``convert``'s output) against its ``manifest.json`` (a file
changed, missing or truncated since the conversion fails the stage before anything runs) -> read its step -> run the baseline's
own continuation: K steps from the source checkpoint at the source layout -> run K steps from the
converted checkpoint at the target layout (both on the job's worker group, via `rank_entry`; each
engine prints the state it loaded before step 1, `migrate.workload.state_print`) ->
`compare_continuations` (pure): the loaded states equal in every logical tensor and counter; per step, loss and
grad norm bit-identical at the same layout and
within their fp32 reduction-order tolerances at another, the learning rate and the consumed samples
equal (a scheduler or data counter not carried shows at the first step); the dataset indices each step consumed equal the
baseline's (checked on their own, not through the loss); every target rank starts from the RNG
state the conversion report says it carries (for carried/replicated states: the baseline's rank
with that role). Writes ``metrics.jsonl`` (the gate's candidate), ``baseline_metrics.jsonl`` and
``resume.json`` (per-step differences, data-order and RNG checks, the conversion's state report).
The ``fault`` option is a documented test hook: it copies the converted checkpoint and breaks its
state (`checkpoint.state.faults`) so the checks can be seen to fail with the right reason.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from collections.abc import Mapping, Sequence

from pydantic import Field

from checkpoint.state.fingerprint import StatePrint, differences
from migrate.pipeline.stage import StageContext, StageDefinition, StageOptions, StageOutcome


class ResumeOptions(StageOptions):
    steps: int = Field(default=3, ge=1, description="K: optimizer steps run after the checkpoint on each side")
    # Correct migrations agree far inside these (fp32, DeepSpeed DP 2<->4/3, Megatron-Core TP2->1, PP2->1,
    # DP 4->2/3, the demo over 10 steps): loss differences <= 3.6e-7, relative grad norm <= 1.4e-7.
    loss_rtol: float = Field(default=5e-6, ge=0, description="relative loss tolerance at a changed layout (fp32 reduction order)")
    loss_atol: float = Field(default=1e-6, ge=0, description="absolute loss tolerance at a changed layout")
    grad_norm_rtol: float = Field(default=5e-6, ge=0, description="relative grad-norm tolerance at a changed layout")
    lr_rtol: float = Field(default=1e-6, ge=0, description="relative learning-rate tolerance (the schedule is a function "
                                                           "of the step: equal at any layout)")
    engine: Literal["deepspeed", "megatron", "fsdp"] | None = Field(
        default=None, description="default: from the source format / layout")
    accept_unchecked: list[Literal["state", "rng", "data_order"]] = Field(
        default_factory=list, description="what may pass unchecked (the report says so); by default nothing unchecked passes")
    fault: Literal["shift_data", "reset_rng", "drop_optimizer", "swap_moments", "reset_lr", "nan_weights",
                   "scale_weights", "reset_step", "perturb_master", "round_master_bf16", "swap_partitions",
                   "swap_glu_halves", "swap_qkv_kv"] | None = Field(
        default=None, description="test hook: break a copy of the converted checkpoint (checkpoint.state.faults)")


UNCHECKABLE = ("state", "rng", "data_order")  # what --accept-unchecked may name


@dataclass(frozen=True, kw_only=True, slots=True)
class Continuation:
    """K steps run from a checkpoint: rank 0's per-step records, the global batch each step consumed,
    every rank's RNG fingerprint at each step's start, and the state the framework held right after its
    load (`StatePrint`; None when the engine printed none)."""

    layout: str
    start_step: int
    records: tuple[dict[str, Any], ...]
    samples: tuple[tuple[int, ...], ...]
    rng: tuple[tuple[str, ...], ...]  # [rank][step]
    state: StatePrint | None = None

    @classmethod
    def from_results(cls, layout: str, results: Sequence[Any]) -> Continuation:
        main = results[0]
        printed = main.extra.get("state_print")
        return cls(layout=layout, start_step=main.start_step, records=tuple(m.as_dict() for m in main.metrics),
                   samples=tuple(tuple(s) for s in main.extra.get("samples", ())),
                   rng=tuple(tuple(r.extra.get("rng", ())) for r in results),
                   state=StatePrint.from_dict(printed) if printed else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeVerdict:
    passed: bool
    reasons: tuple[str, ...]
    loss_diffs: tuple[float, ...]
    max_loss_diff: float
    max_grad_norm_rel_diff: float
    data_order: str
    rng: str
    state: str = "not checked"
    state_differences: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()  # what could not be checked (each a failure unless accepted)
    accepted: tuple[str, ...] = ()  # unchecked, and accepted so by the user
    details: dict[str, Any] = field(default_factory=dict)


def _fmt(indices: Sequence[int], limit: int = 8) -> str:
    head = ", ".join(str(i) for i in indices[:limit])
    return f"[{head}{', ...' if len(indices) > limit else ''}]"


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def _per_step_problems(target: Continuation, baseline: Continuation, *, same_layout: bool, rtol: float, atol: float,
                       grad_norm_rtol: float, lr_rtol: float) -> list[str]:
    """The first step at which each per-step quantity (loss, grad norm, learning rate, consumed samples)
    leaves its tolerance; bit-identical at the same layout except the learning rate's own tolerance."""
    def loss(step: int, t: float, b: float) -> str | None:
        d = abs(t - b)
        if same_layout:
            return None if t == b else (f"loss differs at step {step} at the same layout (must be bit-identical): "
                                        f"target {t!r} baseline {b!r} (|diff| {d:.3g})")
        limit = atol + rtol * abs(b)
        return None if d <= limit else (f"loss differs beyond fp32 reduction tolerance at step {step}: target {t!r} "
                                         f"baseline {b!r} |diff| {d:.3g} > atol {atol:g} + rtol {rtol:g} * |baseline| = "
                                         f"{limit:.3g}")

    def grad_norm(step: int, t: float, b: float) -> str | None:
        if same_layout:
            return None if t == b else (f"grad norm differs at step {step} at the same layout (must be bit-identical): "
                                        f"target {t!r} baseline {b!r}")
        g = _rel(t, b)
        return None if g <= grad_norm_rtol else (f"grad norm differs at step {step}: target {t!r} baseline {b!r}, "
                                                 f"relative {g:.3g} > grad_norm_rtol {grad_norm_rtol:g}")

    def lr(step: int, t: float, b: float) -> str | None:
        r = _rel(t, b)
        return None if r <= lr_rtol else (f"learning rate differs at step {step}: target {t!r} baseline {b!r}, relative "
                                          f"{r:.3g} > lr_rtol {lr_rtol:g} (the scheduler state was not carried)")

    def consumed_samples(step: int, t: int, b: int) -> str | None:
        return None if t == b else f"consumed samples differ at step {step}: target {t} baseline {b}"

    problems: dict[str, str] = {}
    for i, (t, b) in enumerate(zip(target.records, baseline.records)):
        for judge in (loss, grad_norm, lr, consumed_samples):
            name = judge.__name__
            if name in problems or name not in t or name not in b:
                continue
            problem = judge(target.start_step + i + 1, t[name], b[name])
            if problem:
                problems[name] = problem
    return list(problems.values())


def _state_check(target: Continuation, baseline: Continuation) -> tuple[str, tuple[str, ...], bool]:
    """(summary, differences, checked) of the two loaded states."""
    if target.state is None or baseline.state is None:
        side = " and ".join(n for n, c in (("target", target), ("baseline", baseline)) if c.state is None)
        return f"not checked: the {side} run printed no loaded state", (), False
    found = tuple(differences(target.state, baseline.state))
    size = f"{len(baseline.state.tensors)} tensors and {len(baseline.state.values)} values"
    if not found:
        return f"identical at load, before step {target.start_step + 1}: {size}", (), True
    return f"{len(found)} of {size} differ at load", found, True


def compare_continuations(target: Continuation, baseline: Continuation, *, same_layout: bool,
                          rng_decisions: Sequence[Mapping[str, Any]], rtol: float, atol: float,
                          grad_norm_rtol: float = 1e-4, lr_rtol: float = 1e-6, rng_absent: bool = False,
                          accept_unchecked: Sequence[str] = ()) -> ResumeVerdict:
    """Judge the target's continuation against the baseline's; pure. Every failed check gives a reason.

    The loaded states must agree exactly (every logical tensor and value, `checkpoint.state.fingerprint`);
    then the per-step records, the data order and each rank's RNG state. What cannot be checked (a run
    that printed no state, a conversion report without RNG decisions for a source that has RNG state, no
    recorded data order) fails the verdict unless `accept_unchecked` names it (`UNCHECKABLE`)."""
    from checkpoint.state.data_position import first_difference

    unknown = sorted(set(accept_unchecked) - set(UNCHECKABLE))
    if unknown:
        raise ValueError(f"accept_unchecked {unknown}: expected some of {', '.join(UNCHECKABLE)}")
    reasons: list[str] = []
    unchecked: list[tuple[str, str]] = []  # (name, why)
    state, state_differences, checked = _state_check(target, baseline)
    if not checked:
        unchecked.append(("state", state))
    elif state_differences:
        more = len(state_differences) - 3
        shown = "; ".join(state_differences[:3]) + (f"; and {more} more" if more > 0 else "")
        reasons.append(f"loaded state differs from the baseline's before step {target.start_step + 1} "
                       f"({len(state_differences)} difference(s)): {shown}")
    if target.start_step != baseline.start_step:
        reasons.append(f"target resumed at step {target.start_step} but the baseline at step {baseline.start_step}")
    if len(target.records) != len(baseline.records):
        reasons.append(f"target ran {len(target.records)} step(s) after the checkpoint, the baseline {len(baseline.records)}")
    diffs = [abs(t["loss"] - b["loss"]) for t, b in zip(target.records, baseline.records)]
    grad_diffs = [_rel(t["grad_norm"], b["grad_norm"]) for t, b in zip(target.records, baseline.records)
                  if "grad_norm" in t and "grad_norm" in b]
    reasons += _per_step_problems(target, baseline, same_layout=same_layout, rtol=rtol, atol=atol,
                                  grad_norm_rtol=grad_norm_rtol, lr_rtol=lr_rtol)
    first = first_difference(target.samples, baseline.samples)
    if not target.samples:
        data_order = "not checked: the target run recorded no consumed sample indices"
        unchecked.append(("data_order", data_order))
    elif first is None:
        data_order = (f"identical: {len(target.samples)} global batches, {sum(len(s) for s in target.samples)} samples "
                      "in the baseline's order (none repeated, none skipped)")
    else:
        step = target.start_step + first + 1
        t = target.samples[first] if first < len(target.samples) else ()
        b = baseline.samples[first] if first < len(baseline.samples) else ()
        data_order = f"differs from step {step}"
        reasons.append(f"data order differs from step {step}: target consumed {_fmt(t)} baseline {_fmt(b)}")
    rng_problems = []
    for d in rng_decisions:
        rank = int(d["target_rank"])
        got = target.rng[rank][0] if rank < len(target.rng) and target.rng[rank] else None
        if d["policy"] in ("carry", "replicate"):
            src = int(d["source_rank"])
            want = baseline.rng[src][0] if src < len(baseline.rng) and baseline.rng[src] else None
            origin = f"the baseline's rank {src} ({d['policy']})"
        else:
            want, origin = d["fingerprint"], f"the state derived by the conversion ({d['policy']})"
        if got != want:
            rng_problems.append(f"RNG state of rank {rank} at resumed step {target.start_step + 1} is not what the "
                                f"checkpoint should carry: target {got} but {origin} has {want}")
    if rng_decisions and rng_problems:
        rng = f"{len(rng_problems)} of {len(rng_decisions)} rank(s) differ"
        reasons += rng_problems
    elif rng_decisions:
        policies = sorted({d["policy"] for d in rng_decisions})
        rng = f"every rank ({len(rng_decisions)}) starts from the state it should ({', '.join(policies)})"
    elif rng_absent:
        rng = "absent in the source checkpoint: nothing to carry (both sides seed their generators afresh)"
    else:
        rng = "not checked: the checkpoint's conversion report lists no per-rank RNG states"
        unchecked.append(("rng", rng))
    accepted = tuple(f"{name}: {why}" for name, why in unchecked if name in accept_unchecked)
    refused = tuple(f"{name}: {why}" for name, why in unchecked if name not in accept_unchecked)
    reasons += [f"{item} (nothing unchecked passes; --accept-unchecked {item.split(':')[0]} accepts it)"
                for item in refused]
    return ResumeVerdict(passed=not reasons, reasons=tuple(reasons), loss_diffs=tuple(diffs),
                         max_loss_diff=max(diffs, default=float("nan")),
                         max_grad_norm_rel_diff=max(grad_diffs, default=float("nan")), data_order=data_order, rng=rng,
                         state=state, state_differences=state_differences,
                         unchecked=tuple(name for name, _ in unchecked), accepted=accepted)


def rng_absent(state_report: Mapping[str, Any] | None) -> bool:
    """Whether a conversion report says the source checkpoint holds no RNG state at all."""
    return any(e.get("state") == "rng" and e.get("policy") == "absent" for e in (state_report or {}).get("states", []))


def rng_decisions(state_report: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The per-rank RNG decisions of a conversion report (`state_report.json`)."""
    return [{k: e[k] for k in ("target_rank", "source_rank", "fingerprint", "policy")}
            for e in (state_report or {}).get("states", []) if "target_rank" in e]


def manifest_problems(checkpoint: str | Path) -> tuple[str, ...]:
    """Why `checkpoint`'s files are not the ones its conversion wrote (size and checksum of every file its
    `manifest.json` lists; a missing manifest or an in-progress marker); empty when intact."""
    from checkpoint.destination import MANIFEST
    from checkpoint.manifest import verify_manifest

    if not (Path(checkpoint) / MANIFEST).is_file():
        return (f"{Path(checkpoint) / MANIFEST}: missing: the converted checkpoint cannot be checked against what the "
                "conversion wrote",)
    return tuple(verify_manifest(checkpoint))


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a checkpoint was saved at (from its metadata)."""
    from checkpoint.api import read_index

    meta = read_index(path).meta
    for key in ("global_steps", "iteration", "step"):
        if meta.get(key) is not None:
            return int(meta[key])
    state = meta.get("model_state", {})
    if state.get("global_steps") is not None:
        return int(state["global_steps"])
    raise ValueError(f"{path}: no step counter in the checkpoint's metadata (keys {sorted(meta)})")


def _launch(ctx: StageContext, spec: Any, world_size: int, env: Mapping[str, str]) -> list[Any]:
    from migrate.workload.engines import rank_entry

    with ctx.worker_group(world_size=world_size, env=dict(env)) as group:
        return group.run(rank_entry(spec.engine), spec)


def run(ctx: StageContext) -> StageOutcome:
    from checkpoint.safe_load import check_pickles
    from checkpoint.state.faults import inject_fault
    from checkpoint.state.training_state import STATE_REPORT_FILE
    from migrate.stages._target import target_layout, target_micro_batch
    from migrate.stages.convert import source_checkpoint
    from migrate.stages.train import MetricsFollower
    from migrate.workload.from_job import default_engine, run_spec, side_layout

    options: ResumeOptions = ctx.options  # type: ignore[assignment]
    job = ctx.job.spec
    convert = ctx.upstream["convert"]
    converted = Path(convert.outputs["checkpoint"])
    damaged = manifest_problems(converted)
    if damaged:
        shown = damaged[:20]
        return StageOutcome(verdict="fail", metrics={"manifest_problems": len(damaged), "passed": 0},
                            reasons=tuple(f"converted checkpoint differs from its manifest: {p}" for p in shown),
                            summary_md=f"The converted checkpoint `{converted}` is not what the conversion wrote "
                                       f"({len(damaged)} problem(s)); nothing was resumed.\n\n"
                                       + "\n".join(f"- {p}" for p in shown) + "\n")
    if options.fault:  # models a converter that wrote wrong state (its manifest agreeing): applied to a copy
        broken = ctx.work_dir / f"checkpoint_{options.fault}"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(converted, broken)
        inject_fault(broken, options.fault)
        converted = broken
    source = source_checkpoint(ctx.job, ctx.upstream)
    for checkpoint in (source, converted):  # the frameworks' loaders unpickle freely: refuse what is not allowed
        check_pickles(checkpoint)
    start = checkpoint_step(converted)
    steps = start + options.steps
    src_layout = side_layout(job, "baseline")
    dst_layout, _ = target_layout(ctx.job, ctx.upstream)
    dst_micro_batch, _ = target_micro_batch(ctx.job, ctx.upstream)
    env = {"DS_ACCELERATOR": job.target.device_type, "OMP_NUM_THREADS": "1"}
    runs = {}
    for side, layout, load in (("baseline", src_layout, source), ("target", dst_layout, converted)):
        engine = options.engine or default_engine(job, layout)
        path = ctx.work_dir / ("metrics.jsonl" if side == "target" else "baseline_metrics.jsonl")
        path.unlink(missing_ok=True)
        spec = run_spec(job, layout, engine=engine, steps=steps, save_dir=None, load_dir=str(load), save_every=0,
                        metrics_path=str(path), micro_batch_size=dst_micro_batch if side == "target" else None)
        with MetricsFollower(path, ctx, total=options.steps, side=side,
                             select=lambda r: {k: r[k] for k in ("loss", "grad_norm", "lr", "step_time_s") if k in r}):
            runs[side] = Continuation.from_results(layout.describe(), _launch(ctx, spec, layout.world_size, env))
    report_path = converted / STATE_REPORT_FILE
    state_report = json.loads(report_path.read_text()) if report_path.is_file() else None
    same = src_layout == dst_layout and dst_micro_batch == job.training.micro_batch_size
    verdict = compare_continuations(runs["target"], runs["baseline"], same_layout=same,
                                    rng_decisions=rng_decisions(state_report), rtol=options.loss_rtol,
                                    atol=options.loss_atol, grad_norm_rtol=options.grad_norm_rtol, lr_rtol=options.lr_rtol,
                                    rng_absent=rng_absent(state_report), accept_unchecked=options.accept_unchecked)
    per_step = [{"step": start + i + 1, "target_loss": t["loss"], "baseline_loss": b["loss"], "abs_diff": d,
                 "target_grad_norm": t["grad_norm"], "baseline_grad_norm": b["grad_norm"],
                 "target_lr": t["lr"], "baseline_lr": b["lr"]}
                for i, (t, b, d) in enumerate(zip(runs["target"].records, runs["baseline"].records, verdict.loss_diffs))]
    for row in per_step:
        ctx.log_metrics(row["step"], {"loss_abs_diff": row["abs_diff"]})
    (ctx.work_dir / "resume.json").write_text(json.dumps({
        "checkpoint": str(converted), "source_checkpoint": str(source), "start_step": start, "steps": options.steps,
        "fault": options.fault, "per_step": per_step, "max_loss_diff": verdict.max_loss_diff,
        "max_grad_norm_rel_diff": verdict.max_grad_norm_rel_diff,
        "state": verdict.state, "state_differences": list(verdict.state_differences),
        "unchecked": list(verdict.unchecked), "accepted_unchecked": list(verdict.accepted),
        "loaded_state": {side: run.state.as_dict() if run.state else None for side, run in runs.items()},
        "data_order": verdict.data_order, "rng": verdict.rng, "reasons": list(verdict.reasons),
        "samples": {"target": runs["target"].samples, "baseline": runs["baseline"].samples},
        "rng_fingerprints": {"target": runs["target"].rng, "baseline": runs["baseline"].rng},
        "state_report": state_report}, indent=1))
    metrics = {"start_step": start, "steps": len(per_step), "max_loss_diff": verdict.max_loss_diff,
               "max_grad_norm_rel_diff": verdict.max_grad_norm_rel_diff,
               "data_order_ok": int(verdict.data_order.startswith("identical")),
               "state_differences": len(verdict.state_differences), "unchecked": len(verdict.unchecked),
               "passed": int(verdict.passed)}
    rows = "\n".join(f"| {r['step']} | {r['baseline_loss']:.9f} | {r['target_loss']:.9f} | {r['abs_diff']:.3g} | "
                     f"{r['baseline_grad_norm']:.6g} | {r['target_grad_norm']:.6g} | {r['baseline_lr']:.6g} | "
                     f"{r['target_lr']:.6g} |" for r in per_step)
    summary = (f"Resumed the converted checkpoint (step {start}) at {dst_layout.describe()} (micro batch "
               f"{dst_micro_batch}) for {len(per_step)} step(s) "
               f"against the baseline's continuation at {src_layout.describe()}"
               + (f" (fault injected: {options.fault})" if options.fault else "") + ".\n\n"
               "| step | baseline loss | target loss | abs diff | baseline grad norm | target grad norm | baseline lr | "
               "target lr |\n|---|---|---|---|---|---|---|---|\n" + rows + "\n\n"
               f"State at load: {verdict.state}.\n\n"
               + "".join(f"- {d}\n" for d in verdict.state_differences[:20])
               + (f"- ... and {len(verdict.state_differences) - 20} more\n" if len(verdict.state_differences) > 20 else "")
               + f"\nData order: {verdict.data_order}.\n\nRNG: {verdict.rng}.\n"
               + "".join(f"\nAccepted unchecked by the user: {a}.\n" for a in verdict.accepted))
    if state_report:
        summary += "\nState carried by the conversion:\n\n" + "\n".join(
            f"- {e['state']}: {e['policy']} ({e['reason']})" for e in state_report["states"]) + "\n"
    return StageOutcome(verdict="pass" if verdict.passed else "fail", metrics=metrics,
                        outputs={"metrics": str(ctx.work_dir / "metrics.jsonl"),
                                 "baseline_metrics": str(ctx.work_dir / "baseline_metrics.jsonl"),
                                 "report": str(ctx.work_dir / "resume.json")},
                        reasons=verdict.reasons, summary_md=summary)


STAGE = StageDefinition(
    name="resume",
    description="train on from the converted checkpoint at the target layout; losses, data order and RNG vs the baseline",
    run=run,
    options=ResumeOptions,
    depends_on=("convert",),
    after=("train", "search"),
    reads=("source", "target", "model", "training"),
)
