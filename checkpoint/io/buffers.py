"""Tensor buffers: zero-filled ones that cost nothing until touched, and their bytes without a copy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy
import torch


def bytes_of(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-d tensor, without a copy."""
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor from calloc'd memory (untouched pages cost nothing; big ones go back to the
    system when freed) rather than torch's fill, which wakes its whole thread pool for every buffer."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(numpy.zeros(max(nbytes, 1), dtype=numpy.uint8))[:nbytes].view(dtype).reshape(tuple(shape))
