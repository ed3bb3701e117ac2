"""Test hooks: break a converted checkpoint's training state on purpose, so the checks must catch it.

`inject_fault` applies one fault to a checkpoint in place and re-hashes the changed files in its
manifest: DeepSpeed files, Megatron-Core torch_dist (ours in `common.pt`, Megatron-LM's `rng_state`
objects, tensors spliced into the `.distcp` files), Megatron-LM legacy per-rank files and torch DCP
(which faults each takes: below). Client-state faults:
* `shift_data`: the data position moved on by `batches` global batches (a dataloader that skips
  a batch; the resume stage reports the first step whose samples differ);
* `reset_rng`: every rank's RNG re-seeded with the plain seed, as a tool that reseeds on load
  does (`random.seed`, `np.random.seed`, `torch.manual_seed`); the resume stage reports the
  ranks whose RNG state differs from the one the checkpoint should carry.
Optimizer and weight faults (the state check at load names them; the gate sees them in the loss):
* `drop_optimizer`: Adam moments zeroed and its step counter reset, as a resume that loads the
  weights but not the optimizer state;
* `swap_moments`: exp_avg and exp_avg_sq exchanged;
* `reset_lr`: the LR scheduler back at step 0 (warm-up restarts);
* `nan_weights`: one fp32 master weight set to NaN;
* `scale_weights`: every fp32 master weight multiplied by 8 (activations and gradients blow up).
Faults that only the state check at load sees at once (a converter's subtle mistakes):
* `reset_step`: every Adam step counter back to 0, the moments kept (bias correction restarts);
* `perturb_master`: one fp32 master tensor multiplied by (1 + 1e-4);
* `round_master_bf16`: every fp32 master tensor rounded to bf16 (a converter that went through the
  bf16 weights);
* `swap_partitions`: two ranks' optimizer partitions exchanged (DeepSpeed: the first two ranks'
  optimizer files; DCP and Megatron-Core: the first two chunks of each sharded tensor's items);
* `swap_glu_halves`: the gate and up halves of every fused GLU weight exchanged, weights, master and
  moments alike (Megatron-Core `linear_fc1`; a converter that merged them in the wrong order; Megatron-LM
  legacy files: the weights and the flat buffers of `distrib_optim.pt`);
* `swap_qkv_kv`: the K and V rows of every query group of every fused QKV weight exchanged, as
  `swap_glu_halves` (Megatron-Core `linear_qkv`; the head counts from our model shape in `common.pt`;
  legacy files only without `distrib_optim.pt`, whose flat buffers do not hold K and V contiguously).
DeepSpeed takes every fault except the two fused-weight ones (its QKV and GLU are not fused); Megatron-Core torch_dist and
legacy files take every fault except `reset_lr` (Megatron-Core derives the LR from the iteration); DCP every
fault except `reset_rng` (it holds no RNG state) and the fused-weight ones.
Never used by a conversion; only tests and the resume stage's `fault` option call them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError
from checkpoint.formats.megatron_paths import MODEL_FILE, OPTIM_FILE, RANK_DIR_RE
from checkpoint.io.sources import load_range
from checkpoint.state.rng import generator_state_like, state_hex
from checkpoint.state.training_state import CLIENT_STATE_KEY

Fault = Literal["shift_data", "reset_rng", "drop_optimizer", "swap_moments", "reset_lr", "nan_weights", "scale_weights",
                "reset_step", "perturb_master", "round_master_bf16", "swap_partitions", "swap_glu_halves",
                "swap_qkv_kv"]
FAULTS: tuple[str, ...] = ("shift_data", "reset_rng", "drop_optimizer", "swap_moments", "reset_lr", "nan_weights",
                           "scale_weights", "reset_step", "perturb_master", "round_master_bf16", "swap_partitions",
                           "swap_glu_halves", "swap_qkv_kv")
PERTURBATION = 1e-4  # perturb_master's relative change
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
            "accelerator": [generator_state_like(h, seed) for h in state.get("accelerator", [])],
            "trackers": {k: generator_state_like(h, seed) for k, h in state.get("trackers", {}).items()},
        })
    out["rng"] = fresh
    return out


def _edit_adam_states(node: Any, fault: str) -> int:
    """Apply an optimizer fault to every Adam state dict under ``node``; returns how many were edited."""
    if isinstance(node, dict):
        if "exp_avg" in node and "exp_avg_sq" in node:
            if fault == "reset_step":
                if "step" not in node:
                    return 0
                node["step"] = torch.zeros_like(node["step"]) if isinstance(node["step"], torch.Tensor) else 0
            elif fault == "swap_moments":
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


def _edit_master_tensor(tensor: torch.Tensor, fault: str) -> None:
    """Apply a weight fault to one fp32 master tensor in place."""
    with torch.no_grad():
        if fault == "nan_weights":
            tensor.view(-1)[0] = float("nan")
        elif fault == "scale_weights":
            tensor.mul_(8.0)
        elif fault == "perturb_master":
            tensor.mul_(1.0 + PERTURBATION)
        elif fault == "round_master_bf16":
            tensor.copy_(tensor.to(torch.bfloat16).to(tensor.dtype))
        else:
            raise ValueError(f"{fault!r} is not a weight fault")


def _edit_fp32_master(node: Any, fault: str) -> int:
    """Apply a weight fault to the fp32 master partitions under ``node`` (`perturb_master`: the first only);
    returns the tensors edited."""
    count = 0
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _FP32_MASTER_KEYS:
                for tensor in value:
                    _edit_master_tensor(tensor, fault)
                    count += 1
                    if fault == "perturb_master":
                        return count
            else:
                count += _edit_fp32_master(value, fault)
            if count and fault == "perturb_master":
                return count
    elif isinstance(node, (list, tuple)):
        for v in node:
            count += _edit_fp32_master(v, fault)
            if count and fault == "perturb_master":
                return count
    return count


def _serialized(value: Any) -> bytes:
    """`value` as `torch.save` writes it (the bytes of one DCP item)."""
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _splice_objects(root: Path, replace: Mapping[Any, bytes]) -> list[Path]:
    """Rewrite the DCP items named in `replace` (an fqn, or one item's `MetadataIndex` -> new serialized
    bytes) inside their `.distcp` files, shifting every later item of those files, and rewrite `.metadata`
    with the new byte ranges. Each file is written to a temporary name and renamed; returns the files changed."""
    import dataclasses
    import os
    import pickle
    import shutil

    md = safe_load.read_dcp_metadata(root)
    by_file: dict[str, list[Any]] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(idx)
    def new_bytes(idx: Any) -> bytes | None:
        return replace.get(idx, replace.get(idx.fqn))

    touched = {md.storage_data[idx].relative_path for idx in md.storage_data if new_bytes(idx) is not None}
    missing = set(replace) - {idx.fqn for idx in md.storage_data} - set(md.storage_data)
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
                if (replacement := new_bytes(idx)) is not None:
                    dst.write(replacement)
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
    from checkpoint.formats.megatron import RNG_OBJECT_RE
    from checkpoint.state.rng import from_megatron, to_megatron

    if fault == "reset_lr":
        raise CheckpointFormatError(f"{root}: fault reset_lr does not apply to a Megatron-Core checkpoint (its LR is "
                                    f"a function of the iteration)")
    common = safe_load.load(root / "common.pt")
    if fault not in _CLIENT_FAULTS:
        changed = []
        if fault in ("reset_step", "drop_optimizer") and _reset_param_group_steps(common.get("optimizer")):
            torch.save(common, root / "common.pt")
            changed.append(root / "common.pt")
        if fault == "reset_step":
            if not changed:
                raise CheckpointFormatError(f"{root / 'common.pt'}: no optimizer param_groups step to reset")
            return changed
        return changed + _inject_dcp_tensors(root, fault, (common.get(CLIENT_STATE_KEY) or {}).get("model"))
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
            replace[idx.fqn] = _serialized([[to_megatron(st) for st in fresh]])
    if not replace:
        raise CheckpointFormatError(f"{root}: no rng_state objects to inject reset_rng into")
    return _splice_objects(root, replace)


def _reset_param_group_steps(node: Any) -> int:
    """Set every `step` of the optimizer param_groups under `node` to 0; returns how many."""
    count = 0
    if isinstance(node, dict):
        groups = node.get("param_groups")
        for group in groups if isinstance(groups, list) else ():
            if isinstance(group, dict) and "step" in group:
                group["step"] = 0.0 if not isinstance(group["step"], torch.Tensor) else torch.zeros_like(group["step"])
                count += 1
        count += sum(_reset_param_group_steps(v) for k, v in node.items() if k != "param_groups")
    return count


_MEGATRON_STATE = re.compile(r"optimizer\.state\.(exp_avg|exp_avg_sq|param|fp32_param)\.(.+)$")
_TORCH_STATE = re.compile(r"optimizer\.state\.(.+)\.(exp_avg|exp_avg_sq|step)$")


def _tensor_role(fqn: str) -> tuple[str, str]:
    """(role, parameter) of a DCP tensor item: role one of weight, master, exp_avg, exp_avg_sq, step, other;
    Megatron-Core's keys (`optimizer.state.<kind>.<param>`) and torch's (`optimizer.state.<param>.<kind>`)."""
    m = _MEGATRON_STATE.match(fqn)
    if m:
        return ("master" if m.group(1) in ("param", "fp32_param") else m.group(1)), m.group(2)
    m = _TORCH_STATE.match(fqn)
    if m:
        return m.group(2), m.group(1)
    if fqn.startswith("optimizer.") or fqn.startswith("lr_scheduler.") or fqn.startswith("migrate."):
        return "other", fqn
    return "weight", fqn.removeprefix("model.")


def swap_kv_rows(tensor: torch.Tensor, model: Mapping[str, Any]) -> torch.Tensor:
    """A fused QKV weight (rows on axis -2: per query group its queries, then K, then V, Megatron-Core's
    order) with K and V exchanged in every group it holds."""
    heads, groups = int(model["num_attention_heads"]), int(model.get("num_query_groups") or model["num_attention_heads"])
    head_dim = int(model["hidden_size"]) // heads
    per_group = (heads // groups + 2) * head_dim
    rows = tensor.shape[-2]
    if rows % per_group:
        raise CheckpointFormatError(f"fused QKV of {rows} rows is not whole groups of {per_group} rows (heads {heads}, "
                                    f"groups {groups}, head dim {head_dim})")
    shaped = tensor.reshape(*tensor.shape[:-2], rows // per_group, heads // groups + 2, head_dim, tensor.shape[-1])
    q, k, v = shaped[..., :-2, :, :], shaped[..., -2:-1, :, :], shaped[..., -1:, :, :]
    return torch.cat([q, v, k], dim=-3).reshape(tensor.shape).contiguous()


def _inject_dcp_tensors(root: Path, fault: str, model: Mapping[str, Any] | None = None) -> list[Path]:
    """A tensor fault on a DCP-format checkpoint (Megatron-Core torch_dist or torch DCP), spliced into its files.
    The master is Megatron's `optimizer.state.param` where present, else the model's fp32 weights."""

    md = safe_load.read_dcp_metadata(root)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = {idx: info for idx, info in md.storage_data.items()
             if isinstance(md.state_dict_metadata.get(idx.fqn), TensorStorageMetadata)}
    roles = {idx: _tensor_role(idx.fqn) for idx in items}
    has_master = any(role == "master" for role, _ in roles.values())
    master_role = "master" if has_master else "weight"

    def load(idx: Any) -> torch.Tensor:
        info = items[idx]
        return load_range(root / info.relative_path, int(info.offset), int(info.length))

    replace: dict[Any, bytes] = {}
    ordered = sorted(items, key=lambda i: (i.fqn, tuple(i.offset or ()), i.index or 0))
    if fault in ("swap_moments", "drop_optimizer"):
        by_key = {(roles[i][1], tuple(i.offset or ())): i for i in ordered if roles[i][0] == "exp_avg_sq"}
        for idx in ordered:
            role, param = roles[idx]
            if role == "step" and fault == "drop_optimizer":
                replace[idx] = _serialized(torch.zeros_like(load(idx)))
            if role != "exp_avg":
                continue
            other = by_key.get((param, tuple(idx.offset or ())))
            if other is None:
                continue
            if fault == "swap_moments":
                replace[idx], replace[other] = _serialized(load(other)), _serialized(load(idx))
            else:
                replace[idx] = _serialized(torch.zeros_like(load(idx)))
                replace[other] = _serialized(torch.zeros_like(load(other)))
    elif fault == "reset_step":
        replace = {idx: _serialized(torch.zeros_like(load(idx))) for idx in ordered if roles[idx][0] == "step"}
    elif fault in ("nan_weights", "scale_weights", "perturb_master", "round_master_bf16"):
        for idx in ordered:
            if roles[idx][0] != master_role:
                continue
            tensor = load(idx)
            if not tensor.is_floating_point():
                continue
            _edit_master_tensor(tensor, fault)
            replace[idx] = _serialized(tensor)
            if fault == "perturb_master":
                break
    elif fault == "swap_partitions":
        by_fqn: dict[str, list[Any]] = {}
        for idx in ordered:
            if roles[idx][0] in ("master", "exp_avg", "exp_avg_sq"):
                by_fqn.setdefault(idx.fqn, []).append(idx)
        for chunks in by_fqn.values():
            if len(chunks) >= 2 and md.storage_data[chunks[0]].length == md.storage_data[chunks[1]].length:
                first, second = load(chunks[0]), load(chunks[1])
                if first.shape == second.shape:
                    replace[chunks[0]], replace[chunks[1]] = _serialized(second), _serialized(first)
    elif fault == "swap_qkv_kv":
        if model is None:
            raise CheckpointFormatError(f"{root}: swap_qkv_kv needs the model's head counts (our model shape in "
                                        f"common.pt), found none")
        for idx in ordered:
            if roles[idx][1].endswith("linear_qkv.weight"):
                replace[idx] = _serialized(swap_kv_rows(load(idx), model))
    elif fault == "swap_glu_halves":
        for idx in ordered:
            if roles[idx][1].endswith("linear_fc1.weight"):
                tensor = load(idx)
                rows = tensor.shape[-2]
                if rows % 2:
                    continue
                half = rows // 2
                swapped = torch.cat([tensor.narrow(-2, half, half), tensor.narrow(-2, 0, half)], dim=-2)
                replace[idx] = _serialized(swapped.contiguous())
    else:
        raise CheckpointFormatError(f"{root}: fault {fault!r} has no DCP form")
    if not replace:
        raise CheckpointFormatError(f"{root}: nothing to apply fault {fault!r} to (tensor items: "
                                    f"{sorted({r for r, _ in roles.values()})})")
    return _splice_objects(root, replace)


def _inject_dcp_counters(root: Path, fault: str, batches: int) -> list[Path]:
    """`shift_data` (ours: `migrate.sampler.*`) or `reset_lr` (`lr_scheduler.*` step counters) on a torch DCP
    checkpoint, its values spliced into its files; `reset_rng` has nothing to replace (DCP holds no RNG)."""

    md = safe_load.read_dcp_metadata(root)
    values = {idx.fqn: idx for idx in md.storage_data}

    def load(fqn: str) -> Any:
        info = md.storage_data[values[fqn]]
        return load_range(root / info.relative_path, int(info.offset), int(info.length))

    replace: dict[Any, bytes] = {}
    if fault == "reset_lr":
        replace = {fqn: _serialized(0) for fqn in values if fqn in ("lr_scheduler.last_step", "lr_scheduler.last_epoch")}
    elif fault == "shift_data":
        prefix = f"{CLIENT_STATE_KEY}.sampler."
        sampler = {fqn.removeprefix(prefix): load(fqn) for fqn in values if fqn.startswith(prefix)}
        if {"consumed_samples", "global_batch_size", "dataset_size"} <= set(sampler):
            shifted = shift_data({"sampler": sampler}, batches)["sampler"]
            replace = {prefix + k: _serialized(shifted[k]) for k in ("consumed_samples", "epoch") if prefix + k in values}
    if not replace:
        raise CheckpointFormatError(f"{root}: nothing to apply fault {fault!r} to (DCP items "
                                    f"{sorted(f for f in values if not f.startswith(('model.', 'optimizer.')))})")
    return _splice_objects(root, replace)


def _edit_distopt_master(node: Any, fault: str) -> int:
    """A weight fault on the fp32 master (`param`) of Megatron-Core's DistributedOptimizer parameter state
    (dicts holding `param`, `exp_avg`, `exp_avg_sq`); `perturb_master`: the first only."""
    if isinstance(node, dict):
        if "param" in node and "exp_avg" in node and isinstance(node["param"], torch.Tensor):
            _edit_master_tensor(node["param"], fault)
            return 1
        count = 0
        for value in node.values():
            count += _edit_distopt_master(value, fault)
            if count and fault == "perturb_master":
                break
        return count
    if isinstance(node, (list, tuple)):
        count = 0
        for value in node:
            count += _edit_distopt_master(value, fault)
            if count and fault == "perturb_master":
                break
        return count
    return 0


def _swap_fused(state: dict, fault: str) -> int:
    """`swap_glu_halves` (the halves of every `linear_fc1.weight`) or `swap_qkv_kv` (K and V of every
    `linear_qkv.weight`) on a legacy model file's chunk(s)."""
    count = 0
    model = (state.get(CLIENT_STATE_KEY) or {}).get("model")
    for key, chunk in state.items():
        if not (key == "model" or re.fullmatch(r"model\d+", key)) or not isinstance(chunk, dict):
            continue
        for name, tensor in chunk.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if fault == "swap_glu_halves" and name.endswith("linear_fc1.weight") and tensor.shape[0] % 2 == 0:
                half = tensor.shape[0] // 2
                chunk[name] = torch.cat([tensor[half:], tensor[:half]]).contiguous()
                count += 1
            elif fault == "swap_qkv_kv" and name.endswith("linear_qkv.weight") and model:
                chunk[name] = swap_kv_rows(tensor, model)
                count += 1
    return count


