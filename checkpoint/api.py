"""One-call entry points: read (detect the format), plan, convert. Thin composition over the format table.

`read_index(path, expect=LayoutRequest(...))` -> CheckpointIndex; `plan_conversion(index, to=...,
target=LayoutRequest(...))` -> (ConversionPlan, Writer); `convert(src, dst, to=..., target=..., expect=...,
strict=Strictness...)` runs the plan (or only plans, with dry_run). Layouts are asked for as `LayoutRequest`s
(a None axis: the checkpoint's). Formats come from `checkpoint.formats.FORMATS`; nothing here names a format.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.destination import Existing, refuse_unfinished
from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.execute import ExecutionResult, check_destination, execute
from checkpoint.pools import MapFn
from checkpoint.storage import Storage
from checkpoint.write import Writer
from checkpoint.formats import FORMATS as FORMAT_TABLE
from checkpoint.formats import FORMAT_ALIASES, CheckpointFormat, ReadOptions, TargetOptions
from checkpoint.index import CheckpointIndex
from checkpoint.layout import PIPELINE_STAGE_FIELDS, LayoutRequest
from checkpoint.naming import named_for_target
from checkpoint.paths import check_disjoint, check_links, inside
from checkpoint.plan import ConversionPlan, make_plan
from checkpoint.rules.names import NAMINGS
from checkpoint.strictness import StateDifference, Strictness, check

FORMATS: tuple[str, ...] = tuple(f.name for f in FORMAT_TABLE)
WRITABLE_FORMATS: tuple[str, ...] = tuple(f.name for f in FORMAT_TABLE if f.writable)


def get_format(name: str) -> CheckpointFormat:
    """The table entry named `name` (or an earlier spelling of it, `FORMAT_ALIASES`, with a DeprecationWarning);
    raises PlanError listing the known names."""
    if name in FORMAT_ALIASES:
        warnings.warn(f"format name {name!r} is deprecated: use {FORMAT_ALIASES[name]!r}", DeprecationWarning,
                      stacklevel=3)
        name = FORMAT_ALIASES[name]
    for f in FORMAT_TABLE:
        if f.name == name:
            return f
    raise PlanError(f"unknown checkpoint format {name!r}; known: {', '.join(FORMATS)}")


def detect_format(path: str | Path) -> str:
    """The format of the checkpoint at `path`; raises CheckpointFormatError naming what was looked for."""
    for f in FORMAT_TABLE:
        if f.detect(Path(path)):
            return f.name
    raise CheckpointFormatError(f"{path}: no known checkpoint format found (looked for: {', '.join(FORMATS)})")


NO_REQUEST = LayoutRequest()  # every axis left to the checkpoint


def read_index(path: str | Path, *, expect: LayoutRequest = NO_REQUEST, trust_checkpoint: bool = False,
               fmt: str | None = None, follow_symlinks: bool = False,
               model_config: Mapping[str, Any] | None = None) -> CheckpointIndex:
    """Index the checkpoint at `path` (format detected unless `fmt`) from metadata only, checking the
    layout it declares against each axis `expect` names (LayoutMismatchError otherwise). `model_config` gives
    the architecture to readers whose sources may lack it (Megatron), and overrides what a source records
    (each overridden field named in meta `arch_overrides`).

    Before anything is read: the folder must not be a conversion's unfinished output, and no symbolic
    link in it may lead outside it (unless `follow_symlinks`); after: every file the index names must lie
    inside the checkpoint's root. Raises CheckpointFormatError naming the file otherwise."""
    path = Path(path)
    unexpectable = {k: getattr(expect, k) for k in ("vpp", *PIPELINE_STAGE_FIELDS) if getattr(expect, k) is not None}
    if unexpectable:
        raise PlanError(f"expect {', '.join(f'{k}={v}' for k, v in unexpectable.items())}: sources do not declare a "
                        f"virtual pipeline size or pipeline split to check; leave them None")
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or directory")
    refuse_unfinished(path)
    check_links(path, follow_symlinks=follow_symlinks)
    spec = get_format(fmt) if fmt is not None else get_format(detect_format(path))
    try:
        index = spec.read(path, ReadOptions(trust_checkpoint=trust_checkpoint, expect=expect, model_config=model_config))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, OSError) as err:
        # content the reader's own checks did not foresee: still one line naming the checkpoint, not a traceback
        raise CheckpointFormatError(f"{path}: not a readable {spec.name} checkpoint ({type(err).__name__}: "
                                    f"{str(err)[:300]})") from err
    check_index_paths(index, follow_symlinks=follow_symlinks)
    return index


def check_index_paths(index: CheckpointIndex, *, follow_symlinks: bool = False) -> None:
    """Every file an index names (its files and every chunk's file) stays inside its root, links included."""
    root = Path(index.root)
    if index.root:
        check_links(root, follow_symlinks=follow_symlinks)
    for rel in sorted({*index.files, *(c.file for e in index.entries for c in e.chunks)}):
        inside(root, rel, what=f"{root}: the {index.format} checkpoint's file list")


