"""Assemble whole logical tensors from an index (for verification and inspection, not the hot path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from checkpoint.io.sources import Sources
from checkpoint.index import CheckpointIndex, TensorEntry
from checkpoint.overlap import global_flat_range


def read_tensor(index: CheckpointIndex, entry: TensorEntry, sources: Sources | None = None) -> torch.Tensor:
    """The full tensor of `entry`, gathered from its chunks (padding in the stored buffers excluded)."""
    sources = sources or Sources(Path(index.root), trust_checkpoint=False)
    out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    flat_out = out.view(-1)
    for c in entry.chunks:
        stored = sources.tensor(c.file, c.key).reshape(-1)[c.storage_offset:c.storage_offset + c.numel]
        rng = global_flat_range(c.offsets, c.lengths, entry.shape, c.flat_range)
        if rng is not None:
            flat_out[rng[0]:rng[1]].copy_(stored)
        else:
            region = out
            for dim, (o, n) in enumerate(zip(c.offsets, c.lengths)):
                region = region.narrow(dim, o, n)
            region.copy_(stored.view(c.lengths))
    return out


def iter_tensors(index: CheckpointIndex) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    """(entry, full tensor) for every entry of `index`, source files opened once (mmap)."""
    sources = Sources(Path(index.root), trust_checkpoint=False)
    for entry in index.entries:
        yield entry, read_tensor(index, entry, sources)
