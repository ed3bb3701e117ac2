"""Converting real DeepSpeed ZeRO checkpoints to every stage and DP size, checked by DeepSpeed itself.

Sources are trained for real (tests/ds_checkpoint_fixtures.py). References come from DeepSpeed's own
tools (`ds_to_universal`, `zero_to_fp32`) and from DeepSpeed's engine loading the converted
checkpoint at the target layout and training on.
"""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from ds_checkpoint_fixtures import (DSCheckpointSpec, deepspeed_checkpoints, load_and_probe,  # noqa: F401
                                    universal_reference, zero_to_fp32_reference)

from checkpoint import safe_load
from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.manifest import verify_manifest
from checkpoint.materialize import iter_tensors

pytestmark = pytest.mark.slow

# every stage, both precisions, every world size 1..4 appear among the sources
SOURCES = [
    DSCheckpointSpec(world_size=4, stage=1, dtype="fp32"),
    DSCheckpointSpec(world_size=2, stage=1, dtype="bf16"),
    DSCheckpointSpec(world_size=1, stage=2, dtype="fp32"),
    DSCheckpointSpec(world_size=3, stage=2, dtype="bf16"),
    DSCheckpointSpec(world_size=3, stage=3, dtype="fp32"),
    DSCheckpointSpec(world_size=4, stage=3, dtype="bf16"),
]
TARGETS = [(dp, stage) for stage in (1, 2, 3) for dp in (1, 2, 3, 4)]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_state(got: dict, ref: dict, where: str) -> None:
    assert sorted(got) == sorted(ref), where
    for name in ref:
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            # ds_to_universal keeps ZeRO-3 params flat: compare element by element
            a, b = got[name][kind].reshape(-1), ref[name][kind].reshape(-1)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {name} {kind} differs"