def plan_conversion(index: CheckpointIndex, *, to: str, target: LayoutRequest = NO_REQUEST,
                    arch: str | None = None, model_config: Mapping[str, Any] | None = None,
                    max_shard_size: int | str | None = None, dcp_layout: str | None = None,
                    param_names: str | None = None) -> tuple[ConversionPlan, Writer]:
    """Plan `index` into format `to` at the `target` layout (a None axis: the source's, or the format's only
    choice).

    `model_config`: the architecture (ModelShape-style fields) for targets that need one the source lacks.
    `param_names`: the naming convention a DeepSpeed/DCP target is written in (canonical, hf, torchtitan; default:
    the source's); HF and Megatron targets map canonical names, so a source in another convention is renamed."""
    spec = get_format(to)
    if spec.target is None or spec.writer is None:
        raise PlanError(f"format {to!r} is read-only; writable formats: {', '.join(WRITABLE_FORMATS)}")
    opts = TargetOptions(layout=target, arch=arch,
                         model_config=model_config, max_shard_size=max_shard_size, dcp_layout=dcp_layout,
                         param_names=param_names)
    if param_names is not None and param_names not in NAMINGS:
        raise PlanError(f"--param-names {param_names!r}: known conventions are {', '.join(NAMINGS)}")
    if param_names is not None and spec.names != "any":
        why = "map canonical names themselves" if spec.names == "canonical" else "keep the source's module names"
        raise PlanError(f"--param-names {param_names}: {to} targets {why}; formats that take --param-names: "
                        f"{', '.join(f.name for f in FORMAT_TABLE if f.names == 'any')}")
    staged = {k: getattr(target, k) for k in PIPELINE_STAGE_FIELDS if getattr(target, k) is not None}
    if staged and to not in PIPELINE_TARGETS:
        raise PlanError(f"{staged}: only {' and '.join(PIPELINE_TARGETS)} targets place decoder layers on pipeline "
                        f"stages; {to} holds whole tensors")
    _refuse_unmapped_architecture(index, to)
    index = named_for_target(index, target_names=spec.names, want=param_names, arch=arch, model_config=model_config)
    return make_plan(index, spec.target(index, opts)), spec.writer


MLA_TARGETS = ("megatron", "megatron-legacy", "hf")
"""The formats a DeepSeek-V3-class (multi-latent attention) source converts to so far."""
PIPELINE_TARGETS = ("megatron", "megatron-legacy")
"""The formats whose writers place decoder layers on pipeline stages (and take first/last stage layer counts)."""


def _refuse_unmapped_architecture(index: CheckpointIndex, to: str) -> None:
    """Refuse, naming the architecture and the formats it converts to, a conversion of a multi-latent-attention
    source into a format whose writer has no rules for it yet."""
    from checkpoint.model_shape import MLA_ARCHITECTURES

    family = (index.meta.get("arch") or {}).get("architecture")
    if family in MLA_ARCHITECTURES and to not in MLA_TARGETS:
        raise PlanError(f"{index.root}: a {family} model (multi-latent attention) converts to "
                        f"{', '.join(MLA_TARGETS)} (Megatron files at any TP/PP/EP/DP; transformers' DeepseekV3) only so "
                        f"far, not to {to}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversionOutcome:
    plan: ConversionPlan
    result: ExecutionResult | None  # None for a dry run
    differences: tuple[StateDifference, ...] = ()  # what did not pass unchanged (`strictness.differences`)


def convert(src: str | Path, dst: str | Path, *, to: str, target: LayoutRequest = NO_REQUEST,
            expect: LayoutRequest = NO_REQUEST, strict: Strictness = Strictness.REPORT,
            arch: str | None = None, model_config: Mapping[str, Any] | None = None,
            max_shard_size: int | str | None = None, dcp_layout: str | None = None, param_names: str | None = None,
            dry_run: bool = False, map_fn: MapFn | None = None,
            trust_checkpoint: bool = False, follow_symlinks: bool = False, existing: Existing = Existing.REFUSE,
            phase: Callable[..., None] | None = None, storage: Storage | None = None) -> ConversionOutcome:
    """Read `src` (checking the layout it declares against `expect`), plan for format `to` at the `target`
    layout, hold the plan to `strict` (PlanError before anything is written when it refuses), and (unless
    dry_run) write `dst` atomically with a manifest.

    `dst` may neither be the source nor lie inside it (nor contain it); `existing` says what to do with an
    earlier conversion's output there (refuse, resume an unfinished one, overwrite); `storage` where it lies
    (default: one folder every worker sees; see `checkpoint.storage`). `phase(text, files=())`
    is told each phase as it begins (reading the source, planning, writing: with the relative paths of the
    files to be written), for a caller that shows progress."""
    say = phase or (lambda *_, **__: None)
    check_disjoint(src, dst)
    say(f"reading the source index of {src}")
    index = read_index(src, expect=expect, trust_checkpoint=trust_checkpoint, follow_symlinks=follow_symlinks,
                       model_config=model_config)
    check_disjoint(index.root, dst)
    say(f"planning {to} from {len(index.entries)} source tensors in {len(index.files)} files")
    plan, writer = plan_conversion(index, to=to, target=target, arch=arch, model_config=model_config,
                                   max_shard_size=max_shard_size, dcp_layout=dcp_layout, param_names=param_names)
    differences = check(plan, strict)
    check_destination(Path(dst), existing, storage)
    if dry_run:
        return ConversionOutcome(plan=plan, result=None, differences=differences)
    say(f"writing {len(plan.target.files)} files to {dst}", files=[f.path for f in plan.target.files])
    return ConversionOutcome(plan=plan, result=execute(plan, writer, dst, map_fn=map_fn,
                                                       trust_checkpoint=trust_checkpoint, existing=existing,
                                                       storage=storage),
                             differences=differences)
