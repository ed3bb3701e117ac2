"""The torch.save zip container: where each tensor's bytes lie in a file (from its pickle, nothing loaded or
imported), and the CRC-32s `torch.save` under `skip_data` leaves at 0."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from checkpoint.errors import CheckpointError, CheckpointFormatError
from checkpoint.index import KeyPath
from checkpoint.io.checksum import Span, crc_with_spans
from checkpoint.io.sources import resolve_key


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredTensor:
    """Where a contiguous tensor of a torch.save'd (zip) file lies: byte offset of element 0, numel, dtype."""

    offset: int
    numel: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Opaque:
    """Stands in for every non-container class of a pickle read for its tensors' locations only: nothing is imported or run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()


def _rebuild_ref(storage: Any, storage_offset: int, size: Any, stride: Any, *args: Any) -> _TensorRef:
    return _TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


class _LocationUnpickler(pickle.Unpickler):
    """Reads a torch.save'd `data.pkl` into plain containers with `_TensorRef`s in place of tensors."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_ref
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *a: data
        if module == "torch" and name.endswith("Storage") and isinstance(getattr(torch, name, None), type):
            return getattr(torch, name)
        return _Opaque

    def persistent_load(self, pid: Any) -> _StorageRef:
        _, storage_type, key, _, _ = pid
        with warnings.catch_warnings():  # legacy typed-storage classes warn on `.dtype`
            warnings.simplefilter("ignore")
            dtype = storage_type if isinstance(storage_type, torch.dtype) else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage {key}: unknown storage type {storage_type!r}")
        return _StorageRef(str(key), dtype)


class TensorLocations:
    """Byte locations of tensors in torch.save'd files, from each file's pickle (parsed once, nothing loaded)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[Any, Any]] = {}

    def locate(self, path: Path, key: KeyPath) -> StoredTensor | None:
        """The stored tensor at `key` of `path`, or None when it is not one contiguous run of a zip record."""
        p = str(path)
        if p not in self.files:
            try:
                reader = torch._C.PyTorchFileReader(p)
                obj = _LocationUnpickler(io.BytesIO(reader.get_record("data.pkl"))).load()
            except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
                obj, reader = None, None
            self.files[p] = (reader, obj)
        reader, obj = self.files[p]
        if reader is None or sys.byteorder != "little":
            return None
        try:
            ref = resolve_key(obj, key, file=p)
        except CheckpointFormatError:
            return None
        if not isinstance(ref, _TensorRef) or not isinstance(ref.storage, _StorageRef):
            return None
        expect, acc = [], 1
        for n in reversed(ref.size):
            expect.append(acc)
            acc *= n
        if any(n > 1 and st != e for n, st, e in zip(ref.size, ref.stride, reversed(expect))):
            return None
        size = torch.empty((), dtype=ref.storage.dtype).element_size()
        base = reader.get_record_offset(f"data/{ref.storage.key}")
        return StoredTensor(offset=base + ref.storage_offset * size, numel=math.prod(ref.size),
                            dtype=ref.storage.dtype)


def fix_zip_crcs(f: BinaryIO, path: Path, written: Sequence[Span] = ()) -> int:
    """Write the CRC-32 of every tensor record into its data descriptor and central-directory entry,
    and return the CRC-32 of the whole file. `written`: the pieces of the records whose CRC-32 the
    writes returned; a record's CRC combines theirs and reads only the bytes no piece covers (holes
    left as zeros), and the file's combines the records' with the bytes around them (headers and the
    pickle, read after the fix). With no pieces given, every tensor byte is read once.

    `torch.save` under `skip_data` leaves them 0 (torch.load does not check them; zip tools do).
    """
    fd = f.fileno()
    with zipfile.ZipFile(path) as z:
        infos, cd_pos = z.infolist(), z.start_dir
    regions: list[tuple[int, int, int]] = []  # (start, end, crc) of each tensor record's data
    for info in infos:
        head = os.pread(fd, 46, cd_pos)
        if head[:4] != b"PK\x01\x02":
            raise CheckpointError(f"{path}: central directory entry of {info.filename} not where expected")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        if info.CRC == 0 and info.compress_size > 0 and "/data/" in info.filename:
            local_name, local_extra = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            start = info.header_offset + 30 + local_name + local_extra
            end = start + info.compress_size
            crc = crc_with_spans(fd, start, end, written)
            regions.append((start, end, crc))
            packed = struct.pack("<I", crc)
            os.pwrite(fd, packed, cd_pos + 16)
            if info.flag_bits & 0x08:  # data descriptor after the data, with or without its signature
                sig = os.pread(fd, 4, end)
                os.pwrite(fd, packed, end + 4 if sig == b"PK\x07\x08" else end)
            else:
                os.pwrite(fd, packed, info.header_offset + 14)
        cd_pos += 46 + name_len + extra_len + comment_len
    return crc_with_spans(fd, 0, os.fstat(fd).st_size, [Span(start, end - start, crc) for start, end, crc in regions])
