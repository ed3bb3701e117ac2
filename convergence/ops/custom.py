"""The user's operators checked on a device: each candidate implementation's forward and backward against
the reference in float64 and against the reference computed in the same dtype, and the implementation the
device should use.

Call sequence: ``check_operator(op, device, dtypes)`` -> for each dtype and input case: draw the inputs in
float64, round them to the dtype; run the reference on exactly those values in float64 on the CPU, the
reference in the dtype on the device, and every candidate of the device's backend; backward with one
seeded output gradient each -> `TensorCheck` per output and input gradient -> the operator's status:

* ``native``: a candidate of the backend passed every dtype and case (the first one that did is chosen);
* ``wrong``: the backend has candidates and none passed (each failure names its first wrong element);
* ``fallback``: no candidate for the backend; the reference itself runs on the device and is used;
* ``missing``: no candidate, and the reference does not run on the device either.

A tensor passes when its error against float64 is within the dtype's thresholds, or when it is at most
``max_error_ratio`` times the error of the reference computed in the same dtype (so a bf16 kernel is
judged against what bf16 can do). The fractions of elements within 1e-3 and 1e-4 relative error (msprobe's
dual-thousandths and dual-ten-thousandths indicators) are reported beside.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from convergence.ops.metrics import EPS, TensorError, Thresholds, tensor_error
from convergence.ops.numerics import is_unsupported
from convergence.ops.registry import DTYPE_NAMES, OperatorSpec, implementation_name

OperatorStatus = Literal["native", "fallback", "missing", "wrong"]
RunStatus = Literal["pass", "fail", "unsupported", "error"]
REFERENCE = "reference"


@dataclass(frozen=True, kw_only=True, slots=True)
class Execution:
    """One forward + backward: the compared outputs and input gradients, float64 on the CPU, by name
    (``out.<i>``, ``grad.<input>``)."""

    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class WrongElement:
    """The first element beyond the tolerance (row-major), else the one with the largest error."""

    tensor: str
    index: tuple[int, ...]
    value: float
    expected: float
    bound: float

    def describe(self) -> str:
        return (f"{self.tensor}[{', '.join(map(str, self.index))}] = {self.value:.6g}, expected {self.expected:.6g} "
                f"(|error| {abs(self.value - self.expected):.3g} > {self.bound:.3g})")


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorCheck:
    """One output or input gradient of a candidate: its error against float64, the same-dtype reference's
    own error, their ratio, the dual-thousandths fractions, and the verdict."""

    name: str
    vs_fp64: TensorError
    reference_error: TensorError | None
    error_ratio: float
    within_1e3: float
    within_1e4: float
    passed: bool
    first_wrong: WrongElement | None

    def to_dict(self) -> dict[str, Any]:
        error = {k: getattr(self.vs_fp64, k) for k in ("cosine", "max_abs", "max_abs_over_rms", "max_rel",
                                                         "mean_ulp", "max_ulp", "nonfinite")}
        return {"name": self.name, "passed": self.passed, **error, "error_ratio": self.error_ratio,
                "within_1e-3": self.within_1e3, "within_1e-4": self.within_1e4,
                "reasons": list(self.vs_fp64.reasons),
                "first_wrong": self.first_wrong.describe() if self.first_wrong else None}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """One implementation at one dtype and input case."""

    implementation: str
    dtype: str
    case: str
    status: RunStatus
    tensors: tuple[TensorCheck, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "dtype": self.dtype, "case": self.case, "status": self.status,
                "reason": self.reason, "tensors": [t.to_dict() for t in self.tensors]}


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorVerdict:
    """The operator on one device: its status, the implementation chosen, every run behind it."""

    name: str
    backend: str
    device: str
    status: OperatorStatus
    chosen: str | None
    runs: tuple[RunResult, ...]
    reason: str

    @property
    def passed(self) -> bool:
        return self.status in ("native", "fallback")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "device": self.device, "status": self.status,
                "chosen": self.chosen, "passed": self.passed, "reason": self.reason,
                "runs": [r.to_dict() for r in self.runs]}


def backend_of(device: str) -> str:
    """The backend name of a device string: its device type (cpu, cuda, npu, ...)."""
    return torch.device(device).type


def case_generator(seed: int, op: str, case: str) -> torch.Generator:
    """A generator seeded from (seed, operator, case): the same inputs on every machine."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{op}/{case}".encode()))


