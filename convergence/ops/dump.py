"""Dump operators and one model step on one cluster; replay and compare them on another.

``dump_operators(dir, ops, device, dtypes)`` records, for every operator and dtype and input case, the
inputs as rounded, the output gradients, and the outputs and input gradients the device computed with the
implementation it uses. ``dump_model(dir, ...)`` records one training step of a model on a fixed batch: its
weights and batch, every leaf module's activation and output gradient and every parameter gradient
(`convergence.ops.drift.capture_step`), and the output of every aten operator the step called with the
module it ran in (forward). Everything is written as safetensors (no pickle) beside a ``manifest.json``.

``compare_operators(dir, ops, device)`` replays each dumped operator on this device, from the dumped inputs,
with the implementation the device uses, and compares against what the source computed;
``compare_model(dir, ...)`` runs the same step (same weights, same batch; another dtype, device or number
of data-parallel ranks) and compares layer by layer, then aten call by aten call, so a report goes from the
end-to-end loss to the first layer and the first operator that drift beyond tolerance.

Tolerances: two computations of the same thing are compared with the looser dtype's thresholds
(`convergence.ops.metrics`) widened twofold, as each carries its own rounding; layers with
`convergence.ops.drift.DRIFT_LIMIT` of the looser dtype.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convergence.ops.custom import draw, execute
from convergence.ops.drift import DRIFT_LIMIT, RunConfig, capture_step
from convergence.ops.metrics import MANTISSA_BITS, TensorError, Thresholds, tensor_error
from convergence.ops.registry import DTYPE_NAMES, OperatorSpec, implementation_name

FORMAT = "migrate.ops.dump/1"
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"


class DumpError(ValueError):
    """A dump that cannot be compared here (names the file and what is wrong)."""


def _save(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise DumpError(f"{path}: missing from the dump")
    return load_file(str(path))


def _write_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(directory / MANIFEST)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The dump's manifest; a folder that is not a dump is an error naming it."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DumpError(f"{directory}: not an operator dump (no {MANIFEST}); make one with 'migrate ops --dump DIR'")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DumpError(f"{path}: not JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise DumpError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _update_manifest(directory: Path, **parts: Any) -> None:
    path = directory / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {"format": FORMAT}
    manifest.update(parts, torch=torch.__version__)
    _write_manifest(directory, manifest)


def _looser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if MANTISSA_BITS[a] <= MANTISSA_BITS[b] else b


def _widened(th: Thresholds, factor: float = 2.0) -> Thresholds:
    return Thresholds(cosine_min=1 - factor * (1 - th.cosine_min), max_abs_eps=th.max_abs_eps * factor,
                      max_rel_eps=th.max_rel_eps * factor, mean_ulp=th.mean_ulp * factor)


def dump_operators(directory: str | Path, ops: Sequence[OperatorSpec], device: str, dtypes: Sequence[str], *,
                   chosen: Mapping[str, Callable[..., Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Record every operator at every dtype and case with the implementation `chosen` for it on `device`;
    returns the manifest entries (also written to the dump's manifest)."""
    root = Path(directory)
    entries = []
    for op in ops:
        fn = chosen[op.name]
        for dtype_name in (d for d in dtypes if op.dtypes is None or d in op.dtypes):
            dtype = DTYPE_NAMES[dtype_name]
            for case in op.cases:
                inputs, grads = draw(op, case, dtype, seed)
                result = execute(op, fn, inputs, grads, device=device, dtype=dtype)
                rel = Path("ops") / op.name / dtype_name / f"{case}.safetensors"
                tensors = {f"input.{k}": v for k, v in inputs.items()}
                tensors.update({f"grad_output.{i}": g for i, g in enumerate(grads)})
                tensors.update({k: v.to(dtype) for k, v in result.tensors.items()})
                _save(root / rel, tensors)
                entries.append({"name": op.name, "implementation": implementation_name(fn), "dtype": dtype_name,
                                "case": case, "file": str(rel), "tensors": sorted(result.tensors)})
    _update_manifest(root, device=device, seed=seed, operators=entries)
    return entries


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayCheck:
    """One dumped operator run replayed here: each tensor against the source's."""

    name: str
    dtype: str
    case: str
    source_implementation: str
    implementation: str
    tensors: tuple[TensorError, ...]

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "case": self.case, "passed": self.passed,
                "source_implementation": self.source_implementation, "implementation": self.implementation,
                "tensors": [{"name": t.name, "passed": t.passed, "cosine": t.cosine, "max_rel": t.max_rel,
                             "max_abs_over_rms": t.max_abs_over_rms, "mean_ulp": t.mean_ulp,
                             "reasons": list(t.reasons)} for t in self.tensors]}


