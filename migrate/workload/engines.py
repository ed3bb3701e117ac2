"""Which per-rank function runs which built-in engine."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from migrate.workload.metrics import RankResult


# Besides the framework and the engine: what a rank imports later, inside the framework's initialize, model
# build, save and load (about 45 modules a run: 0.03-0.06 s of a rank's 0.15-0.6 s of CPU). The fork server
# skips a name this version of the framework lacks. Nothing here may touch a GPU at import: ranks fork after it.
_RANK_MODULES = ("checkpoint.state.fingerprint", "migrate.workload.state_print")
_ENGINE_MODULES = {
    "deepspeed": ("deepspeed", "migrate.workload.deepspeed_engine", *_RANK_MODULES,
                  "deepspeed.comm.mori", "deepspeed.module_inject.auto_ep_layer", "deepspeed.ops.op_builder.all_ops",
                  "deepspeed.runtime.superoffload.superoffload_stage3", "deepspeed.runtime.zero.muon.muon_optimizer"),
    "megatron": ("megatron.core", "migrate.workload.megatron.engine", *_RANK_MODULES,
                 "migrate.workload.megatron.cpu_adapter", "migrate.workload.megatron_norm",
                 "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.gpt_model",
                 "megatron.core.transformer.multi_latent_attention", "megatron.core.fusions.fused_cross_entropy",
                 "megatron.core.dist_checkpointing.strategies.torch",
                 "megatron.core.dist_checkpointing.strategies.filesystem_async",
                 "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
                 "multiprocessing.managers"),
    "fsdp": ("torch.distributed.checkpoint", "migrate.workload.fsdp_engine", *_RANK_MODULES,
             "torch.distributed.checkpoint.state_dict"),
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
