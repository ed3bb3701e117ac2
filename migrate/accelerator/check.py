"""One prepared check of what only a real GPU or NPU can prove, for the few minutes one is lent.

Call sequence: ``run_check(device, out, size, budget_s)`` runs the steps below in order, each timed and
guarded (a step that fails is reported and the next one runs; a step that would start after the budget
is spent is skipped and says so), and writes ``report.json`` and ``report.md`` into ``out``:

1. ``device_facts``: matmul TFLOP/s per dtype, memory copy bandwidth and device memory, measured
   (`migrate.search.measure`) next to the shipped profile's numbers;
2. ``operator_numerics``: `migrate ops` on the device in fp32, bf16 and fp16, with the check's model for the
   coverage scan and the layer drift;
3. ``checkpoint_round_trip``: a checkpoint written on the device (one rank, bf16, DeepSpeed ZeRO-1) converted
   to ZeRO-2 by `checkpoint.api.convert`, then the original and the converted one loaded by DeepSpeed on the
   CPU, every logical tensor and counter equal (`checkpoint.state.fingerprint`); and the reverse, written on
   the CPU and loaded on the device;
4. ``memory_and_step_time``: every single-device candidate of the search space the built-in workloads run
   (Megatron-Core plain and distributed optimizer, DeepSpeed ZeRO-0 and ZeRO-1, every micro batch and
   sequence length of the size), as long as the budget lasts: the memory model's prediction against the
   device allocator (tensor bytes against ``max_memory_allocated``, the total against
   ``max_memory_reserved``), and on the CPU against the peak of live tensor bytes the torch profiler saw
   allocated (the lowest of `CPU_MEASURE_RUNS` runs, each in a fresh process: the profiler's errors only
   inflate, see `migrate.accelerator.tensor_peak`); the measured step time against the cost model,
   uncalibrated and calibrated on the other candidates (leave one out).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from migrate.workload.run_spec import RunSpec, TrainSpec

REPORT_JSON, REPORT_MD = "report.json", "report.md"


@dataclass(frozen=True, kw_only=True)
class CheckSize:
    """How big the check runs: the model, the candidates' micro batches and sequence lengths, the steps."""

    name: str
    model: ModelShape
    seq_lengths: tuple[int, ...]
    micro_batches: tuple[int, ...]
    global_batch_size: int
    precision: Literal["fp32", "bf16"]
    warmup: int
    steps: int
    matmul_size: int
    copy_mb: int
    repeats: int


SIZES = {
    "small": CheckSize(  # the CPU in the test suite: minutes of 2 cores
        name="small", model=ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                      num_attention_heads=4, num_query_groups=2, vocab_size=128, seq_length=32),
        seq_lengths=(32, 64), micro_batches=(1, 2), global_batch_size=4, precision="fp32", warmup=1, steps=2,
        matmul_size=256, copy_mb=16, repeats=3),
    "full": CheckSize(  # one accelerator, under 8 minutes: a 0.8B-parameter Llama in bf16
        name="full", model=ModelShape(architecture="llama", num_layers=8, hidden_size=2048, ffn_hidden_size=5632,
                                     num_attention_heads=16, num_query_groups=4, vocab_size=32000, seq_length=1024),
        seq_lengths=(1024, 2048), micro_batches=(1, 2, 4), global_batch_size=8, precision="bf16", warmup=2, steps=3,
        matmul_size=8192, copy_mb=1024, repeats=20),
}

# (framework, sharding) of the one-device candidates the built-in workloads run.
ENGINES: tuple[tuple[Literal["megatron", "deepspeed"], OptimizerSharding], ...] = (
    ("megatron", OptimizerSharding.NONE), ("megatron", OptimizerSharding.DISTRIBUTED_OPTIMIZER),
    ("deepspeed", OptimizerSharding.NONE), ("deepspeed", OptimizerSharding.ZERO1))


@dataclass
class StepReport:
    """One step: ok, failed (with the error) or skipped (with why), its seconds, a line and its data."""

    name: str
    status: str = "skipped"
    seconds: float = 0.0
    summary: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def shipped_profile_name(device: str) -> str:
    """The shipped device profile a device is compared with (by its reported name on CUDA)."""
    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device)).lower()
        for model in ("h200", "h100", "a100", "mi300x"):
            if model in name.replace(" ", "").replace("-", ""):
                return model
        return "h100"
    return {"npu": "ascend-910b"}.get(kind, "cpu")


