"""Which torch.distributed backend serves which device type.

The full adapter (multi-backend strings, backend environment, option mapping) lives in
``migrate.comm``; this module holds the small table the worker group needs to start.
"""

from __future__ import annotations

import importlib.util

DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu")

# device type -> (default backend, backends that can drive it)
_BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu": ("gloo", ("gloo", "mpi")),
    "cuda": ("nccl", ("nccl", "gloo", "mpi")),
    "npu": ("hccl", ("hccl",)),  # Gloo moves only CPU and CUDA tensors
    "xpu": ("xccl", ("xccl",)),
}


class BackendError(ValueError):
    """A backend that cannot drive the chosen device type, or is not installed."""


def default_backend(device_type: str) -> str:
    """The backend a job gets when it says ``backend: auto``."""
    if device_type not in _BACKENDS:
        raise BackendError(f"device type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    return _BACKENDS[device_type][0]


def allowed_backends(device_type: str) -> tuple[str, ...]:
    """Backends that can drive ``device_type`` (first is the default)."""
    if device_type not in _BACKENDS:
        raise BackendError(f"device type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    return _BACKENDS[device_type][1]


def resolve_backend(device_type: str, backend: str) -> str:
    """``auto`` becomes the device's default; anything else must be allowed for the device.

    Multi-backend strings such as ``cpu:gloo,cuda:nccl`` pass through when every part is
    allowed for its own device.
    """
    if backend == "auto":
        return default_backend(device_type)
    if ":" in backend:
        for part in backend.split(","):
            dev, _, name = part.partition(":")
            if name not in allowed_backends(dev):
                raise BackendError(f"backend {name!r} cannot drive {dev!r} in {backend!r}; allowed: {allowed_backends(dev)}")
        return backend
    if backend not in allowed_backends(device_type):
        raise BackendError(
            f"backend {backend!r} cannot drive device type {device_type!r}; allowed: {', '.join(allowed_backends(device_type))}"
        )
    return backend


def backend_available(backend: str) -> bool:
    """Whether this process can create a process group on ``backend`` (HCCL needs torch_npu)."""
    import torch.distributed as dist

    if backend == "hccl":
        return importlib.util.find_spec("torch_npu") is not None
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    if backend in checks:
        return bool(checks[backend]())
    if backend == "xccl":
        return bool(getattr(dist, "is_xccl_available", lambda: False)())
    return False


def torch_device(device_type: str, local_index: int) -> str:
    """The torch device string a rank uses: ``cpu`` or ``<type>:<index>``."""
    return "cpu" if device_type == "cpu" else f"{device_type}:{local_index}"
