"""Training with DeepSpeed on Gloo: ZeRO 1/2/3, fp32/bf16, checkpoints DeepSpeed reloads,
bit-identical resume."""
import os

import pytest

from migrate.workload.deepspeed_engine import deepspeed_config, deepspeed_load_target
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec, TrainSpec
from workload_fixtures import workload_extensions_dir  # noqa: F401 - fixture


def _spec(stage, dtype, **kw):
    return RunSpec(engine="deepspeed", model=TINY_LLAMA, train=TrainSpec(precision=dtype, global_batch_size=12),
                   zero_stage=stage, **kw)


def test_config_follows_the_recipe_and_names_bad_batch_sizes():
    config = deepspeed_config(_spec(2, "bf16", steps=3), dp=3)
    assert config["gradient_accumulation_steps"] == 4
    assert config["zero_optimization"]["stage"] == 2
    assert config["bf16"] == {"enabled": True}
    assert config["optimizer"]["params"]["torch_adam"] is True
    with pytest.raises(ValueError, match=r"micro_batch_size\(1\) \* dp\(5\) = 5"):
        deepspeed_config(_spec(1, "fp32", steps=3), dp=5)


def test_load_target_accepts_a_save_dir_or_a_tag_dir(tmp_path):
    (tmp_path / "latest").write_text("global_step4")
    tag = tmp_path / "global_step2"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert deepspeed_load_target(str(tmp_path)) == (str(tmp_path), None)
    assert deepspeed_load_target(str(tag)) == (str(tmp_path), "global_step2")
    with pytest.raises(FileNotFoundError, match="neither a DeepSpeed save dir"):
        deepspeed_load_target(str(tmp_path / "global_step2" / ".."  / ".." ))


CASES = [(1, 1, "fp32"), (2, 2, "bf16"), (3, 2, "fp32"), (4, 3, "fp32"), (2, 3, "bf16"), (4, 1, "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,stage,dtype", CASES, ids=[f"ws{w}-zero{s}-{d}" for w, s, d in CASES])
def test_deepspeed_trains_saves_and_resumes_bit_identically(tmp_path, workload_extensions_dir, world_size, stage, dtype):
    full = launch(_spec(stage, dtype, steps=4, save_dir=str(tmp_path), save_every=2,
                        metrics_path=str(tmp_path / "metrics.jsonl")), world_size)
    losses = full[0].losses
    assert len(losses) == 4 and all(r.losses == losses for r in full)
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "latest").read_text().strip() == "global_step4"
    prefix = "bf16_" if dtype == "bf16" else ""
    for tag in ("global_step2", "global_step4"):
        files = set(os.listdir(tmp_path / tag))
        assert {f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)} <= files, files
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4

    resumed = launch(_spec(stage, dtype, steps=4, load_dir=str(tmp_path / "global_step2")), world_size)
    assert resumed[0].start_step == 2
    assert resumed[0].losses == losses[2:]
    assert [m.grad_norm for m in resumed[0].metrics] == [m.grad_norm for m in full[0].metrics[2:]]
    assert [m.consumed_samples for m in resumed[0].metrics] == [36, 48]


@pytest.mark.slow
def test_same_seed_and_layout_give_the_same_losses(workload_extensions_dir):
    first = launch(_spec(2, "fp32", steps=3), 2)
    second = launch(_spec(2, "fp32", steps=3), 2)
    assert first[0].losses == second[0].losses
    assert [m.lr for m in first[0].metrics] == [m.lr for m in second[0].metrics]
