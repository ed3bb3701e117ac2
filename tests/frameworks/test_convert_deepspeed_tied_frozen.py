"""Tied weights (DeepSpeed's `shared_params`) and frozen params (`requires_grad=False`, no optimizer
state) converted across ZeRO stages and DP sizes, checked by DeepSpeed's engine and its zero_to_fp32.

ZeRO-1/2 keep frozen params whole in `module` (ZeRO-2 also lists them in `frozen_param_shapes` /
`frozen_param_fragments`); ZeRO-3 keeps one piece per rank in `frozen_param_fragments`, which DeepSpeed's
load copies into each rank's partition. A tied name is the very tensor of its param.
"""

import dataclasses
import json
import math

import pytest
import torch
from ds_checkpoint_fixtures import (DSCheckpointSpec, deepspeed_checkpoints, load_and_probe,  # noqa: F401
                                    zero_to_fp32_reference)

from click.testing import CliRunner

from checkpoint import safe_load
from checkpoint.api import LayoutRequest, convert, plan_conversion, read_index
from checkpoint.errors import PlanError
from checkpoint.manifest import verify_manifest
from checkpoint.materialize import iter_tensors
from migrate.commands.inspect import command as inspect_cmd

pytestmark = pytest.mark.slow

Z1 = DSCheckpointSpec(world_size=2, stage=1, model="tied_frozen")
Z2 = DSCheckpointSpec(world_size=2, stage=2, model="tied_frozen")
Z3_BF16 = DSCheckpointSpec(world_size=3, stage=3, dtype="bf16", model="tied_frozen")
FROZEN = {"fc1.weight", "fc1.bias"}


def _assert_same(got: dict, ref: dict, where: str) -> None:
    assert sorted(got) == sorted(ref), where
    for name, kinds in ref.items():
        assert sorted(got[name]) == sorted(kinds), f"{where}: {name}"
        for kind, t in kinds.items():
            assert torch.equal(got[name][kind], t), f"{where}: {name} {kind} differs"


@pytest.mark.parametrize("spec,dp,stage", [(Z1, 3, 3), (Z3_BF16, 2, 2)], ids=["z1dp2-z3dp3", "z3dp3bf16-z2dp2"])
def test_tied_and_frozen_params_convert_and_deepspeed_loads_them(spec, dp, stage, deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(spec)
    shown = CliRunner().invoke(inspect_cmd, [str(src)])
    assert shown.exit_code == 0, shown.output
    assert "tied        head.weight is embed.weight" in shown.output
    assert "frozen      2 params without optimizer state (fc1.weight, fc1.bias)" in shown.output
    dst = tmp_path / "converted"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=dp, zero_stage=stage))
    assert verify_manifest(dst) == []
    model_files = sorted((dst / "global_step3").glob("*model_states.pt"))
    states = [safe_load.load(f) for f in model_files]
    assert all(s["shared_params"] == {"head.weight": "embed.weight"} for s in states)
    assert all(set(s["frozen_param_shapes"]) == FROZEN for s in states)  # ZeRO-2/3 targets list them
    if stage != 3:  # the tied name is its param's very tensor, as torch.save of DeepSpeed's own module keeps it
        module = states[0]["module"]
        assert module["head.weight"].data_ptr() == module["embed.weight"].data_ptr()

    # DeepSpeed's own extraction sees the same model: trained params, the tied name and the frozen ones
    # (from a ZeRO-1 source it omits the frozen params, which ZeRO-1 keeps only in the module state)
    ref32, got32 = zero_to_fp32_reference(src), zero_to_fp32_reference(dst)
    assert set(ref32) <= set(got32) and set(got32) - set(ref32) == (FROZEN if spec.stage == 1 else set())
    assert {"head.weight", *FROZEN} <= set(got32)
    for k in ref32:
        assert torch.equal(got32[k], ref32[k]), f"zero_to_fp32 {k} differs"
    if spec.stage == 1:
        module = safe_load.load(src / "global_step3" / "mp_rank_00_model_states.pt")["module"]
        assert all(torch.equal(got32[k], module[k]) for k in FROZEN)

    # DeepSpeed's engine loads it at the target layout (frozen params overwritten from the checkpoint)
    ref = load_and_probe(src, world_size=spec.world_size, stage=spec.stage, dtype=spec.dtype, model=spec.model,
                         work=tmp_path / "load_src")
    loaded = load_and_probe(dst, world_size=dp, stage=stage, dtype=spec.dtype, model=spec.model,
                            work=tmp_path / "load_dst")
    _assert_same(loaded.params, ref.params, f"{spec.name} -> z{stage} dp{dp}")
    assert {n for n, kinds in loaded.params.items() if "frozen" in kinds} == FROZEN
    assert loaded.meta["global_steps"] == spec.steps and loaded.meta["optimizer_step"] == [float(spec.steps)]
    source_probe = json.loads((src / "fixture.json").read_text())["probe_loss"]
    assert math.isclose(loaded.probe_loss, source_probe, rel_tol=1e-2 if spec.dtype == "bf16" else 1e-5)
    assert math.isfinite(loaded.probe_after_step) and loaded.probe_after_step != loaded.probe_loss


