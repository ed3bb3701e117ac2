"""No code runs from a checkpoint: a pickle payload in any pickled file of any format is refused.

Each case copies a checkpoint the real framework wrote (DeepSpeed ZeRO-2 and ZeRO-3, Megatron-Core
torch_dist and Megatron-LM legacy files, FSDP2 + DCP, a universal checkpoint), plants a payload (an
object whose unpickling runs `exec`, writing a marker file) into one pickled file, and runs
`migrate inspect`, `migrate convert` and the pre-load scan the resume and train stages use. Each must
exit 2 (or raise) naming the file, write nothing, and never run the payload; `--trust-checkpoint`
is the only way round (and then the payload does run, which shows it was planted where it is read).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import torch
from click.testing import CliRunner

from checkpoint import safe_load
from checkpoint.errors import UntrustedCheckpointError
from checkpoint.state.faults import _splice_objects
from migrate.cli import main as cli

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this runs code: it writes `marker` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


def _resave(path: Path, marker: Path, edit: Callable[[Any, Payload], Any] | None = None) -> None:
    obj = torch.load(path, map_location="cpu", weights_only=False)
    payload = Payload(marker)
    if edit is not None:
        obj = edit(obj, payload)
    elif isinstance(obj, dict):
        obj["notes"] = payload
    else:
        obj = {"param": obj, "notes": payload}
    torch.save(obj, path)


def _metadata(root: Path, marker: Path) -> None:
    md = safe_load.read_dcp_metadata(root)
    md.notes = Payload(marker)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def _object(pattern: str) -> Callable[[Path, Path], None]:
    """Replace the first DCP value whose key contains `pattern` with a payload (shifting the rest)."""

    def plant(root: Path, marker: Path) -> None:
        import io

        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = safe_load.read_dcp_metadata(root)
        fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
                   and pattern in k)
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        _splice_objects(root, {fqn: buf.getvalue()})

    return plant


def _file(rel: str, edit: Callable[[Any, Payload], Any] | None = None) -> Callable[[Path, Path], None]:
    def plant(root: Path, marker: Path) -> None:
        matches = sorted(root.glob(rel))
        assert matches, f"{rel} not in {root}"
        _resave(matches[0], marker, edit)

    return plant


def _bucket(obj: Any, payload: Payload) -> Any:  # distrib_optim.pt: {buckets_coalesced, gbuf: {...}}
    obj["notes"] = payload
    return obj


def _universal(deepspeed_checkpoint: Any, tmp: Path) -> Path:
    from checkpoint.api import convert

    src = deepspeed_checkpoint(2, 2).path
    out = tmp / "universal"
    if not out.exists():
        convert(src, out, to="deepspeed_universal")
    return out


SOURCES: dict[str, Callable[..., Path]] = {
    "deepspeed_z2": lambda f, tmp: f["deepspeed_checkpoint"](2, 2).path,
    "deepspeed_z3": lambda f, tmp: f["deepspeed_checkpoint"](2, 3).path,
    "megatron": lambda f, tmp: f["megatron_checkpoint"](1, 1, 2).path,
    "megatron_legacy": lambda f, tmp: f["megatron_legacy_checkpoint"](1, 2, 1).path,
    "dcp": lambda f, tmp: f["fsdp_checkpoint"](2).path,
    "universal": lambda f, tmp: _universal(f["deepspeed_checkpoint"], tmp),
}

# (source, where the payload goes, the file the error must name, planter)
PLACEMENTS = [
    ("deepspeed_z2", "model states", "mp_rank_00_model_states.pt", _file("global_step*/mp_rank_00_model_states.pt")),
    ("deepspeed_z2", "optimizer shard of rank 1", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
     _file("global_step*/*zero_pp_rank_1_mp_rank_00_optim_states.pt")),
    ("deepspeed_z3", "ZeRO-3 model states of rank 1", "zero_pp_rank_1_mp_rank_00_model_states.pt",
     _file("global_step*/zero_pp_rank_1_mp_rank_00_model_states.pt")),
    ("deepspeed_z3", "ZeRO-3 optimizer shard", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
     _file("global_step*/*zero_pp_rank_0_mp_rank_00_optim_states.pt")),
    ("megatron", ".metadata", ".metadata", lambda root, m: _metadata(root, m)),
    ("megatron", "common.pt", "common.pt", _file("common.pt")),
    ("megatron", "an _extra_state object", ".distcp", _object("._extra_state/")),
    ("megatron", "an rng_state object", ".distcp", _object("rng_state")),
    ("megatron", "the optimizer's param groups object", ".distcp", _object("optimizer/shard")),
    ("megatron_legacy", "rank 0's model_optim_rng.pt", "mp_rank_00_000/model_optim_rng.pt",
     _file("mp_rank_00_000/model_optim_rng.pt")),
    ("megatron_legacy", "rank 1's model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt",
     _file("mp_rank_00_001/model_optim_rng.pt")),
    ("megatron_legacy", "distrib_optim.pt", "mp_rank_00_001/distrib_optim.pt",
     _file("mp_rank_00_001/distrib_optim.pt", _bucket)),
    ("dcp", ".metadata", ".metadata", lambda root, m: _metadata(root, m)),
    ("dcp", "a stored value (the LR scheduler)", ".distcp", _object("lr_scheduler")),
    ("universal", "model states", "mp_rank_00_model_states.pt", _file("*/mp_rank_00_model_states.pt")),
    ("universal", "the optimizer state file", "optimizer_state.pt", _file("*/zero/optimizer_state.pt")),
    ("universal", "a param's fp32 master", "fp32.pt", _file("*/zero/*/fp32.pt")),
    ("universal", "a param's exp_avg", "exp_avg.pt", _file("*/zero/*/exp_avg.pt")),
]


@pytest.fixture
def planted(request, tmp_path, tmp_path_factory):
    fixtures = {name: request.getfixturevalue(name) for name in
                ("deepspeed_checkpoint", "megatron_checkpoint", "megatron_legacy_checkpoint", "fsdp_checkpoint")}

    def make(source: str, plant: Callable[[Path, Path], None]) -> tuple[Path, Path]:
        original = SOURCES[source](fixtures, tmp_path_factory.getbasetemp())
        root = tmp_path / "src"
        shutil.copytree(original.parent if source == "megatron_legacy" else original, root, symlinks=True)
        ckpt = root / original.name if source == "megatron_legacy" else root
        marker = tmp_path / "PAYLOAD_RAN"
        plant(ckpt, marker)
        return ckpt, marker

    return make


@pytest.mark.parametrize("source,where,named,plant", PLACEMENTS, ids=[f"{s}:{w}" for s, w, _, _ in PLACEMENTS])
def test_payload_is_refused_everywhere_and_never_runs(planted, tmp_path, source, where, named, plant):
    ckpt, marker = planted(source, plant)
    runner = CliRunner()
    inspect = runner.invoke(cli, ["inspect", str(ckpt)])
    assert inspect.exit_code == 2, inspect.output
    assert named in inspect.stderr and ("refusing" in inspect.stderr or "needs" in inspect.stderr), inspect.stderr
    assert "Traceback" not in inspect.output
    out = tmp_path / "out"
    convert = runner.invoke(cli, ["convert", str(ckpt), str(out), "--to", "dcp" if source != "dcp" else "deepspeed"])
    assert convert.exit_code == 2, convert.output
    assert named in convert.stderr, convert.stderr
    assert not out.exists()
    with pytest.raises(UntrustedCheckpointError, match=named.replace(".", r"\.")):
        safe_load.check_pickles(ckpt)  # what the resume and train stages run before a framework loads it
    assert not marker.exists(), "the payload ran"
    if "_extra_state" in where:  # copied verbatim, never unpickled by us: only Megatron-Core's load would run it
        return
    trusted = runner.invoke(cli, ["inspect", str(ckpt), "--trust-checkpoint"])
    assert marker.exists(), f"the payload was not where it is read ({trusted.output})"


def test_payload_in_a_real_torch_metadata_never_imports_anything(tmp_path):
    """The allow-list unpickler resolves no global outside DCP's metadata classes, not even a harmless one."""
    from checkpoint.errors import CheckpointFormatError

    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": Path("/etc")}) + b"")
    with pytest.raises(CheckpointFormatError, match="not DCP Metadata"):
        safe_load.read_dcp_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(shutil.rmtree))
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: refusing to unpickle shutil\.rmtree"):
        safe_load.read_dcp_metadata(tmp_path)
