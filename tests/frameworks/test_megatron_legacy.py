"""Megatron-LM legacy per-rank checkpoints (`iter_*/mp_rank_XX[_YYY]/model_optim_rng.pt` + `distrib_optim.pt`).

What a user does: train the Megatron engine with `checkpoint_format="torch"`, resume it at the same layout
(bit-identical losses), `migrate convert` it to other TP/PP/DP layouts (legacy or torch_dist) and back, and resume
the converted checkpoint at the target layout. The engine's legacy load calls the Megatron-Core methods
Megatron-LM's `load_checkpoint` calls, in its order (`model.load_state_dict`, `optimizer.load_state_dict`,
`optimizer.load_parameter_state`). Checks: optimizer state re-read through our index equals the source bit for bit;
the first resumed loss (the model's output on the fixed next batch) within 1e-6 of the source's (fp32), the
second within 1e-5; broken rank files are errors that name them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from checkpoint.api import LayoutRequest, convert, detect_format, read_index
from checkpoint.errors import CheckpointFormatError
from checkpoint.formats.megatron_paths import RANK_DIR_RE, rank_dir
from checkpoint.index import Kind, TensorKey
from checkpoint.materialize import iter_tensors
from checkpoint.state.training_state import STATE_REPORT_FILE
from checkpoint.verify import compare_indexes
from migrate.stages.resume import rng_decisions
from migrate.workload.fixtures import launch

GBS = 8


def _resume(ck, load_dir, tp: int, pp: int, dp: int, distopt: bool = True) -> list[float]:
    """Steps 3-4 from `load_dir` at (tp, pp, dp); converted checkpoints hold the DistributedOptimizer's state."""
    return _resume_ranks(ck, load_dir, tp, pp, dp, distopt)[0].losses


def _resume_ranks(ck, load_dir, tp: int, pp: int, dp: int, distopt: bool = True) -> list:
    spec = dataclasses.replace(ck.spec, tp=tp, pp=pp, load_dir=str(load_dir), save_dir=None, steps=4,
                               distributed_optimizer=distopt)
    results = launch(spec, tp * pp * dp)
    assert results[0].start_step == 2
    return results


def _rng_as_reported(target, results, world: int) -> None:
    """The conversion's state report names an RNG decision for every target rank, and each rank resumes from the
    state it names (what the resume stage checks)."""
    report = json.loads((target / STATE_REPORT_FILE).read_text())
    decisions = rng_decisions(report)
    assert sorted(d["target_rank"] for d in decisions) == list(range(world)), decisions
    got = [r.extra["rng"][0] for r in results]
    assert [got[d["target_rank"]] for d in decisions] == [d["fingerprint"] for d in decisions]


def _same_state(source, back) -> list[str]:
    """`compare_indexes` problems of a Megatron target (legacy or torch_dist): tensors equal bit for bit, and Adam's
    step, which Megatron keeps per param group (no per-parameter `step` tensors), equal to the source's."""
    step = source.meta["train_state"]["step"]
    problems = compare_indexes(source, back)
    groups = [pg for g in back.meta["optimizer_groups"] for pg in g["param_groups"]]
    problems += [f"param group step {pg.get('step')} != source step {step}" for pg in groups
                 if float(pg.get("step", -1)) != float(step)]
    return problems


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == 2, got
    assert abs(got[0] - want[0]) / abs(want[0]) <= 1e-6, (got, want)
    assert got[1] == pytest.approx(want[1], rel=1e-5), (got, want)


def test_rank_dir_names_follow_megatron_lm():
    assert rank_dir(tp_rank=1, pp_rank=0, ep_rank=0, pp=1, ep=1) == "mp_rank_01"
    assert rank_dir(tp_rank=0, pp_rank=3, ep_rank=0, pp=4, ep=1) == "mp_rank_00_003"
    assert rank_dir(tp_rank=2, pp_rank=1, ep_rank=5, pp=2, ep=8) == "mp_rank_02_001_005"
    assert rank_dir(tp_rank=0, pp_rank=0, ep_rank=1, pp=1, ep=2) == "mp_rank_00_001"
    assert all(RANK_DIR_RE.match(n) for n in ("mp_rank_00", "mp_rank_07_002", "mp_rank_00_001_003"))
    assert not RANK_DIR_RE.match("mp_rank_00_model_states.pt")  # DeepSpeed's file, not a legacy rank dir


