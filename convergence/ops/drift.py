"""Per-layer drift of one training step between two runs (two devices or two dtypes).

Call sequence: ``compare_step(make_model, make_batch, loss_fn, a, b)`` builds the model
once, copies its weights into both runs, runs forward + backward in each with forward
hooks (module outputs) and full backward hooks (gradients w.r.t. module outputs) on
every leaf module, and compares each captured tensor in float64. Activations are
listed in forward order, gradients in backward order; the report names the first
layer of each whose relative error exceeds the looser of the two dtypes' limits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DRIFT_LIMIT = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
"""Relative error (||a - b|| / ||b||) beyond which a layer counts as drifting."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerDrift:
    layer: str
    kind: str
    """``activation``, ``grad_output`` or ``param_grad``."""
    rel_error: float
    cosine: float
    drifts: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class DriftReport:
    a: RunConfig
    b: RunConfig
    limit: float
    layers: tuple[LayerDrift, ...]
    loss_a: float
    loss_b: float

    def first(self, kind: str) -> LayerDrift | None:
        return next((x for x in self.layers if x.kind == kind and x.drifts), None)

    @property
    def first_drift(self) -> str | None:
        """The first drifting layer in forward order (activations), else in backward order."""
        hit = self.first("activation") or self.first("grad_output") or self.first("param_grad")
        return hit.layer if hit else None

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"device": self.a.device, "dtype": str(self.a.dtype)},
                "b": {"device": self.b.device, "dtype": str(self.b.dtype)}, "limit": self.limit,
                "loss_a": self.loss_a, "loss_b": self.loss_b, "first_drift": self.first_drift,
                "layers": [{"layer": x.layer, "kind": x.kind, "rel_error": x.rel_error, "cosine": x.cosine,
                            "drifts": x.drifts} for x in self.layers]}


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def capture_step(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                 run: RunConfig) -> tuple[float, list[tuple[str, str, torch.Tensor]]]:
    """One forward + backward; returns the loss and (layer, kind, tensor as float64 CPU) in capture order."""
    model = model.to(run.device, run.dtype)
    captured: list[tuple[str, str, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        if list(module.children()) or not name:
            continue

        def fwd(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            t = _first_tensor(out)
            if t is not None:
                captured.append((name, "activation", t.detach().to("cpu", torch.float64)))

        def bwd(mod: nn.Module, grad_in: Any, grad_out: Any, name: str = name) -> None:
            t = _first_tensor(grad_out)
            if t is not None:
                captured.append((name, "grad_output", t.detach().to("cpu", torch.float64)))

        handles += [module.register_forward_hook(fwd), module.register_full_backward_hook(bwd)]
    try:
        moved = [b.to(run.device, run.dtype) if b.is_floating_point() else b.to(run.device) for b in batch]
        loss = loss_fn(model, moved)
        with warnings.catch_warnings():
            # Leaf modules fed integer inputs (embeddings) have no input gradient: expected.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    for name, p in model.named_parameters():
        if p.grad is not None:
            captured.append((name, "param_grad", p.grad.detach().to("cpu", torch.float64)))
    return float(loss.detach()), captured


def compare_step(make_model: Callable[[], nn.Module], batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 a: RunConfig, b: RunConfig, *, limit: float | None = None,
                 prepare_b: Callable[[nn.Module], None] | None = None) -> DriftReport:
    """Compare one step of the same model and batch under ``a`` and ``b`` (b is the reference side).

    ``prepare_b`` may modify run b's model before the step (used to install a device
    adapter, or by tests to inject a fault).
    """
    base = make_model()
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model_a, model_b = make_model(), make_model()
    model_a.load_state_dict(state)
    model_b.load_state_dict(state)
    if prepare_b is not None:
        prepare_b(model_b)
    loss_a, cap_a = capture_step(model_a, batch, loss_fn, a)
    loss_b, cap_b = capture_step(model_b, batch, loss_fn, b)
    if [(n, k) for n, k, _ in cap_a] != [(n, k) for n, k, _ in cap_b]:
        raise ValueError(f"runs captured different layers: {len(cap_a)} vs {len(cap_b)} tensors; "
                         f"the two runs must execute the same modules")
    limit = limit if limit is not None else max(DRIFT_LIMIT[a.dtype], DRIFT_LIMIT[b.dtype])
    layers = []
    for (name, kind, ta), (_, _, tb) in zip(cap_a, cap_b):
        diff = float((ta - tb).norm())
        ref = float(tb.norm())
        rel = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
        denom = float(ta.norm()) * ref
        cos = float((ta * tb).sum()) / denom if denom > 0 else 1.0
        layers.append(LayerDrift(layer=name, kind=kind, rel_error=rel, cosine=cos, drifts=not rel <= limit))
    return DriftReport(a=a, b=b, limit=limit, layers=tuple(layers), loss_a=loss_a, loss_b=loss_b)
