"""Optimizer state beyond Adam, resharded and judged by the frameworks' own loads.

Sources are real runs saved by the frameworks' own save paths: FSDP2 at 2 Gloo ranks with torch's SGD (momentum,
Nesterov), AdamW(amsgrad) and Muon, saved with `dcp.save` of `get_model_state_dict` / `get_optimizer_state_dict`;
DeepSpeed ZeRO-2 at 2 ranks with a client optimizer (torch's SGD, AdamW(amsgrad)), saved with
`engine.save_checkpoint`. Each is converted to another world size (and across the two formats) and loaded by the
target framework with the same optimizer: DCP's `load` + `set_optimizer_state_dict` under FSDP2, DeepSpeed's
`load_checkpoint`. Every weight and every optimizer state tensor (momentum buffers, both moments, amsgrad's max,
the step) then equals what the saving run held, read back with the frameworks' own accessors (full state dicts,
`safe_get_full_optimizer_state`). Factored state (torch's Adafactor: row/column variances) is carried where the
parameter stays whole and refused by name where a target splits or flattens it; targets with fixed Adam slots
(Megatron, DeepSpeed universal) refuse other state by name instead of dropping it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import PlanError
from checkpoint.index import Kind
from tests.cli_process import run_migrate

pytestmark = pytest.mark.slow

SAVE_WORLD = 2
STEPS = 3
TAG = f"global_step{STEPS}"
STATE = {"sgd": ("momentum_buffer",), "adamw_amsgrad": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
         "muon": ("momentum_buffer",)}


def _model() -> torch.nn.Module:
    """Bias-free (Muon takes matrices only), with row counts that split unevenly over 2 and 3 ranks."""
    return torch.nn.Sequential(torch.nn.Linear(12, 13, bias=False), torch.nn.ReLU(), torch.nn.Linear(13, 7, bias=False))


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    if name == "adamw_amsgrad":
        return torch.optim.AdamW(params, lr=0.01, amsgrad=True, foreach=False)
    if name == "muon":
        return torch.optim.Muon(params, lr=0.02)
    raise ValueError(name)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(100 * step + rank))


def _hparams(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _rank_fsdp(ctx: Any, optimizer: str, path: str, save: bool) -> Any:
    """Save: train STEPS steps under FSDP2 and `dcp.save`; load: a fresh model (other weights) `dcp.load`ed.
    Either way, rank 0 returns the full state: {(name, kind): tensor}, the param groups' hyper-parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.manual_seed(0 if save else 1)
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    optim = _optimizer(optimizer, model.parameters())
    if save:
        for step in range(STEPS):
            model(_batch(ctx.rank, step)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
        dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)},
                 checkpoint_id=path)
    else:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=full)
    optim_sd = get_optimizer_state_dict(model, optim, options=full)
    if ctx.rank != 0:  # full state dicts with cpu_offload are rank 0's only
        return None
    out = {(n, "fp32_master"): t.clone() for n, t in weights.items()}
    out |= {(n, k): torch.as_tensor(v).clone() for n, s in optim_sd["state"].items() for k, v in s.items()}
    return out, _hparams(optim_sd["param_groups"])