# (tp, pp, dp, distributed optimizer): the layouts the engine saves and resumes bit-identically
SAME_LAYOUT = [(2, 1, 1, True), (1, 2, 1, True), (1, 1, 2, True), (2, 1, 1, False)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,distopt", SAME_LAYOUT,
                         ids=[f"tp{t}pp{p}dp{d}-{'distopt' if o else 'plain'}" for t, p, d, o in SAME_LAYOUT])
def test_engine_resumes_legacy_checkpoint_bit_identically(megatron_legacy_checkpoint, tp, pp, dp, distopt):
    ck = megatron_legacy_checkpoint(tp, pp, dp, distributed_optimizer=distopt)
    names = sorted(p.name for p in ck.path.iterdir())
    assert names == sorted(rank_dir(tp_rank=t, pp_rank=p, ep_rank=0, pp=pp, ep=1)
                           for t in range(tp) for p in range(pp))
    for name in names:
        files = sorted(f.name for f in (ck.path / name).iterdir())
        assert files == (["distrib_optim.pt", "model_optim_rng.pt"] if distopt else ["model_optim_rng.pt"])
    assert (ck.path.parent / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert _resume(ck, ck.path, tp, pp, dp, distopt) == ck.losses[2:]  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "plain"])
def test_reader_indexes_weights_and_optimizer_state(megatron_legacy_checkpoint, distopt):
    ck = megatron_legacy_checkpoint(2, 1, 1, distributed_optimizer=distopt)
    assert detect_format(ck.path) == "megatron-legacy" and detect_format(ck.path.parent) == "megatron-legacy"
    index = read_index(ck.path)
    assert (index.meta["tp"], index.meta["pp"], index.meta["dp"], index.meta["sharding"]) == (
        2, 1, 1, "dp_zero" if distopt else "plain")
    assert index.meta["train_state"]["step"] == 2 and index.meta["optimizer_groups"][0]["param_groups"][0]["step"] == 2
    tensors = {e.key: t for e, t in iter_tensors(index)}
    params = [k for k in tensors if k.kind is Kind.PARAM]
    assert len(params) == 21  # llama, 2 layers: embed, lm_head, norm + 2 x (2 norms, q, k, v, o, gate, up, down)
    for k in params:
        assert tensors[TensorKey(name=k.name, kind=Kind.EXP_AVG_SQ)].shape == tensors[k].shape
        if distopt:  # the DistributedOptimizer's fp32 master equals the fp32 weights bit for bit
            assert torch.equal(tensors[k], tensors[TensorKey(name=k.name, kind=Kind.MASTER)]), k
    assert index.meta["train_state"]["rng"] is not None


# (source tp, pp, dp, distopt) -> [(format, tp, pp, dp)]: converted, re-read, resumed at the target layout
CONVERSIONS = {
    (2, 1, 1, True): [("megatron-legacy", 1, 1, 1), ("megatron-legacy", 1, 2, 1), ("megatron-legacy", 1, 1, 2),
                      ("megatron", 1, 2, 1)],
    (1, 2, 1, True): [("megatron-legacy", 2, 1, 1), ("megatron-legacy", 1, 1, 2)],
    (2, 1, 1, False): [("megatron-legacy", 1, 1, 2)],
}
PAIRS = [(src, dst) for src, dsts in CONVERSIONS.items() for dst in dsts]


