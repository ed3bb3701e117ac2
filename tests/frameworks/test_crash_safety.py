"""kill -9 at random points of real conversions: nothing a loader takes for complete is ever left behind.

For each target format (and with worker processes) a `migrate convert` process (tests/cli_process.py) is
killed with SIGKILL at a random moment of its write phase, over several seeds (then at its start, until one
kill lands before the end). After each kill: the source is byte-for-byte unchanged; the destination is either finished (its
manifest verifies) or refused by our reader and by the target framework's own entry point (DeepSpeed's
zero_to_fp32 reads `latest`, DCP's loader `.metadata`, Megatron-LM's tracker, then Megatron-Core's
`check_is_distributed_checkpoint`, safetensors the weights file); no worker outlives its coordinator; a
plain rerun names the unfinished conversion, and `--resume` finishes it into the same files an
uninterrupted conversion writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from collections.abc import Callable

import psutil
import pytest
from click.testing import CliRunner

from checkpoint.api import read_index
from checkpoint.destination import INCOMPLETE, MANIFEST
from checkpoint.errors import CheckpointError
from checkpoint.manifest import verify_manifest
from migrate.cli import main as cli
from tests.cli_process import MigrateProcess, start_migrate

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _deepspeed_accepts(dest: Path) -> bool:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        get_fp32_state_dict_from_zero_checkpoint(str(dest))
    except Exception:  # noqa: BLE001 - any refusal of DeepSpeed's own reader
        return False
    return True


def _dcp_accepts(dest: Path) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        dcp_to_torch_save(str(dest), str(dest.parent / f"{dest.name}.probe.pt"))
    except (Exception, CheckpointException):  # noqa: BLE001 - DCP's own error derives from BaseException
        return False
    return True


def _megatron_iteration_dir(dest: Path) -> Path | None:
    """Where Megatron-LM's load_checkpoint starts: the tracker file names the iteration directory."""
    tracker = dest / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    return dest / f"iter_{int(tracker.read_text().strip()):07d}"


def _megatron_accepts(dest: Path) -> bool:
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    it = _megatron_iteration_dir(dest)
    return it is not None and bool(check_is_distributed_checkpoint(str(it)))


def _legacy_accepts(dest: Path) -> bool:
    it = _megatron_iteration_dir(dest)
    return it is not None and (it / "mp_rank_00" / "model_optim_rng.pt").is_file()


def _universal_accepts(dest: Path) -> bool:  # DeepSpeed's load_checkpoint(load_universal=True) reads latest_universal
    return (dest / "latest_universal").is_file()


def _hf_accepts(dest: Path) -> bool:
    """transformers' `from_pretrained` starts from `config.json`, then loads the weights file (a complete
    `model.safetensors` alone, renamed into place before the manifest, is no loadable HF model)."""
    from safetensors.torch import load_file

    if not (dest / "config.json").is_file():
        return False
    try:
        load_file(str(dest / "model.safetensors"))
    except Exception:  # noqa: BLE001
        return False
    return True


# (case id, source fixture call, convert options, the target framework's entry point)
CASES: list[tuple[str, Callable[[dict], Path], list[str], Callable[[Path], bool]]] = [
    ("deepspeed", lambda f: f["deepspeed_checkpoint"](2, 2).path, ["--to", "deepspeed", "--dp", "4", "--zero-stage", "3"],
     _deepspeed_accepts),
    ("deepspeed-workers", lambda f: f["deepspeed_checkpoint"](2, 2).path,
     ["--to", "deepspeed", "--dp", "4", "--zero-stage", "1", "--workers", "2"], _deepspeed_accepts),
    ("universal", lambda f: f["deepspeed_checkpoint"](2, 2).path, ["--to", "deepspeed_universal"], _universal_accepts),
    ("dcp", lambda f: f["megatron_checkpoint"](1, 1, 2).path, ["--to", "dcp", "--dp", "4"], _dcp_accepts),
    ("megatron", lambda f: f["megatron_checkpoint"](1, 1, 2).path, ["--to", "megatron", "--tp", "2", "--dp", "1"],
     _megatron_accepts),
    ("megatron-legacy", lambda f: f["megatron_checkpoint"](1, 1, 2).path, ["--to", "megatron-legacy", "--pp", "2",
                                                                            "--dp", "1"], _legacy_accepts),
    ("hf", lambda f: f["megatron_checkpoint"](1, 1, 2).path, ["--to", "hf"], _hf_accepts),
]


def _run(src: Path, dest: Path, options: list[str]) -> MigrateProcess:
    return start_migrate(["convert", str(src), str(dest), *options], env={**os.environ, "OMP_NUM_THREADS": "1"})


def _write_seconds(src: Path, dest: Path, options: list[str]) -> float:
    """An uninterrupted conversion (the reference output); how long its write phase took."""
    proc = _run(src, dest, options)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    return float(re.search(rb"in ([0-9.]+) s to", out).group(1))


