"""Verification of a conversion: every tensor of the target equals the source's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from checkpoint.io.sources import Sources
from checkpoint.manifest import verify_manifest
from checkpoint.errors import PlanError
from checkpoint.index import CheckpointIndex, Kind
from checkpoint.materialize import read_tensor
from checkpoint.plan import source_for


def compare_indexes(source: CheckpointIndex, target: CheckpointIndex) -> list[str]:
    """Problems found comparing each target tensor with the source tensor it came from (empty: equal).

    A target param the source only holds as fp32 master is compared with the master cast to its dtype;
    per-parameter Adam steps a writer derived from a per-group step (Megatron sources) are checked
    against the source's train-state step (`checkpoint.formats.adam_step`); targets that keep the step
    per param group (Megatron) hold none to check here.
    """
    from checkpoint.formats.adam_step import split_derived_steps

    problems = list(verify_manifest(target.root)) if (Path(target.root) / "manifest.json").exists() else []
    if any(e.key.kind is Kind.STEP for e in target.entries):  # a target keeping Adam's step per parameter
        target, step_problems = split_derived_steps(source, target)
        problems += step_problems
    src_entries = source.by_key()
    src_files, dst_files = Sources(Path(source.root), False), Sources(Path(target.root), False)
    for entry in target.entries:
        try:
            src_entry, _ = source_for(entry.key, entry.dtype, src_entries)
        except PlanError:
            problems.append(f"{entry.key}: not in the source")
            continue
        want = read_tensor(source, src_entry, src_files).to(getattr(torch, entry.dtype))
        got = read_tensor(target, entry, dst_files)
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            problems.append(f"{entry.key}: target differs from source (max abs diff {diff})")
    return problems
