"""Where a DCP checkpoint keeps its model and optimizer state, read from the structure: pure functions.

Users save DCP state dicts under their own names: `{"model": ..., "optimizer": ...}` (FSDP2 with
`get_model_state_dict` / `get_optimizer_state_dict`), the PyTorch DCP tutorial's `{"model", "optim"}` or its
`{"app": AppState}` (`app.model.*`, `app.optim.*`), torchtitan's CheckpointManager (model keys at the top level,
the optimizer saved with `flatten_optimizer_state_dict=True`: `optimizer.state.<fqn>.exp_avg` as one key,
`optimizer.param_groups.<fqn>.lr`, beside `lr_scheduler`, `dataloader`, `train_state`). Each stored item has a
path (DCP's planner data). Optimizer state is recognised by its shape of path wherever it sits:
`(*root, "state", <fqn>, <name>)` nested, `(*root, "state.<fqn>.<name>")` flattened, where `<name>` is Adam's
`exp_avg|exp_avg_sq|step` or, beside a torch optimizer's `param_groups` under the same root, any state name
(SGD's `momentum_buffer`, `max_exp_avg_sq`, ...); the optimizer root is where those sit. The model root is the
one prefix under which the optimizer's parameter names are found (without optimizer state: the prefix holding the
most tensor bytes). Every other item is
carried as a value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint.errors import CheckpointFormatError
from checkpoint.index import STATE_NAME

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
_FLAT_STATE = re.compile(r"^state\.(?P<fqn>.+)\.(?P<kind>" + STATE_NAME.pattern.strip("^$") + ")$")
_FLAT_GROUP = re.compile(r"^param_groups\.(?P<fqn>.+)\.(?P<field>[^.]+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class DCPLayout:
    """The roots (path prefixes) of the model and optimizer state; `flat_optimizer` for torchtitan's form."""

    model_root: tuple[str, ...]
    optimizer_root: tuple[str, ...] | None
    flat_optimizer: bool

    def describe(self) -> str:
        model = ".".join(self.model_root) or "(top level)"
        if self.optimizer_root is None:
            return f"model at {model}; no optimizer state"
        optim = ".".join(self.optimizer_root) or "(top level)"
        return f"model at {model}; optimizer at {optim} ({'flattened' if self.flat_optimizer else 'nested'})"


def optimizer_roots(paths: Iterable[Sequence[Any]]) -> frozenset[tuple[str, ...]]:
    """The prefixes under which a torch optimizer's `param_groups` are stored (nested `param_groups.<i>.<field>`
    or flattened `param_groups.<fqn>.<field>`): where state of any name is optimizer state."""
    roots = set()
    for path in paths:
        p = tuple(str(x) for x in path)
        for i, part in enumerate(p):
            if part == "param_groups" or part.startswith("param_groups."):
                roots.add(p[:i])
    return frozenset(roots)


def optimizer_item(path: Sequence[Any], roots: Collection[tuple[str, ...]] = ()
                   ) -> tuple[tuple[str, ...], str, str, bool] | None:
    """(optimizer root, param fqn, state name, flattened) when `path` is optimizer state, else None: Adam's state
    anywhere, a state of any other name under one of `roots` (`optimizer_roots`)."""
    p = tuple(str(x) for x in path)
    if len(p) >= 3 and p[-3] == "state" and (p[-1] in ADAM_STATE or p[:-3] in roots) and STATE_NAME.match(p[-1]):
        return p[:-3], p[-2], p[-1], False
    if p and (m := _FLAT_STATE.match(p[-1])) and (m["kind"] in ADAM_STATE or p[:-1] in roots):
        return p[:-1], m["fqn"], m["kind"], True
    return None