def compare_operators(directory: str | Path, ops: Sequence[OperatorSpec], device: str, *,
                      chosen: Mapping[str, Callable[..., Any]], dtype: str | None = None) -> list[ReplayCheck]:
    """Replay every dumped operator on `device` (in the dumped dtype, or `dtype`) with the implementation
    `chosen` for it, from the dumped inputs and output gradients; compare with the dumped results."""
    root = Path(directory)
    manifest = read_manifest(root)
    by_name = {op.name: op for op in ops}
    unknown = sorted({e["name"] for e in manifest.get("operators", [])} - set(by_name))
    if unknown:
        raise DumpError(f"{root}: the dump holds operator(s) {unknown} that this registry does not "
                        f"(registered: {sorted(by_name)})")
    out = []
    for entry in manifest.get("operators", []):
        op = by_name[entry["name"]]
        saved = _load(root / entry["file"])
        source_dtype = DTYPE_NAMES[entry["dtype"]]
        here = DTYPE_NAMES[dtype] if dtype else source_dtype
        inputs = {k.removeprefix("input."): v for k, v in saved.items() if k.startswith("input.")}
        grads = [saved[f"grad_output.{i}"] for i in range(sum(k.startswith("grad_output.") for k in saved))]
        result = execute(op, chosen[op.name], inputs, grads, device=device, dtype=here)
        loose = _looser(source_dtype, here)
        th = _widened(op.threshold(next(n for n, d in DTYPE_NAMES.items() if d == loose)))
        checks = tuple(tensor_error(name, result.tensors[name], saved[name].to(torch.float64), loose, th)
                       for name in entry["tensors"])
        out.append(ReplayCheck(name=op.name, dtype=dtype or entry["dtype"], case=entry["case"],
                               source_implementation=entry["implementation"],
                               implementation=implementation_name(chosen[op.name]), tensors=checks))
    return out


# ---------------------------------------------------------------------------------------------- the model


MAX_CALL_ELEMENTS = 1 << 20
"""An aten call's output larger than this is kept as (norm, sum, largest magnitude), not element by element."""


def summarize(t: torch.Tensor) -> torch.Tensor:
    """What a large call output is kept as: its norm, sum and largest magnitude (float64)."""
    t = t.detach().to(torch.float64)
    return torch.stack((t.norm(), t.sum(), t.abs().max())).cpu()


class _CallRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten call's first floating tensor output (float64 on the CPU, summarized when large), with the
    leaf-most module it ran in."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[str, str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out if isinstance(out, torch.Tensor) else next(
            (o for o in out if isinstance(o, torch.Tensor)), None) if isinstance(out, (tuple, list)) else None
        if first is not None and first.is_floating_point() and first.numel():
            kept = summarize(first) if first.numel() > MAX_CALL_ELEMENTS else first.detach().to("cpu", torch.float64)
            self.calls.append((func.name(), self.stack[-1] if self.stack else "", kept))
        return out


