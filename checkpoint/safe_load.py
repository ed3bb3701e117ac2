"""Loading checkpoint files with `torch.load(weights_only=True)` and an explicit allow-list.

The allow-list holds exactly the non-tensor classes DeepSpeed and Megatron put in their
checkpoints. A file whose pickle references anything else is refused with an error naming the
file and the classes, unless the caller opts in with `trust_checkpoint=True`.

Raw pickles that are not torch files (DCP's and Megatron's `.metadata`) go through `load_pickle`,
an unpickler whose `find_class` admits only the allow-list given (`DCP_METADATA_GLOBALS`: DCP's
metadata classes, torch's dtypes and sizes): torch's own `FileSystemReader.read_metadata()`, which
unpickles with plain `pickle`, is never called. `check_pickles(root)` applies the same rules to every
pickled file of a checkpoint tree before a framework's own loader (which unpickles freely) sees it.

DeepSpeed's and Megatron-Core's classes are read and written through stand-ins (`STAND_INS`: same
pickled name, same state) so that neither reading nor writing a checkpoint imports deepspeed (~0.7 s)
or megatron.core (the enums and the optimizer config in Megatron-LM's args: ~5 s, Megatron-Core's
package imports its layers): a file saved with `torch.save(obj, f, pickle_module=PICKLE_MODULE)`
references the frameworks' own classes, which they load as usual. Pickled any other way, a stand-in
turns into the real class (the framework imported then). Copies of a stand-in stay stand-ins.
"""

from __future__ import annotations

import copy
import importlib
import io
import os
import pickle
import threading
import types
import zipfile
from pathlib import Path
from typing import Any, ClassVar, SupportsIndex

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
        # the rest of what Megatron-Core registers for Megatron-LM's args (exit_signal, cuda_graph_scope, paths,
        # placeholder namespaces, the optimizer config): values only, their state unpickled under the same rules
        "megatron.core.transformer.enums.CudaGraphScope",
        "megatron.core.optimizer.optimizer_config.OptimizerConfig",
        "signal.Signals",
        "pathlib.PosixPath",
        "types.SimpleNamespace",
        # NumPy's RNG state tuple (np.random.get_state(): kind, uint32 key array, pos, has_gauss, cached) that
        # Megatron-LM's get_rng_state saves; numpy 1.x writes the array constructor as numpy.core.multiarray
        "numpy.ndarray",
        "numpy.dtype",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
    }
)


