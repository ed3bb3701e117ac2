"""Which torch.distributed backend serves which device type: the one table of the project.

The worker group reads it to start a process group; the communication adapter (``migrate.comm.backends``)
reads it to select, probe and translate backends. A leaf module: no torch at import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

DEFAULT_BACKEND: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}
"""Device type -> the backend torch (and torch_npu) use by default; its keys are the device types."""

DEVICE_TYPES = tuple(DEFAULT_BACKEND)

BACKEND_DEVICES: Mapping[str, tuple[str, ...]] = {
    "nccl": ("cuda",),
    "hccl": ("npu",),  # Gloo moves only CPU and CUDA tensors
    "gloo": ("cpu", "cuda"),
    "xccl": ("xpu",),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
}
"""Backend -> device types whose tensors it can move."""


class BackendError(ValueError):
    """A backend that cannot drive the chosen device type, or is not installed."""


def _known(device_type: str) -> None:
    if device_type not in DEFAULT_BACKEND:
        raise BackendError(f"device type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")


def default_backend(device_type: str) -> str:
    """The backend a job gets when it says ``backend: auto``."""
    _known(device_type)
    return DEFAULT_BACKEND[device_type]


def allowed_backends(device_type: str) -> tuple[str, ...]:
    """Backends that can drive ``device_type`` (first is the default)."""
    _known(device_type)
    default = DEFAULT_BACKEND[device_type]
    return (default, *(b for b, devices in BACKEND_DEVICES.items() if device_type in devices and b != default))


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
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available,
              "ucc": dist.is_ucc_available}
    if backend in checks:
        return bool(checks[backend]())
    if backend == "xccl":
        return bool(getattr(dist, "is_xccl_available", lambda: False)())
    return False


def torch_device(device_type: str, local_index: int) -> str:
    """The torch device string a rank uses: ``cpu`` or ``<type>:<index>``."""
    return "cpu" if device_type == "cpu" else f"{device_type}:{local_index}"