def draw(op: OperatorSpec, case: str, dtype: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """(inputs rounded to `dtype`, output gradients rounded to `dtype`) of one case; the output gradients
    are drawn after a float64 run of the reference has shown the outputs' shapes."""
    gen = case_generator(seed, op.name, case)
    drawn = op.make_inputs(gen, case)
    rounded = {k: v.to(dtype) if v.is_floating_point() else v for k, v in drawn.items()}
    shapes = [o.shape for o in _select(op, _as_list(op.reference(**{k: v.to(torch.float64) if v.is_floating_point() else v
                                                                    for k, v in rounded.items()})))]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    return rounded, grads


def _as_list(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    raise TypeError(f"an operator must return a tensor or a tuple of tensors, got {type(out).__name__}")


def _select(op: OperatorSpec, outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if op.outputs is None:
        return list(outs)
    if max(op.outputs, default=-1) >= len(outs):
        raise ValueError(f"operator {op.name!r}: outputs {list(op.outputs)} but it returned {len(outs)} tensor(s)")
    return [outs[i] for i in op.outputs]


def grad_names(op: OperatorSpec, inputs: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    if op.grad is not None:
        missing = sorted(set(op.grad) - set(inputs))
        if missing:
            raise ValueError(f"operator {op.name!r}: grad names {missing} are not inputs ({sorted(inputs)})")
        return op.grad
    return tuple(k for k, v in inputs.items() if v.is_floating_point())


def execute(op: OperatorSpec, fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor],
            grad_outputs: Sequence[torch.Tensor], *, device: str, dtype: torch.dtype) -> Execution:
    """`fn` forward and backward on `device` in `dtype` (float64: the reference) from the given inputs."""
    names = grad_names(op, inputs)
    leaves = {}
    for k, v in inputs.items():
        if v.is_floating_point():
            leaves[k] = v.to(device=device, dtype=dtype).detach().clone().requires_grad_(k in names)
        else:
            leaves[k] = v.to(device)
    outs = _select(op, _as_list(fn(**leaves)))
    if len(outs) != len(grad_outputs):
        raise ValueError(f"operator {op.name!r}: {len(outs)} compared output(s) but {len(grad_outputs)} gradients")
    tensors = {f"out.{i}": o.detach().to("cpu", torch.float64) for i, o in enumerate(outs)}
    pairs = [(o, g.to(device=device, dtype=o.dtype)) for o, g in zip(outs, grad_outputs) if o.requires_grad]
    if pairs and names:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for k in names:
        grad = leaves[k].grad
        tensors[f"grad.{k}"] = (grad if grad is not None else torch.zeros_like(leaves[k])).detach().to("cpu", torch.float64)
    return Execution(tensors=tensors)


def first_wrong(name: str, actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
                th: Thresholds) -> WrongElement | None:
    """The first element (row-major) whose error exceeds max(max_abs_eps * eps * rms, max_rel_eps * eps * |ref|),
    else the element with the largest error; None for an empty tensor."""
    a, r = actual.reshape(-1), reference.reshape(-1)
    if not a.numel():
        return None
    eps = EPS[dtype]
    agree = (torch.isnan(a) & torch.isnan(r)) | (a == r)  # non-finite in both, alike
    err = torch.where(agree, torch.zeros_like(a), (a - r).abs().nan_to_num(nan=float("inf")))
    rms = float(r[torch.isfinite(r)].pow(2).mean().sqrt()) if torch.isfinite(r).any() else 0.0
    bound = torch.maximum(torch.full_like(r, th.max_abs_eps * eps * rms), th.max_rel_eps * eps * r.abs().nan_to_num())
    beyond = torch.nonzero(err > bound)
    i = int(beyond[0]) if len(beyond) else int(torch.argmax(err))
    index = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), actual.shape))
    return WrongElement(tensor=name, index=index, value=float(a[i]), expected=float(r[i]), bound=float(bound[i]))


def _within(actual: torch.Tensor, reference: torch.Tensor, rel: float) -> float:
    a, r = actual.reshape(-1), reference.reshape(-1)
    finite = torch.isfinite(r)
    a, r = a[finite], r[finite]
    if not r.numel():
        return 1.0
    rms = float(r.pow(2).mean().sqrt())
    counted = r.abs() >= rms * 1e-3
    if not counted.any():
        return 1.0
    return float((((a - r).abs() / r.abs())[counted] < rel).double().mean())


def check_tensor(name: str, actual: torch.Tensor, reference64: torch.Tensor, same_dtype: torch.Tensor | None,
                 dtype: torch.dtype, th: Thresholds, max_error_ratio: float) -> TensorCheck:
    """One tensor of a candidate against float64 and against the reference computed in the same dtype."""
    vs = tensor_error(name, actual, reference64, dtype, th)
    ref = tensor_error(name, same_dtype, reference64, dtype, th) if same_dtype is not None else None
    ratio = 0.0
    if ref is not None:
        tiny = 1e-300
        ratio = max(vs.max_abs_over_rms / max(ref.max_abs_over_rms, tiny), vs.mean_ulp / max(ref.mean_ulp, tiny))
        if vs.max_abs == 0:
            ratio = 0.0
    passed = vs.passed or (ref is not None and not vs.nonfinite and ratio <= max_error_ratio)
    return TensorCheck(name=name, vs_fp64=vs, reference_error=ref, error_ratio=ratio,
                       within_1e3=_within(actual, reference64, 1e-3), within_1e4=_within(actual, reference64, 1e-4),
                       passed=passed, first_wrong=None if passed else first_wrong(name, actual, reference64, dtype, th))