def _torch_constants() -> frozenset[str]:
    """`torch.<name>` of every dtype, layout and memory format (pickled as module globals)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return frozenset(f"torch.{n}" for n, v in vars(torch).items() if isinstance(v, kinds))


# What DCP's `.metadata` (torch.distributed.checkpoint.metadata.Metadata, pickled) references, and nothing else
DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        # the local save plans Megatron-Core keeps in `all_local_plans` (plain dataclasses and enums)
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.planner.LoadPlan",
        "torch.distributed.checkpoint.planner.ReadItem",
        "torch.distributed.checkpoint.planner.LoadItemType",
        "torch.Size",
        "torch.serialization._get_layout",
        "collections.OrderedDict",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
    }
) | _torch_constants()

# Values Megatron-Core stores as ShardedObjects and copies verbatim (`_extra_state`: None, a tensor or a BytesIO)
OBJECT_GLOBALS: frozenset[str] = ALLOWED_GLOBALS | {"_io.BytesIO"}


# torch's safe_globals() edits one process-wide set, which get_unsafe_globals_in_checkpoint also reads:
# one check-and-load at a time, or a thread sees another's temporary entries as safe and leaves them out
_SAFE_GLOBALS_LOCK = threading.RLock()


def _resolve(name: str) -> Any:
    """The object torch's weights_only unpickler admits for the pickled global `name`: (object, name) where
    the object lives under another name (stand-ins; numpy 1.x's `numpy.core` alias of `numpy._core`)."""
    if name in STAND_INS:
        return STAND_INS[name], name
    module, _, attr = name.rpartition(".")
    import warnings

    with warnings.catch_warnings():  # numpy 2 warns when numpy.core is imported by that name
        warnings.simplefilter("ignore", DeprecationWarning)
        obj = getattr(importlib.import_module(module), attr)
    own = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    return obj if own == name else (obj, name)


# The instance types `numpy.dtype(...)` returns for the plain numeric dtypes (the unpickler checks the type of
# the object it sets the state of): admitted with `numpy.dtype`, never object, void or string dtypes
_NUMPY_DTYPE_CLASSES = tuple(f"numpy.dtypes.{n}DType" for n in (
    "Bool", "Int8", "UInt8", "Int16", "UInt16", "Int32", "UInt32", "Int64", "UInt64", "Long", "ULong",
    "LongLong", "ULongLong", "Short", "UShort", "Byte", "UByte", "Float16", "Float32", "Float64"))


def admitted(names: list[str]) -> list[Any]:
    """What to pass torch's `safe_globals` for a file whose pickle references the allow-listed `names`."""
    out = [_resolve(n) for n in names]
    if "numpy.dtype" in names:
        import numpy.dtypes

        out += [getattr(numpy.dtypes, n.rpartition(".")[2]) for n in _NUMPY_DTYPE_CLASSES
                if hasattr(numpy.dtypes, n.rpartition(".")[2])]
    return out


def _real(name: str) -> type:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class _StandIn:
    """A DeepSpeed class as checkpoints hold it: `pickle_name` is the real class's qualified name."""

    pickle_name: ClassVar[str]

    def _state(self) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """(constructor args, state dict for BUILD or None): REDUCE args for enums, NEWOBJ + BUILD else."""
        return (), dict(self.__dict__)

    def _ctor_args(self) -> tuple[Any, ...]:
        """Arguments the real class's constructor accepts (its state is then set from `_state`)."""
        return ()

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Pickled by anything but PICKLE_MODULE: the real class's constructor, then its state (loads
        with weights_only under the real name, like the real object)."""
        args, state = self._state()
        return (_real(self.pickle_name), args) if state is None else (_real(self.pickle_name), self._ctor_args(),
                                                                      state)

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and self._state() == other._state()

    def __repr__(self) -> str:
        return f"{self.pickle_name}{self._state()}"

    def __copy__(self) -> Any:
        new = type(self).__new__(type(self), *self._state()[0])
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new = type(self).__new__(type(self), *copy.deepcopy(self._state()[0], memo))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class ZeroStageEnum(int, _StandIn):
    """deepspeed.runtime.zero.config.ZeroStageEnum (an int Enum: 0..3)."""

    pickle_name = "deepspeed.runtime.zero.config.ZeroStageEnum"
    _members: ClassVar[dict[int, ZeroStageEnum]] = {}

    def __new__(cls, value: int) -> ZeroStageEnum:  # one object per stage, like the Enum's members
        if int(value) not in cls._members:
            cls._members[int(value)] = int.__new__(cls, value)
        return cls._members[int(value)]

    @property
    def value(self) -> int:
        return int(self)

    def _state(self) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        return (int(self),), None

    __hash__ = int.__hash__


class fragment_address(_StandIn):  # DeepSpeed's name
    """deepspeed.utils.tensor_fragment.fragment_address (a dataclass: numel, start)."""

    pickle_name = "deepspeed.utils.tensor_fragment.fragment_address"

    def __init__(self, numel: int, start: int) -> None:
        self.numel, self.start = numel, start

    def _ctor_args(self) -> tuple[Any, ...]:
        return self.numel, self.start


class LossScaler(_StandIn):
    """deepspeed.runtime.fp16.loss_scaler.LossScaler (a static loss scale)."""

    pickle_name = "deepspeed.runtime.fp16.loss_scaler.LossScaler"

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale, self.dynamic = scale, False

    def _ctor_args(self) -> tuple[Any, ...]:
        return (self.cur_scale,)


class DynamicLossScaler(_StandIn):
    """deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (its attributes are carried as they were read)."""

    pickle_name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"

    def __init__(self, init_scale: float = 2.0 ** 32, scale_window: int = 1000, min_scale: float = 1,
                 delayed_shift: int = 1, consecutive_hysteresis: bool = False) -> None:
        self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_factor = init_scale, 0, -1, 2.0
        self.scale_window, self.min_scale, self.delayed_shift = scale_window, min_scale, delayed_shift
        self.cur_hysteresis, self.consecutive_hysteresis, self.dynamic = delayed_shift, consecutive_hysteresis, True

    def _ctor_args(self) -> tuple[Any, ...]:
        d = self.__dict__
        return (d.get("cur_scale", 2.0 ** 32), d.get("scale_window", 1000), d.get("min_scale", 1),
                d.get("delayed_shift", 1), d.get("consecutive_hysteresis", False))


class _EnumMember(_StandIn):
    """A member of an Enum class named only by `pickle_name`: its value (one object per value, like the
    members), pickled as Enum pickles its members (the class called with the value)."""

    _members: ClassVar[dict[Any, _EnumMember]]
    value: Any

    def __new__(cls, value: Any) -> _EnumMember:
        try:
            member = cls._members.get(value)
        except TypeError:  # unhashable: as the Enum itself answers a value none of its members has
            raise ValueError(f"{value!r} is not a valid {cls.pickle_name}") from None
        if member is None:
            member = cls._members[value] = object.__new__(cls)
            member.value = value
        return member

    def _state(self) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        return (self.value,), None

    def __hash__(self) -> int:
        return hash((self.pickle_name, self.value))

    def __repr__(self) -> str:
        return f"{self.pickle_name}({self.value!r})"

    def __copy__(self) -> _EnumMember:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _EnumMember:
        return self


class _Object(_StandIn):
    """An instance of a class named only by `pickle_name` (a dataclass): its attributes, pickled as the
    class pickles (NEWOBJ, then its attributes as state)."""


def _stand_in(base: type[_StandIn], pickle_name: str) -> type[_StandIn]:
    attrs: dict[str, Any] = {"pickle_name": pickle_name, "__doc__": f"{pickle_name} as pickled ({base.__name__})"}
    if base is _EnumMember:
        attrs["_members"] = {}
    return type(pickle_name.rpartition(".")[2], (base,), attrs)


# Megatron-Core's classes in Megatron-LM's pickled args (legacy files, torch_dist common.pt)
_MEGATRON_ENUMS = ("megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
                   "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.CudaGraphScope",
                   "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
                   "megatron.core.rerun_state_machine.RerunDiagnostic")
_MEGATRON_OBJECTS = ("megatron.core.optimizer.optimizer_config.OptimizerConfig",)

_STAND_IN_CLASSES: tuple[type[_StandIn], ...] = (
    ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler,
    *(_stand_in(_EnumMember, n) for n in _MEGATRON_ENUMS), *(_stand_in(_Object, n) for n in _MEGATRON_OBJECTS))
STAND_INS: dict[str, type] = {c.pickle_name: c for c in _STAND_IN_CLASSES}


_PythonPickler: Any = pickle._Pickler  # type: ignore[attr-defined]  # typeshed leaves the pure-Python pickler out


class _Pickler(_PythonPickler):  # the Python pickler: its `save` can be extended, the C one's cannot
    """Pickles stand-ins under the real classes' names (GLOBAL opcodes), importing nothing; the rest as usual."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if not isinstance(obj, _StandIn):
            return super().save(obj, save_persistent_id)
        if id(obj) in self.memo:
            self.write(self.get(self.memo[id(obj)][0]))
            return None
        args, state = obj._state()
        self._save_class(type(obj))
        self.save(args)
        self.write(pickle.REDUCE if state is None else pickle.NEWOBJ)
        self.memoize(obj)
        if state is not None:
            self.save(state)
            self.write(pickle.BUILD)
        return None

    def _save_class(self, cls: type[_StandIn]) -> None:
        if id(cls) in self.memo:
            self.write(self.get(self.memo[id(cls)][0]))
            return
        module, _, name = cls.pickle_name.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())
        self.memoize(cls)


PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="checkpoint.safe_load.PICKLE_MODULE")


def _registered_by_torch(entry: Any) -> bool:
    obj = entry[0] if isinstance(entry, tuple) else entry
    return str(getattr(obj, "__module__", "") or "").split(".")[0] == "torch"


class _only:  # lower case: used as a context manager, like torch's safe_globals
    """torch's safe globals for one load or check: torch's own and `entries`, nothing else. Other libraries
    register classes process-wide at import (Megatron-Core its enums, configs, numpy's arrays, BytesIO), which
    would hide them from the allow-list check; and torch keeps them in a set, so where one has a stand-in's name,
    which of the two a load built would be left to the set's order."""

    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries

    def __enter__(self) -> None:
        _SAFE_GLOBALS_LOCK.acquire()
        self.registered = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals([g for g in self.registered if _registered_by_torch(g)] + self.entries)

    def __exit__(self, *exc: object) -> None:
        try:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(self.registered)
        finally:
            _SAFE_GLOBALS_LOCK.release()


def _unsafe_globals(source: Any) -> list[str]:
    """torch's `get_unsafe_globals_in_checkpoint` measured against torch's own safe globals alone."""
    with _only([]):
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))


def required_globals(path: Path) -> list[str]:
    """Names of the non-default globals the pickle in `path` references (reads the pickle only)."""
    try:
        with _SAFE_GLOBALS_LOCK:
            return _unsafe_globals(str(path))
    except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as err:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"\x80\x02":  # a pickle stream: torch.save's legacy (pre-1.6, non-zip) format
            raise CheckpointFormatError(f"{path}: saved in torch's legacy non-zip format (torch < 1.6 or "
                                        f"_use_new_zipfile_serialization=False), which is not read here; re-save it "
                                        f"with a current torch (torch.save(torch.load(f), f))") from err
        raise CheckpointFormatError(f"{path}: not a readable torch checkpoint (truncated or corrupt?): {err}") from err