def _id(src, dst) -> str:
    t, p, d, o = src
    return f"tp{t}pp{p}dp{d}{'' if o else '-plain'}-to-{dst[0]}-tp{dst[1]}pp{dst[2]}dp{dst[3]}"


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", PAIRS, ids=[_id(s, d) for s, d in PAIRS])
def test_convert_legacy_and_resume_at_target_layout(megatron_legacy_checkpoint, tmp_path, src, dst):
    ck = megatron_legacy_checkpoint(*src[:3], distributed_optimizer=src[3])
    fmt, tp, pp, dp = dst
    target = tmp_path / "iter_0000002"
    outcome = convert(ck.path, target, to=fmt, target=LayoutRequest(dp=dp, tp=tp, pp=pp))
    back = read_index(target)
    assert back.format == fmt and (back.meta["tp"], back.meta["pp"], back.meta["dp"]) == (tp, pp, dp)
    assert _same_state(outcome.plan.source, back) == []  # weights, fp32 master, exp_avg, exp_avg_sq
    results = _resume_ranks(ck, target, tp, pp, dp)
    _close(results[0].losses, ck.losses[2:])
    _rng_as_reported(target, results, tp * pp * dp)


@pytest.mark.slow
def test_torch_dist_to_legacy_and_back(megatron_checkpoint, megatron_legacy_checkpoint, tmp_path):
    dist_ck = megatron_checkpoint(2, 1, 1, global_batch_size=GBS)
    want = megatron_legacy_checkpoint(2, 1, 1).losses[2:]  # same seed, data and layout: the reference steps 3-4
    legacy = tmp_path / "legacy" / "iter_0000002"
    outcome = convert(dist_ck.path, legacy, to="megatron-legacy", target=LayoutRequest(dp=1, tp=1, pp=2))
    assert _same_state(outcome.plan.source, read_index(legacy)) == []
    again = tmp_path / "dist" / "iter_0000002"
    back = convert(legacy, again, to="megatron", target=LayoutRequest(dp=1, tp=2, pp=1))
    assert _same_state(outcome.plan.source, read_index(again)) == []
    assert back.plan.source.format == "megatron-legacy"
    _close(_resume(dist_ck, legacy, 1, 2, 1), want)


@pytest.mark.slow
def test_cli_inspect_and_convert_name_the_legacy_format(megatron_legacy_checkpoint, tmp_path):
    from migrate.cli import main

    ck = megatron_legacy_checkpoint(2, 1, 1)
    runner = CliRunner()
    shown = runner.invoke(main, ["inspect", str(ck.path)])
    assert shown.exit_code == 0, shown.output
    assert "megatron-legacy" in shown.output
    out = runner.invoke(main, ["convert", str(ck.path), str(tmp_path / "dst"), "--to", "megatron-legacy", "--tp", "1"])
    assert out.exit_code == 0, out.output
    assert read_index(tmp_path / "dst").meta["tp"] == 1


@pytest.mark.slow
def test_broken_rank_files_are_named(megatron_legacy_checkpoint, tmp_path):
    ck = megatron_legacy_checkpoint(2, 1, 1)
    broken = tmp_path / "truncated"
    shutil.copytree(ck.path, broken)
    victim = broken / "mp_rank_01" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        read_index(broken)
    with pytest.raises(Exception, match="mp_rank_01/model_optim_rng.pt"):
        launch(dataclasses.replace(ck.spec, load_dir=str(broken), save_dir=None), 2)

    missing_optim = tmp_path / "no_optim"
    shutil.copytree(ck.path, missing_optim)
    (missing_optim / "mp_rank_00" / "distrib_optim.pt").unlink()
    with pytest.raises(CheckpointFormatError, match="mp_rank_00/distrib_optim.pt: file is missing"):
        read_index(missing_optim)

    missing_dir = tmp_path / "no_rank"
    shutil.copytree(ck.path, missing_dir)
    shutil.rmtree(missing_dir / "mp_rank_01")
    with pytest.raises(CheckpointFormatError, match=r"missing \['mp_rank_01'\]"):
        read_index(missing_dir)