def test_tied_and_frozen_round_trip_through_zero3_is_bit_exact(deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(Z2)
    convert(src, tmp_path / "mid", to="deepspeed", target=LayoutRequest(dp=4, zero_stage=3))
    mid = read_index(tmp_path / "mid")
    frozen = {e.key.name: e for e in mid.entries if e.key.name in FROZEN}
    assert all(len(e.chunks) == 4 and e.chunks[0].key[0] == "frozen_param_fragments" for e in frozen.values())
    convert(tmp_path / "mid", tmp_path / "back", to="deepspeed", target=LayoutRequest(dp=2, zero_stage=2))
    original, back = read_index(src), read_index(tmp_path / "back")
    assert [(e.key, e.shape, e.dtype, e.chunks) for e in back.entries] == [
        (e.key, e.shape, e.dtype, e.chunks) for e in original.entries]
    for (entry, a), (_, b) in zip(iter_tensors(original), iter_tensors(back), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{entry.key} differs after the round trip"
    src_model = safe_load.load(src / "global_step3" / "mp_rank_00_model_states.pt")
    back_model = safe_load.load(tmp_path / "back" / "global_step3" / "mp_rank_00_model_states.pt")
    assert list(back_model["module"]) == list(src_model["module"])
    for k in ("shared_params", "frozen_param_shapes"):
        assert back_model[k] == src_model[k], k
    assert all(torch.equal(back_model["frozen_param_fragments"][n], src_model["frozen_param_fragments"][n])
               for n in FROZEN)


def test_other_formats_refuse_tied_and_frozen_deepspeed_params_by_name(deepspeed_checkpoints, tmp_path):
    src = deepspeed_checkpoints(Z2)
    for fmt, options in (("dcp", {"dp": 2}), ("hf", {}), ("deepspeed_universal", {"dp": 2, "zero_stage": 2})):
        with pytest.raises(PlanError, match=r"ties parameters \(head.weight is embed.weight\)"):
            convert(src, tmp_path / fmt, to=fmt, target=LayoutRequest(**options))
        assert not (tmp_path / fmt).exists()
    # frozen params alone (the same index without its tie): the writers that need optimizer state refuse them
    untied = dataclasses.replace(read_index(src), meta={**read_index(src).meta, "shared_params": {}})
    for fmt, options in (("dcp", {"dp": 2}), ("megatron", {"tp": 1}), ("megatron-legacy", {"tp": 1}),
                         ("deepspeed_universal", {"dp": 2, "zero_stage": 2})):
        with pytest.raises(PlanError, match=r"holds 2 frozen parameters without optimizer state \(\['fc1.weight', "
                                            r"'fc1.bias'\]\)"):
            plan_conversion(untied, to=fmt, target=LayoutRequest(**options))