def _kill_during_writes(src: Path, dest: Path, options: list[str], delay: float) -> list[psutil.Process]:
    """Start a conversion, wait for its marker (the write phase began), sleep `delay`, SIGKILL it; return the
    processes it had started (workers), for the test to check that none survives."""
    proc = _run(src, dest, options)
    deadline = time.monotonic() + 120
    while not (dest / INCOMPLETE).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    proc.kill()
    proc.communicate()
    return children


@pytest.fixture
def engines(request):
    return {name: request.getfixturevalue(name) for name in ("deepspeed_checkpoint", "megatron_checkpoint")}


def _files(root: Path) -> dict[str, str]:
    """A finished output's files and their checksums from its manifest (DCP's metadata holds a fresh save id)."""
    return {k: v for k, v in json.loads((root / MANIFEST).read_text())["files"].items() if not k.endswith(".metadata")}


def _kill_and_judge(src: Path, dest: Path, options: list[str], delay: float, reference: Path,
                    framework_accepts: Callable[[Path], bool], label: str) -> str:
    """Kill a conversion `delay` s into its writes and judge what it left; the outcome in words. An unfinished
    output must be refused by a plain rerun and finished by `--resume` into the uninterrupted run's files."""
    before = digest(src)
    workers = _kill_during_writes(src, dest, options, delay)
    gone_by = time.monotonic() + 5
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE], \
        f"{label}: workers outlived the killed coordinator"
    assert digest(src) == before, f"{label}: the source changed"
    if not dest.exists():
        return "nothing written"
    if not (dest / INCOMPLETE).exists() and (dest / MANIFEST).is_file():
        assert verify_manifest(dest) == [], label
        return "finished"
    with pytest.raises(CheckpointError, match="unfinished conversion"):
        read_index(dest)
    if framework_accepts(dest):  # only once every file it points at is in place (commit files last)
        problems = verify_manifest(dest)
        assert problems and all(INCOMPLETE in p for p in problems), f"{label}: {problems}"
        outcome = "committed, marker left"
    else:
        outcome = "refused"
    plain = CliRunner().invoke(cli, ["convert", str(src), str(dest), *options])
    assert plain.exit_code == 2 and "unfinished conversion" in plain.stderr and "--resume" in plain.stderr
    resumed = CliRunner().invoke(cli, ["convert", str(src), str(dest), *options, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert verify_manifest(dest) == []
    assert _files(dest) == _files(reference), f"{label}: the resumed output differs from an uninterrupted one"
    assert read_index(dest).format == read_index(reference).format
    return outcome


# Kills at the start of the writes, after the seeds' random ones, until one interrupts a conversion: a write
# phase of a few tens of milliseconds (HF's) can end before a random kill lands on a loaded machine.
EARLY_KILLS = 3


@pytest.mark.parametrize("case,source,options,framework_accepts", CASES, ids=[c[0] for c in CASES])
def test_kill_at_random_points_leaves_nothing_that_looks_complete(engines, tmp_path, case, source, options,
                                                                  framework_accepts):
    src = source(engines)
    reference = tmp_path / "reference"
    write_s = _write_seconds(src, reference, options)
    kills = [(f"seed {seed}", random.Random(f"{case}-{seed}").uniform(0, 1.3 * write_s + 0.02)) for seed in SEEDS]
    outcomes = []
    while kills:
        name, delay = kills.pop(0)
        outcomes.append(_kill_and_judge(src, tmp_path / f"out{len(outcomes)}", options, delay, reference,
                                        framework_accepts, f"{case} {name} ({delay:.3f} s)"))
        interrupted = "refused" in outcomes or "nothing written" in outcomes
        if not kills and not interrupted and len(outcomes) < len(SEEDS) + EARLY_KILLS:
            kills.append((f"early kill {len(outcomes) - len(SEEDS) + 1}", 0.0))
    assert "refused" in outcomes or "nothing written" in outcomes, (write_s, outcomes)
    print(f"{case}: {outcomes}")


def test_overwrite_replaces_a_crashed_or_finished_output_but_never_foreign_content(engines, tmp_path):
    src = engines["deepspeed_checkpoint"](2, 2).path
    dest = tmp_path / "out"
    _kill_during_writes(src, dest, ["--to", "deepspeed", "--dp", "4"], 0.0)
    runner = CliRunner()
    assert runner.invoke(cli, ["convert", str(src), str(dest), "--to", "deepspeed", "--dp", "2", "--resume"]
                         ).exit_code in (0, 2)  # another plan: refused unless the kill came before the marker
    done = runner.invoke(cli, ["convert", str(src), str(dest), "--to", "deepspeed", "--dp", "2", "--overwrite"])
    assert done.exit_code == 0, done.output
    again = runner.invoke(cli, ["convert", str(src), str(dest), "--to", "deepspeed", "--dp", "2"])
    assert again.exit_code == 2 and "finished conversion" in again.stderr and "--overwrite" in again.stderr
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = runner.invoke(cli, ["convert", str(src), str(foreign), "--to", "deepspeed", "--overwrite"])
    assert refused.exit_code == 2 and "holds no conversion of ours" in refused.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"
    shutil.rmtree(foreign)
