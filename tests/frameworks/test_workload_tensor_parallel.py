"""Training the built-in decoder with DTensor tensor parallelism (+ FSDP2 on the dp axis) on Gloo:
tp2 matches tp1, DCP checkpoints resume bit-identically, DCP's resharding load moves a checkpoint
between (dp, tp) layouts, and the DCP reader indexes TP chunks."""
import dataclasses

import pytest

from checkpoint.model_shape import ModelShape
from migrate.workload.fixtures import TINY_LLAMA, TINY_MIXTRAL, launch
from migrate.workload.run_spec import RunSpec, TrainSpec
from migrate.workload.tensor_parallel import MeshShape, check_tensor_parallel, tp_plan

TOL = 1e-5  # fp32: TP splits matmul reductions, so losses agree to rounding, not bit for bit


def _spec(**kw):
    return RunSpec(engine="fsdp", model=kw.pop("model", TINY_LLAMA), train=TrainSpec(), **kw)


def test_mesh_puts_the_tp_ranks_of_a_replica_next_to_each_other():
    mesh = MeshShape.of(4, 2)
    assert (mesh.dp, mesh.tp) == (2, 2)
    assert [mesh.coordinates(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match=r"world_size\(3\) is not divisible by tp\(2\)"):
        MeshShape.of(3, 2)


def test_plan_splits_attention_and_mlp_columns_then_rows():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = tp_plan(TINY_LLAMA, sequence_parallel=False)
    for i in range(TINY_LLAMA.num_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert isinstance(plan[f"layers.{i}.{name}"], ColwiseParallel), name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert isinstance(plan[f"layers.{i}.{name}"], RowwiseParallel), name
    assert not any(isinstance(p, SequenceParallel) for p in plan.values())
    sp = tp_plan(dataclasses.replace(TINY_LLAMA, architecture="gpt"), sequence_parallel=True)
    assert "layers.0.mlp.gate_proj" not in sp
    assert isinstance(sp["layers.1.input_layernorm"], SequenceParallel) and isinstance(sp["norm"], SequenceParallel)
    assert sp["layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)


def test_layouts_tp_cannot_split_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide num_query_groups\(2\)"):
        check_tensor_parallel(TINY_LLAMA, 4, False)
    with pytest.raises(ValueError, match=r"seq_length\(30\)"):
        check_tensor_parallel(dataclasses.replace(TINY_LLAMA, seq_length=30), 4, True)
    with pytest.raises(ValueError, match="dense models"):
        check_tensor_parallel(TINY_MIXTRAL, 2, False)
    with pytest.raises(ValueError, match="tied_embeddings"):
        check_tensor_parallel(dataclasses.replace(TINY_LLAMA, tied_embeddings=True), 2, False)
    check_tensor_parallel(TINY_MIXTRAL, 1, False)


@pytest.mark.slow
def test_tp2_matches_tp1_writes_dcp_that_inspect_reads_and_resumes_bit_identically(tmp_path):
    from checkpoint.api import LayoutRequest, read_index
    from checkpoint.errors import LayoutMismatchError
    from migrate.commands.inspect import describe

    tp1 = launch(_spec(steps=4), 1)[0].losses
    full = launch(_spec(steps=4, tp=2, save_dir=str(tmp_path), save_every=2), 2)
    losses = full[0].losses
    assert full[1].losses == losses and losses[-1] < losses[0], losses
    assert max(abs(a - b) for a, b in zip(losses, tp1)) < TOL, (losses, tp1)
    assert full[0].extra["tp"] == 2 and full[0].extra["dp"] == 1

    index = read_index(tmp_path / "step-2", expect=LayoutRequest(dp=1, tp=2))
    assert (index.meta["dp"], index.meta["tp"], index.meta["world_size"], index.meta["global_steps"]) == (1, 2, 2, 2)
    o_proj = index.by_key()[next(k for k in index.by_key() if k.name == "layers.0.self_attn.o_proj.weight")]
    assert sorted(c.offsets for c in o_proj.chunks) == [(0, 0), (0, 32)]  # RowwiseParallel: split on dim 1
    assert describe(index)["format"] == "dcp"
    with pytest.raises(LayoutMismatchError, match=r"declared tp=1 but the checkpoint was saved at tp=2"):
        read_index(tmp_path / "step-2", expect=LayoutRequest(tp=1))

    resumed = launch(_spec(steps=4, tp=2, load_dir=str(tmp_path / "step-2")), 2)
    assert resumed[0].start_step == 2 and resumed[0].losses == losses[2:]
    assert [m.grad_norm for m in resumed[0].metrics] == [m.grad_norm for m in full[0].metrics[2:]]


@pytest.mark.slow
def test_tp2_dp2_sequence_parallel_resumes_bit_identically_and_reshards_through_dcp(tmp_path):
    from checkpoint.api import read_index

    full = launch(_spec(steps=4, tp=2, sequence_parallel=True, save_dir=str(tmp_path), save_every=2), 4)
    losses = full[0].losses
    assert all(r.losses == losses for r in full) and losses[-1] < losses[0], losses
    assert full[0].extra["dp"] == 2 and full[0].extra["sequence_parallel"]
    ckpt = tmp_path / "step-2"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert (read_index(ckpt).meta["dp"], read_index(ckpt).meta["tp"]) == (2, 2)

    resumed = launch(_spec(steps=4, tp=2, sequence_parallel=True, load_dir=str(ckpt)), 4)
    assert resumed[0].start_step == 2 and resumed[0].losses == losses[2:]

    # DCP's own resharding load: the (dp2, tp2) checkpoint continues at (dp2, tp1) and (dp1, tp2).
    for tp, world in ((1, 2), (2, 2)):
        moved = launch(_spec(steps=4, tp=tp, load_dir=str(ckpt)), world)
        assert moved[0].start_step == 2
        assert max(abs(a - b) for a, b in zip(moved[0].losses, losses[2:])) < TOL, (tp, world, moved[0].losses, losses)


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,tol", [("gpt", "fp32", TOL), ("llama", "bf16", 1e-3)])
def test_sequence_parallel_matches_tp1_for_layernorm_with_bias_and_in_bf16(arch, dtype, tol):
    model = ModelShape(architecture=arch, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, vocab_size=128, seq_length=32)
    train = TrainSpec(precision=dtype)
    sp = launch(RunSpec(engine="fsdp", model=model, train=train, steps=3, tp=2, sequence_parallel=True), 2)[0].losses
    tp1 = launch(RunSpec(engine="fsdp", model=model, train=train, steps=3), 1)[0].losses
    assert max(abs(a - b) for a, b in zip(sp, tp1)) < tol, (sp, tp1)


def _job(layout):
    from pathlib import Path

    import yaml

    from migrate.job.schema import JobSpec

    data = yaml.safe_load((Path(__file__).parents[2] / "configs" / "demo_cpu.yaml").read_text())
    data["source"]["layout"] = layout
    data["source"]["cluster"]["device_count"] = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    return JobSpec.model_validate(data)


def test_a_job_with_engine_fsdp_and_tp2_maps_to_a_dp_x_tp_run():
    from migrate.workload.from_job import default_engine, run_spec, side_layout

    job = _job({"tp": 2, "dp": 2, "sharding": "fsdp"})
    layout = side_layout(job, "baseline")
    assert default_engine(job, layout) == "fsdp"
    spec = run_spec(job, layout, engine="fsdp", steps=2, save_dir=None, load_dir=None, save_every=0,
                    metrics_path=None, sequence_parallel=True)
    assert (spec.engine, spec.tp, spec.data_parallel_size(4), spec.sequence_parallel) == ("fsdp", 2, 2, True)
    with pytest.raises(ValueError, match=r"pp\(2\) ep\(1\) and needs megatron"):
        run_spec(job, side_layout(_job({"pp": 2, "dp": 2, "sharding": "fsdp"}), "baseline"), engine="fsdp", steps=2,
                 save_dir=None, load_dir=None, save_every=0, metrics_path=None)
    with pytest.raises(ValueError, match="places dp before tp"):
        run_spec(job, side_layout(_job({"tp": 2, "dp": 2, "sharding": "fsdp", "order": "dp-tp-cp-ep-pp"}), "baseline"),
                 engine="fsdp", steps=2, save_dir=None, load_dir=None, save_every=0, metrics_path=None)