def allowing(names: list[str]) -> _only:
    """Hold the lock and admit the allow-listed globals `names` (and torch's own) for
    torch.load(weights_only=True)."""
    return _only(admitted(names))


def load(path: str | Path, *, mmap: bool = False, trust_checkpoint: bool = False) -> Any:
    """Load `path` on the CPU with weights_only=True and the allow-list; mmap keeps tensor data on disk.

    Raises CheckpointFormatError for a missing/truncated file and UntrustedCheckpointError naming the
    file and the classes outside the allow-list (unless trust_checkpoint, which loads with
    weights_only=False).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: file is missing")
    with _SAFE_GLOBALS_LOCK:
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
            with allowing(needed):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as err:
            reason = _weights_only_reason(str(err))
            if reason is None:
                raise CheckpointFormatError(f"{path}: cannot load (truncated or corrupt?): {err}") from err
            if not trust_checkpoint:
                raise UntrustedCheckpointError(f"{path}: refusing to unpickle it: {reason} (not in the allow-list); "
                                               f"pass trust_checkpoint / --trust-checkpoint if you trust this file"
                                               ) from None
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        except (zipfile.BadZipFile, RuntimeError, EOFError, ValueError, OSError) as err:
            raise CheckpointFormatError(f"{path}: cannot load (truncated or corrupt?): {err}") from err


def _weights_only_reason(message: str) -> str | None:
    """The line of torch's weights_only refusal that names what it would not build (e.g. a numpy object
    dtype, which no global in the pickle names); None when the error is not such a refusal."""
    if "Weights only load failed" not in message:
        return None
    lines = [ln.strip() for ln in message.splitlines() if "but got" in ln or "Unsupported" in ln]
    return lines[0] if lines else "torch's weights_only unpickler refused an object"


class _AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed` and no persistent ids; anything else
    raises UntrustedCheckpointError naming the file and the global (nothing of it is imported or run)."""

    def __init__(self, f: Any, allowed: frozenset[str], where: str) -> None:
        super().__init__(f)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise UntrustedCheckpointError(
                f"{self.where}: refusing to unpickle {full} (not in the allow-list of classes this file may hold); "
                f"pass trust_checkpoint / --trust-checkpoint if you trust this file")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError(f"{self.where}: refusing a pickle persistent id ({str(pid)[:40]}); this file "
                                       f"is expected to be a plain pickle")


