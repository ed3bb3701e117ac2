"""Test-session settings and shared fixtures.

Environment: W&B offline and quiet, Ray without auth token, DeepSpeed on the CPU
accelerator. One embedded Ray cluster per test file (``ray_session``): Ray start costs
seconds, so the tests of a file share it.

Tiers, one folder each: ``unit`` (one process), ``multiprocess`` (child processes, no
framework), ``frameworks`` (checkpoints a real framework wrote or loads), ``accelerator``
(a GPU or NPU). A unit or multiprocess test that asks for a framework's checkpoint is
refused at collection; a test that asks for one is marked ``slow``, every accelerator test
``accelerator``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

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


# Session fixtures whose checkpoints a real framework writes (tests/workload_fixtures.py, ds_checkpoint_fixtures.py).
FRAMEWORK_FIXTURES = frozenset({"deepspeed_checkpoint", "deepspeed_checkpoints", "fsdp_checkpoint", "megatron_checkpoint",
                                "megatron_legacy_checkpoint", "workload_extensions_dir"})
TIERS = ("unit", "multiprocess", "frameworks", "accelerator")


def _tier(item: pytest.Item) -> str:
    return item.path.parent.name


COSTS = Path(__file__).with_name("file_costs.json")


def _test_file(nodeid: str) -> str:
    """The test file of a node id, relative to the root (`tests/unit/test_x.py::test_y[z]` -> `tests/unit/test_x.py`)."""
    return nodeid.split("::")[0]


def _file_costs() -> dict[str, float]:
    """Seconds each test file took (setup, call and teardown of its tests), as `--record-file-costs` wrote them."""
    return json.loads(COSTS.read_text()) if COSTS.exists() else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-file-costs", action="store_true",
                     help="write each test file's seconds into tests/file_costs.json (the order the files run in)")


_seconds_by_file: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_by_file[_test_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under --record-file-costs the process that sees every test's report (xdist's controller, or the one
    process under `-n 0`) writes the seconds of the files that ran into tests/file_costs.json (run the whole
    suite: a file's cost is what its tests took in this run)."""
    if not session.config.getoption("--record-file-costs") or hasattr(session.config, "workerinput"):
        return
    costs = _file_costs()
    costs.update({path: round(seconds) for path, seconds in _seconds_by_file.items()})
    COSTS.write_text(json.dumps(dict(sorted(costs.items())), indent=0) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = [f"{item.nodeid} (tier {_tier(item)!r} asks for {sorted(FRAMEWORK_FIXTURES & set(item.fixturenames))})"
                 for item in items if _tier(item) in ("unit", "multiprocess")
                 and FRAMEWORK_FIXTURES & set(getattr(item, "fixturenames", ()))]
    outside = [f"{item.nodeid} (not in a tier's folder: {', '.join(TIERS)})" for item in items if _tier(item) not in TIERS]
    if misplaced or outside:
        raise pytest.UsageError("tests in the wrong tier: " + "; ".join(misplaced + outside))
    # The costliest files first (tests/file_costs.json; `--no-loadscope-reorder` in addopts keeps this order under
    # xdist): a worker takes the next file when it is nearly done with its own, so the last files to start are
    # the short ones and neither worker waits long for the other at the end. Unlisted files count 1 s a test.
    costs = _file_costs()
    per_file = Counter(_test_file(item.nodeid) for item in items)
    cost = {path: costs.get(path, count) for path, count in per_file.items()}
    items.sort(key=lambda item: (-cost[_test_file(item.nodeid)], _test_file(item.nodeid)))
    for item in items:
        if _tier(item) == "accelerator":
            item.add_marker(pytest.mark.accelerator)
        if FRAMEWORK_FIXTURES & set(getattr(item, "fixturenames", ())):  # its session's first use launches a framework
            item.add_marker(pytest.mark.slow)
    if _accelerator_present():
        return
    skip = pytest.mark.skip(reason="needs a GPU or NPU; none present")
    for item in items:
        if "accelerator" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_session():
    """An embedded Ray cluster with 8 logical CPUs, shared by the tests of one file. Kept for the whole session it
    sat idle from the first file using it to the end, its raylet, agents and up to eight idle workers polling:
    3-6 s of CPU a minute, more than the 5 s a cluster costs to start."""
    from migrate.runtime.ray_cluster import connect

    with connect("embedded", num_cpus=8) as conn:
        yield conn


# Local ranks and `migrate` commands (tests/cli_process.py) fork from one server that imported every engine's
# framework, the HF Trainer and the CLI once (instead of 2-15 s of imports per rank, launch and command).
from migrate.runtime.worker_group import warm_local_ranks  # noqa: E402
from migrate.workload.engines import engine_modules  # noqa: E402
from tests.cli_process import PRELOAD as CLI_PRELOAD  # noqa: E402
from tests.hf_trainer_fixtures import PRELOAD as HF_TRAINER_PRELOAD  # noqa: E402

warm_local_ranks(*engine_modules("megatron"), *engine_modules("deepspeed"), *engine_modules("fsdp"),
                 *HF_TRAINER_PRELOAD, *CLI_PRELOAD)

# Checkpoints written by the real engines, made once per session and shared.
from workload_fixtures import (deepspeed_checkpoint, fsdp_checkpoint, megatron_checkpoint,  # noqa: E402,F401
                               megatron_legacy_checkpoint, workload_extensions_dir)
