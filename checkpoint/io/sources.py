"""Reading source checkpoints: a torch.save'd object at a byte range, one tensor of a .safetensors file,
and `Sources`, the per-worker view of a source folder (files mapped lazily, ranges cached)."""

from __future__ import annotations

import json
import os
import pickle
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError, UntrustedCheckpointError
from checkpoint.index import KeyPath
from checkpoint.io.buffers import bytes_of

# Key paths that address stored tensors outside a torch.save'd object (see `Sources.tensor`):
BYTE_RANGE = "@range"  # (BYTE_RANGE, offset, length): one torch.save'd tensor at that byte range (DCP)
SAFETENSORS = "@safetensors"  # (SAFETENSORS, name): tensor `name` of a .safetensors file

def resolve_key(obj: Any, key: KeyPath, *, file: str) -> Any:
    """obj[k0][k1]...; a missing key raises CheckpointFormatError naming the file and the path."""
    cur = obj
    for i, k in enumerate(key):
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            raise CheckpointFormatError(f"{file}: key path {list(key[:i + 1])} not found") from None
    return cur


def load_range(path: Path, offset: int, length: int, *, trust_checkpoint: bool = False) -> Any:
    """The object torch.save'd at bytes [offset, offset + length) of `path`, loaded with weights_only=True
    and the allow-list for stored values (`safe_load.OBJECT_GLOBALS`: what DeepSpeed and Megatron store, and
    BytesIO, which torchtitan's train state and Megatron-Core's extra states are); a global outside it raises
    UntrustedCheckpointError naming the file and the global, unless trust_checkpoint."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise CheckpointFormatError(f"{path}: needs bytes [{offset}, {offset + length}) but the file has {size} "
                                        f"(truncated?)")
    needed = safe_load.range_globals(path, offset, length)
    refused = sorted(n for n in needed if n not in safe_load.OBJECT_GLOBALS)
    if refused and not trust_checkpoint:
        raise UntrustedCheckpointError(f"{path}: the object at bytes [{offset}, {offset + length}) needs "
                                       f"{', '.join(refused)} (not in the allow-list of classes that DeepSpeed/"
                                       f"Megatron store); pass trust_checkpoint / --trust-checkpoint if you trust "
                                       f"this file")
    with open(path, "rb") as f:
        try:
            if refused:
                return torch.load(safe_load.window(f, offset, length), map_location="cpu", weights_only=False)
            with safe_load.allowing(needed):
                return torch.load(safe_load.window(f, offset, length), map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
            raise CheckpointFormatError(f"{path}: bytes [{offset}, {offset + length}) unreadable: {err}") from err


class Sources:
    """Source files opened lazily with mmap (data stays on disk until a region is copied).

    Byte-range keys load one stored tensor, kept in a small cache (at most `cache_bytes`, least
    recently used evicted) since several copy items often read the same stored tensor; safetensors
    keys read the one tensor's bytes at the offsets the file's header gives (no mapping of the file,
    whose touched pages would stay resident).
    """

    def __init__(self, root: Path, trust_checkpoint: bool, cache_bytes: int = 256 << 20) -> None:
        self.root, self.trust = root, trust_checkpoint
        self.cache: dict[str, Any] = {}
        self.ranges: dict[tuple[str, int, int], torch.Tensor] = {}
        self.cache_bytes = cache_bytes

    def close(self) -> None:
        """Drop the loaded files and cached ranges (their mappings are released with them)."""
        self.cache.clear()
        self.ranges.clear()

    @staticmethod
    def mapped(key: KeyPath) -> bool:
        """Whether `tensor(file, key)` is a view of a memory-mapped torch file (pages can be released)."""
        return not (key and key[0] in (BYTE_RANGE, SAFETENSORS))

    def _range(self, file: str, offset: int, length: int) -> torch.Tensor:
        k = (file, offset, length)
        if k in self.ranges:
            self.ranges[k] = self.ranges.pop(k)  # most recently used last
            return self.ranges[k]
        t = load_range(self.root / file, offset, length)
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{self.root / file}: bytes [{offset}, {offset + length}) hold "
                                        f"{type(t).__name__}, not a tensor")
        self.ranges[k] = t
        while len(self.ranges) > 1 and sum(v.untyped_storage().nbytes() for v in self.ranges.values()) > \
                self.cache_bytes:
            self.ranges.pop(next(iter(self.ranges)))
        return t

    def tensor(self, file: str, key: KeyPath) -> torch.Tensor:
        if key and key[0] == BYTE_RANGE:
            return self._range(file, int(key[1]), int(key[2]))
        if key and key[0] == SAFETENSORS:
            if file not in self.cache:
                self.cache[file] = safetensors_header(self.root / file)
            return read_safetensor(self.root / file, self.cache[file], str(key[1]))
        if file not in self.cache:
            self.cache[file] = safe_load.load(self.root / file, mmap=True, trust_checkpoint=self.trust)
        t = resolve_key(self.cache[file], key, file=str(self.root / file))
        if isinstance(t, int) and not isinstance(t, bool):  # a step DeepSpeed's FusedAdam/CPUAdam keep as int
            return torch.tensor(t, dtype=torch.int64)
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{self.root / file}: {list(key)} is {type(t).__name__}, not a tensor")
        return t


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32,
                       "U64": torch.uint64}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The parsed JSON header of a .safetensors file, with `__data_start__`: the byte offset of its data."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointFormatError(f"{path}: header of {n} bytes but the file has {size} (truncated?)")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as err:
        raise CheckpointFormatError(f"{path}: unreadable safetensors header: {err}") from err
    return {**header, "__data_start__": 8 + n}


def read_safetensor(path: Path, header: Mapping[str, Any], name: str) -> torch.Tensor:
    """Tensor `name` of a .safetensors file, read from its byte range into fresh memory."""
    spec = header.get(name)
    if not isinstance(spec, dict) or spec.get("dtype") not in _SAFETENSORS_DTYPES:
        raise CheckpointFormatError(f"{path}: no readable tensor {name!r} in the header ({spec})")
    begin, end = spec["data_offsets"]
    t = torch.empty(spec["shape"], dtype=_SAFETENSORS_DTYPES[spec["dtype"]])
    want = t.numel() * t.element_size()
    if end - begin != want:
        raise CheckpointFormatError(f"{path}: tensor {name!r} spans {end - begin} bytes, shape {spec['shape']} "
                                    f"{spec['dtype']} needs {want}")
    view, pos = bytes_of(t.reshape(-1)), header["__data_start__"] + begin
    with open(path, "rb", buffering=0) as f:
        while len(view):
            got = os.preadv(f.fileno(), [view], pos)
            if got <= 0:
                raise CheckpointFormatError(f"{path}: tensor {name!r} ends past the end of the file (truncated?)")
            view, pos = view[got:], pos + got
    return t