def load_pickle(path: str | Path, *, allowed: frozenset[str], trust_checkpoint: bool = False) -> Any:
    """Unpickle the plain pickle file `path` resolving only the globals in `allowed` (plain `pickle`
    with trust_checkpoint). Raises CheckpointFormatError for a missing or unreadable file and
    UntrustedCheckpointError naming the file and the first global outside `allowed`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: file is missing")
    try:
        with open(path, "rb") as f:
            if trust_checkpoint:
                return pickle.load(f)  # the user vouched for this file
            return _AllowListUnpickler(f, allowed, str(path)).load()
    except UntrustedCheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError, TypeError,
            ValueError, KeyError, RecursionError, MemoryError) as err:
        raise CheckpointFormatError(f"{path}: not a readable pickle (truncated or corrupt?): "
                                    f"{type(err).__name__}: {err}") from err


def read_dcp_metadata(directory: str | Path, *, trust_checkpoint: bool = False) -> Any:
    """DCP's `Metadata` from `directory/.metadata`, unpickled with `DCP_METADATA_GLOBALS` only (what
    `FileSystemReader.read_metadata()` returns, without its plain unpickling)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / ".metadata"
    md = load_pickle(path, allowed=DCP_METADATA_GLOBALS, trust_checkpoint=trust_checkpoint)
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict) or \
            not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointFormatError(f"{path}: holds {type(md).__name__}, not DCP Metadata with state_dict_metadata "
                                    f"and storage_data")
    return md


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable read-only stream."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: pos, io.SEEK_CUR: self.pos + pos, io.SEEK_END: self.length + pos}[whence]
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf)[:n]) or 0
        self.pos += got
        return got


def window(f: Any, offset: int, length: int) -> io.BufferedReader:
    """A buffered reader over bytes [offset, offset + length) of the open binary file `f`."""
    return io.BufferedReader(_Window(f, offset, length))


def range_globals(path: Path, offset: int, length: int) -> list[str]:
    """Non-default globals of the torch.save'd object at bytes [offset, offset + length) of `path`."""
    with open(path, "rb") as f, _SAFE_GLOBALS_LOCK:
        try:
            return _unsafe_globals(window(f, offset, length))
        except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as err:
            raise CheckpointFormatError(f"{path}: bytes [{offset}, {offset + length}) are no readable torch object "
                                        f"(truncated or corrupt?): {err}") from err


_ZIP_MAGIC = b"PK\x03\x04"


def check_pickles(root: str | Path, *, trust_checkpoint: bool = False) -> int:
    """Refuse a checkpoint tree any of whose pickles a framework's own loader would unpickle beyond the
    allow-lists: every torch zip file (`ALLOWED_GLOBALS`), every plain pickle (`.metadata`:
    `DCP_METADATA_GLOBALS`) and every non-tensor value inside DCP `.distcp` files (`OBJECT_GLOBALS`; DCP
    and Megatron-Core load those with `weights_only=False`). Reads pickles only, no tensor data.
    Returns the number of pickles checked; raises UntrustedCheckpointError naming the file and the
    classes (nothing with trust_checkpoint), CheckpointFormatError for an unreadable one."""
    root = Path(root)
    if trust_checkpoint:
        return 0
    checked = 0
    base = root if root.is_dir() else root.parent
    for dirpath, _, names in os.walk(base):
        for name in sorted(names):
            path = Path(dirpath) / name
            if not path.is_file() or name.endswith(".distcp"):  # DCP data: its values are checked via .metadata
                continue
            with open(path, "rb") as f:
                head = f.read(4)
            if head == _ZIP_MAGIC and zipfile.is_zipfile(path) and any(
                    n.endswith("data.pkl") for n in zipfile.ZipFile(path).namelist()):
                refused = sorted(set(required_globals(path)) - ALLOWED_GLOBALS)
                if refused:
                    raise UntrustedCheckpointError(
                        f"{path}: refusing to unpickle {', '.join(refused)} (not in the allow-list of classes that "
                        f"DeepSpeed/Megatron store); pass trust_checkpoint / --trust-checkpoint if you trust this file")
                checked += 1
            elif name == ".metadata":
                md = read_dcp_metadata(path.parent)
                checked += 1 + _check_dcp_objects(path.parent, md)
    return checked


def _check_dcp_objects(directory: Path, md: Any) -> int:
    """Check every non-tensor value of a DCP checkpoint against `OBJECT_GLOBALS`; the number checked."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    n = 0
    for idx, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata):
            continue
        path = directory / str(info.relative_path)
        refused = sorted(set(range_globals(path, int(info.offset), int(info.length))) - OBJECT_GLOBALS)
        if refused:
            raise UntrustedCheckpointError(f"{path}: value {idx.fqn} needs {', '.join(refused)} (not in the allow-list); "
                                           f"pass trust_checkpoint / --trust-checkpoint if you trust this file")
        n += 1
    return n
