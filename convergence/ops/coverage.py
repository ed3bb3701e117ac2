"""Which aten operators a model runs, and which of them the target device lacks.

Call sequence: ``record_operators(step)`` runs one callable (a forward + backward of
the model) under a TorchDispatchMode and counts every operator that reaches a
kernel, with the devices of its tensor inputs and outputs; ``scan(recorded, key)``
asks PyTorch's dispatcher, per operator, whether the target's dispatch key (``CPU``,
``CUDA``, ``PrivateUse1`` for NPUs, ...) has a kernel of its own, only a composite
one, only the backend's boxed fallback (runs somewhere else, silently) or nothing.
Operators whose outputs landed on the CPU while their inputs were on the target
device are reported as observed CPU fallbacks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CoverageStatus = Literal["native", "composite", "fallback", "missing"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedOps:
    counts: Mapping[str, int]
    input_devices: Mapping[str, tuple[str, ...]]
    cpu_outputs_from_device_inputs: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCoverage:
    op: str
    count: int
    status: CoverageStatus
    detail: str
    registered: str | None = None
    """For an operator outside aten and prims (a user's custom operator): the registry operator that checks it."""

    @property
    def custom(self) -> bool:
        return self.op.split("::")[0] not in ("aten", "prims")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoverageReport:
    dispatch_key: str
    ops: tuple[OpCoverage, ...]
    observed_cpu_fallbacks: tuple[str, ...] = field(default=())

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(o.op for o in self.ops if o.status == "missing")

    @property
    def fallback(self) -> tuple[str, ...]:
        return tuple(o.op for o in self.ops if o.status == "fallback") + self.observed_cpu_fallbacks

    @property
    def unregistered(self) -> tuple[str, ...]:
        """Custom operators the model calls that no registry entry checks."""
        return tuple(o.op for o in self.ops if o.custom and o.registered is None)

    @property
    def passed(self) -> bool:
        return not self.missing and not self.fallback

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_key": self.dispatch_key, "passed": self.passed, "missing": list(self.missing),
                "fallback": list(self.fallback), "unregistered": list(self.unregistered),
                "ops": [{"op": o.op, "count": o.count, "status": o.status, "detail": o.detail,
                         "custom": o.custom, "registered": o.registered} for o in self.ops]}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.devices: dict[str, set[str]] = {}
        self.cpu_outputs: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.counts[name] += 1
        inputs = {str(t.device) for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        self.devices.setdefault(name, set()).update(inputs)
        out = func(*args, **(kwargs or {}))
        outputs = {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        if outputs == {"cpu"} and any(not d.startswith(("cpu", "meta")) for d in inputs):
            self.cpu_outputs.add(name)
        return out


def record_operators(step: Callable[[], Any]) -> RecordedOps:
    """Run ``step`` once and record the operators that reach a kernel."""
    recorder = _Recorder()
    with recorder:
        step()
    return RecordedOps(counts=dict(recorder.counts),
                       input_devices={k: tuple(sorted(v)) for k, v in recorder.devices.items()},
                       cpu_outputs_from_device_inputs=tuple(sorted(recorder.cpu_outputs)))


def op_status(op: str, dispatch_key: str) -> tuple[CoverageStatus, str]:
    """How the dispatcher would run ``op`` (``aten::mm``, ``aten::add.Tensor``) for ``dispatch_key``."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if has(op, dispatch_key):
        return "native", f"{dispatch_key} kernel"
    for composite in ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd"):
        if has(op, composite):
            return "composite", f"no {dispatch_key} kernel; {composite} decomposes it into other operators"
    key = getattr(torch._C.DispatchKey, dispatch_key, None)
    if key is not None and torch._C._dispatch_has_backend_fallback(key):
        return "fallback", f"no {dispatch_key} kernel; the backend's boxed fallback runs it (typically on the CPU)"
    return "missing", f"no {dispatch_key} kernel, no composite kernel, no backend fallback"


def scan(recorded: RecordedOps, dispatch_key: str, *, ignore: Iterable[str] = (),
         registered: Mapping[str, str] | None = None) -> CoverageReport:
    """Coverage of every recorded operator on ``dispatch_key`` (pure apart from dispatcher queries);
    `registered` maps a custom operator's name (``namespace::name``) to the registry operator checking it."""
    skip = set(ignore)
    known = dict(registered or {})
    rows = []
    for op, count in sorted(recorded.counts.items()):
        if op in skip:
            continue
        status, detail = op_status(op, dispatch_key)
        base = op.split(".")[0]  # an overload (ns::op.default) is registered under its packet's name
        rows.append(OpCoverage(op=op, count=count, status=status, detail=detail, registered=known.get(op, known.get(base))))
    return CoverageReport(dispatch_key=dispatch_key, ops=tuple(rows),
                          observed_cpu_fallbacks=recorded.cpu_outputs_from_device_inputs)


def dispatch_key_for(device: str) -> str:
    """The dispatch key of a device string: cpu -> CPU, cuda:0 -> CUDA, npu:0 -> PrivateUse1, meta -> Meta."""
    kind = torch.device(device).type
    return {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta", "xpu": "XPU", "mps": "MPS"}.get(kind, "PrivateUse1")
