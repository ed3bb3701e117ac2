"""Session-scoped fixtures with checkpoints written by the real engines.

Import them in tests/conftest.py (`from tests.workload_fixtures import *` or by name).
`deepspeed_checkpoint(world_size, zero_stage, dtype="fp32", steps=2)` trains once per
distinct argument tuple per session and returns a `TrainedCheckpoint` (its `.path` is the
DeepSpeed save dir holding `latest` and `global_step<steps>/`).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from migrate.workload import fixtures
from migrate.workload.fixtures import TrainedCheckpoint

__all__ = ["deepspeed_checkpoint", "megatron_checkpoint", "megatron_legacy_checkpoint", "fsdp_checkpoint",
           "workload_extensions_dir"]


@pytest.fixture(scope="session")
def workload_extensions_dir():
    """The TORCH_EXTENSIONS_DIR every rank uses: torch's own per-user cache unless the environment
    names one, so DeepSpeed's shm op compiles once per machine (~30 s), not once per test session."""
    import os

    from torch.utils.cpp_extension import _get_build_directory

    path = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.dirname(_get_build_directory("deepspeed_shm_comm", verbose=False))
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


@pytest.fixture(scope="session")
def deepspeed_checkpoint(tmp_path_factory, workload_extensions_dir):
    cache: dict[tuple, TrainedCheckpoint] = {}

    def get(world_size: int, zero_stage: int, dtype: str = "fp32", steps: int = 2) -> TrainedCheckpoint:
        key = (world_size, zero_stage, dtype, steps)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"ds_ws{world_size}_z{zero_stage}_{dtype}_s{steps}")
            cache[key] = fixtures.make_deepspeed_checkpoint(directory, world_size, zero_stage, dtype, steps)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def megatron_checkpoint(tmp_path_factory):
    """`get(tp, pp, dp, ep=1, moe=False, steps=2, global_batch_size=8)` -> TrainedCheckpoint of a
    torch_dist checkpoint with the distributed optimizer state."""
    cache: dict[tuple, TrainedCheckpoint] = {}

    def get(tp: int, pp: int, dp: int, ep: int = 1, moe: bool = False, steps: int = 2,
            global_batch_size: int = 8) -> TrainedCheckpoint:
        key = (tp, pp, dp, ep, moe, steps, global_batch_size)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"mcore_tp{tp}_pp{pp}_dp{dp}_ep{ep}")
            cache[key] = fixtures.make_megatron_checkpoint(directory, tp=tp, pp=pp, dp=dp, ep=ep, moe=moe, steps=steps,
                                                           global_batch_size=global_batch_size)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory):
    """`get(world_size, steps=2)` -> TrainedCheckpoint of an FSDP2 DCP checkpoint."""
    cache: dict[tuple, TrainedCheckpoint] = {}

    def get(world_size: int, steps: int = 2) -> TrainedCheckpoint:
        key = (world_size, steps)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"fsdp_ws{world_size}")
            cache[key] = fixtures.make_fsdp_checkpoint(directory, world_size=world_size, steps=steps)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def megatron_legacy_checkpoint(tmp_path_factory):
    """`get(tp, pp, dp, distributed_optimizer=True, global_batch_size=8, ep=1, moe=False, precision="fp32")` ->
    TrainedCheckpoint
    of a Megatron-LM legacy per-rank checkpoint (`checkpoint_format="torch"`): one launch trains 4 steps saving at
    step 2 (`.path` is `iter_0000002`) and at 4, so `.losses[2:]` are the uninterrupted steps 3-4 a resume must repeat.
    Import it by name in the test module (tests/conftest.py imports the older fixtures only)."""
    from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL, launch
    from migrate.workload.megatron.state import iteration_dir
    from migrate.workload.run_spec import RunSpec, TrainSpec

    cache: dict[tuple, TrainedCheckpoint] = {}

    def get(tp: int, pp: int, dp: int, distributed_optimizer: bool = True, global_batch_size: int = 8,
            ep: int = 1, moe: bool = False, precision: str = "fp32") -> TrainedCheckpoint:
        key = (tp, pp, dp, distributed_optimizer, global_batch_size, ep, moe, precision)
        if key not in cache:
            kind = ("dist" if distributed_optimizer else "plain") + ("_moe" if moe else "") + f"_{precision}"
            directory = tmp_path_factory.mktemp(f"mlegacy_tp{tp}_pp{pp}_dp{dp}_ep{ep}_{kind}")
            spec = RunSpec(engine="megatron", model=TINY_MIXTRAL if moe else TINY_LLAMA, steps=4, tp=tp, pp=pp, ep=ep,
                           save_every=2, distributed_optimizer=distributed_optimizer, checkpoint_format="torch",
                           save_dir=str(directory), train=TrainSpec(global_batch_size=global_batch_size,
                                                                    precision=precision))
            results = launch(spec, tp * pp * dp)
            cache[key] = TrainedCheckpoint(path=Path(iteration_dir(str(directory), 2)), spec=spec,
                                           world_size=tp * pp * dp, results=tuple(results))
        return cache[key]

    return get
