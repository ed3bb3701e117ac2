"""What a checkpoint format plugs into the converter: one `CheckpointFormat` value per format module.

Call sequence (coordinator): `detect(path)` picks the format of a source; its `read(path, expect)`
builds the index from metadata only; the target format's `target(index, options)` describes the
files it will write (a `TargetSpec`) and its `writer` assembles each file from filled buffers
(run by the executor's workers). Formats register in `checkpoint.formats.FORMATS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.write import Writer
from checkpoint.index import CheckpointIndex
from checkpoint.layout import LayoutRequest
from checkpoint.plan import TargetSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """How to read a source: trust for pickles outside the allow-list, and the declared layout to check.

    `None` fields are not checked; a reader raises LayoutMismatchError when the files say otherwise.
    """

    trust_checkpoint: bool = False
    expect: LayoutRequest = LayoutRequest()  # None axes: not checked
    model_config: Mapping[str, Any] | None = None  # architecture for sources that hold none, overriding theirs


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetOptions:
    """The target `layout` (a `None` axis: the source's, or the format's only choice) and what else a target
    builder needs: `arch` names the HF parameter-name map;
    `model_config` gives the architecture (ModelShape-style fields: architecture, num_layers, hidden_size,
    ...) to targets whose layout rules need it when the source does not carry it (Megatron).
    """

    layout: LayoutRequest = LayoutRequest()
    arch: str | None = None
    model_config: Mapping[str, Any] | None = None
    max_shard_size: int | str | None = None  # HF: the largest safetensors shard ("5GB", bytes)
    dcp_layout: str | None = None  # DCP: "nested" (FSDP2's model/optimizer) or "torchtitan"
    param_names: str | None = None  # DeepSpeed/DCP: the naming convention written (canonical, hf, torchtitan)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointFormat:
    """One format: its name, detection, reader and (when writable) target builder and writer."""

    name: str
    description: str
    detect: Callable[[Path], bool]
    read: Callable[[Path, ReadOptions], CheckpointIndex]
    target: Callable[[CheckpointIndex, TargetOptions], TargetSpec] | None = None
    writer: Writer | None = None
    # "canonical": the target builder maps canonical names itself (HF, Megatron), so a source in another naming
    # convention is renamed first; "source": the module names pass through unchanged; "any": the target may be
    # written in another convention (--param-names; DeepSpeed then lays its flat buffers out in that model's order)
    names: str = "source"

    @property
    def writable(self) -> bool:
        return self.target is not None and self.writer is not None


def refuse_tied_embeddings(source: CheckpointIndex, target: str) -> None:
    """Raise PlanError when `source` ties its input and output embeddings (one canonical tensor) and the
    `target` writer lays out untied models only (it would leave the output weight missing)."""
    arch = source.meta.get("arch")
    if isinstance(arch, Mapping) and arch.get("tied_embeddings"):
        raise PlanError(f"source {source.root} ({source.format}) ties its input and output embeddings; the {target} "
                        f"writer writes untied models only (the output weight would be missing). Tied models "
                        f"convert between megatron (torch_dist) layouts")
    refuse_shared_params(source, target)


def refuse_shared_params(source: CheckpointIndex, target: str) -> None:
    """Raise PlanError when `source` stores one tensor under several module names (DeepSpeed's
    `shared_params`) and the `target` writer lays out one tensor per name."""
    shared = source.meta.get("shared_params")
    if shared:
        pairs = ", ".join(f"{a} is {o}" for a, o in list(shared.items())[:3])
        raise PlanError(f"source {source.root} ({source.format}) ties parameters ({pairs}); the {target} writer "
                        f"writes one tensor per name only (the tied name would be missing). Tied DeepSpeed models "
                        f"convert between deepspeed layouts (any dp and ZeRO stage)")


def refuse_frozen_params(source: CheckpointIndex, target: str) -> None:
    """Raise PlanError when `source` holds parameters without optimizer state (DeepSpeed's frozen params)
    and the `target` writer lays out optimizer state for every parameter."""
    frozen = source.meta.get("frozen_params")
    if frozen:
        names = [n for n, _ in frozen]
        raise PlanError(f"source {source.root} ({source.format}) holds {len(names)} frozen parameters without "
                        f"optimizer state ({names[:3]}{'...' if len(names) > 3 else ''}); the {target} writer lays "
                        f"out optimizer state for every parameter. Frozen parameters convert between deepspeed "
                        f"layouts (any dp and ZeRO stage) and to hf (weights)")


def check_agreement(field: str, values: Mapping[str, Any]) -> None:
    """Raise CheckpointFormatError when the files of one checkpoint disagree on `field`: `values` maps each
    file to what it holds; the message lists each distinct value with the files holding it (the most common
    first), so the file that came from another save is named."""
    groups: dict[str, list[str]] = {}
    for file, value in values.items():
        groups.setdefault(repr(value), []).append(str(file))
    if len(groups) <= 1:
        return
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = "; ".join(f"{value} in {', '.join(files[:3])}{' ...' if len(files) > 3 else ''} ({len(files)} file"
                      f"{'s' if len(files) > 1 else ''})" for value, files in ranked)
    raise CheckpointFormatError(f"the checkpoint's files disagree on {field}: {parts}; every file of a checkpoint "
                                f"must come from the same save")


def scalar(value: Any) -> Any:
    """A stored counter as a plain number (a 1-element tensor's value), for comparing files."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
