"""The user's operators: a reference implementation, the implementations each backend should use, how to
draw inputs, what to compare, and tolerances.

A registry comes from data (the job's ``stages.ops.custom`` entries, implementations named
``module:function`` or ``path/to/file.py:function``) or from a Python module or file that defines
``OPERATORS``, a list of `OperatorSpec` or of such mappings. Inputs are drawn by a function
``make(generator, case) -> {name: tensor}`` in float64 (the checks round them to the dtype under test),
or from a declarative mapping of input name to ``{shape, dtype, low, high, p}`` with ``cases`` that
override it (``empty``, ``odd``, ``large``, ``masked``: whatever edge cases the operator has).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from convergence.ops.metrics import THRESHOLDS, Thresholds

FILE_MODULE_PREFIX = "migrate_user_ops_"  # modules loaded from a .py file the job names
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RegistryError(ValueError):
    """A registry entry that cannot be used (names the operator and the field)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    """One input drawn from a seeded generator: floats uniform in [low, high) (float64, rounded later),
    integers uniform in [low, high), booleans True with probability p."""

    shape: tuple[int, ...]
    dtype: str = "float"
    low: float = -1.0
    high: float = 1.0
    p: float = 0.5

    def draw(self, gen: torch.Generator) -> torch.Tensor:
        if self.dtype == "float":
            return torch.rand(self.shape, generator=gen, dtype=torch.float64) * (self.high - self.low) + self.low
        if self.dtype in ("int64", "int32"):
            return torch.randint(int(self.low), int(self.high), self.shape, generator=gen,
                                 dtype=getattr(torch, self.dtype))
        return torch.rand(self.shape, generator=gen) < self.p


@dataclass(frozen=True)
class DeclaredInputs:
    """`make(generator, case)` from declared inputs and per-case overrides of their fields."""

    inputs: Mapping[str, InputSpec]
    cases: Mapping[str, Mapping[str, Mapping[str, Any]]]

    def __call__(self, gen: torch.Generator, case: str) -> dict[str, torch.Tensor]:
        overrides = self.cases.get(case, {})
        out = {}
        for name, spec in self.inputs.items():
            changed = dict(overrides.get(name, {}))
            if "shape" in changed:
                changed["shape"] = tuple(int(v) for v in changed["shape"])
            out[name] = InputSpec(**{**_fields(spec), **changed}).draw(gen)
        return out


def _fields(spec: InputSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in InputSpec.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, kw_only=True)
class OperatorSpec:
    """A user's operator. `targets` maps a backend (the device type: cpu, cuda, npu, ...) to its candidate
    implementations in preference order; each implementation is called as ``fn(**inputs)`` like
    `reference` and returns a tensor or a tuple of tensors. `outputs` picks the compared outputs by index
    (None: all), `grad` the inputs whose gradients are compared (None: every floating input; () none)."""

    name: str
    reference: Callable[..., Any]
    targets: Mapping[str, tuple[Callable[..., Any], ...]]
    make_inputs: Callable[[torch.Generator, str], dict[str, torch.Tensor]]
    cases: tuple[str, ...] = ("typical",)
    outputs: tuple[int, ...] | None = None
    grad: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    thresholds: Mapping[str, Thresholds] = field(default_factory=dict)
    max_error_ratio: float = 2.0
    """A candidate whose error exceeds the float64 thresholds passes when it is at most this many times the
    error of the reference computed in the same dtype (a bf16 kernel judged against bf16 expectations)."""

    def threshold(self, dtype: str) -> Thresholds:
        return self.thresholds.get(dtype, THRESHOLDS[DTYPE_NAMES[dtype]])

    def candidates(self, backend: str) -> tuple[Callable[..., Any], ...]:
        """The backend's implementations; ``"*"`` names those every backend uses (the built-in operators)."""
        return tuple(self.targets.get(backend, self.targets.get("*", ())))


def implementation_name(fn: Callable[..., Any]) -> str:
    """What reports call an implementation: `module:qualname`, or the registered name of a torch.library
    custom operator (``namespace::name``)."""
    registered = getattr(fn, "_qualname", None) or getattr(fn, "_qualified_op_name", None)
    if isinstance(registered, str):
        return registered
    module = getattr(fn, "__module__", "?")
    if module.startswith(FILE_MODULE_PREFIX) and getattr(sys.modules.get(module), "__file__", None):
        module = Path(sys.modules[module].__file__).name  # type: ignore[arg-type]
    return f"{module}:{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def resolve(ref: str | Callable[..., Any], *, base: Path | None = None, where: str = "") -> Any:
    """The object named ``module:attr`` (a dotted module) or ``path/to/file.py:attr`` (relative to `base`);
    a callable is returned as it is."""
    if callable(ref):
        return ref
    module_name, sep, attr = str(ref).rpartition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"{where}: {ref!r}: expected 'module:function' or 'path/to/file.py:function'")
    module = load_module(module_name, base=base, where=where)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"{where}: {ref!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_module(name: str, *, base: Path | None = None, where: str = "") -> Any:
    """Import a dotted module, or load a ``.py`` file (relative to `base`) under a stable module name."""
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        path = path.resolve()
        if not path.is_file():
            raise RegistryError(f"{where}: {path}: no such Python file")
        module_name = FILE_MODULE_PREFIX + hashlib.sha256(str(path).encode()).hexdigest()[:16]
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RegistryError(f"{where}: cannot import {name!r}: {exc}") from None