def record_calls(model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[[nn.Module, Any], torch.Tensor]
                 ) -> list[tuple[str, str, torch.Tensor]]:
    """(aten operator, module path, output) of every call of one forward, in order (the backward then runs
    unrecorded: the autograd engine's order differs between dtypes; gradients are compared per layer);
    outputs over `MAX_CALL_ELEMENTS` elements as `summarize` keeps them."""
    stack: list[str] = []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(name or "<model>")
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    recorder = _CallRecorder(stack)
    try:
        with recorder:
            loss = loss_fn(model, list(batch))
    finally:
        for h in handles:
            h.remove()
    loss.backward()  # backward calls are compared per layer (output and parameter gradients), not call by call
    return recorder.calls


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every weight's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _cast_batch(batch: Sequence[torch.Tensor], device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    return [b.to(device, dtype) if b.is_floating_point() else b.to(device) for b in batch]


def dump_model(directory: str | Path, model_factory: Callable[[], nn.Module], batch: Sequence[torch.Tensor],
               loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, device: str, dtype: str) -> dict[str, Any]:
    """Record one step of the model (see the module docstring); returns the manifest's model entry."""
    root = Path(directory)
    model = model_factory()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = RunConfig(device=device, dtype=DTYPE_NAMES[dtype])
    loss, captured = capture_step(model, batch, loss_fn, run)
    traced = model_factory()
    traced.load_state_dict(state)
    traced = traced.to(device, run.dtype)
    calls = record_calls(traced, _cast_batch(batch, device, run.dtype), loss_fn)
    tensors = {f"weight.{k}": v for k, v in state.items()}
    tensors.update({f"batch.{i}": b for i, b in enumerate(batch)})
    tensors.update({f"layer.{i}": t.to(run.dtype) for i, (_, _, t) in enumerate(captured)})
    tensors.update({f"call.{i}": t.to(run.dtype) for i, (_, _, t) in enumerate(calls)})
    _save(root / MODEL_FILE, tensors)
    entry = {"device": device, "dtype": dtype, "loss": loss, "weights_sha256": weights_digest(state),
             "batch": len(batch), "layers": [{"layer": n, "kind": k} for n, k, _ in captured],
             "calls": [{"op": op, "module": m} for op, m, _ in calls], "file": MODEL_FILE}
    _update_manifest(root, model=entry)
    return entry


@dataclass(frozen=True, kw_only=True, slots=True)
class Drift:
    """One captured tensor (a layer's activation, output gradient or parameter gradient, or an aten call's
    output) here against the source: relative error of the norm, cosine, and whether it drifts."""

    index: int
    name: str
    kind: str
    rel_error: float
    cosine: float
    drifts: bool


