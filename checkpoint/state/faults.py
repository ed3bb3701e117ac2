"""Test hooks: break a converted checkpoint's training state on purpose, so the checks must catch it.

`inject_fault` applies one fault to a checkpoint in place and re-hashes the changed files in its
manifest (DeepSpeed: every fault; Megatron-Core torch_dist: the two client-state faults, on ours in
`common.pt` and on Megatron-LM's `rng_state` objects). Client-state faults (what the resume stage
checks directly):
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
from checkpoint.state.rng import _generator_state_like, state_hex
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
            "torch": state_hex(torch.Generator().manual_seed(seed).get_state()),
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


def _splice_objects(root: Path, replace: Mapping[str, bytes]) -> list[Path]:
    """Rewrite the DCP objects named in `replace` (fqn -> new serialized bytes) inside their `.distcp`
    files, shifting every later item of those files, and rewrite `.metadata` with the new byte ranges.
    Each file is written to a temporary name and renamed; returns the files changed."""
    import dataclasses
    import os
    import pickle
    import shutil

    md = safe_load.read_dcp_metadata(root)
    by_file: dict[str, list[Any]] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(idx)
    touched = {md.storage_data[idx].relative_path for idx in md.storage_data if idx.fqn in replace}
    missing = set(replace) - {idx.fqn for idx in md.storage_data}
    if missing:
        raise CheckpointFormatError(f"{root}/.metadata: no stored objects {sorted(missing)}")
    def copy(src: Any, dst: Any, n: int) -> None:  # n bytes, in bounded chunks
        while n > 0:
            chunk = src.read(min(n, 1 << 24))
            if not chunk:
                raise CheckpointFormatError(f"{src.name}: ends before a stored item (truncated?)")
            dst.write(chunk)
            n -= len(chunk)

    changed = []
    for rel in sorted(touched):
        tmp = root / f"{rel}.tmp"
        with open(root / rel, "rb") as src, open(tmp, "wb") as dst:
            for idx in sorted(by_file[rel], key=lambda i: md.storage_data[i].offset):
                info = md.storage_data[idx]
                copy(src, dst, info.offset - src.tell())  # any bytes between items stay as they are
                start = dst.tell()
                if idx.fqn in replace:
                    dst.write(replace[idx.fqn])
                    src.seek(info.length, os.SEEK_CUR)
                else:
                    copy(src, dst, info.length)
                md.storage_data[idx] = dataclasses.replace(info, offset=start, length=dst.tell() - start)
            shutil.copyfileobj(src, dst)
        os.replace(tmp, root / rel)
        changed.append(root / rel)
    (root / ".metadata.tmp").write_bytes(pickle.dumps(md))
    os.replace(root / ".metadata.tmp", root / ".metadata")
    return changed + [root / ".metadata"]


def _inject_megatron(root: Path, fault: str, batches: int) -> list[Path]:
    """`shift_data` on ours (`migrate`) in `common.pt`; `reset_rng` on every `rng_state` object."""
    import io

    from checkpoint.execute import load_range
    from checkpoint.formats.megatron import RNG_OBJECT_RE
    from checkpoint.state.rng import from_megatron, to_megatron

    if fault not in _CLIENT_FAULTS:
        raise CheckpointFormatError(f"{root}: fault {fault!r} applies to DeepSpeed checkpoints; a Megatron-Core "
                                    f"checkpoint takes {', '.join(_CLIENT_FAULTS)}")
    common = safe_load.load(root / "common.pt")
    ours = common.get(CLIENT_STATE_KEY)
    if not isinstance(ours, Mapping) or "sampler" not in ours:
        raise CheckpointFormatError(f"{root / 'common.pt'}: no {CLIENT_STATE_KEY!r} state with a sampler to inject "
                                    f"{fault} into")
    if fault == "shift_data":
        common[CLIENT_STATE_KEY] = shift_data(ours, batches)
        torch.save(common, root / "common.pt")
        return [root / "common.pt"]
    md = safe_load.read_dcp_metadata(root)
    replace = {}
    for idx, info in md.storage_data.items():
        if RNG_OBJECT_RE.match(idx.fqn):
            value = load_range(root / info.relative_path, int(info.offset), int(info.length))
            states = [from_megatron(st, where=f"{root}: {idx.fqn}") for st in value[0]]
            fresh = reset_rng({"sampler": ours["sampler"], "rng": states})["rng"]
            buf = io.BytesIO()
            torch.save([[to_megatron(st) for st in fresh]], buf)
            replace[idx.fqn] = buf.getvalue()
    if not replace:
        raise CheckpointFormatError(f"{root}: no rng_state objects to inject reset_rng into")
    return _splice_objects(root, replace)


def inject_fault(checkpoint: str | Path, fault: Fault, *, batches: int = 1) -> list[Path]:
    """Apply `fault` to the checkpoint at `checkpoint` in place (DeepSpeed: a save dir with `latest`, or a
    tag dir; Megatron-Core: an `iter_*` dir or a save dir naming one); update `manifest.json` when
    present. Returns the files changed. Apply it to a copy: the source stays as it was only then."""
    from checkpoint.formats.deepspeed import resolve_tag_dir
    from checkpoint.formats.megatron import is_megatron_checkpoint, resolve_iteration_dir

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if is_megatron_checkpoint(checkpoint):
        root = resolve_iteration_dir(checkpoint)
        return _update_manifest(root, _inject_megatron(root, fault, batches))
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
    return _update_manifest(root, changed)


def _update_manifest(root: Path, changed: list[Path]) -> list[Path]:
    """Re-hash the changed files in `root/manifest.json` (when there is one); returns `changed`."""
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
