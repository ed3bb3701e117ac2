"""transformers `Trainer` checkpoint folders (`checkpoint-N/`) around a DeepSpeed engine's files: what the
Trainer itself saves beside `global_stepN/` and `latest`, read as metadata and written again for another
world size.

`Trainer._save_checkpoint` writes `trainer_state.json` (global step, log history, callbacks' state: required
by `train(resume_from_checkpoint=...)`), the model's `config.json` (and `generation_config.json`),
`rng_state_{process}.pth` per process (`rng_state.pth` on one), `scheduler.pt` where no engine holds the
scheduler (under DeepSpeed its engine files keep either scheduler), and `training_args.bin` (a pickled
TrainingArguments, never loaded on resume: not read, not carried). On resume each process loads its own RNG file:
a target rank takes the
state of the source rank at the same place when the world size is kept, one copy when every source rank
holds the same state (the Trainer seeds every process alike), else a state derived from (step, rank)
(`checkpoint.state.rng.plan_rng`, its decisions reported).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError
from checkpoint.formats.hf import json_file_bytes, json_object_file
from checkpoint.plan import TargetFile, ValueItem, ValueRole
from checkpoint.state.rng import plan_rng, roles, state_hex, state_tensor

TRAINER_STATE = "trainer_state.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SCHEDULER = "scheduler.pt"
_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_DEVICE_KEYS = ("cuda", "npu", "xla", "hpu", "mlu", "musa")


def is_trainer_folder(root: Path) -> bool:
    return (root / TRAINER_STATE).is_file()


def rng_from_trainer(state: Any, where: Path) -> dict[str, Any]:
    """A Trainer RNG file's content as the plain per-rank state of `checkpoint.state.rng`."""
    try:
        version, internal, gauss = state["python"]
        kind, key, pos, has_gauss, cached = state["numpy"]
        devices: tuple[str | None, Any] = next(((k, state[k]) for k in _DEVICE_KEYS if k in state), (None, []))
        device_states = devices[1] if isinstance(devices[1], (list, tuple)) else [devices[1]]
        if kind != "MT19937":
            raise ValueError(f"numpy generator {kind!r}")
        return {"python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss},
                "numpy": {"key": [int(x) for x in np.asarray(key)], "pos": int(pos), "has_gauss": int(has_gauss),
                          "cached_gaussian": float(cached)},
                "torch": state_hex(state["cpu"]), "accelerator": [state_hex(t) for t in device_states], "trackers": {},
                "device_key": devices[0], "device_list": isinstance(devices[1], (list, tuple))}
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointFormatError(f"{where}: not a Trainer RNG state (python, numpy, cpu generators): {err}") from None


def rng_to_trainer(state: Mapping[str, Any], *, device_key: str | None, device_list: bool) -> dict[str, Any]:
    """The dict `Trainer._load_rng_state` restores, from a plain per-rank state."""
    py, n = state["python"], state["numpy"]
    out: dict[str, Any] = {
        "python": (py["version"], tuple(py["internal"]), py["gauss_next"]),
        "numpy": ("MT19937", np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]),
        "cpu": state_tensor(state["torch"])}
    if device_key is not None:
        devices = [state_tensor(h) for h in state.get("accelerator", [])]
        out[device_key] = devices if device_list else devices[0]
    return out