@dataclass(frozen=True, kw_only=True)
class ModelComparison:
    """The model step here against the dumped one: losses, every layer, every aten call."""

    source: Mapping[str, Any]
    here: Mapping[str, Any]
    loss_source: float
    loss_here: float
    limit: float
    layers: tuple[Drift, ...]
    calls: tuple[Drift, ...]
    calls_compared: int
    calls_unmatched: tuple[int, int]  # (here, source): calls on one side only (casts, other decompositions)
    only_here: tuple[tuple[str, str], ...] = ()  # (operator, module) of the first calls with no match on the source

    def first(self, kind: str | None = None) -> Drift | None:
        return next((d for d in self.layers if d.drifts and (kind is None or d.kind == kind)), None)

    @property
    def first_call(self) -> Drift | None:
        return next((d for d in self.calls if d.drifts), None)

    @property
    def passed(self) -> bool:
        return self.first() is None and self.first_call is None

    def describe(self) -> str:
        """End to end, then the first layer, then the first operator: one line."""
        text = (f"loss {self.loss_here:.6g} here ({self.here['device']}, {self.here['dtype']}, world size "
                f"{self.here.get('world_size', 1)}) vs {self.loss_source:.6g} on the source ({self.source['device']}, "
                f"{self.source['dtype']})")
        layer = self.first("activation") or self.first()
        if layer is not None:
            text += (f"; first drifting layer: {layer.name} ({layer.kind}, relative error {layer.rel_error:.3g} > "
                     f"{self.limit:g})")
            extra = [op for op, module in self.only_here if module == layer.name]
            if extra:
                text += f", which runs {', '.join(extra[:3])} that the source did not"
        call = self.first_call
        if call is not None:
            text += (f"; first drifting operator: call {call.index} {call.kind} in {call.name or '<model>'} "
                     f"(relative error {call.rel_error:.3g} > {self.limit:g})")
        if self.passed:
            text += f"; every layer and the {self.calls_compared} matching aten calls within {self.limit:g}"
        if any(self.calls_unmatched):
            text += (f" ({self.calls_unmatched[0]} call(s) only here, {self.calls_unmatched[1]} only on the source: "
                     f"casts or other decompositions)")
        return text

    def to_dict(self) -> dict[str, Any]:
        def rows(items: Sequence[Drift]) -> list[dict[str, Any]]:
            return [{"index": d.index, "name": d.name, "kind": d.kind, "rel_error": d.rel_error, "cosine": d.cosine,
                     "drifts": d.drifts} for d in items]

        first = self.first("activation") or self.first()
        return {"passed": self.passed, "summary": self.describe(), "source": dict(self.source), "here": dict(self.here),
                "loss_source": self.loss_source, "loss_here": self.loss_here, "limit": self.limit,
                "first_layer": first.name if first else None,
                "first_call": ({"index": self.first_call.index, "op": self.first_call.kind, "module": self.first_call.name}
                               if self.first_call else None),
                "calls_unmatched": list(self.calls_unmatched), "calls_compared": self.calls_compared,
                "layers": rows(self.layers), "calls": rows([d for d in self.calls if d.drifts][:50])}


def _drift(index: int, name: str, kind: str, here: torch.Tensor, source: torch.Tensor, limit: float) -> Drift:
    if here.shape != source.shape:
        return Drift(index=index, name=name, kind=kind, rel_error=float("inf"), cosine=0.0, drifts=True)
    diff, ref = float((here - source).norm()), float(source.norm())
    rel = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
    denom = float(here.norm()) * ref
    cos = float((here * source).sum()) / denom if denom > 0 else 1.0
    return Drift(index=index, name=name, kind=kind, rel_error=rel, cosine=cos, drifts=not rel <= limit)