def _run(op: OperatorSpec, fn: Callable[..., Any], label: str, inputs: Mapping[str, torch.Tensor],
         grads: Sequence[torch.Tensor], reference64: Execution, same_dtype: Execution | None, *, device: str,
         dtype_name: str, case: str) -> RunResult:
    dtype = DTYPE_NAMES[dtype_name]
    try:
        got = execute(op, fn, inputs, grads, device=device, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - reported with the implementation
        status: RunStatus = "unsupported" if is_unsupported(exc) else "error"
        return RunResult(implementation=label, dtype=dtype_name, case=case, status=status,
                         reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    th = op.threshold(dtype_name)
    checks = []
    for name, ref in reference64.tensors.items():
        actual = got.tensors.get(name)
        if actual is None or actual.shape != ref.shape:
            shape = None if actual is None else tuple(actual.shape)
            return RunResult(implementation=label, dtype=dtype_name, case=case, status="fail",
                             reason=f"{name}: shape {shape}, expected {tuple(ref.shape)}")
        checks.append(check_tensor(name, actual, ref, same_dtype.tensors.get(name) if same_dtype else None,
                                   dtype, th, op.max_error_ratio))
    bad = [c for c in checks if not c.passed]
    reason = " | ".join(f"{c.name}: {'; '.join(c.vs_fp64.reasons)}"
                        + (f"; {c.error_ratio:.3g}x the same-dtype reference's error" if c.reference_error else "")
                        + (f"; first wrong {c.first_wrong.describe()}" if c.first_wrong else "") for c in bad)
    return RunResult(implementation=label, dtype=dtype_name, case=case, status="fail" if bad else "pass",
                     tensors=tuple(checks), reason=reason)


def check_operator(op: OperatorSpec, device: str, dtypes: Sequence[str], *, seed: int = 0) -> OperatorVerdict:
    """Every candidate of the device's backend, and the reference on the device, at every dtype and case."""
    backend = backend_of(device)
    wanted = [d for d in dtypes if op.dtypes is None or d in op.dtypes]
    candidates = [(implementation_name(fn), fn) for fn in op.candidates(backend)]
    runs: list[RunResult] = []
    for dtype_name in wanted:
        dtype = DTYPE_NAMES[dtype_name]
        for case in op.cases:
            inputs, grads = draw(op, case, dtype, seed)
            reference64 = execute(op, op.reference, inputs, grads, device="cpu", dtype=torch.float64)
            try:
                same = execute(op, op.reference, inputs, grads, device=device, dtype=dtype)
            except Exception:  # noqa: BLE001 - the reference may not run on the device: judged by float64 alone
                same = None
            for label, fn in [(REFERENCE, op.reference)] + candidates:
                runs.append(_run(op, fn, label, inputs, grads, reference64, same, device=device,
                                 dtype_name=dtype_name, case=case))
    return resolve_status(op.name, backend, device, [c for c, _ in candidates], runs)


def resolve_status(name: str, backend: str, device: str, candidates: Sequence[str],
                   runs: Sequence[RunResult]) -> OperatorVerdict:
    """Pure: the operator's status from its runs (see the module docstring)."""
    def runs_of(label: str) -> list[RunResult]:
        return [r for r in runs if r.implementation == label]

    available = [c for c in candidates if not all(r.status == "unsupported" for r in runs_of(c))]
    for label in available:
        if all(r.status == "pass" for r in runs_of(label)):
            others = [c for c in available if c != label]
            return OperatorVerdict(name=name, backend=backend, device=device, status="native", chosen=label,
                                   runs=tuple(runs), reason=f"{label} passes {len(runs_of(label))} dtype x case run(s)"
                                   + (f" (also registered: {', '.join(others)})" if others else ""))
    if available:
        failures = [f"{r.implementation} [{r.dtype}, {r.case}] {r.status}: {r.reason}" for label in available
                    for r in runs_of(label) if r.status != "pass"]
        return OperatorVerdict(name=name, backend=backend, device=device, status="wrong", chosen=REFERENCE,
                               runs=tuple(runs), reason=f"{len(available)} {backend} implementation(s), none passes: "
                                                        + "; ".join(failures[:3])
                                                        + (f"; and {len(failures) - 3} more" if len(failures) > 3 else ""))
    reference = runs_of(REFERENCE)
    if reference and all(r.status == "pass" for r in reference):
        return OperatorVerdict(name=name, backend=backend, device=device, status="fallback", chosen=REFERENCE,
                               runs=tuple(runs), reason=f"no {backend} implementation registered; the reference runs "
                                                        f"on {device} and passes")
    why = "; ".join(f"[{r.dtype}, {r.case}] {r.status}: {r.reason}" for r in reference if r.status != "pass")[:500]
    return OperatorVerdict(name=name, backend=backend, device=device, status="missing", chosen=None, runs=tuple(runs),
                           reason=f"no {backend} implementation registered, and the reference does not run on "
                                  f"{device}: {why}")
