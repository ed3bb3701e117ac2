"""The whole operator-numerics suite on one device, as plain JSON-able data.

``run_suite(device, dtypes, ...)`` runs the built-in operator checks, the user's registered operators
(`convergence.ops.custom`), and with a model: the coverage scan of one step (marking the custom operators the
registry checks) and the layer-drift comparison (device in ``drift_dtype`` against CPU float32). With
``dump`` it records every operator and the model step into that folder; with ``compare`` it replays a dump
made elsewhere and names the first operator, layer and aten call that drift (`convergence.ops.dump`).
It returns a dict with a ``passed`` flag and ``reasons``; callers decide where it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from convergence.ops.coverage import dispatch_key_for, record_operators, scan
from convergence.ops.custom import OperatorVerdict, check_operator
from convergence.ops.drift import RunConfig, compare_step
from convergence.ops.numerics import CASES, DTYPES, check_operators
from convergence.ops.registry import OperatorSpec, implementation_name

BUILTIN_PREFIX = "builtin."


def _inputs_of(make: Callable[[torch.Generator], Any]) -> Callable[[torch.Generator, Any], Any]:
    return lambda gen, case: make(gen)


def builtin_specs(ops: Sequence[str] | None = None) -> tuple[OperatorSpec, ...]:
    """The built-in operator cases as registry operators that every backend runs with its own kernels."""
    return tuple(OperatorSpec(name=BUILTIN_PREFIX + c.name, reference=c.fn, targets={"*": (c.fn,)},
                              make_inputs=_inputs_of(c.make), grad=c.grad)
                 for c in CASES if ops is None or c.name in ops)


def chosen_implementations(custom: Sequence[OperatorSpec], verdicts: Sequence[OperatorVerdict],
                           device: str) -> dict[str, Callable[..., Any]]:
    """What the device runs for each operator, as a dump records it and a compare replays it: the first
    registered implementation of its backend that runs there (whether its check passed or not: a compare
    shows what production does), else the reference; a missing operator is left out."""
    backend = torch.device(device).type
    chosen: dict[str, Callable[..., Any]] = {}
    for op, verdict in zip(custom, verdicts):
        runs: dict[str, list[str]] = {}
        for run in verdict.runs:
            runs.setdefault(run.implementation, []).append(run.status)
        runnable = [fn for fn in op.candidates(backend)
                    if any(status != "unsupported" for status in runs.get(implementation_name(fn), ["pass"]))]
        if runnable:
            chosen[op.name] = runnable[0]
        elif verdict.status != "missing":
            chosen[op.name] = op.reference
    return chosen


def run_suite(device: str, dtypes: Sequence[str], *, ops: Sequence[str] | None = None,
              model_factory: Callable[[], nn.Module] | None = None, batch: Any = None,
              loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
              drift_dtype: str = "fp32", seed: int = 0, custom: Sequence[OperatorSpec] = (),
              allow_fallback: bool = True, dump: str | None = None, compare: str | None = None,
              compare_dtype: str | None = None, layer_captures: tuple[float, list] | None = None,
              world_size: int = 1) -> dict[str, Any]:
    """Every check on `device`; never raises on a bad result (see the module docstring). `layer_captures`
    is the model step as data-parallel ranks ran it (`convergence.ops.dump.data_parallel_capture`) for the
    comparison of a dump at `world_size` ranks; `compare_dtype` replays the dump in another dtype (default:
    operators as dumped, the model step in `drift_dtype`)."""
    results = check_operators(device, dtypes, ops, seed)
    reasons = [f"{r.op} [{r.dtype}] {r.status}: {r.reason}" for r in results if r.status != "pass"]
    out: dict[str, Any] = {"device": device, "operators": [r.to_dict() for r in results]}
    verdicts = [check_operator(op, device, dtypes, seed=seed) for op in custom]
    out["custom"] = [v.to_dict() for v in verdicts]
    for v in verdicts:
        if v.status in ("wrong", "missing") or (v.status == "fallback" and not allow_fallback):
            reasons.append(f"{v.name} {v.status} on {v.device}: {v.reason}")
    chosen = chosen_implementations(custom, verdicts, device)
    registered = {implementation_name(fn): op.name for op in custom for fns in op.targets.values() for fn in fns}
    if model_factory is not None and loss_fn is not None:
        model = model_factory().to(device)
        moved = [b.to(device) for b in batch]
        recorded = record_operators(lambda: loss_fn(model, moved).backward())
        coverage = scan(recorded, dispatch_key_for(device), registered=registered)
        out["coverage"] = coverage.to_dict()
        reasons += [f"coverage: {op} has no {coverage.dispatch_key} kernel" for op in coverage.missing]
        reasons += [f"coverage: {op} falls back off the device" for op in coverage.fallback]
        reasons += [f"coverage: custom operator {op} runs in the model but no registry entry checks it"
                    for op in coverage.unregistered]
        drift = compare_step(model_factory, batch, loss_fn, RunConfig(device=device, dtype=DTYPES[drift_dtype]),
                             RunConfig(device="cpu", dtype=torch.float32))
        out["drift"] = drift.to_dict()
        if drift.first_drift is not None:
            worst = max(drift.layers, key=lambda x: x.rel_error)
            reasons.append(f"drift: {device} {drift_dtype} vs cpu fp32 first exceeds rel error {drift.limit:g} at "
                           f"layer {drift.first_drift} (worst {worst.layer} {worst.kind} {worst.rel_error:.3e})")
    builtins = builtin_specs(ops)
    chosen.update({op.name: op.reference for op in builtins})
    recorded_ops = [op for op in (*custom, *builtins) if op.name in chosen]
    if dump:
        from convergence.ops.dump import dump_model, dump_operators

        entries = dump_operators(dump, recorded_ops, device, dtypes, chosen=chosen, seed=seed)
        out["dump"] = {"directory": dump, "operator_runs": len(entries)}
        if model_factory is not None and loss_fn is not None:
            entry = dump_model(dump, model_factory, batch, loss_fn, device=device, dtype=drift_dtype)
            out["dump"].update(layers=len(entry["layers"]), calls=len(entry["calls"]), loss=entry["loss"])
    if compare:
        reasons += _compare(out, compare, recorded_ops, chosen, device, compare_dtype, compare_dtype or drift_dtype,
                            model_factory, loss_fn, layer_captures, world_size)
    out["passed"] = not reasons
    out["reasons"] = reasons
    return out


def _compare(out: dict[str, Any], directory: str, recorded_ops: Sequence[OperatorSpec], chosen: dict[str, Any],
             device: str, dtype: str | None, model_dtype: str, model_factory: Callable[[], nn.Module] | None,
             loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None, layer_captures: tuple[float, list] | None,
             world_size: int) -> list[str]:
    from convergence.ops.dump import compare_model, compare_operators, read_manifest

    manifest = read_manifest(directory)
    replays = compare_operators(directory, recorded_ops, device, chosen=chosen, dtype=dtype)
    failed = [r for r in replays if not r.passed]
    result: dict[str, Any] = {"directory": directory, "source_device": manifest.get("device"),
                              "operators": [r.to_dict() for r in replays],
                              "first_operator": (f"{failed[0].name} [{failed[0].dtype}, {failed[0].case}]"
                                                 if failed else None)}
    reasons = []
    for r in failed:
        bad = "; ".join(f"{t.name}: {'; '.join(t.reasons)}" for t in r.tensors if not t.passed)
        reasons.append(f"compare: {r.name} [{r.dtype}, {r.case}] here ({r.implementation}) differs from the source "
                       f"({r.source_implementation}): {bad}")
    if "model" in manifest and model_factory is not None and loss_fn is not None:
        comparison = compare_model(directory, model_factory, loss_fn, device=device, dtype=model_dtype,
                                   captured=layer_captures, world_size=world_size)
        result["model"] = comparison.to_dict()
        if not comparison.passed:
            reasons.append(f"compare: {comparison.describe()}")
    out["compare"] = result
    return reasons


def summary_markdown(result: dict[str, Any]) -> str:
    """A Markdown report of the suite's result."""
    lines = [f"# Operator numerics on `{result['device']}`: **{'PASS' if result['passed'] else 'FAIL'}**", "",
             "| operator | dtype | status | worst cosine | worst max rel | worst mean ULP |", "|---|---|---|---|---|---|"]
    for r in result["operators"]:
        ts = r["tensors"]
        cos = min((t["cosine"] for t in ts), default=float("nan"))
        rel = max((t["max_rel"] for t in ts), default=float("nan"))
        ulp = max((t["mean_ulp"] for t in ts), default=float("nan"))
        lines.append(f"| {r['op']} | {r['dtype']} | {r['status']} | {cos:.7f} | {rel:.2e} | {ulp:.2f} |")
    if result.get("custom"):
        lines += ["", "Registered operators (each candidate against float64 and against the reference in the same dtype):",
                  "", "| operator | status | used on the device | runs | worst cosine | worst error ratio | "
                      "min within 1e-3 | min within 1e-4 | detail |", "|---|---|---|---|---|---|---|---|---|"]
        for v in result["custom"]:
            runs = [r for r in v["runs"] if r["implementation"] == v["chosen"]] or v["runs"]
            ts = [t for r in runs for t in r["tensors"]]
            cos = min((t["cosine"] for t in ts), default=float("nan"))
            ratio = max((t["error_ratio"] for t in ts), default=float("nan"))
            w3 = min((t["within_1e-3"] for t in ts), default=float("nan"))
            w4 = min((t["within_1e-4"] for t in ts), default=float("nan"))
            detail = v["reason"].replace("|", "/")
            lines.append(f"| {v['name']} | {v['status']} | {v['chosen'] or '-'} | {len(runs)} | {cos:.7f} | {ratio:.3g} | "
                         f"{w3:.4f} | {w4:.4f} | {detail[:400]} |")
    if "coverage" in result:
        c = result["coverage"]
        custom_ops = [o for o in c["ops"] if o.get("custom")]
        lines += ["", f"Coverage on {c['dispatch_key']}: {len(c['ops'])} operators, missing {c['missing'] or 'none'}, "
                      f"fallback {c['fallback'] or 'none'}"
                      + (", custom: " + ", ".join(
                          f"{o['op']} ({'checked as ' + o['registered'] if o['registered'] else 'not registered'})"
                          for o in custom_ops) if custom_ops else "")]
    if "drift" in result:
        d = result["drift"]
        lines += ["", f"Layer drift ({d['a']['dtype']} on {d['a']['device']} vs {d['b']['dtype']} on {d['b']['device']}): "
                      f"first drifting layer {d['first_drift'] or 'none'} (limit {d['limit']:g}); "
                      f"loss {d['loss_a']:.6f} vs {d['loss_b']:.6f}"]
    if "dump" in result:
        d = result["dump"]
        lines += ["", f"Dumped {d['operator_runs']} operator run(s)"
                      + (f" and a model step ({d['layers']} layer tensors, {d['calls']} aten calls, loss {d['loss']:.6f})"
                         if "layers" in d else "") + f" to `{d['directory']}`."]
    if "compare" in result:
        c = result["compare"]
        bad = sum(1 for r in c["operators"] if not r["passed"])
        lines += ["", f"Compared with the dump `{c['directory']}` (made on {c['source_device']}): "
                      f"{len(c['operators']) - bad} of {len(c['operators'])} operator runs agree"
                      + (f"; first that differs: {c['first_operator']}" if c["first_operator"] else "") + "."]
        if "model" in c:
            lines += ["", f"Model step: {c['model']['summary']}."]
    if result["reasons"]:
        lines += ["", "Problems:", *[f"- {r}" for r in result["reasons"]]]
    return "\n".join(lines) + "\n"
