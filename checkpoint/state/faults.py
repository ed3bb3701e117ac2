"""Test hooks: break a converted checkpoint's training state on purpose, so the checks must catch it.

`inject_fault` applies one fault to a DeepSpeed checkpoint in place and re-hashes the changed
files in its manifest. Client-state faults (what the resume stage checks directly):
* `shift_data`: the data position moved on by `batches` global batches (a dataloader that skips
  a batch; the resume stage reports the first step whose samples differ);
* `reset_rng`: every rank's RNG re-seeded with the plain seed, as a tool that reseeds on load
  does (`random.seed`, `np.random.seed`, `torch.manual_seed`); the resume stage reports the
  ranks whose RNG state differs from the one the checkpoint should carry.
Optimizer and weight faults (what the convergence gate must see in the loss and grad norm):
* `drop_optimizer`: Adam moments zeroed and its step counter reset, as a resume that loads the
  weights but not the optimizer state;
* `swap_moments`: exp_avg and exp_avg_sq exchanged;
* `reset_lr`: the LR scheduler back at step 0 (warm-up restarts);
* `nan_weights`: one fp32 master weight set to NaN;
* `scale_weights`: every fp32 master weight multiplied by 8 (activations and gradients blow up).
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

Fault = Literal["shift_data", "reset_rng", "drop_optimizer", "swap_moments", "reset_lr", "nan_weights", "scale_weights"]
FAULTS: tuple[str, ...] = ("shift_data", "reset_rng", "drop_optimizer", "swap_moments", "reset_lr", "nan_weights",
                           "scale_weights")
_CLIENT_FAULTS = ("shift_data", "reset_rng")
_FP32_MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")


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


def _edit_adam_states(node: Any, fault: str) -> int:
    """Apply an optimizer fault to every Adam state dict under ``node``; returns how many were edited."""
    if isinstance(node, dict):
        if "exp_avg" in node and "exp_avg_sq" in node:
            if fault == "swap_moments":
                node["exp_avg"], node["exp_avg_sq"] = node["exp_avg_sq"], node["exp_avg"]
            else:  # drop_optimizer
                node["exp_avg"] = torch.zeros_like(node["exp_avg"])
                node["exp_avg_sq"] = torch.zeros_like(node["exp_avg_sq"])
                if "step" in node:
                    node["step"] = torch.zeros_like(node["step"]) if isinstance(node["step"], torch.Tensor) else 0
            return 1
        return sum(_edit_adam_states(v, fault) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(_edit_adam_states(v, fault) for v in node)
    return 0


def _edit_fp32_master(node: Any, fault: str) -> int:
    """Apply a weight fault to the fp32 master partitions under ``node``; returns the tensors edited."""
    count = 0
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _FP32_MASTER_KEYS:
                for tensor in value:
                    if fault == "nan_weights":
                        tensor.view(-1)[0] = float("nan")
                    else:  # scale_weights
                        tensor.mul_(8.0)
                    count += 1
            else:
                count += _edit_fp32_master(value, fault)
    elif isinstance(node, (list, tuple)):
        count += sum(_edit_fp32_master(v, fault) for v in node)
    return count


def inject_fault(checkpoint: str | Path, fault: Fault, *, batches: int = 1) -> list[Path]:
    """Apply `fault` to the DeepSpeed checkpoint at `checkpoint` (a save dir with `latest`, or a tag
    dir) in place; update `manifest.json` when present. Returns the files changed."""
    from checkpoint.formats.deepspeed import resolve_tag_dir

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    root, tag = resolve_tag_dir(checkpoint)
    changed = []
    if fault in _CLIENT_FAULTS or fault == "reset_lr":
        for path in sorted((root / tag).glob("*model_states.pt")):
            state = safe_load.load(path)
            if fault == "reset_lr":
                scheduler = state.get("lr_scheduler")
                if not isinstance(scheduler, dict) or not {"last_step", "last_epoch"} & set(scheduler):
                    continue  # ZeRO-3 per-rank model files carry no scheduler
                for key in ("last_step", "last_epoch"):
                    if key in scheduler:
                        scheduler[key] = 0
            else:
                if CLIENT_STATE_KEY not in state:
                    raise CheckpointFormatError(f"{path}: no {CLIENT_STATE_KEY!r} client state to inject {fault} into")
                client = state[CLIENT_STATE_KEY]
                state[CLIENT_STATE_KEY] = shift_data(client, batches) if fault == "shift_data" else reset_rng(client)
            torch.save(state, path)
            changed.append(path)
    else:
        edit = _edit_adam_states if fault in ("drop_optimizer", "swap_moments") else _edit_fp32_master
        for path in sorted((root / tag).glob("*optim_states.pt")):
            state = safe_load.load(path)
            if edit(state, fault):
                torch.save(state, path)
                changed.append(path)
    if not changed:
        raise CheckpointFormatError(f"{root / tag}: nothing to apply fault {fault!r} to")
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