def _group(device: str, world_size: int = 1) -> Any:
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules

    kind = device.split(":")[0]
    env = {"DS_ACCELERATOR": kind, "OMP_NUM_THREADS": "1"}
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    return start_worker_group(WorkerGroupSpec(world_size=world_size, mode="local", device_type=kind, env=env,
                                              timeout_s=600, preload=engine_modules("deepspeed") + engine_modules("megatron")))


# ----------------------------------------------------------------------------------------------- steps


def device_facts(device: str, size: CheckSize) -> StepReport:
    from migrate.search.measure import measure_rank
    from parallel_search.profiles import load_profile

    profile = load_profile(shipped_profile_name(device))
    with _group(device) as group:
        (measured,) = group.run(measure_rank, size.matmul_size, size.copy_mb, 1, size.repeats, ("fp32", "bf16", "fp16"))
        (memory_gb,) = group.run(_device_memory_gb)
    rows = {dtype: {"measured_tflops": rate, "profile_tflops": profile.peak_tflops.get(dtype),
                    "ratio": rate / profile.peak_tflops[dtype] if profile.peak_tflops.get(dtype) else None}
            for dtype, rate in measured["tflops"].items()}
    data = {"profile": profile.name, "matmul": rows, "copy_gbps": measured["copy_gbps"],
            "profile_memory_bandwidth_gbps": profile.memory_bandwidth_gbps, "memory_gb": memory_gb,
            "profile_memory_gb": profile.memory_gb}
    best = max(rows, key=lambda d: rows[d]["measured_tflops"])
    return StepReport(name="device_facts", status="ok", data=data,
                      summary=(f"{best} matmul {rows[best]['measured_tflops']:.3g} TFLOP/s (profile {profile.name}: "
                               f"{rows[best]['profile_tflops']}), copy {measured['copy_gbps']:.3g} GB/s (profile "
                               f"{profile.memory_bandwidth_gbps:g}), memory "
                               f"{'n/a on the cpu' if memory_gb is None else f'{memory_gb:.1f} GB'} "
                               f"(profile {profile.memory_gb:g})"))


def _device_memory_gb(ctx: Any) -> float | None:
    import torch

    kind = ctx.device_type
    if kind == "cpu":
        return None
    return getattr(torch, kind).get_device_properties(torch.device(ctx.device)).total_memory / 1e9


def operator_numerics(device: str, size: CheckSize) -> StepReport:
    from convergence.ops.suite import run_suite
    from migrate.stages.ops import model_inputs

    model = model_inputs(dataclasses.asdict(size.model), 1234)
    result = run_suite(device, ("fp32", "bf16", "fp16"), drift_dtype="bf16", **model)
    statuses = [r["status"] for r in result["operators"]]
    data = {"passed": result["passed"], "reasons": result["reasons"], "pass": statuses.count("pass"),
            "fail": statuses.count("fail"), "unsupported": statuses.count("unsupported"),
            "coverage_missing": result.get("coverage", {}).get("missing", []),
            "coverage_fallback": result.get("coverage", {}).get("fallback", []),
            "first_drift": result.get("drift", {}).get("first_drift"), "operators": result["operators"]}
    return StepReport(name="operator_numerics", status="ok", data=data,
                      summary=(f"{statuses.count('pass')} of {len(statuses)} operator x dtype runs pass, "
                               f"{statuses.count('fail')} fail, {statuses.count('unsupported')} unsupported; "
                               f"coverage missing {len(data['coverage_missing'])}, fallback "
                               f"{len(data['coverage_fallback'])}; first drifting layer {data['first_drift'] or 'none'}"))


def _ds_spec(size: CheckSize, steps: int, zero_stage: int, save_dir: str | None = None,
             load_dir: str | None = None) -> RunSpec:
    return RunSpec(engine="deepspeed", model=size.model, steps=steps, zero_stage=zero_stage, save_dir=save_dir,
                   load_dir=load_dir, train=TrainSpec(global_batch_size=size.global_batch_size, precision="bf16"))


def _loaded_print(device: str, spec: RunSpec) -> Any:
    from checkpoint.state.fingerprint import StatePrint
    from migrate.workload.engines import rank_entry

    with _group(device) as group:
        (result,) = group.run(rank_entry("deepspeed"), spec)
    return StatePrint.from_dict(result.extra["state_print"])


