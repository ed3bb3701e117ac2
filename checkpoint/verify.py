"""Verification of a conversion: every tensor of the target equals the source's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from checkpoint.execute import _Sources, verify_manifest
from checkpoint.index import CheckpointIndex, Kind, TensorKey
from checkpoint.materialize import read_tensor


def compare_indexes(source: CheckpointIndex, target: CheckpointIndex) -> list[str]:
    """Problems found comparing each target tensor with the source tensor it came from (empty: equal).

    A target param the source only holds as fp32 master is compared with the master cast to its dtype.
    """
    problems = list(verify_manifest(target.root)) if (Path(target.root) / "manifest.json").exists() else []
    src_entries = source.by_key()
    src_files, dst_files = _Sources(Path(source.root), False), _Sources(Path(target.root), False)
    for entry in target.entries:
        src_entry = src_entries.get(entry.key) or src_entries.get(TensorKey(name=entry.key.name, kind=Kind.MASTER))
        if src_entry is None or entry.key.kind is Kind.STEP and entry.key not in src_entries:
            problems.append(f"{entry.key}: not in the source")
            continue
        want = read_tensor(source, src_entry, src_files).to(getattr(torch, entry.dtype))
        got = read_tensor(target, entry, dst_files)
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            problems.append(f"{entry.key}: target differs from source (max abs diff {diff})")
    return problems
