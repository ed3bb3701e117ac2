"""Session-scoped fixtures with checkpoints written by the real engines.

Import them in tests/conftest.py (`from tests.workload_fixtures import *` or by name).
`deepspeed_checkpoint(world_size, zero_stage, dtype="fp32", steps=2)` trains once per
distinct argument tuple per test run and returns a `TrainedCheckpoint` (its `.path` is the
DeepSpeed save dir holding `latest` and `global_step<steps>/`).

Under pytest-xdist the workers share these checkpoints (`built_once`): the first worker to ask for
one trains it, the others wait for it and read it.
"""
from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

from migrate.workload import fixtures
from migrate.workload.fixtures import TrainedCheckpoint

__all__ = ["deepspeed_checkpoint", "megatron_checkpoint", "megatron_legacy_checkpoint", "fsdp_checkpoint",
           "workload_extensions_dir", "built_once"]

T = TypeVar("T")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s result, built once per test run and shared by every xdist worker: the first worker to
    ask builds into `<run's temp root>/built_once/<name>` under a file lock and records the result beside it
    (pickled: this run's own objects, read back only by this run's workers); the others wait on the lock and
    read the record. A build that raised leaves no record, so the next worker to ask builds again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's popen-gwN
    shared = root / "built_once"
    shared.mkdir(exist_ok=True)
    folder, record = shared / name, shared / f"{name}.pickle"
    with FileLock(str(shared / f"{name}.lock")):
        if record.exists():
            return pickle.loads(record.read_bytes())
        if folder.exists():
            shutil.rmtree(folder)  # what a build that raised left behind
        folder.mkdir()
        result = build(folder)
        partial = shared / f"{name}.pickle.partial"
        partial.write_bytes(pickle.dumps(result))
        partial.replace(record)
        return result


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
            cache[key] = built_once(tmp_path_factory, f"ds_ws{world_size}_z{zero_stage}_{dtype}_s{steps}",
                                    lambda folder: fixtures.make_deepspeed_checkpoint(folder, *key))
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
            name = f"mcore_tp{tp}_pp{pp}_dp{dp}_ep{ep}{'_moe' if moe else ''}_s{steps}_gbs{global_batch_size}"
            cache[key] = built_once(tmp_path_factory, name, lambda folder: fixtures.make_megatron_checkpoint(
                folder, tp=tp, pp=pp, dp=dp, ep=ep, moe=moe, steps=steps, global_batch_size=global_batch_size))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory):
    """`get(world_size, steps=2)` -> TrainedCheckpoint of an FSDP2 DCP checkpoint."""
    cache: dict[tuple, TrainedCheckpoint] = {}

    def get(world_size: int, steps: int = 2) -> TrainedCheckpoint:
        key = (world_size, steps)
        if key not in cache:
            cache[key] = built_once(tmp_path_factory, f"fsdp_ws{world_size}_s{steps}",
                                    lambda folder: fixtures.make_fsdp_checkpoint(folder, world_size=world_size,
                                                                                 steps=steps))
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

            def build(folder: Path) -> TrainedCheckpoint:
                spec = RunSpec(engine="megatron", model=TINY_MIXTRAL if moe else TINY_LLAMA, steps=4, tp=tp, pp=pp,
                               ep=ep, save_every=2, distributed_optimizer=distributed_optimizer,
                               checkpoint_format="torch", save_dir=str(folder),
                               train=TrainSpec(global_batch_size=global_batch_size, precision=precision))
                results = launch(spec, tp * pp * dp)
                return TrainedCheckpoint(path=Path(iteration_dir(str(folder), 2)), spec=spec,
                                         world_size=tp * pp * dp, results=tuple(results))

            cache[key] = built_once(tmp_path_factory,
                                    f"mlegacy_tp{tp}_pp{pp}_dp{dp}_ep{ep}_{kind}_gbs{global_batch_size}", build)
        return cache[key]

    return get
