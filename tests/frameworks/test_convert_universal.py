"""Converting to and from DeepSpeed's universal checkpoint, checked against DeepSpeed's own tools.

References: `ds_to_universal` run on the same source (tensor by tensor), and DeepSpeed's engine
loading our universal output with `"checkpoint": {"load_universal": true}` at another dp size (and
our DeepSpeed output written from a universal checkpoint with its plain loader), then training on.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from ds_checkpoint_fixtures import (DSCheckpointSpec, deepspeed_checkpoints, load_and_probe,  # noqa: F401
                                    universal_reference)

from checkpoint import safe_load
from checkpoint.api import LayoutRequest, convert, detect_format, read_index
from checkpoint.errors import PlanError
from checkpoint.manifest import verify_manifest
from checkpoint.formats.universal import LATEST

pytestmark = pytest.mark.slow

SOURCES = [  # shared with tests/frameworks/test_convert_deepspeed.py: trained once per session
    DSCheckpointSpec(world_size=4, stage=1, dtype="fp32"),
    DSCheckpointSpec(world_size=3, stage=2, dtype="bf16"),
    DSCheckpointSpec(world_size=3, stage=3, dtype="fp32"),
]


def _our_universal(dst: Path) -> dict[str, dict[str, torch.Tensor]]:
    tag_dir = dst / (dst / LATEST).read_text().strip()
    kinds = ("fp32", "exp_avg", "exp_avg_sq")
    return {d.name: {k: torch.load(d / f"{k}.pt", weights_only=True)["param"] for k in kinds}
            for d in sorted((tag_dir / "zero").iterdir()) if d.is_dir()}


def _assert_same(got: dict, ref: dict, where: str) -> None:
    assert sorted(got) == sorted(ref), where
    for name in ref:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = got[name][kind].reshape(-1), ref[name][kind].reshape(-1)  # ds_to_universal keeps ZeRO-3 flat
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {name} {kind} differs"


@pytest.mark.parametrize("spec", SOURCES, ids=lambda s: s.name)
def test_deepspeed_to_universal_equals_ds_to_universal(spec, deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(spec)
    ref = universal_reference(src, tmp_path / "ref" / "global_step3_universal")
    for stage in (1, 3):
        dst = tmp_path / f"uni_z{stage}"
        convert(src, dst, to="deepspeed_universal", target=LayoutRequest(zero_stage=stage))
        assert verify_manifest(dst) == []
        assert detect_format(dst) == "deepspeed-universal"
        _assert_same(_our_universal(dst), ref, f"{spec.name} -> universal (z{stage} names)")
        steps = {n: torch.load(p, weights_only=True) for n, p in
                 ((p.parent.name, p) for p in (dst / "global_step3_universal" / "zero").glob("*/step.pt"))}
        assert sorted(steps) == sorted(ref) and all(float(s) == spec.steps for s in steps.values())
    # ds_to_universal's own output reads back as the same index (tensors, shapes, dtypes)
    ours = {(e.key, e.shape, e.dtype) for e in read_index(tmp_path / "uni_z3").entries}
    theirs = read_index(tmp_path / "ref" / "global_step3_universal")
    assert {(e.key, e.shape, e.dtype) for e in theirs.entries if e.key.kind.value != "param"} <= ours


LOADS = [  # (source, universal written for stage, load at dp, stage): dp changes, and 1/2 <-> 3 both ways
    (SOURCES[0], 1, 2, 1),
    (SOURCES[2], 3, 2, 3),
    (SOURCES[0], 3, 3, 3),
    (SOURCES[1], 2, 2, 2),
]


@pytest.mark.parametrize("spec,written,dp,stage", LOADS,
                         ids=lambda v: v.name if isinstance(v, DSCheckpointSpec) else str(v))
def test_deepspeed_loads_our_universal_at_another_dp_and_continues(spec, written, dp, stage, deepspeed_checkpoints,
                                                                  tmp_path):
    src = deepspeed_checkpoints(spec)
    dst = tmp_path / "universal"
    convert(src, dst, to="deepspeed_universal", target=LayoutRequest(zero_stage=written))
    ref = universal_reference(src, tmp_path / "ref" / "global_step3_universal")
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype=spec.dtype, work=tmp_path / "load", universal=True)
    _assert_same(loaded.params, ref, f"{spec.name} -> universal -> DeepSpeed z{stage} dp{dp}")
    model_states = safe_load.load(next((src / "global_step3").glob("*model_states.pt")))
    assert loaded.meta["global_steps"] == spec.steps
    assert loaded.meta["optimizer_step"] == [float(spec.steps)]
    assert loaded.meta["scheduler"] == model_states["lr_scheduler"]
    assert loaded.meta["client"] == {"data_position": model_states["data_position"], "note": "fixture"}
    source_probe = json.loads((src / "fixture.json").read_text())["probe_loss"]
    assert math.isclose(loaded.probe_loss, source_probe, rel_tol=1e-2 if spec.dtype == "bf16" else 1e-5)
    assert math.isfinite(loaded.probe_after_step) and loaded.probe_after_step != loaded.probe_loss


@pytest.mark.parametrize("dp,stage", [(2, 1), (3, 2), (2, 3)])
def test_universal_to_deepspeed_loads_in_deepspeeds_engine(dp, stage, deepspeed_checkpoints, tmp_path):
    spec = SOURCES[0]
    src = deepspeed_checkpoints(spec)
    theirs = tmp_path / "ref" / "global_step3_universal"  # DeepSpeed's own universal output is the source
    ref = universal_reference(src, theirs)
    dst = tmp_path / "ds"
    convert(theirs, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
    assert verify_manifest(dst) == []
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype=spec.dtype, work=tmp_path / "load")
    _assert_same(loaded.params, ref, f"universal -> DeepSpeed z{stage} dp{dp}")
    assert loaded.meta["global_steps"] == spec.steps and loaded.meta["optimizer_step"] == [float(spec.steps)]
    source_probe = json.loads((src / "fixture.json").read_text())["probe_loss"]
    assert math.isclose(loaded.probe_loss, source_probe, rel_tol=1e-5)


def test_universal_without_adam_state_is_refused(tmp_path):
    """A weights-only source cannot become a universal checkpoint: DeepSpeed's loader needs the moments."""
    from checkpoint.formats.universal import universal_target
    from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorEntry, TensorKey

    entry = TensorEntry(key=TensorKey(name="w", kind=Kind.PARAM), shape=(2,), dtype="float32",
                        chunks=(ChunkRef(file="m.pt", key=("w",), offsets=(0,), lengths=(2,)),))
    index = CheckpointIndex(format="hf", root=str(tmp_path), entries=(entry,), files=("m.pt",),
                            meta={"train_state": {"step": 3, "param_names": ["w"]}})
    with pytest.raises(PlanError, match=r"Adam moments of every param.*\['w'\]"):
        universal_target(index, zero_stage=1, dp=1)
