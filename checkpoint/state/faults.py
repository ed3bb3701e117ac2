"""Test hooks: break a converted checkpoint's training state on purpose, so the resume stage must catch it.

Two faults, each a pure edit of the client state plus `inject_fault`, which applies one to the
DeepSpeed model-states files of a checkpoint in place and re-hashes them in its manifest:
* `shift_data`: the data position moved on by `batches` global batches (a dataloader that skips
  a batch; the resume stage reports the first step whose samples differ);
* `reset_rng`: every rank's RNG re-seeded with the plain seed, as a tool that reseeds on load
  does (`random.seed`, `np.random.seed`, `torch.manual_seed`); the resume stage reports the
  ranks whose RNG state differs from the one the checkpoint should carry.
Never used by a conversion; only tests and the resume stage's `fault` option call them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError
from checkpoint.state.rng import _generator_state_like, _hex
from checkpoint.state.training_state import CLIENT_STATE_KEY

Fault = Literal["shift_data", "reset_rng"]
FAULTS: tuple[str, ...] = ("shift_data", "reset_rng")


def shift_data(client: Mapping[str, Any], batches: int = 1) -> dict[str, Any]:
    """`client` with its data position `batches` global batches further (step counters unchanged)."""
    out = copy.deepcopy(dict(client))
    sampler = out["sampler"]
    gbs = int(sampler["global_batch_size"])
    consumed = int(sampler["consumed_samples"]) + batches * gbs
    per_epoch = (int(sampler["dataset_size"]) // gbs) * gbs
    sampler["consumed_samples"], sampler["epoch"] = consumed, consumed // per_epoch
    if "data" in out:
        out["data"]["consumed_samples_per_rank"] = [consumed] * len(out["data"]["consumed_samples_per_rank"])
    return out


def reset_rng(client: Mapping[str, Any]) -> dict[str, Any]:
    """`client` with every rank's RNG state replaced by the state of a plain reseed with the run's seed."""
    import random

    import numpy as np

    out = copy.deepcopy(dict(client))
    seed = int(out["sampler"]["seed"])
    version, internal, gauss = random.Random(seed).getstate()
    np_state = np.random.RandomState(seed).get_state(legacy=False)
    fresh = []
    for state in out["rng"]:
        fresh.append({
            "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss},
            "numpy": {"key": [int(x) for x in np_state["state"]["key"]], "pos": int(np_state["state"]["pos"]),
                      "has_gauss": int(np_state["has_gauss"]), "cached_gaussian": float(np_state["gauss"])},
            "torch": _hex(torch.Generator().manual_seed(seed).get_state()),
            "accelerator": [_generator_state_like(h, seed) for h in state.get("accelerator", [])],
            "trackers": {k: _generator_state_like(h, seed) for k, h in state.get("trackers", {}).items()},
        })
    out["rng"] = fresh
    return out


def inject_fault(checkpoint: str | Path, fault: Fault, *, batches: int = 1) -> list[Path]:
    """Apply `fault` to every DeepSpeed model-states file of the checkpoint at `checkpoint` (a save dir
    with `latest`) in place; update `manifest.json` when present. Returns the files changed."""
    from checkpoint.formats.deepspeed import resolve_tag_dir

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    root, tag = resolve_tag_dir(checkpoint)
    files = sorted((root / tag).glob("*model_states.pt"))
    changed = []
    for path in files:
        state = safe_load.load(path)
        if CLIENT_STATE_KEY not in state:
            raise CheckpointFormatError(f"{path}: no {CLIENT_STATE_KEY!r} client state to inject {fault} into")
        client = state[CLIENT_STATE_KEY]
        state[CLIENT_STATE_KEY] = shift_data(client, batches) if fault == "shift_data" else reset_rng(client)
        torch.save(state, path)
        changed.append(path)
    manifest = root / "manifest.json"
    if manifest.is_file():
        record = json.loads(manifest.read_text())
        for path in changed:
            rel = str(path.relative_to(root))
            if rel in record.get("files", {}):
                record["files"][rel] = {"bytes": path.stat().st_size,
                                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        manifest.write_text(json.dumps(record, indent=1, sort_keys=True))
    return changed