def find_layout(tensors: Mapping[tuple[str, ...], int], *, where: str,
                roots: Collection[tuple[str, ...]] = ()) -> DCPLayout:
    """The layout of a checkpoint whose tensors are `tensors` (path -> bytes), `roots` the prefixes holding an
    optimizer's param groups (`optimizer_roots`). Raises CheckpointFormatError naming the roots when the
    optimizer state sits under several, or when no prefix holds its parameters."""
    optim = {path: item for path in tensors if (item := optimizer_item(path, roots)) is not None}
    roots = {item[0] for item in optim.values()}
    if len(roots) > 1:
        raise CheckpointFormatError(f"{where}: optimizer state under several roots {sorted('.'.join(r) for r in roots)}; "
                                    f"one optimizer is read")
    others = [p for p in tensors if p not in optim]
    by_root: dict[tuple[str, ...], int] = {}
    for p in others:
        for cut in range(len(p)):
            by_root[p[:cut]] = by_root.get(p[:cut], 0) + tensors[p]
    if not roots:
        if not others:
            raise CheckpointFormatError(f"{where}: no tensors")
        # the deepest prefix holding (nearly) all the bytes: model weights dwarf counters and buffers
        total = sum(tensors[p] for p in others)
        best = max((r for r, n in by_root.items() if n * 10 >= total * 9), key=len)
        return DCPLayout(model_root=best, optimizer_root=None, flat_optimizer=False)
    (root,) = roots
    params = {item[1] for item in optim.values()}
    flat = any(item[3] for item in optim.values())
    candidates = []
    for r in by_root:
        names = {name for p in others if (name := _under(r, p)) is not None}
        if params <= names:
            candidates.append(r)
    if not candidates:
        sample = sorted(params)[:3]
        raise CheckpointFormatError(f"{where}: the optimizer at {'.'.join(root) or '(top level)'} holds state for "
                                    f"{sample}{'...' if len(params) > 3 else ''} but no prefix holds tensors of "
                                    f"those names")
    return DCPLayout(model_root=max(candidates, key=len), optimizer_root=root, flat_optimizer=flat)


def param_name(layout: DCPLayout, path: Sequence[str]) -> str | None:
    """The parameter fqn of a model tensor at `path`, None when the path is outside the model root."""
    return _under(layout.model_root, tuple(path))


def _under(root: tuple[str, ...], path: tuple[str, ...]) -> str | None:
    """The name of `path` below `root`. At the top level only single keys are model names (a model state dict
    is flat: torchtitan's `tok_embeddings.weight` is one key, `train_state.step` a nested entry)."""
    if len(path) <= len(root) or path[:len(root)] != root or (not root and len(path) != 1):
        return None
    return ".".join(path[len(root):])


def param_groups(layout: DCPLayout, values: Mapping[tuple[str, ...], Any], names: Sequence[str]
                 ) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch keeps them ({hparams..., "params": [fqn, ...]}): nested
    (`param_groups.<i>.<field>`) as saved, flattened (`param_groups.<fqn>.<field>`) grouped by equal fields in
    parameter order."""
    root = layout.optimizer_root
    if root is None:
        return []
    n = len(root)
    nested: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        if path[:n] != root or len(path) <= n:
            continue
        rest = path[n:]
        if rest[0] == "param_groups" and len(rest) == 3 and str(rest[1]).isdigit():
            nested.setdefault(int(rest[1]), {})[str(rest[2])] = value
        elif len(rest) == 1 and (m := _FLAT_GROUP.match(str(rest[0]))):
            per_param.setdefault(m["fqn"], {})[m["field"]] = value
    if nested:
        return [nested[i] for i in sorted(nested)]
    groups: list[dict[str, Any]] = []
    for name in names:
        if name not in per_param:
            continue
        fields = {k: v for k, v in per_param[name].items() if k != "params"}
        for g in groups:
            if _same(g, fields):
                g["params"].append(name)
                break
        else:
            groups.append({**fields, "params": [name]})
    return groups


def _same(group: Mapping[str, Any], fields: Mapping[str, Any]) -> bool:
    keys = set(group) - {"params"}
    if keys != set(fields):
        return False
    for k in keys:
        a, b = group[k], fields[k]
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            continue
        if a != b:
            return False
    return True