def _rank_deepspeed(ctx: Any, optimizer: str, path: str, save: bool) -> Any:
    """Save: train STEPS steps under DeepSpeed ZeRO-2 with the client optimizer and `save_checkpoint`; load: a fresh
    engine (other weights) `load_checkpoint`s. Rank 0 returns {(name, kind): full tensor} (DeepSpeed's own
    accessors) and the wrapped optimizer's param-group hyper-parameters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.set_num_threads(1)
    torch.manual_seed(0 if save else 1)
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(optimizer, model.parameters()),
                                           config=config)
    if save:
        for step in range(STEPS):
            engine.backward(engine(_batch(ctx.rank, step)).pow(2).mean())
            engine.step()
        engine.save_checkpoint(path, tag=TAG)
    else:
        loaded, _ = engine.load_checkpoint(path)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from {path}")
    engine.optimizer._hp_optimizer_states_linked = False  # ZeRO-2 links its state accessors lazily
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    inner = engine.optimizer.optimizer
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        out[(name, "fp32_master")] = safe_get_full_fp32_param(p).clone()
        for kind in STATE[optimizer]:
            if kind != "step":
                out[(name, kind)] = safe_get_full_optimizer_state(p, kind).clone()
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return out, _hparams(inner.param_groups), steps


def _group(world: int, engine: str):
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group
    from migrate.workload.engines import engine_modules

    return start_worker_group(WorkerGroupSpec(world_size=world, mode="local", backend="gloo", timeout_s=300,
                                              env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
                                              preload=engine_modules(engine)))


def fsdp_run(optimizer: str, path: Path, *, world: int, save: bool) -> Any:
    with _group(world, "fsdp") as group:
        return group.run(_rank_fsdp, optimizer, str(path), save)[0]


def deepspeed_run(optimizer: str, path: Path, *, world: int, save: bool) -> Any:
    with _group(world, "deepspeed") as group:
        return group.run(_rank_deepspeed, optimizer, str(path), save)[0]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """`get(engine, optimizer)` -> (checkpoint dir, the saving run's full state); each run once per session."""
    cache: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(engine: str, optimizer: str) -> tuple[Path, Any]:
        if (engine, optimizer) not in cache:
            out = tmp_path_factory.mktemp(f"{engine}_{optimizer}") / "ckpt"
            run = fsdp_run if engine == "fsdp" else deepspeed_run
            cache[(engine, optimizer)] = out, run(optimizer, out, world=SAVE_WORLD, save=True)
        return cache[(engine, optimizer)]

    return get


def _unequal(want: dict, got: dict) -> list:
    assert set(got) == set(want), f"state names differ: {sorted(set(got) ^ set(want))}"
    return [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_amsgrad", "muon"])
def test_fsdp2_optimizer_state_reshards_2_to_3_ranks_and_dcp_loads_it_equal(saved, tmp_path, optimizer):
    src, (truth, groups) = saved("fsdp", optimizer)
    index = read_index(src)
    kinds = {str(e.key.kind) for e in index.entries} - {"param"}
    assert kinds == set(STATE[optimizer]), kinds
    dst = tmp_path / "dcp3"
    convert(src, dst, to="dcp", target=LayoutRequest(dp=3))
    loaded, loaded_groups = fsdp_run(optimizer, dst, world=3, save=False)
    assert not _unequal(truth, loaded), f"DCP's load at 3 ranks differs from the {optimizer} run"
    assert loaded_groups == groups


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_amsgrad"])
def test_deepspeed_client_optimizer_state_reshards_2_to_3_ranks_and_deepspeed_loads_it_equal(saved, tmp_path,
                                                                                             optimizer):
    src, (truth, groups, steps) = saved("deepspeed", optimizer)
    index = read_index(src)
    assert {str(e.key.kind) for e in index.entries} - {"param", "fp32_master"} == set(STATE[optimizer])
    dst = tmp_path / "ds3"
    convert(src, dst, to="deepspeed", target=LayoutRequest(dp=3, zero_stage=2))
    loaded, loaded_groups, loaded_steps = deepspeed_run(optimizer, dst, world=3, save=False)
    assert not _unequal(truth, loaded), f"DeepSpeed's load at 3 ranks differs from the {optimizer} run"
    assert loaded_groups == groups and loaded_steps == steps == ([float(STEPS)] if "step" in STATE[optimizer] else [])


def test_sgd_momentum_crosses_from_fsdp2_to_deepspeed_and_back(saved, tmp_path):
    """FSDP2's SGD state into DeepSpeed's ZeRO-2 flat partitions at 3 ranks, and DeepSpeed's back into DCP at 1."""
    src, (truth, _) = saved("fsdp", "sgd")
    ds = tmp_path / "ds"
    convert(src, ds, to="deepspeed", target=LayoutRequest(dp=3, zero_stage=2))
    loaded, groups, _ = deepspeed_run("sgd", ds, world=3, save=False)
    assert not _unequal(truth, loaded), "DeepSpeed's load of FSDP2's SGD state differs from the run"
    assert groups[0]["momentum"] == 0.9 and groups[0]["nesterov"] is True
    ds_src, (ds_truth, _, _) = saved("deepspeed", "sgd")
    back = tmp_path / "dcp1"
    convert(ds_src, back, to="dcp", target=LayoutRequest(dp=1))
    loaded, groups = fsdp_run("sgd", back, world=1, save=False)
    assert not _unequal(ds_truth, loaded), "DCP's load of DeepSpeed's SGD state differs from the run"


@pytest.mark.parametrize("to", ["megatron", "deepspeed-universal"])
def test_targets_with_adam_slots_refuse_other_state_by_name(saved, tmp_path, to):
    src, _ = saved("fsdp", "sgd")
    dst = tmp_path / "out"
    with pytest.raises(PlanError, match=r"momentum_buffer on 2 parameter\(s\), e\.g\. 0\.weight has no place there"):
        convert(src, dst, to=to, target=LayoutRequest(dp=1, zero_stage=2)) if to != "megatron" else convert(src, dst, to=to)
    assert not dst.exists()
    cli = run_migrate(["convert", str(src), str(tmp_path / "cli"), "--to", to])
    assert cli.returncode == 2 and "momentum_buffer" in cli.stderr and "Traceback" not in cli.stderr


# ---------------------------------------------------------------- factored state (torch's Adafactor)

def _adafactor_checkpoint(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """A single-process run with torch's Adafactor saved with `dcp.save` (no process group: the parameters stay
    whole); returns its state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.Adafactor(model.parameters(), lr=0.01)
    for step in range(STEPS):
        model(_batch(0, step)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    out = {(n, "fp32_master"): t.clone() for n, t in state["model"].items()}
    return out | {(n, k): torch.as_tensor(v).clone() for n, s in state["optimizer"]["state"].items()
                  for k, v in s.items()}


def _adafactor_load(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    torch.manual_seed(1)
    model = _model()
    optim = torch.optim.Adafactor(model.parameters(), lr=0.01)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optimizer"])
    sd = get_optimizer_state_dict(model, optim)
    out = {(n, "fp32_master"): t.clone() for n, t in get_model_state_dict(model).items()}
    return out | {(n, k): torch.as_tensor(v).clone() for n, s in sd["state"].items() for k, v in s.items()}


def test_factored_state_is_carried_whole_and_refused_by_name_where_parameters_are_split(tmp_path):
    src = tmp_path / "adafactor"
    truth = _adafactor_checkpoint(src)
    index = read_index(src)
    kinds = {str(e.key.kind) for e in index.entries if e.key.kind is not Kind.PARAM}
    assert {"row_var", "col_var", "step"} <= kinds
    whole = tmp_path / "whole"
    convert(src, whole, to="dcp", target=LayoutRequest(dp=1))
    assert not _unequal(truth, _adafactor_load(whole)), "DCP's load of the carried Adafactor state differs"
    for to, opts, why in (("dcp", {"dp": 2}, "FSDP2 shards each parameter along dim 0 over 2 ranks"),
                          ("deepspeed", {"dp": 1, "zero_stage": 2}, "ZeRO-2 flattens every parameter's state")):
        dst = tmp_path / f"{to}_split"
        with pytest.raises(PlanError) as err:
            convert(src, dst, to=to, target=LayoutRequest(**opts))
        message = str(err.value)
        assert "row_var" in message and why in message and "not its parameter's" in message, message
        assert not dst.exists()
