"""Domain errors of the checkpoint library; every message names the file, tensor or field involved."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: something about a checkpoint or a conversion is wrong."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint on disk is missing files, truncated, or its contents contradict its metadata."""


class LayoutMismatchError(CheckpointError):
    """A checkpoint's actual layout differs from the layout it was declared to have."""


class PlanError(CheckpointError):
    """The planner cannot map the source onto the target (missing tensor, shape mismatch, gap)."""


class DestinationError(CheckpointError):
    """The destination is not usable: not empty, not writable, or the disk filled up."""


class UntrustedCheckpointError(CheckpointError):
    """A pickle in the checkpoint needs a class outside the allow-list (pass trust_checkpoint to load it)."""


class OtherPlanError(DestinationError):
    """The destination holds an unfinished conversion of another plan (it cannot be resumed, only replaced)."""
