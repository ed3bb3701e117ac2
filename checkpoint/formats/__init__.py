"""Readers and writers of the checkpoint formats the converter supports: the format table.

`FORMATS` lists one `CheckpointFormat` per format module, in detection order (the first whose
`detect` accepts a path wins, so more specific formats come first). Adding a format is one line here.
"""

from __future__ import annotations

from checkpoint.formats import dcp, deepspeed, hf, megatron, megatron_legacy, universal
from checkpoint.formats.base import CheckpointFormat, ReadOptions, TargetOptions

FORMATS: tuple[CheckpointFormat, ...] = (
    universal.SPEC,  # before deepspeed: a universal tag directory also holds *model_states.pt
    deepspeed.SPEC,
    megatron_legacy.SPEC,  # mp_rank_*/model_optim_rng.pt directories
    megatron.SPEC,  # before dcp: a torch_dist checkpoint is also a DCP directory
    dcp.SPEC,
    hf.SPEC,
)

# Earlier spellings of format names, accepted (with a note) until migrate 0.3.
FORMAT_ALIASES: dict[str, str] = {"deepspeed_universal": "deepspeed-universal", "megatron_legacy": "megatron-legacy"}

__all__ = ["FORMATS", "FORMAT_ALIASES", "CheckpointFormat", "ReadOptions", "TargetOptions"]