def load_model_dump(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the manifest's model entry, the dumped tensors)."""
    manifest = read_manifest(directory)
    if "model" not in manifest:
        raise DumpError(f"{directory}: the dump holds no model step (dump with a model: 'migrate ops JOB --dump DIR')")
    return manifest["model"], _load(Path(directory) / manifest["model"]["file"])


def compare_model(directory: str | Path, model_factory: Callable[[], nn.Module],
                  loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, device: str, dtype: str,
                  captured: tuple[float, list[tuple[str, str, torch.Tensor]]] | None = None,
                  world_size: int = 1) -> ModelComparison:
    """The dumped step run here with the dumped weights and batch: layers (from `captured`, the step as data
    parallel ranks ran it, or run here in one process) and aten calls (one process, the whole batch)."""
    entry, saved = load_model_dump(directory)
    state = {k.removeprefix("weight."): v for k, v in saved.items() if k.startswith("weight.")}
    batch = [saved[f"batch.{i}"] for i in range(entry["batch"])]
    model = model_factory()
    missing = sorted(set(model.state_dict()) ^ set(state))
    if missing:
        raise DumpError(f"{directory}: the dumped weights do not fit this model: {missing[:8]} differ")
    model.load_state_dict(state)
    run = RunConfig(device=device, dtype=DTYPE_NAMES[dtype])
    if captured is None:
        captured = capture_step(model, batch, loss_fn, run)
    loss, layers_here = captured
    limit = max(DRIFT_LIMIT[run.dtype], DRIFT_LIMIT[DTYPE_NAMES[entry["dtype"]]])
    if [(n, k) for n, k, _ in layers_here] != [(x["layer"], x["kind"]) for x in entry["layers"]]:
        raise DumpError(f"{directory}: the model here captures {len(layers_here)} tensors, the dump "
                        f"{len(entry['layers'])}: the two runs must execute the same modules")
    layers = tuple(_drift(i, n, k, t, saved[f"layer.{i}"].to(torch.float64), limit)
                   for i, (n, k, t) in enumerate(layers_here))
    traced = model_factory()
    traced.load_state_dict(state)
    traced = traced.to(device, run.dtype)
    calls_here = record_calls(traced, _cast_batch(batch, device, run.dtype), loss_fn)
    pairs, unmatched = align_calls([(op, m) for op, m, _ in calls_here], [(c["op"], c["module"]) for c in entry["calls"]])
    matched = {i for i, _ in pairs}
    only_here = tuple((op, m) for i, (op, m, _) in enumerate(calls_here) if i not in matched)[:50]
    drifts = []
    for i, j in pairs:
        op, module, t = calls_here[i]
        source = saved[f"call.{j}"].to(torch.float64)
        drifts.append(_drift(j, module, op, summarize(t) if source.shape == (3,) and t.shape != (3,) else t, source, limit))
    here = {"device": device, "dtype": dtype, "world_size": world_size}
    return ModelComparison(source={k: entry[k] for k in ("device", "dtype")}, here=here, loss_source=entry["loss"],
                           loss_here=loss, limit=limit, layers=layers, calls=tuple(drifts),
                           calls_compared=len(drifts), calls_unmatched=unmatched, only_here=only_here)


def align_calls(here: Sequence[tuple[str, str]], source: Sequence[tuple[str, str]]
                ) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Matched (here, source) call indices of two (operator, module) sequences (a longest matching
    alignment: dtype casts and other decompositions present on one side only are skipped), and how many
    calls of each side were left unmatched."""
    import difflib

    matcher = difflib.SequenceMatcher(a=list(here), b=list(source), autojunk=False)
    pairs = [(blk.a + k, blk.b + k) for blk in matcher.get_matching_blocks() for k in range(blk.size)]
    return pairs, (len(here) - len(pairs), len(source) - len(pairs))


def data_parallel_capture(model_factory: Callable[[], nn.Module], directory: str | Path,
                          loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, device: str, dtype: str,
                          group: Any = None) -> tuple[float, list[tuple[str, str, torch.Tensor]]]:
    """The dumped step as data-parallel ranks run it (collective over `group`): each rank takes its contiguous
    slice of the batch, parameter gradients are averaged by all-reduce, and every rank returns the captures
    of the whole batch (activations gathered along the batch, output gradients scaled to the whole batch's
    mean loss), comparable with a one-process run."""
    import torch.distributed as dist

    entry, saved = load_model_dump(directory)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batch = [saved[f"batch.{i}"] for i in range(entry["batch"])]
    size = batch[0].shape[0]
    if size % world:
        raise DumpError(f"{directory}: the dumped batch of {size} samples does not split over {world} ranks")
    share = size // world
    mine = [b[rank * share:(rank + 1) * share] for b in batch]
    model = model_factory()
    model.load_state_dict({k.removeprefix("weight."): v for k, v in saved.items() if k.startswith("weight.")})
    loss, captured = capture_step(model, mine, loss_fn, RunConfig(device=device, dtype=DTYPE_NAMES[dtype]))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (loss, [(n, k, t) for n, k, t in captured if k != "param_grad"]), group=group)
    total = sum(g[0] for g in gathered) / world
    merged = []
    for i, (name, kind, _) in enumerate(gathered[0][1]):
        parts = torch.cat([g[1][i][2] for g in gathered], dim=0)
        merged.append((name, kind, parts / world if kind == "grad_output" else parts))
    for name, kind, t in captured:
        if kind == "param_grad":
            summed = t.clone()
            dist.all_reduce(summed, group=group)
            merged.append((name, kind, summed / world))
    return total, merged

