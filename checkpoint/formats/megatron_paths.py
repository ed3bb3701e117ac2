"""Megatron-LM's names on disk, in one place (`megatron/training/checkpointing.py`): the tracker file beside the
iteration directories, an iteration's directory, and the legacy format's per-rank directory and files."""

from __future__ import annotations

import re

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""The tracker in a save directory: the latest iteration's number, or `release`."""

MODEL_FILE = "model_optim_rng.pt"
"""Legacy format (`--ckpt-format torch`): a rank's model, optimizer, scheduler, RNG and args."""

OPTIM_FILE = "distrib_optim.pt"
"""Legacy format: the distributed optimizer's parameter state (`save_parameter_state`)."""

RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
"""A legacy per-rank directory: tp rank, then the pp rank when pp > 1, then the ep rank when ep > 1."""


def iteration_dir_name(iteration: int) -> str:
    """The directory of a checkpoint of `iteration` (`get_checkpoint_name`): `iter_0000042`."""
    return f"iter_{int(iteration):07d}"


def rank_dir(*, tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """A legacy per-rank directory: `mp_rank_XX`, `_YYY` when pp > 1, `_EEE` when ep > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