@pytest.mark.slow
def test_moe_expert_parallel_legacy_resumes_and_converts(megatron_legacy_checkpoint, tmp_path):
    """Mixtral-style model at EP2·DP2: Megatron-Core's ChainedOptimizer writes [dense, expert] parameter states
    (dense only in the EP rank 0 dir); resumed bit-identically, converted to EP1·DP1 and resumed there."""
    ck = megatron_legacy_checkpoint(1, 1, 2, ep=2, moe=True)
    assert sorted(p.name for p in ck.path.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    spec = dataclasses.replace(ck.spec, load_dir=str(ck.path), save_dir=None)
    assert launch(spec, 2)[0].losses == ck.losses[2:]
    target = tmp_path / "iter_0000002"
    outcome = convert(ck.path, target, to="megatron-legacy", target=LayoutRequest(dp=1, ep=1))
    assert _same_state(outcome.plan.source, read_index(target)) == []
    _close(launch(dataclasses.replace(spec, ep=1, load_dir=str(target)), 1)[0].losses, ck.losses[2:])


@pytest.mark.slow
def test_virtual_pipeline_legacy_round_trip(tmp_path):
    """PP2·vPP2 (4 layers): chunks `model0`/`model1`, one grad buffer each in distrib_optim.pt. Resumed
    bit-identically; converted to PP2 without virtual stages and written back at vPP2 (the writer's
    `convert(..., vpp=2)`): re-read equal, and Megatron-Core resumes it at vPP2 with the same losses."""
    from migrate.workload.fixtures import TINY_LLAMA
    from migrate.workload.run_spec import RunSpec, TrainSpec

    spec = RunSpec(engine="megatron", model=dataclasses.replace(TINY_LLAMA, num_layers=4), steps=4, pp=2, vpp=2,
                   distributed_optimizer=True, save_every=2, checkpoint_format="torch", save_dir=str(tmp_path / "src"),
                   train=TrainSpec(global_batch_size=GBS))
    want = launch(spec, 2)[0].losses[2:]
    source = tmp_path / "src" / "iter_0000002"
    resume = dataclasses.replace(spec, load_dir=str(source), save_dir=None)
    assert launch(resume, 2)[0].losses == want
    index = read_index(source)
    assert index.meta["vpp"] == 2
    flat = tmp_path / "pp2" / "iter_0000002"
    convert(source, flat, to="megatron-legacy", target=LayoutRequest(vpp=1))  # pp kept (2), virtual stages dropped
    assert read_index(flat).meta["vpp"] == 1 and _same_state(index, read_index(flat)) == []
    back = tmp_path / "vpp2" / "iter_0000002"
    convert(flat, back, to="megatron-legacy", target=LayoutRequest(vpp=2))
    again = read_index(back)
    assert again.meta["vpp"] == 2 and _same_state(index, again) == []
    _close(launch(dataclasses.replace(resume, load_dir=str(back)), 2)[0].losses, want)


@pytest.mark.slow
def test_bf16_legacy_keys_each_grad_buffer_by_its_param_dtype(megatron_legacy_checkpoint, tmp_path):
    """bf16 weights with fp32 norms: Megatron-Core keeps two grad buffers per chunk, keyed (bf16, fp32) and
    (fp32, fp32) in distrib_optim.pt; the reader maps both and the writer emits them so that
    `load_parameter_state` takes the result at another layout."""
    ck = megatron_legacy_checkpoint(2, 1, 1, precision="bf16")
    raw = torch.load(ck.path / "mp_rank_00" / "distrib_optim.pt", weights_only=False)
    assert [next(iter(raw[g])) for g in (0, 1)] == [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    source = read_index(ck.path)
    assert {e.dtype for e in source.entries if e.key.kind is Kind.PARAM and "norm" in e.key.name} == {"float32"}
    target = tmp_path / "legacy"
    outcome = convert(ck.path, target, to="megatron-legacy", target=LayoutRequest(dp=1, tp=1, pp=2))
    assert _same_state(outcome.plan.source, read_index(target)) == []
    planned = {e.key.name: e.dtype for e in outcome.plan.target.index.entries if e.key.kind is Kind.PARAM}
    assert planned["norm.weight"] == "float32" and planned["embed_tokens.weight"] == "bfloat16"
    # in named_parameters order a dtype's first param opens its buffer: the last stage starts with a layer's norm
    written = torch.load(target / "iter_0000002" / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert [next(iter(written[g])) for g in (0, 1)] == [(torch.float32, torch.float32),
                                                         (torch.bfloat16, torch.float32)]
    losses = _resume(ck, target, 1, 2, 1)
    assert len(losses) == 2 and losses[0] == pytest.approx(ck.losses[2], rel=2e-2)