def operator_from_mapping(entry: Mapping[str, Any], *, base: Path | None = None) -> OperatorSpec:
    """One registry entry as data (the job's YAML shape) -> `OperatorSpec`."""
    name = str(entry.get("name") or "")
    where = f"operator {name!r}" if name else "operator"
    unknown = sorted(set(entry) - {"name", "reference", "targets", "inputs", "cases", "outputs", "grad", "dtypes",
                                   "tolerances", "max_error_ratio"})
    if unknown:
        raise RegistryError(f"{where}: unknown field(s) {unknown}")
    for required in ("name", "reference", "inputs"):
        if required not in entry:
            raise RegistryError(f"{where}: field {required!r} is required")
    targets = {str(backend): tuple(resolve(r, base=base, where=f"{where}.targets.{backend}")
                                   for r in (refs if isinstance(refs, (list, tuple)) else [refs]))
               for backend, refs in (entry.get("targets") or {}).items()}
    raw_inputs = entry["inputs"]
    raw_cases = entry.get("cases") or ["typical"]
    if isinstance(raw_inputs, Mapping):
        declared = {k: InputSpec(**{**v, "shape": tuple(int(s) for s in v["shape"])}) for k, v in raw_inputs.items()}
        cases = raw_cases if isinstance(raw_cases, Mapping) else {c: {} for c in raw_cases}
        unknown_inputs = sorted({i for c in cases.values() for i in (c or {})} - set(declared))
        if unknown_inputs:
            raise RegistryError(f"{where}: cases override unknown input(s) {unknown_inputs}; inputs: {sorted(declared)}")
        make = DeclaredInputs(inputs=declared, cases={k: dict(v or {}) for k, v in cases.items()})
        case_names = tuple(cases)
    else:
        make = resolve(raw_inputs, base=base, where=f"{where}.inputs")
        case_names = tuple(raw_cases)
    dtypes = tuple(entry["dtypes"]) if entry.get("dtypes") else None
    bad = sorted(set(dtypes or ()) - set(DTYPE_NAMES))
    if bad:
        raise RegistryError(f"{where}: dtypes {bad}: expected some of {', '.join(DTYPE_NAMES)}")
    thresholds = {}
    for dtype, values in (entry.get("tolerances") or {}).items():
        if dtype not in DTYPE_NAMES:
            raise RegistryError(f"{where}: tolerances for {dtype!r}: expected some of {', '.join(DTYPE_NAMES)}")
        base_th = THRESHOLDS[DTYPE_NAMES[dtype]]
        try:
            thresholds[dtype] = Thresholds(**{**{f: getattr(base_th, f) for f in Thresholds.__slots__},  # type: ignore[attr-defined]
                                              **values})
        except TypeError as exc:
            raise RegistryError(f"{where}: tolerances.{dtype}: {exc}; fields: cosine_min, max_abs_eps, max_rel_eps, "
                                f"mean_ulp") from None
    return OperatorSpec(
        name=name, reference=resolve(entry["reference"], base=base, where=f"{where}.reference"), targets=targets,
        make_inputs=make, cases=case_names,
        outputs=tuple(int(i) for i in entry["outputs"]) if entry.get("outputs") is not None else None,
        grad=tuple(entry["grad"]) if entry.get("grad") is not None else None, dtypes=dtypes, thresholds=thresholds,
        max_error_ratio=float(entry.get("max_error_ratio", 2.0)))


def load_registry(entries: Sequence[Mapping[str, Any]] = (), modules: Sequence[str] = (), *,
                  base: Path | None = None) -> tuple[OperatorSpec, ...]:
    """Every operator of the YAML `entries` and of the `modules` (each defining ``OPERATORS``); names unique."""
    found = [operator_from_mapping(e, base=base) for e in entries]
    for name in modules:
        module = load_module(name, base=base, where=f"registry {name}")
        listed = getattr(module, "OPERATORS", None)
        if listed is None:
            raise RegistryError(f"registry {name}: defines no OPERATORS list")
        found += [op if isinstance(op, OperatorSpec) else operator_from_mapping(op, base=base) for op in listed]
    names = [op.name for op in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RegistryError(f"operators registered twice: {twice}")
    return tuple(found)
