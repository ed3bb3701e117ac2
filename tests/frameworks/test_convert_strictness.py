"""`convert(..., target=LayoutRequest(...), expect=..., strict=...)`: what does not pass unchanged is listed
(REPORT) or refused before a byte is written (REFUSE_LOSS, REFUSE_CHANGE), through the API and `migrate
convert --strict`."""

import hashlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from ds_checkpoint_fixtures import DSCheckpointSpec, deepspeed_checkpoints  # noqa: F401

from checkpoint.api import LayoutRequest, Strictness, convert, read_index
from checkpoint.errors import PlanError
from checkpoint.layout import LayoutError
from checkpoint.manifest import verify_manifest
from checkpoint.verify import compare_indexes
from migrate.commands.convert import command as convert_cmd

pytestmark = pytest.mark.slow
DEEPSPEEDS_OWN = DSCheckpointSpec(world_size=3, stage=2, dtype="bf16")  # written by DeepSpeed's engine itself


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_dp_and_stage_change_of_deepspeeds_own_checkpoint_passes_the_strictest_check(deepspeed_checkpoints,
                                                                                      tmp_path):
    """ZeRO-2 dp3 bf16 -> ZeRO-1 dp2: every weight, master, moment and step reaches the target, none is made
    up, so REFUSE_CHANGE writes it (and the output equals the source)."""
    src = deepspeed_checkpoints(DEEPSPEEDS_OWN)
    outcome = convert(src, tmp_path / "out", to="deepspeed", target=LayoutRequest(dp=2, zero_stage=1),
                      expect=LayoutRequest(dp=3, zero_stage=2), strict=Strictness.REFUSE_CHANGE)
    assert outcome.differences == ()
    assert verify_manifest(tmp_path / "out") == []
    assert compare_indexes(outcome.plan.source, read_index(tmp_path / "out")) == []


def test_what_a_conversion_to_hf_drops_is_listed_and_refuse_loss_refuses_it_before_writing(deepspeed_checkpoint,
                                                                                           tmp_path):
    ck = deepspeed_checkpoint(2, 1)
    before = _digest(ck.path)
    listed = convert(ck.path, tmp_path / "report", to="hf", dry_run=True).differences
    states = {d.state.split(" ")[0]: d for d in listed}
    assert set(states) == {"exp_avg", "exp_avg_sq", "step"}, [d.describe() for d in listed]  # fp32: no master lost
    assert all(d.lost and d.policy == "dropped" and "hf target has no place" in d.reason for d in listed)
    assert "exp_avg of 21 tensor(s)" in states["exp_avg"].state
    with pytest.raises(PlanError, match=r"^refuse-loss: deepspeed -> hf would lose 3 state\(s\): exp_avg of 21 "):
        convert(ck.path, tmp_path / "refused", to="hf", strict=Strictness.REFUSE_LOSS)
    assert not (tmp_path / "refused").exists()
    assert _digest(ck.path) == before


def test_per_rank_rng_a_dcp_target_drops_is_a_loss(deepspeed_checkpoint, tmp_path):
    ck = deepspeed_checkpoint(2, 1)
    with pytest.raises(PlanError, match=r"would lose 1 state\(s\): rng: dropped \(the source holds per-rank RNG"):
        convert(ck.path, tmp_path / "dcp", to="dcp", target=LayoutRequest(dp=2), strict=Strictness.REFUSE_LOSS)
    assert not (tmp_path / "dcp").exists()
    written = convert(ck.path, tmp_path / "dcp", to="dcp", target=LayoutRequest(dp=2))  # REPORT: written, listed
    assert [d.describe() for d in written.differences] == [
        "rng: dropped (the source holds per-rank RNG states; a DCP checkpoint of this layout holds none)"]
    assert verify_manifest(tmp_path / "dcp") == []


def test_rng_derived_for_a_changed_tensor_parallel_role_is_a_change_not_a_loss(megatron_checkpoint, tmp_path):
    """Megatron-Core TP2 -> TP1: no source rank holds a TP1 rank's shards, so its RNG is derived from the seed,
    the step and its role. REFUSE_LOSS writes it; REFUSE_CHANGE refuses, naming each derived rank."""
    ck = megatron_checkpoint(2, 1, 1)
    kept = convert(ck.path, tmp_path / "loss", to="megatron", target=LayoutRequest(tp=1, pp=1, dp=2),
                   strict=Strictness.REFUSE_LOSS)
    derived = [d for d in kept.differences if d.policy == "derive"]
    assert derived and all(not d.lost and d.state.startswith("rng rank") for d in derived), kept.differences
    assert verify_manifest(tmp_path / "loss") == []
    with pytest.raises(PlanError, match=r"^refuse-change: megatron -> megatron would lose or change "
                                        rf"{len(kept.differences)} state\(s\): rng rank 0"):
        convert(ck.path, tmp_path / "change", to="megatron", target=LayoutRequest(tp=1, pp=1, dp=2),
                strict=Strictness.REFUSE_CHANGE)
    assert not (tmp_path / "change").exists()


def test_cli_strict_refuses_with_one_line_and_exit_2_and_reports_by_default(deepspeed_checkpoint, tmp_path):
    src = str(deepspeed_checkpoint(2, 1).path)
    refused = CliRunner().invoke(convert_cmd, [src, str(tmp_path / "a"), "--to", "hf", "--strict", "refuse-loss"])
    assert refused.exit_code == 2, refused.output
    assert refused.output.startswith("error: refuse-loss: deepspeed -> hf would lose 3 state(s): exp_avg")
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    reported = CliRunner().invoke(convert_cmd, [src, str(tmp_path / "b"), "--to", "hf", "--dry-run"])
    assert reported.exit_code == 0, reported.output
    assert "state not passed unchanged (--strict report):\n  exp_avg of 21 tensor(s)" in reported.output


def test_a_layout_request_names_the_bad_axis():
    with pytest.raises(LayoutError, match=r"tp=0: a parallel size is a positive integer"):
        LayoutRequest(tp=0)
    with pytest.raises(LayoutError, match=r"zero_stage=4: DeepSpeed's ZeRO stages are 1, 2 and 3"):
        LayoutRequest(zero_stage=4)
    assert LayoutRequest(tp=2, dp=4, zero_stage=1).describe() == "tp2·dp4 zero1"
    assert LayoutRequest().describe() == "as the checkpoint"


def test_expecting_a_virtual_pipeline_size_is_refused(deepspeed_checkpoint, tmp_path):
    with pytest.raises(PlanError, match=r"expect vpp=2: sources do not declare a virtual pipeline size"):
        convert(deepspeed_checkpoint(2, 1).path, tmp_path / "out", to="deepspeed", expect=LayoutRequest(vpp=2))