def read_trainer_files(root: Path, *, trust_checkpoint: bool = False) -> dict[str, Any]:
    """The Trainer's own files in `root` as plain metadata: trainer_state, config, generation_config, per-rank RNG
    states (rank order; one file: rank 0) and the scheduler state when the Trainer saved one."""
    state = json_object_file(root / TRAINER_STATE)
    assert state is not None
    ranks: dict[int, dict[str, Any]] = {}
    for f in sorted(root.iterdir()):
        m = _RNG_RE.match(f.name)
        if m:
            ranks[int(m.group(1) or 0)] = rng_from_trainer(
                safe_load.load(f, trust_checkpoint=trust_checkpoint), f)
    if ranks and sorted(ranks) != list(range(len(ranks))):
        raise CheckpointFormatError(f"{root}: RNG files for processes {sorted(ranks)}: expected 0..{len(ranks) - 1}")
    scheduler = None
    if (root / SCHEDULER).is_file():
        scheduler = safe_load.load(root / SCHEDULER, trust_checkpoint=trust_checkpoint)
        if not isinstance(scheduler, Mapping):
            raise CheckpointFormatError(f"{root / SCHEDULER}: holds {type(scheduler).__name__}, not a scheduler "
                                        f"state dict")
        scheduler = dict(scheduler)
    return {"trainer_state": state, "hf_config": json_object_file(root / CONFIG),
            "generation_config": json_object_file(root / GENERATION_CONFIG),
            "rng": [ranks[r] for r in sorted(ranks)], "scheduler": scheduler,
            "files": sorted(f.name for f in root.iterdir() if f.is_file() and (
                f.name in (TRAINER_STATE, CONFIG, GENERATION_CONFIG, SCHEDULER) or _RNG_RE.match(f.name)))}


def new_trainer_state(*, global_step: int, train_batch_size: int) -> dict[str, Any]:
    """The trainer_state.json of a run that reached `global_step`, as transformers' own TrainerState (with the
    TrainerControl callback state every Trainer saves) writes it: for a checkpoint-N folder made from another
    framework's checkpoint."""
    import dataclasses

    from transformers import TrainerControl, TrainerState

    state = TrainerState(global_step=global_step, train_batch_size=train_batch_size,
                         stateful_callbacks=[TrainerControl()])  # type: ignore[list-item]  # as Trainer saves it
    return json.loads(json.dumps(dataclasses.asdict(state)))


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def trainer_rng(trainer: Mapping[str, Any], *, world_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each of `world_size` processes' RNG state and the decision that gave it (`plan_rng`); empty when the source
    holds no RNG file."""
    sources = list(trainer.get("rng") or [])
    if not sources:
        return [], []
    step = int(trainer["trainer_state"].get("global_step") or 0)
    states, made = plan_rng(sources, roles(dp=len(sources)), roles(dp=world_size), seed=0, step=step)
    return states, [d.as_dict() for d in made]


def trainer_files(trainer: Mapping[str, Any], *, world_size: int) -> tuple[TargetFile, ...]:
    """The Trainer's files for a run of `world_size` processes, each planned from its value (config.json,
    generation_config.json, scheduler.pt, one RNG state per process, trainer_state.json); `trainer_file_bytes`
    encodes one."""
    out: list[tuple[str, ValueRole, Any]] = []
    for name, key in ((CONFIG, "hf_config"), (GENERATION_CONFIG, "generation_config")):
        if trainer.get(key) is not None:
            out.append((name, ValueRole.OBJECT, trainer[key]))
    if trainer.get("scheduler") is not None:
        out.append((SCHEDULER, ValueRole.OBJECT, trainer["scheduler"]))
    states, _ = trainer_rng(trainer, world_size=world_size)
    first = (trainer.get("rng") or [{}])[0]  # the source's device generators: their key and form
    for r, state in enumerate(states):
        name = "rng_state.pth" if world_size == 1 else f"rng_state_{r}.pth"
        out.append((name, ValueRole.RNG, rng_to_trainer(state, device_key=first.get("device_key"),
                                                        device_list=bool(first.get("device_list")))))
    out.append((TRAINER_STATE, ValueRole.COMMON, trainer["trainer_state"]))
    return tuple(TargetFile(path=name, role=TRAINER_ROLE, rank=None, values=(ValueItem(key=(), role=role, value=value),))
                 for name, role, value in out)


TRAINER_ROLE = "hf_trainer"  # the role of the files `trainer_files` plans


def trainer_file_bytes(file: TargetFile) -> bytes:
    """A file of `trainer_files` as the Trainer writes it: JSON (sorted, indented by 2) or `torch.save`d."""
    value = file.values[0].value
    if file.path.endswith(".json"):
        return json_file_bytes(value)
    return _saved(value)