def _swap_glu_in_flat_buffers(root: Path) -> list[Path]:
    """Exchange the gate and up ranges of every GLU weight's fp32 master and moments inside the legacy
    files' `distrib_optim.pt` flat buffers, where our legacy reader places them (`read_megatron_legacy`)."""
    import math

    from checkpoint.formats.megatron_legacy import read_megatron_legacy
    from checkpoint.index import Kind

    index = read_megatron_legacy(root)
    entries = {(e.key.name, e.key.kind): e for e in index.entries}
    edits: dict[str, list[tuple[Any, int, int, int]]] = {}
    for (name, kind), gate in entries.items():
        if not name.endswith("mlp.gate_proj.weight") or kind not in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ):
            continue
        up = entries.get((name.removesuffix("gate_proj.weight") + "up_proj.weight", kind))
        for a, b in zip(gate.chunks, up.chunks if up else ()):
            if a.file == b.file and a.key == b.key and a.lengths == b.lengths:
                edits.setdefault(a.file, []).append((a.key, a.storage_offset, b.storage_offset, math.prod(a.lengths)))
    changed = []
    for rel, swaps in sorted(edits.items()):
        path = Path(index.root) / rel
        raw = safe_load.load(path)
        for key, first, second, numel in swaps:
            flat = raw
            for k in key:
                flat = flat[k]
            kept = flat[first:first + numel].clone()
            flat[first:first + numel] = flat[second:second + numel]
            flat[second:second + numel] = kept
        torch.save(raw, path)
        changed.append(path)
    return changed


