"""Training with PyTorch FSDP2 on Gloo: DCP checkpoints that DCP reloads, bit-identical resume."""
import pytest

from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL, launch
from migrate.workload.run_spec import RunSpec, TrainSpec


def _spec(dtype="fp32", model=TINY_LLAMA, **kw):
    return RunSpec(engine="fsdp", model=model, train=TrainSpec(precision=dtype), **kw)


CASES = [(1, "fp32", "llama"), (2, "bf16", "llama"), (4, "fp32", "mixtral")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,dtype,arch", CASES, ids=[f"ws{w}-{d}-{a}" for w, d, a in CASES])
def test_fsdp2_trains_saves_dcp_and_resumes_bit_identically(tmp_path, world_size, dtype, arch):
    model = TINY_MIXTRAL if arch == "mixtral" else TINY_LLAMA
    full = launch(_spec(dtype, model, steps=4, save_dir=str(tmp_path), save_every=2), world_size)
    losses = full[0].losses
    assert all(r.losses == losses for r in full) and losses[-1] < losses[0], losses
    assert (tmp_path / "step-2" / ".metadata").is_file()
    assert sorted(p.name for p in (tmp_path / "step-2").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world_size)]
    resumed = launch(_spec(dtype, model, steps=4, load_dir=str(tmp_path / "step-2")), world_size)
    assert resumed[0].start_step == 2 and resumed[0].losses == losses[2:]


def test_fsdp_engine_refuses_pipeline_and_expert_parallel_layouts():
    from migrate.workload.fsdp_engine import train_fsdp

    class Ctx:
        device_type, world_size, rank, device = "cpu", 2, 0, "cpu"

    with pytest.raises(ValueError, match=r"pp\(2\) ep\(1\)"):
        train_fsdp(Ctx(), _spec(steps=1, pp=2))
    with pytest.raises(ValueError, match=r"world_size\(2\) is not divisible by tp\(4\)"):
        train_fsdp(Ctx(), _spec(steps=1, tp=4))
