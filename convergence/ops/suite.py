"""The whole operator-numerics suite on one device, as plain JSON-able data.

``run_suite(device, dtypes, model_factory, batch, loss_fn, drift_dtype)`` runs the
operator checks, the coverage scan of one model step and the layer-drift comparison
(device in ``drift_dtype`` against CPU float32), and returns a dict with a ``passed``
flag and ``reasons``. Callers decide where it runs (in-process or on a worker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from convergence.ops.coverage import dispatch_key_for, record_operators, scan
from convergence.ops.drift import RunConfig, compare_step
from convergence.ops.numerics import DTYPES, check_operators


def run_suite(device: str, dtypes: Sequence[str], *, ops: Sequence[str] | None = None,
              model_factory: Callable[[], nn.Module] | None = None, batch: Any = None,
              loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
              drift_dtype: str = "fp32", seed: int = 0) -> dict[str, Any]:
    """Operator numerics, and with a model: coverage scan and layer drift. Never raises on a bad result."""
    results = check_operators(device, dtypes, ops, seed)
    reasons = [f"{r.op} [{r.dtype}] {r.status}: {r.reason}" for r in results if r.status != "pass"]
    out: dict[str, Any] = {"device": device, "operators": [r.to_dict() for r in results]}
    if model_factory is not None and loss_fn is not None:
        model = model_factory().to(device)
        moved = [b.to(device) for b in batch]
        recorded = record_operators(lambda: loss_fn(model, moved).backward())
        coverage = scan(recorded, dispatch_key_for(device))
        out["coverage"] = coverage.to_dict()
        reasons += [f"coverage: {op} has no {coverage.dispatch_key} kernel" for op in coverage.missing]
        reasons += [f"coverage: {op} falls back off the device" for op in coverage.fallback]
        drift = compare_step(model_factory, batch, loss_fn, RunConfig(device=device, dtype=DTYPES[drift_dtype]),
                             RunConfig(device="cpu", dtype=torch.float32))
        out["drift"] = drift.to_dict()
        if drift.first_drift is not None:
            worst = max(drift.layers, key=lambda x: x.rel_error)
            reasons.append(f"drift: {device} {drift_dtype} vs cpu fp32 first exceeds rel error {drift.limit:g} at "
                           f"layer {drift.first_drift} (worst {worst.layer} {worst.kind} {worst.rel_error:.3e})")
    out["passed"] = not reasons
    out["reasons"] = reasons
    return out


def summary_markdown(result: dict[str, Any]) -> str:
    """A Markdown table of the suite's result."""
    lines = [f"# Operator numerics on `{result['device']}`: **{'PASS' if result['passed'] else 'FAIL'}**", "",
             "| operator | dtype | status | worst cosine | worst max rel | worst mean ULP |", "|---|---|---|---|---|---|"]
    for r in result["operators"]:
        ts = r["tensors"]
        cos = min((t["cosine"] for t in ts), default=float("nan"))
        rel = max((t["max_rel"] for t in ts), default=float("nan"))
        ulp = max((t["mean_ulp"] for t in ts), default=float("nan"))
        lines.append(f"| {r['op']} | {r['dtype']} | {r['status']} | {cos:.7f} | {rel:.2e} | {ulp:.2f} |")
    if "coverage" in result:
        c = result["coverage"]
        lines += ["", f"Coverage on {c['dispatch_key']}: {len(c['ops'])} operators, missing {c['missing'] or 'none'}, "
                      f"fallback {c['fallback'] or 'none'}"]
    if "drift" in result:
        d = result["drift"]
        lines += ["", f"Layer drift ({d['a']['dtype']} on {d['a']['device']} vs {d['b']['dtype']} on {d['b']['device']}): "
                      f"first drifting layer {d['first_drift'] or 'none'} (limit {d['limit']:g}); "
                      f"loss {d['loss_a']:.6f} vs {d['loss_b']:.6f}"]
    if result["reasons"]:
        lines += ["", "Problems:", *[f"- {r}" for r in result["reasons"]]]
    return "\n".join(lines) + "\n"
