"""Run Megatron-Core's CUDA-only calls on the CPU, in the spirit of Ascend's `transfer_to_npu`.

`cpu_device_adapter()` is a context manager that patches, and restores on exit:

* device queries: `torch.cuda.current_device` -> 0, `torch.cuda.device_count` -> 1,
  `torch.cuda.set_device`, `synchronize`, `empty_cache` -> no-ops;
* the CUDA RNG used by `tensor_parallel.random` (get/set state, manual_seed, the tracker's
  `_set_cuda_rng_state`/`_get_cuda_rng_state`) -> the CPU generator;
* streams and events (`torch.cuda.Stream`, `Event`, `stream`, `current_stream`,
  `default_stream`) -> no-op objects;
* tensor factories (`torch.zeros`, `empty`, `ones`, `full`, `tensor`, `arange`, `rand*`,
  `*_like`, `as_tensor`, ..., `Tensor.new_empty`, `new_zeros`, ...) and `Tensor.to` / `Tensor.cuda`: a CUDA device (`"cuda"`,
  `"cuda:0"`, an int, `torch.device("cuda")`) becomes the CPU;
* `Tensor.type()` reports CPU float types under their CUDA names (the DistributedOptimizer
  checks `param.type() == "torch.cuda.FloatTensor"`);
* `megatron.core.transformer.moe.moe_utils.te_general_gemm` -> None (it is referenced
  without Transformer Engine);
* `megatron.core.transformer.multi_latent_attention.HAVE_TE` -> False (its Transformer Engine
  import succeeds against a mock whose `TELinear` is no type, and `isinstance` then raises);
* `torch.distributed.all_to_all_single` split sizes given as NumPy arrays or tensors (the
  MoE dispatcher) -> lists of ints;
* `torch.distributed.all_gather` / `reduce_scatter` with pieces of different lengths along
  dim 0 (the MoE alltoall dispatcher at tp > 1 gathers/scatters each TP rank's routed tokens
  with `output_split_sizes`): Gloo refuses them ("ProcessGroupGloo::allgather: invalid tensor
  size"), so every piece is zero-padded to the longest, moved with one even collective and
  sliced back. Even pieces go to the original call unchanged.

Sequence parallel on the CPU needs no patch: the engine builds its norms with
`migrate.workload.megatron_norm.SequenceParallelTorchNorm` (torch norms whose params are
marked `sequence_parallel`, as Apex's FusedLayerNorm does), because 0.16.1's own torch
fallback, `WrappedTorchNorm`, asserts `not config.sequence_parallel`.

Verified against megatron-core `VERIFIED_MEGATRON_CORE` on torch 2.13 (CPU); another
version raises unless `allow_other_versions=True`.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator

import torch

VERIFIED_MEGATRON_CORE = "0.16.1"

FACTORIES = ("zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "randperm",
             "zeros_like", "empty_like", "ones_like", "full_like", "rand_like", "randn_like", "as_tensor",
             "empty_strided", "linspace", "eye")
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")
CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                   "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor", "torch.DoubleTensor": "torch.cuda.DoubleTensor",
                   "torch.LongTensor": "torch.cuda.LongTensor", "torch.IntTensor": "torch.cuda.IntTensor",
                   "torch.ByteTensor": "torch.cuda.ByteTensor", "torch.BoolTensor": "torch.cuda.BoolTensor"}

_lock = threading.Lock()
_active = False


@dataclass(frozen=True, slots=True)
class Patch:
    """One attribute replaced while the adapter is active."""

    owner: Any
    name: str
    replacement: Any
    why: str

    @property
    def target(self) -> str:
        if isinstance(self.owner, type):
            return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.name}"
        return f"{self.owner.__name__}.{self.name}"


def is_cuda_device(device: Any) -> bool:
    """True for what CUDA code passes as a device: 'cuda', 'cuda:N', an int, torch.device('cuda')."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def to_cpu_device(device: Any) -> Any:
    return torch.device("cpu") if is_cuda_device(device) else device


