"""DCP's `.metadata` from where each item was written: the one builder behind the DCP writer, the Megatron
torch_dist writer and the Megatron metadata synthesized for planning at scale.

The `Metadata` is what `torch.distributed.checkpoint.FileSystemReader.read_metadata` unpickles and its
`load` plans from: each tensor's global shape and dtype with its chunks (boxes), each non-tensor item as
bytes, and each item's byte range in its file. torch's `_StorageInfo` (private, unchanged since torch 2.0)
is used here only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacedItem:
    """One stored item: a chunk (`box`) of the tensor `fqn`, or with `box` None a non-tensor value, held in
    `file` (relative to the checkpoint directory) at bytes [offset, offset + length)."""

    fqn: str
    file: str
    offset: int
    length: int
    box: Box | None = None


def build_metadata(items: Iterable[PlacedItem], tensors: Mapping[str, tuple[tuple[int, ...], str]], *,
                   planner_data: Mapping[str, tuple[Any, ...]] | None = None, save_id: str | None = None) -> Any:
    """The DCP `Metadata` of `items`; `tensors` gives each tensor's global (shape, dtype name) and declares
    it even where no chunk of it was written. `planner_data` maps an fqn to its state-dict path (DCP's
    default planner flattens nested dicts); `save_id` fills `storage_meta` as `FileSystemWriter` does."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    declared: dict[str, Any] = {
        fqn: TensorStorageMetadata(properties=TensorProperties(dtype=getattr(torch, dtype)), size=torch.Size(shape),
                                   chunks=[])
        for fqn, (shape, dtype) in tensors.items()}
    storage: dict[Any, Any] = {}
    for item in items:
        if item.box is None:
            declared[item.fqn] = BytesStorageMetadata()
            index = MetadataIndex(fqn=item.fqn)
        else:
            offsets, sizes = item.box
            chunks = declared[item.fqn].chunks
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            index = MetadataIndex(fqn=item.fqn, offset=torch.Size(offsets), index=len(chunks) - 1)
        storage[index] = _StorageInfo(relative_path=item.file, offset=item.offset, length=item.length)
    kwargs: dict[str, Any] = {}
    if planner_data is not None:
        kwargs["planner_data"] = dict(planner_data)
    if save_id is not None:
        kwargs["storage_meta"] = StorageMeta(checkpoint_id=None, save_id=save_id, load_id=None)
    return Metadata(state_dict_metadata=declared, storage_data=storage, **kwargs)


def save_values(stream: Any, values: Iterable[Any], fqn: Any) -> list[list[Any]]:
    """Write each of `values` (`checkpoint.plan.ValueItem`) at the end of `stream` as DCP's `FileSystemWriter`
    writes a state dict's items: a whole tensor `torch.save`d in place, any other value `torch.save`d to bytes,
    a copied value verbatim. One JSON-able row per item, for the coordinator's `.metadata`:
    [fqn (`fqn(key)`), state-dict path, start, length, shape or None, dtype name or None] (shape and dtype for
    tensors)."""
    import io

    import torch

    from checkpoint import safe_load
    from checkpoint.index import dtype_name

    rows: list[list[Any]] = []
    for item in values:
        start = stream.tell()
        shape = dtype = None
        if item.copy is not None:
            stream.write(item.copy.read())
        elif isinstance(item.value, torch.Tensor):
            torch.save(item.value, stream)
            shape, dtype = list(item.value.shape), dtype_name(item.value.dtype)
        else:
            buf = io.BytesIO()
            torch.save(item.value, buf, pickle_module=safe_load.PICKLE_MODULE)  # stand-ins under their classes' names
            stream.write(buf.getbuffer())
        rows.append([fqn(item.key), list(item.key), start, stream.tell() - start, shape, dtype])
    return rows


def placed_values(rows: Iterable[list[Any]], file: str) -> tuple[list[PlacedItem], dict[str, tuple[tuple[int, ...],
                                                                                                      str]]]:
    """The items `save_values` wrote in `file` (its rows), and the global (shape, dtype) of those that are
    whole tensors (one chunk at offset 0), for `build_metadata`."""
    placed, tensors = [], {}
    for fqn, _, start, length, shape, dtype in rows:
        box = None if shape is None else ((0,) * len(shape), tuple(shape))
        placed.append(PlacedItem(fqn=fqn, file=file, offset=start, length=length, box=box))
        if shape is not None:
            tensors[fqn] = (tuple(shape), dtype)
    return placed, tensors
