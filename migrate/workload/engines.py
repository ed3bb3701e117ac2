"""Which per-rank function runs which built-in engine."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from migrate.workload.metrics import RankResult


_ENGINE_MODULES = {
    "deepspeed": ("deepspeed", "migrate.workload.deepspeed_engine"),
    "megatron": ("megatron.core", "migrate.workload.megatron.engine"),
    "fsdp": ("torch.distributed.checkpoint", "migrate.workload.fsdp_engine"),
}


def engine_modules(engine: str) -> tuple[str, ...]:
    """The modules `engine`'s ranks import (for a worker group to load ahead of time)."""
    return _ENGINE_MODULES.get(engine, ())


def rank_entry(engine: str) -> Callable[[Any, Any], RankResult]:
    """The per-rank training function of `engine` (imported lazily: each pulls a big framework)."""
    if engine == "deepspeed":
        from migrate.workload.deepspeed_engine import train_deepspeed
        return train_deepspeed
    if engine == "megatron":
        from migrate.workload.megatron.engine import train_megatron
        return train_megatron
    if engine == "fsdp":
        from migrate.workload.fsdp_engine import train_fsdp
        return train_fsdp
    raise ValueError(f"unknown engine {engine!r}: expected deepspeed, megatron or fsdp")