def _redirect_device_kwarg(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def _tensor_to(original: Callable) -> Callable:
    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(to_cpu_device(a) if is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = (torch.device("cpu"),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> torch.Tensor:
    return self


def _tensor_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            name = original(self)
            return CUDA_TYPE_NAMES.get(name, name)
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class _NoOpStream:
    """Stands in for torch.cuda.Stream / Event: every method does nothing, waits return at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: None

    def record_event(self, event: Any = None) -> _NoOpStream:
        return event if event is not None else _NoOpStream()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def __enter__(self) -> _NoOpStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def _noop_stream_context(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _split_sizes_as_ints(original: Callable) -> Callable:
    def as_ints(sizes: Any) -> Any:
        if sizes is None or isinstance(sizes, list) and all(type(s) is int for s in sizes):
            return sizes
        return [int(s) for s in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]

    @functools.wraps(original)
    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, *args: Any, **kwargs: Any) -> Any:
        return original(output, input, as_ints(output_split_sizes), as_ints(input_split_sizes), *args, **kwargs)

    return all_to_all_single


def _uneven(tensors: list[torch.Tensor]) -> bool:
    return len({tuple(t.shape) for t in tensors}) > 1


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _uneven_all_gather(original: Callable) -> Callable:
    @functools.wraps(original)
    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        if not _uneven([*tensor_list, tensor]) or async_op:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in [*tensor_list, tensor])
        gathered = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        original(gathered, _padded(tensor, rows), group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])
        return None

    return all_gather


def _uneven_reduce_scatter(original: Callable) -> Callable:
    @functools.wraps(original)
    def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = None, group: Any = None,
                       async_op: bool = False) -> Any:
        op = torch.distributed.ReduceOp.SUM if op is None else op
        if not _uneven([*input_list, output]) or async_op:
            return original(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in [*input_list, output])
        padded = [_padded(t, rows) for t in input_list]
        result = output.new_empty((rows, *output.shape[1:]))
        original(result, padded, op=op, group=group)
        output.copy_(result[: output.shape[0]])
        return None

    return reduce_scatter


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def planned_patches() -> list[Patch]:
    """Every patch the adapter applies, in order; pure except for importing megatron.core."""
    cuda = torch.cuda
    patches = [
        Patch(cuda, "current_device", lambda: 0, "device index used as a tensor device; 0 maps to the CPU"),
        Patch(cuda, "device_count", lambda: 1, "one (CPU) device per rank"),
        Patch(cuda, "set_device", lambda device: None, "no device to select"),
        Patch(cuda, "synchronize", lambda device=None: None, "CPU ops are synchronous"),
        Patch(cuda, "empty_cache", lambda: None, "no caching allocator"),
        Patch(cuda, "get_rng_state", _cpu_get_rng_state, "CUDA RNG -> CPU generator"),
        Patch(cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state),
              "CUDA RNG -> CPU generator"),
        Patch(cuda, "manual_seed", lambda seed: torch.manual_seed(seed), "CUDA RNG -> CPU generator"),
        Patch(cuda, "Stream", _NoOpStream, "streams are no-ops"),
        Patch(cuda, "Event", _NoOpStream, "events are no-ops"),
        Patch(cuda, "stream", _noop_stream_context, "stream context is a no-op"),
        Patch(cuda, "current_stream", lambda device=None: _NoOpStream(), "streams are no-ops"),
        Patch(cuda, "default_stream", lambda device=None: _NoOpStream(), "streams are no-ops"),
        Patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to), "CUDA target device -> CPU"),
        Patch(torch.Tensor, "cuda", _tensor_cuda, "Tensor.cuda() keeps the tensor on the CPU"),
        Patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type), "CPU types reported under CUDA names"),
        Patch(torch.distributed, "all_to_all_single", _split_sizes_as_ints(torch.distributed.all_to_all_single),
              "NumPy/tensor split sizes -> list of ints (MoE alltoall dispatcher)"),
        Patch(torch.distributed, "all_gather", _uneven_all_gather(torch.distributed.all_gather),
              "uneven pieces padded to the longest (Gloo refuses uneven all_gather; MoE at tp > 1)"),
        Patch(torch.distributed, "reduce_scatter", _uneven_reduce_scatter(torch.distributed.reduce_scatter),
              "uneven pieces padded to the longest (Gloo refuses uneven reduce_scatter; MoE at tp > 1)"),
    ]
    patches += [Patch(torch, name, _redirect_device_kwarg(getattr(torch, name)), "CUDA device kwarg -> CPU")
                for name in FACTORIES]
    patches += [Patch(torch.Tensor, name, _redirect_device_kwarg(getattr(torch.Tensor, name)),
                      "CUDA device kwarg -> CPU") for name in TENSOR_FACTORIES]
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    patches += [
        Patch(multi_latent_attention, "HAVE_TE", False, "MLA's TELinear is a mock without Transformer Engine"),
        Patch(tp_random, "_set_cuda_rng_state", _cpu_set_rng_state, "RNG tracker fork uses the CPU generator"),
        Patch(tp_random, "_get_cuda_rng_state", _cpu_get_rng_state, "RNG tracker fork uses the CPU generator"),
        Patch(moe_utils, "te_general_gemm", None, "referenced without Transformer Engine; None picks torch matmul"),
    ]
    return patches


def check_megatron_version(allow_other_versions: bool = False) -> str:
    """The installed megatron-core version; raises when it is not the verified one."""
    from megatron.core.package_info import __version__

    if __version__ != VERIFIED_MEGATRON_CORE and not allow_other_versions:
        raise RuntimeError(f"the CPU device adapter is verified with megatron-core {VERIFIED_MEGATRON_CORE}, "
                           f"found {__version__}; pass allow_other_versions=True to try it anyway")
    return __version__


_MISSING = object()


@contextlib.contextmanager
def cpu_device_adapter(allow_other_versions: bool = False) -> Iterator[list[Patch]]:
    """Apply every patch of `planned_patches()` for the duration of the block; yields them.

    Not re-entrant: a nested or concurrent activation raises. Restores the originals on exit,
    also when the block raises.
    """
    global _active
    check_megatron_version(allow_other_versions)
    with _lock:
        if _active:
            raise RuntimeError("cpu_device_adapter is already active in this process")
        _active = True
    patches = planned_patches()
    originals: list[tuple[Any, str, Any]] = []
    try:
        for patch in patches:
            originals.append((patch.owner, patch.name, patch.owner.__dict__.get(patch.name, _MISSING)
                              if isinstance(patch.owner, type) else getattr(patch.owner, patch.name, _MISSING)))
            setattr(patch.owner, patch.name, patch.replacement)
        yield patches
    finally:
        for owner, name, original in reversed(originals):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        with _lock:
            _active = False
