"""Test-session settings and shared fixtures.

Environment: W&B offline and quiet, Ray without auth token, DeepSpeed on the CPU
accelerator. One embedded Ray cluster per session (``ray_session``): Ray start costs
seconds, so every Ray test shares it.
"""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def _accelerator_present() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except Exception:  # noqa: BLE001
        return False
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _accelerator_present():
        return
    skip = pytest.mark.skip(reason="needs a GPU or NPU; none present")
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray cluster with 8 logical CPUs, shared by the whole test session."""
    from migrate.runtime.ray_cluster import connect

    with connect("embedded", num_cpus=8) as conn:
        yield conn


# Local ranks fork from one server that imported every engine's framework once (instead of 5-15 s of
# imports per rank and launch).
from migrate.runtime.worker_group import warm_local_ranks  # noqa: E402
from migrate.workload.engines import engine_modules  # noqa: E402

warm_local_ranks(*engine_modules("megatron"), *engine_modules("deepspeed"), *engine_modules("fsdp"))

# Checkpoints written by the real engines, made once per session and shared.
from workload_fixtures import (deepspeed_checkpoint, fsdp_checkpoint, megatron_checkpoint,  # noqa: E402,F401
                               megatron_legacy_checkpoint, workload_extensions_dir)