def _inject_legacy(root: Path, fault: str, batches: int) -> list[Path]:
    """A fault on Megatron-LM's legacy per-rank files (`mp_rank_*/model_optim_rng.pt`, `distrib_optim.pt`).
    `swap_glu_halves` edits the model's weights and, with the distributed optimizer, the gate and up ranges
    of its flat buffers (which the load copies into the weights); `swap_qkv_kv` is refused there;
    `swap_partitions` exchanges the first two rank directories' optimizer files."""
    from checkpoint.state.rng import from_megatron, to_megatron

    if fault == "reset_lr":
        raise CheckpointFormatError(f"{root}: fault reset_lr does not apply to a Megatron checkpoint (its LR is a "
                                    f"function of the iteration)")
    ranks = sorted(p for p in root.iterdir() if RANK_DIR_RE.match(p.name) and (p / MODEL_FILE).is_file())
    optim_files = [p / OPTIM_FILE for p in ranks if (p / OPTIM_FILE).is_file()]
    if fault == "swap_qkv_kv" and optim_files:
        raise CheckpointFormatError(f"{root}: swap_qkv_kv on legacy files needs them without distrib_optim.pt "
                                    f"(with it, the load takes the weights from its flat fp32 buffers, where K "
                                    f"and V of a group are not one contiguous range)")
    if fault == "swap_partitions":
        if len(optim_files) < 2 or optim_files[0].stat().st_size != optim_files[1].stat().st_size:
            raise CheckpointFormatError(f"{root}: swap_partitions needs two equal-sized distrib_optim.pt files, found "
                                        f"{[str(f.relative_to(root)) for f in optim_files]}")
        a, b = optim_files[0].read_bytes(), optim_files[1].read_bytes()
        optim_files[0].write_bytes(b)
        optim_files[1].write_bytes(a)
        return optim_files[:2]
    changed: list[Path] = []
    for rank in ranks:
        path = rank / MODEL_FILE
        state = safe_load.load(path)
        edited = 0
        if fault == "shift_data" and CLIENT_STATE_KEY in state:
            state[CLIENT_STATE_KEY] = shift_data(state[CLIENT_STATE_KEY], batches)
            edited = 1
        elif fault == "reset_rng" and state.get("rng_state"):
            ours = state.get(CLIENT_STATE_KEY) or {}
            states = [from_megatron(st, where=f"{path}: rng_state") for st in state["rng_state"]]
            fresh = reset_rng({"sampler": ours["sampler"], "rng": states})["rng"]
            state["rng_state"] = [to_megatron(st) for st in fresh]
            edited = 1
        elif fault in ("reset_step", "drop_optimizer"):
            edited = _reset_param_group_steps(state.get("optimizer")) + (
                _edit_adam_states(state.get("optimizer"), fault) if fault == "drop_optimizer" else 0)
        elif fault in ("swap_glu_halves", "swap_qkv_kv"):
            edited = _swap_fused(state, fault)
        elif fault in ("swap_moments",):
            edited = _edit_adam_states(state.get("optimizer"), fault)
        if edited:
            torch.save(state, path)
            changed.append(path)
    if fault == "swap_glu_halves" and optim_files:
        changed += _swap_glu_in_flat_buffers(root)
    if fault in ("drop_optimizer", "swap_moments", "nan_weights", "scale_weights", "perturb_master",
                 "round_master_bf16"):
        for path in optim_files:
            raw = safe_load.load(path)
            if fault in ("drop_optimizer", "swap_moments"):
                edited = _edit_adam_states(raw, fault)
            else:
                edited = _edit_distopt_master(raw, fault)
            if edited:
                torch.save(raw, path)
                changed.append(path)
                if fault == "perturb_master":
                    break
    if not changed:
        raise CheckpointFormatError(f"{root}: nothing to apply fault {fault!r} to")
    return changed