@pytest.mark.parametrize("spec", SOURCES, ids=lambda s: s.name)
def test_every_stage_and_dp_size_matches_deepspeeds_own_extraction(spec, deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(spec)
    before = _digest(src)
    ref = universal_reference(src, tmp_path / "ref")
    ref32 = zero_to_fp32_reference(src)
    for dp, stage in TARGETS:
        dst = tmp_path / f"z{stage}_dp{dp}"
        outcome = convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
        assert verify_manifest(dst) == []
        index = read_index(dst)
        assert (index.meta["dp"], index.meta["stage"], index.meta["dtype"]) == (
            dp, stage, "bfloat16" if spec.dtype == "bf16" else "float32")
        assert len(outcome.result.files) == 1 + dp + (dp if stage == 3 else 1)
        _assert_same_state(universal_reference(dst, tmp_path / f"uni_z{stage}_dp{dp}"), ref, f"-> z{stage} dp{dp}")
        got32 = zero_to_fp32_reference(dst)
        assert all(torch.equal(got32[k], ref32[k]) for k in ref32) and sorted(got32) == sorted(ref32)
    assert _digest(src) == before, "the source checkpoint changed"


def _skeleton(obj):
    """A loaded file with every tensor replaced by its (dtype, shape): the non-tensor content."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return [(k, _skeleton(v)) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_skeleton(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__qualname__, _skeleton(vars(obj)))
    return obj


@pytest.mark.parametrize("spec,via", [
    (SOURCES[3], (2, 3)),  # z2 dp3 bf16 -> z3 dp2 -> z2 dp3
    (SOURCES[4], (4, 1)),  # z3 dp3 fp32 -> z1 dp4 -> z3 dp3
    (SOURCES[0], (3, 2)),  # z1 dp4 fp32 -> z2 dp3 -> z1 dp4
], ids=lambda v: v.name if isinstance(v, DSCheckpointSpec) else f"via_z{v[1]}_dp{v[0]}")
def test_round_trip_n_to_m_to_n_is_bit_exact(spec, via, deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(spec)
    convert(src, tmp_path / "mid", to="deepspeed", target=LayoutRequest(dp=via[0], zero_stage=via[1]))
    convert(tmp_path / "mid", tmp_path / "back", to="deepspeed", target=LayoutRequest(dp=spec.world_size, zero_stage=spec.stage))
    original, back = read_index(src), read_index(tmp_path / "back")
    assert [(e.key, e.shape, e.dtype, e.chunks) for e in back.entries] == [
        (e.key, e.shape, e.dtype, e.chunks) for e in original.entries], "layout differs after the round trip"
    for (entry, a), (_, b) in zip(iter_tensors(original), iter_tensors(back)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{entry.key} differs after the round trip"
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*.pt"))
    assert files == sorted(str(p.relative_to(tmp_path / "back")) for p in (tmp_path / "back").rglob("*.pt"))
    for name in files:
        assert _skeleton(safe_load.load(tmp_path / "back" / name)) == _skeleton(safe_load.load(src / name)), name
    assert (tmp_path / "back" / "latest").read_text() == (src / "latest").read_text()

LOADS = [  # (source, target dp, target stage): DeepSpeed loads the conversion and trains on
    (SOURCES[3], 2, 3),
    (SOURCES[5], 3, 1),
    (SOURCES[0], 1, 2),
    (SOURCES[4], 4, 3),
    (SOURCES[2], 2, 1),
    (SOURCES[1], 3, 3),
]


@pytest.mark.parametrize("spec,dp,stage", LOADS, ids=lambda v: v.name if isinstance(v, DSCheckpointSpec) else str(v))
def test_deepspeed_loads_the_conversion_and_continues_training(spec, dp, stage, deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(spec)
    dst = tmp_path / "converted"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
    ref = universal_reference(src, tmp_path / "ref")
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype=spec.dtype, work=tmp_path / "load")
    _assert_same_state(loaded.params, ref, f"{spec.name} -> z{stage} dp{dp} loaded by DeepSpeed")
    model_states = safe_load.load(next((src / "global_step3").glob("*model_states.pt")))
    assert loaded.meta["global_steps"] == model_states["global_steps"] == spec.steps
    assert loaded.meta["optimizer_step"] == [float(spec.steps)]
    assert loaded.meta["scheduler"] == model_states["lr_scheduler"]
    assert loaded.meta["client"] == {"data_position": model_states["data_position"], "note": "fixture"}
    source_probe = json.loads((src / "fixture.json").read_text())["probe_loss"]
    if (stage == 3) == (spec.stage == 3):  # same forward code path: the very same loss
        assert loaded.probe_loss == source_probe
    else:  # ZeRO-3 runs linears through its own autograd function: rounding may differ in the last bits
        assert math.isclose(loaded.probe_loss, source_probe, rel_tol=1e-2 if spec.dtype == "bf16" else 1e-5)
    assert math.isfinite(loaded.probe_after_step) and loaded.probe_after_step != loaded.probe_loss


CONFIG_BUILT = [  # (source, target dp, target stage, the optimizer class DeepSpeed builds from its config on CPU)
    (DSCheckpointSpec(world_size=2, stage=2, optimizer="ds_adam"), 3, 3, "FusedAdam"),
    (DSCheckpointSpec(world_size=2, stage=2, optimizer="ds_cpu_adam"), 3, 1, "DeepSpeedCPUAdam"),
]


@pytest.mark.parametrize("spec,dp,stage,cls", CONFIG_BUILT, ids=lambda v: v.name if isinstance(v, DSCheckpointSpec)
                         else str(v))
def test_config_built_fused_and_cpu_adam_convert_and_load_bit_exact(spec, dp, stage, cls, deepspeed_checkpoints,
                                                                     tmp_path):
    """DeepSpeed's own Adam (built from `"optimizer": {"type": "Adam"}`) keeps `step` as a Python int."""
    src = deepspeed_checkpoints(spec)
    assert json.loads((src / "fixture.json").read_text())["optimizer_class"] == cls
    optim = safe_load.load(src / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"] == spec.steps
    assert type(optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]) is int
    dst = tmp_path / "converted"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
    assert verify_manifest(dst) == []
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype=spec.dtype, optimizer=spec.optimizer,
                            work=tmp_path / "load")
    assert loaded.meta["optimizer_class"] == cls
    _assert_same_state(loaded.params, universal_reference(src, tmp_path / "ref"), f"{spec.name} -> z{stage} dp{dp}")
    assert loaded.meta["optimizer_step"] == [float(spec.steps)] and loaded.meta["optimizer_step_type"] == ["int"]
    assert loaded.meta["global_steps"] == spec.steps
    source_probe = json.loads((src / "fixture.json").read_text())["probe_loss"]
    assert math.isclose(loaded.probe_loss, source_probe, rel_tol=1e-5)
    assert math.isfinite(loaded.probe_after_step) and loaded.probe_after_step != loaded.probe_loss
    # and back to the source layout: every tensor, the int step included, bit for bit
    convert(dst, tmp_path / "back", to="deepspeed", target=LayoutRequest(dp=spec.world_size, zero_stage=spec.stage))
    original, back = read_index(src), read_index(tmp_path / "back")
    for (entry, a), (_, b) in zip(iter_tensors(original), iter_tensors(back), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{entry.key} differs after the round trip"
    back_optim = safe_load.load(tmp_path / "back" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert type(back_optim["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]) is int


BF16_OPTIMIZER = DSCheckpointSpec(world_size=3, stage=1, dtype="bf16", grad_accum="fp32")  # DeepSpeed's BF16_Optimizer


@pytest.fixture(scope="module")
def bf16_optimizer_reference(deepspeed_checkpoints, tmp_path_factory):
    """The BF16_Optimizer source as DeepSpeed itself loads it at its own layout (the reference state)."""
    return load_and_probe(deepspeed_checkpoints(BF16_OPTIMIZER), world_size=BF16_OPTIMIZER.world_size, stage=1,
                          dtype="bf16", grad_accum="fp32", work=tmp_path_factory.mktemp("bf16opt_ref"))


@pytest.mark.parametrize("dp,stage,grad_accum,wrapper", [
    (2, 1, "fp32", "BF16_Optimizer"),  # the same config at dp 2: BF16_Optimizer's own files
    (4, 2, "", "DeepSpeedZeroOptimizer"),  # ZeRO-2 with bf16 gradients
], ids=["bf16opt_dp2", "zero2_dp4"])
def test_bf16_optimizer_checkpoints_convert_and_load(dp, stage, grad_accum, wrapper, deepspeed_checkpoints,
                                                     bf16_optimizer_reference, tmp_path):
    """bf16 + ZeRO-1 + fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, whose files keep no
    zero_stage and the fp32 partitions with their alignment padding."""
    spec = BF16_OPTIMIZER
    src = deepspeed_checkpoints(spec)
    fixture = json.loads((src / "fixture.json").read_text())
    assert fixture["wrapper_class"] == "BF16_Optimizer"
    index = read_index(src)
    assert (index.meta["stage"], index.meta["optimizer_flavor"]) == (1, "bf16_optimizer")
    dst = tmp_path / "converted"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
    assert verify_manifest(dst) == []
    last = safe_load.load(dst / "global_step3" / f"bf16_zero_pp_rank_{dp - 1}_mp_rank_00_optim_states.pt")
    assert ("zero_stage" in last["optimizer_state_dict"]) == (wrapper != "BF16_Optimizer")
    ref = bf16_optimizer_reference
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype="bf16", grad_accum=grad_accum,
                            work=tmp_path / "load_dst")
    assert loaded.meta["wrapper_class"] == wrapper
    _assert_same_state(loaded.params, ref.params, f"BF16_Optimizer dp3 -> {wrapper} dp{dp}")
    assert loaded.meta["optimizer_step"] == [float(spec.steps)] and loaded.meta["global_steps"] == spec.steps
    assert loaded.probe_loss == fixture["probe_loss"]
    assert math.isfinite(loaded.probe_after_step) and loaded.probe_after_step != loaded.probe_loss
    if stage == 1:  # and back: BF16_Optimizer's files again, bit for bit
        convert(dst, tmp_path / "back", to="deepspeed", target=LayoutRequest(dp=spec.world_size, zero_stage=1))
        for (entry, a), (_, b) in zip(iter_tensors(index), iter_tensors(read_index(tmp_path / "back")), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{entry.key} differs after the round trip"
        for r in range(spec.world_size):
            name = f"global_step3/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            assert _skeleton(safe_load.load(tmp_path / "back" / name)) == _skeleton(safe_load.load(src / name)), name
