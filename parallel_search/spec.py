"""What the search plans for besides the model (`checkpoint.model_shape.ModelShape`, the one model shape): the
training recipe and the cluster.

These are the library's own frozen values (the orchestrator maps its job sections onto
them); every field is checked on construction and errors print every number involved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


class SpecError(ValueError):
    """A training or cluster description whose numbers do not fit together."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingShape:
    """Batch sizes and precision; the micro batch is part of each candidate."""

    global_batch_size: int
    precision: Precision = "bf16"

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise SpecError(f"training.global_batch_size={self.global_batch_size} must be >= 1")
        if self.precision not in BYTES_PER_ELEMENT:
            raise SpecError(f"training.precision={self.precision!r}: expected one of {sorted(BYTES_PER_ELEMENT)}")

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterShape:
    """How many devices, how many per node (links inside a node are faster)."""

    device_count: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.device_count < 1 or self.devices_per_node < 1:
            raise SpecError(f"cluster: device_count({self.device_count}) and devices_per_node({self.devices_per_node}) "
                            "must be >= 1")
        if self.device_count % self.devices_per_node and self.devices_per_node < self.device_count:
            raise SpecError(f"cluster: device_count({self.device_count}) is not a multiple of "
                            f"devices_per_node({self.devices_per_node})")

    @property
    def per_node(self) -> int:
        return min(self.devices_per_node, self.device_count)