def inject_fault(checkpoint: str | Path, fault: Fault, *, batches: int = 1) -> list[Path]:
    """Apply `fault` to the checkpoint at `checkpoint` in place (DeepSpeed: a save dir with `latest`, or a
    tag dir; Megatron-Core: an `iter_*` dir or a save dir naming one); update `manifest.json` when
    present. Returns the files changed. Apply it to a copy: the source stays as it was only then."""
    from checkpoint.formats.dcp import is_dcp_checkpoint
    from checkpoint.formats.deepspeed import resolve_tag_dir
    from checkpoint.formats.megatron import is_megatron_checkpoint, resolve_iteration_dir
    from checkpoint.formats.megatron_legacy import is_legacy_checkpoint

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if is_megatron_checkpoint(checkpoint):
        root = resolve_iteration_dir(checkpoint)
        return _update_manifest(root, _inject_megatron(root, fault, batches))
    if is_legacy_checkpoint(checkpoint):
        root = resolve_iteration_dir(checkpoint)
        return _update_manifest(root, _inject_legacy(root, fault, batches))
    if is_dcp_checkpoint(Path(checkpoint)):
        root = Path(checkpoint)
        if fault in _CLIENT_FAULTS or fault == "reset_lr":
            return _update_manifest(root, _inject_dcp_counters(root, fault, batches))
        return _update_manifest(root, _inject_dcp_tensors(root, fault))
    if fault in ("swap_glu_halves", "swap_qkv_kv"):
        raise CheckpointFormatError(f"{checkpoint}: fault {fault} applies to Megatron-Core checkpoints (fused "
                                    f"linear_fc1 / linear_qkv); a DeepSpeed model's are not fused")
    root, tag = resolve_tag_dir(checkpoint)
    changed = []
    if fault == "swap_partitions":
        files = sorted((root / tag).glob("*optim_states.pt"))
        if len(files) < 2:
            raise CheckpointFormatError(f"{root / tag}: swap_partitions needs two ranks' optimizer files, found "
                                        f"{[f.name for f in files]}")
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
        return _update_manifest(root, files[:2])
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
        edit = _edit_adam_states if fault in ("drop_optimizer", "swap_moments", "reset_step") else _edit_fp32_master
        for path in sorted((root / tag).glob("*optim_states.pt")):
            state = safe_load.load(path)
            if edit(state, fault):
                torch.save(state, path)
                changed.append(path)
    if not changed:
        raise CheckpointFormatError(f"{root / tag}: nothing to apply fault {fault!r} to")
    return _update_manifest(root, changed)


def _update_manifest(root: Path, changed: list[Path]) -> list[Path]:
    """Re-hash the changed files in the `manifest.json` of `root` or of its parent (a save dir above an
    `iter_*` dir), when there is one; returns `changed`."""
    base = next((d for d in (root, root.parent) if (d / "manifest.json").is_file()), None)
    if base is not None:
        manifest = base / "manifest.json"
        record = json.loads(manifest.read_text())
        for path in changed:
            rel = str(path.relative_to(base))
            if rel in record.get("files", {}):
                record["files"][rel] = {"bytes": path.stat().st_size,
                                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        manifest.write_text(json.dumps(record, indent=1, sort_keys=True))
    return changed
