"""Loading checkpoint files with `torch.load(weights_only=True)` and an explicit allow-list.

The allow-list holds exactly the non-tensor classes DeepSpeed and Megatron put in their
checkpoints. A file whose pickle references anything else is refused with an error naming the
file and the classes, unless the caller opts in with `trust_checkpoint=True`.
"""

from __future__ import annotations

import importlib
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from checkpoint.errors import CheckpointFormatError, UntrustedCheckpointError

ALLOWED_GLOBALS: frozenset[str] = frozenset(
    {
        # DeepSpeed ZeRO optimizer files
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        # Megatron (legacy checkpoints store the argparse namespace and enums)
        "argparse.Namespace",
        "megatron.core.enums.ModelType",
        "megatron.core.transformer.enums.AttnBackend",
        "megatron.core.transformer.enums.AttnMaskType",
        "megatron.core.rerun_state_machine.RerunMode",
        "megatron.core.rerun_state_machine.RerunState",
        "megatron.core.rerun_state_machine.RerunDiagnostic",
    }
)


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def required_globals(path: Path) -> list[str]:
    """Names of the non-default globals the pickle in `path` references (reads the pickle only)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: not a readable torch checkpoint (truncated or corrupt?): {err}") from err


def load(path: str | Path, *, mmap: bool = False, trust_checkpoint: bool = False) -> Any:
    """Load `path` on the CPU with weights_only=True and the allow-list; mmap keeps tensor data on disk.

    Raises CheckpointFormatError for a missing/truncated file and UntrustedCheckpointError naming the
    file and the classes outside the allow-list (unless trust_checkpoint, which loads with
    weights_only=False).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: file is missing")
    needed = required_globals(path)
    refused = sorted(n for n in needed if n not in ALLOWED_GLOBALS)
    if refused and not trust_checkpoint:
        raise UntrustedCheckpointError(
            f"{path}: refusing to unpickle {', '.join(refused)} (not in the allow-list of classes that "
            f"DeepSpeed/Megatron store); pass trust_checkpoint / --trust-checkpoint if you trust this file"
        )
    try:
        if refused:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals([_resolve(n) for n in needed]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: cannot load (truncated or corrupt?): {err}") from err