def checkpoint_round_trip(device: str, size: CheckSize, out: Path) -> StepReport:
    """DeepSpeed ZeRO-1 in bf16 written on one side, converted to ZeRO-2 (another flat layout of every
    state) by `checkpoint.api.convert`, and the original and the converted one loaded by DeepSpeed on the
    other side: every logical tensor and counter of the two loads equal."""
    from checkpoint.api import LayoutRequest, convert
    from checkpoint.state.fingerprint import differences
    from migrate.workload.engines import rank_entry

    root = out / "checkpoints"
    shutil.rmtree(root, ignore_errors=True)
    saved_at = 2
    directions: dict[str, dict[str, Any]] = {}
    for label, writer, reader in (("device to cpu", device, "cpu"), ("cpu to device", "cpu", device)):
        where = root / label.replace(" ", "_")
        with _group(writer) as group:
            group.run(rank_entry("deepspeed"), _ds_spec(size, saved_at, 1, save_dir=str(where / "written")))
        convert(where / "written", where / "converted", to="deepspeed", target=LayoutRequest(dp=1, zero_stage=2))
        original = _loaded_print(reader, _ds_spec(size, saved_at + 1, 1, load_dir=str(where / "written")))
        converted = _loaded_print(reader, _ds_spec(size, saved_at + 1, 2, load_dir=str(where / "converted")))
        found = differences(converted, original)
        directions[label] = {"written_on": writer, "loaded_on": reader, "tensors": len(original.tensors),
                             "values": len(original.values), "differences": found[:20]}
    bad = {k: v for k, v in directions.items() if v["differences"]}
    summary = "; ".join(f"{k}: {v['tensors']} tensors and {v['values']} values "
                        + ("equal" if not v["differences"] else f"{len(v['differences'])} differ")
                        for k, v in directions.items())
    return StepReport(name="checkpoint_round_trip", status="failed" if bad else "ok", data=directions,
                      summary=f"DeepSpeed ZeRO-1 bf16 -> migrate convert -> ZeRO-2: {summary}",
                      error="; ".join(d for v in bad.values() for d in v["differences"][:3]))


CPU_MEASURE_RUNS = 2  # the profiler's record misses some frees (a peak too high, never too low): the lowest counts


def measure_run(ctx: Any, spec: RunSpec) -> dict[str, Any]:
    """On one rank: run `spec` and report its step times and peak memory, by the device allocator, or on the
    CPU by the torch profiler's record of every tensor allocation (and the RSS growth beside it)."""
    import torch

    from migrate.accelerator.tensor_peak import cpu_memory_events, tensor_peak
    from migrate.search.profiler import PeakRss, release_freed_memory
    from migrate.workload.engines import rank_entry

    entry = rank_entry(spec.engine)
    if ctx.device_type != "cpu":
        backend = getattr(torch, ctx.device_type)
        backend.empty_cache()
        backend.reset_peak_memory_stats()
        allocated, reserved = backend.memory_allocated(), backend.memory_reserved()
        result = entry(ctx, spec)
        return {"step_times_s": [m.step_time_s for m in result.metrics], "measure": f"{ctx.device_type} allocator",
                "tensor_peak_bytes": int(backend.max_memory_allocated() - allocated),
                "reserved_peak_bytes": int(backend.max_memory_reserved() - reserved)}
    from torch.profiler import ProfilerActivity, profile

    release_freed_memory()
    with PeakRss() as rss, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        baseline = rss.peak
        result = entry(ctx, spec)
    measured = tensor_peak(cpu_memory_events(prof.profiler.kineto_results.experimental_event_tree()))
    return {"step_times_s": [m.step_time_s for m in result.metrics], "tensor_peak_bytes": measured.peak_bytes,
            "measure": "torch profiler: peak of live CPU tensor bytes allocated during the run (steps timed under it)",
            "rss_peak_bytes": int(rss.peak - baseline), "allocations": measured.events,
            "unrecorded_frees": measured.unrecorded_frees}


def _candidates(size: CheckSize) -> list[tuple[Any, ModelShape]]:
    from parallel_search.space import Candidate

    out = []
    for seq in size.seq_lengths:
        model = dataclasses.replace(size.model, seq_length=seq)
        for framework, sharding in ENGINES:
            for mbs in size.micro_batches:
                if size.global_batch_size % mbs:
                    continue
                out.append((Candidate(framework=framework, layout=ParallelLayout(dp=1, sharding=sharding),
                                      micro_batch_size=mbs), model))
    return out


def memory_and_step_time(device: str, size: CheckSize, deadline: float) -> StepReport:
    from migrate.search.profiler import failure_reason, run_spec_for
    from parallel_search.cost import cost_terms, fit_calibration, predict
    from parallel_search.memory import estimate_memory
    from parallel_search.profiles import load_profile
    from parallel_search.spec import ClusterShape, TrainingShape

    profile = load_profile(shipped_profile_name(device))
    train = TrainSpec(global_batch_size=size.global_batch_size, precision=size.precision)
    shape_train = TrainingShape(global_batch_size=size.global_batch_size, precision=size.precision)
    rows: list[dict[str, Any]] = []
    samples = []
    for cand, model in _candidates(size):
        row: dict[str, Any] = {"candidate": cand.label(), "seq_length": model.seq_length}
        rows.append(row)
        if time.monotonic() > deadline:
            row["status"] = "skipped: the time budget is spent"
            continue
        estimate = estimate_memory(model, shape_train, cand, profile, allocated=True)
        terms = cost_terms(model, shape_train, ClusterShape(device_count=1, devices_per_node=1), cand, profile)
        row.update(predicted_tensor_bytes=estimate.tensors, predicted_total_bytes=estimate.total,
                   predicted_step_s=predict(terms))
        runs = []
        try:  # a fresh process per run: nothing of the previous run's engine is still allocated
            for _ in range(CPU_MEASURE_RUNS if device == "cpu" else 1):
                with _group(device) as group:
                    (run,) = group.run(measure_run, run_spec_for(cand, model, train, size.warmup + size.steps))
                runs.append(run)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is a row of the report
            row["status"] = f"failed: {failure_reason(exc)}"
            continue
        measured = min(runs, key=lambda r: r["tensor_peak_bytes"])
        timed = sorted(t for r in runs for t in r["step_times_s"][size.warmup:])
        step = timed[len(timed) // 2]
        row.update(status="ok", measure=measured["measure"], measured_tensor_bytes=measured["tensor_peak_bytes"],
                   tensor_ratio=estimate.tensors / max(measured["tensor_peak_bytes"], 1), measured_step_s=step,
                   under_predicted=estimate.tensors < measured["tensor_peak_bytes"])
        if "reserved_peak_bytes" in measured:
            row.update(measured_reserved_bytes=measured["reserved_peak_bytes"],
                       total_ratio=estimate.total / max(measured["reserved_peak_bytes"], 1))
            row["under_predicted"] = row["under_predicted"] or estimate.total < measured["reserved_peak_bytes"]
        if "rss_peak_bytes" in measured:
            row.update(measured_rss_bytes=measured["rss_peak_bytes"], unrecorded_frees=measured["unrecorded_frees"],
                       tensor_peaks_bytes=[r["tensor_peak_bytes"] for r in runs],
                       allocations=[r["allocations"] for r in runs])
        samples.append((len(rows) - 1, terms, step))
    for i, (index, terms, step) in enumerate(samples):  # the cost model calibrated on every other candidate
        others = [(t, s) for j, (_, t, s) in enumerate(samples) if j != i]
        if others:
            rows[index]["calibrated_step_s"] = predict(terms, fit_calibration(others))
            rows[index]["calibrated_ratio"] = rows[index]["calibrated_step_s"] / step
        rows[index]["uncalibrated_ratio"] = rows[index]["predicted_step_s"] / step
    done = [r for r in rows if r.get("status") == "ok"]
    under = [r["candidate"] + f" seq {r['seq_length']}" for r in done if r["under_predicted"]]
    ratios = [r["tensor_ratio"] for r in done]
    calibrated = [abs(r["calibrated_ratio"] - 1) for r in done if "calibrated_ratio" in r]
    from migrate.search.profiler import unsupported_by_builtin
    from parallel_search.space import Candidate

    unrunnable = [rc for rc in ("selective", "full") if unsupported_by_builtin(
        Candidate(framework="megatron", layout=ParallelLayout(dp=1), micro_batch_size=1, recompute=rc))]
    data: dict[str, Any] = {"profile": profile.name, "rows": rows, "under_predicted": under, "measured": len(done),
            "not_run": [f"recompute {' and '.join(unrunnable)}: the built-in workloads have none (the search "
                        f"profiles such candidates with the user's own launch command)"] if unrunnable else [],
            "skipped": sum(1 for r in rows if str(r.get("status", "")).startswith("skipped")),
            "failed": sum(1 for r in rows if str(r.get("status", "")).startswith("failed"))}
    summary = (f"{len(done)} of {len(rows)} candidates measured; predicted/measured tensor bytes "
               f"{min(ratios, default=float('nan')):.2f}..{max(ratios, default=float('nan')):.2f}; "
               + (f"UNDER-PREDICTED: {', '.join(under)}" if under else "no under-prediction")
               + (f"; calibrated step time within {max(calibrated):.0%} (leave one out)" if calibrated else "")
               + ("; not run: " + "; ".join(data["not_run"]) if data["not_run"] else ""))
    return StepReport(name="memory_and_step_time", status="ok" if done else "failed", data=data, summary=summary,
                      error="" if done else "no candidate could be measured")


# ------------------------------------------------------------------------------------------ the whole


def run_check(device: str, out: str | Path, size: str = "full", budget_s: float = 480.0,
              echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every step within `budget_s` seconds (see the module docstring); write and return the report."""
    import torch

    if size not in SIZES:
        raise ValueError(f"size {size!r}: expected one of {', '.join(SIZES)}")
    check = SIZES[size]
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    deadline = began + budget_s
    kind = device.split(":")[0]
    steps: list[tuple[str, Callable[[], StepReport]]] = [
        ("device_facts", lambda: device_facts(device, check)),
        ("operator_numerics", lambda: operator_numerics(device, check)),
        ("checkpoint_round_trip", lambda: checkpoint_round_trip(device, check, root)),
        ("memory_and_step_time", lambda: memory_and_step_time(device, check, deadline)),
    ]
    reports = []
    for name, step in steps:
        started = time.monotonic()
        if started > deadline:
            reports.append(StepReport(name=name, summary=f"the budget of {budget_s:g} s was spent before it began"))
        else:
            try:
                report = step()
            except Exception as exc:  # noqa: BLE001 - one failed step does not stop the others
                report = StepReport(name=name, status="failed", error=f"{type(exc).__name__}: {exc}",
                                    summary=traceback.format_exc(limit=8).strip().splitlines()[-1])
            report.seconds = round(time.monotonic() - started, 2)
            reports.append(report)
        echo(f"[accelerator-check] {reports[-1].name}: {reports[-1].status} in {reports[-1].seconds:.1f} s: "
             f"{reports[-1].summary}")
    result = {
        "device": device, "device_name": _device_name(device), "size": size, "budget_s": budget_s,
        "seconds": round(time.monotonic() - began, 2), "torch": torch.__version__,
        "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kind": kind, "passed": all(r.status == "ok" for r in reports),
        "steps": [dataclasses.asdict(r) for r in reports],
    }
    (root / REPORT_JSON).write_text(json.dumps(result, indent=1, default=str))
    (root / REPORT_MD).write_text(markdown(result))
    return result


def _device_name(device: str) -> str:
    import platform

    import torch

    kind = device.split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if kind == "npu":
        try:
            return torch.npu.get_device_name(torch.device(device))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            return "npu"
    return platform.processor() or platform.machine()


def _gb(value: Any) -> str:
    return "-" if value is None else f"{value / 1e9:.3f}"


def markdown(result: dict[str, Any]) -> str:
    """The human report: each step's line, then the memory and step-time table."""
    lines = [f"# Accelerator check on `{result['device']}` ({result['device_name']}): "
             f"{'all steps ran' if result['passed'] else 'NOT ALL STEPS RAN'}", "",
             f"- size {result['size']}, {result['seconds']:.0f} s of a {result['budget_s']:g} s budget, torch "
             f"{result['torch']}, written {result['written']}", "", "| step | status | seconds | result |",
             "|---|---|---|---|"]
    for step in result["steps"]:
        text = (step["summary"] + (f" ({step['error']})" if step["error"] else "")).replace("|", "/")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {text} |")
    table = next((s for s in result["steps"] if s["name"] == "memory_and_step_time" and s["data"]), None)
    if table:
        lines += ["", f"Memory model and cost model against the measured runs ({table['data']['profile']} profile):", "",
                  "| candidate | seq | predicted tensors GB | measured tensors GB | ratio | predicted total GB | "
                  "measured reserved GB | step s | uncalibrated | calibrated (leave one out) | status |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in table["data"]["rows"]:
            lines.append(
                f"| {r['candidate']} | {r['seq_length']} | {_gb(r.get('predicted_tensor_bytes'))} | "
                f"{_gb(r.get('measured_tensor_bytes'))} | {r.get('tensor_ratio', float('nan')):.2f} | "
                f"{_gb(r.get('predicted_total_bytes'))} | {_gb(r.get('measured_reserved_bytes'))} | "
                f"{r.get('measured_step_s', float('nan')):.4f} | {r.get('uncalibrated_ratio', float('nan')):.2f} | "
                f"{r.get('calibrated_ratio', float('nan')):.2f} | {r.get('status', '')} |")
        rows = [r for r in table["data"]["rows"] if r.get("measure")]
        if rows:
            lines += ["", f"Measured by: {rows[0]['measure']}."]
    return "\n".join(lines) + "\n"
