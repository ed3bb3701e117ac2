"""Megatron-LM legacy per-rank checkpoints (`--ckpt-format torch`): reader and writer.

On disk (`iter_NNNNNNN/`, Megatron-LM's `get_checkpoint_name`): one directory per model-parallel rank,
`mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]` (pp suffix only when pp > 1, ep suffix only when ep > 1), holding
* `model_optim_rng.pt`: {args (argparse.Namespace), checkpoint_version, iteration, model | model0..
  (the chunk's local tensors, layers numbered locally, experts `mlp.experts.local_experts.{i}`), optimizer
  (`optimizer.state_dict()`), opt_param_scheduler, rng_state (list: one state, or one per DP rank),
  num_floating_point_operations_so_far, migrate (the built-in engines' state and model shape)};
* `distrib_optim.pt` (DistributedOptimizer): Megatron-Core's `save_parameter_state`, the DP-rank-0 gather
  `{buckets_coalesced, gbuf_idx: {(param dtype, grad dtype): {param, exp_avg, exp_avg_sq, numel_unpadded}}}`,
  one flat fp32 world tensor per grad buffer (= model chunk), params in reverse named_parameters order each
  padded to 64 elements (the dp_reshardable bucket layout of `checkpoint.formats.megatron`); under expert
  parallelism a list [dense state | None, expert state] (Megatron-Core's ChainedOptimizer).
Without the DistributedOptimizer `optimizer` is torch Adam's state dict (per-parameter state indexed in
Megatron-Core's param-group order: weight-decay group (2-D params), then the no-decay group (1-D params)).

The index is canonical (the rules of `checkpoint.rules.megatron`), so legacy <-> torch_dist <-> other formats
at any TP/PP/EP/DP. The writer emits the DistributedOptimizer form at the target layout; Megatron-Core loads it
with `model.load_state_dict`, `optimizer.load_state_dict`, `optimizer.load_parameter_state`.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError, PlanError
from checkpoint.formats.base import check_agreement, refuse_frozen_params, refuse_shared_params, scalar
from checkpoint.formats.megatron import (FORMAT as DIST_FORMAT, LEGACY_FORMAT, TRACKER_FILE, LocalParam, arch_of_common,
                                         bucket_offsets, canonical_train_state, check_padded_vocab, grad_buffers,
                                         iteration_dir_name, param_dtypes, saved_model_spec, tracker_text,
                                         domain_params, megatron_meta_from, param_flat_pieces,
                                         resolve_iteration_dir, source_arch, target_optimizer_groups,
                                         check_pipeline_split, pipeline_split_of, target_pipeline_split,
                                         target_training_state, target_vpp)
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorEntry, TensorKey, dtype_name
from checkpoint.layout import PIPELINE_STAGE_FIELDS, OptimizerSharding, ParallelLayout
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import (SWIGLU_ARCHITECTURES, canonical_tensors, expert_range, held_layers,
                                       pipeline_stage_layers, stored_rules)
from checkpoint.formats.megatron_args import PIPELINE_STAGE_ARGS, args_summary, as_mapping, layout_from_args
from checkpoint.formats.megatron_paths import MODEL_FILE, OPTIM_FILE, RANK_DIR_RE, rank_dir
from checkpoint.state.optimizer_state import refuse_unplaced_state
from checkpoint.state.rng import expand_megatron_rng, from_megatron, roles, to_megatron
from checkpoint.state.training_state import STATE_REPORT_FILE

FORMAT = LEGACY_FORMAT
STATE_KINDS = {"param": Kind.MASTER, "exp_avg": Kind.EXP_AVG, "exp_avg_sq": Kind.EXP_AVG_SQ}
_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def _untied(arch: ModelShape, where: str) -> ModelShape:
    """Refuse tied input/output embeddings by name: the legacy reader/writer map the output layer's own weight
    (a tied model's last stage holds a copy of the embedding that this module does not map yet)."""
    if arch.tied_embeddings:
        raise CheckpointFormatError(f"{where}: tied input/output embeddings (tied_embeddings=True) are not supported "
                                    f"by the legacy Megatron format; convert through torch_dist (format 'megatron')")
    return arch


def is_legacy_checkpoint(path: str | Path) -> bool:
    """An iteration dir (or a save dir whose tracker names one) holding `mp_rank_*/model_optim_rng.pt`."""
    root = resolve_iteration_dir(path)
    try:
        return any(RANK_DIR_RE.match(p.name) and (p / MODEL_FILE).is_file() for p in root.iterdir())
    except OSError:
        return False


# ---------------------------------------------------------------- local tensors of one rank (pure)

def local_params(arch: ModelShape, *, tp: int, pp: int, vpp: int, ep: int, tp_rank: int, pp_rank: int, ep_rank: int,
                 vp_stage: int, first_pipeline_stage_layers: int | None = None,
                 last_pipeline_stage_layers: int | None = None) -> list[tuple[str, LocalParam]]:
    """(state-dict name, LocalParam) of every parameter of one model chunk on one rank, named_parameters order
    (layers numbered within the chunk, experts within the EP rank)."""
    out = []
    split = {"first_pipeline_stage_layers": first_pipeline_stage_layers, "last_pipeline_stage_layers": last_pipeline_stage_layers}
    first_layer = pipeline_stage_layers(arch.num_layers, pp, vpp, pp_rank, vp_stage, **split).start
    experts = expert_range(arch.num_experts, ep, ep_rank) if arch.num_experts else range(0)
    for p in domain_params(arch, tp=tp, pp=pp, vpp=vpp, ep=1, tp_rank=tp_rank, pp_rank=pp_rank, vp_stage=vp_stage,
                           ep_rank=0, experts=False, **split):
        if p.rule.scope == "expert" and p.expert not in experts:
            continue
        out.append((_state_name(p, first_layer, experts.start if p.rule.scope == "expert" else 0), p))
    return out


def local_buffers(arch: ModelShape, *, tp: int, pp: int, vpp: int, tp_rank: int, pp_rank: int, vp_stage: int,
                  first_pipeline_stage_layers: int | None = None,
                  last_pipeline_stage_layers: int | None = None) -> list[tuple[str, LocalParam]]:
    """(state-dict name, LocalParam) of every persistent buffer Megatron-Core saves with one model chunk (the
    router's expert bias of each MoE layer): model tensors without grad or optimizer state."""
    layers = pipeline_stage_layers(arch.num_layers, pp, vpp, pp_rank, vp_stage,
                                   first_pipeline_stage_layers=first_pipeline_stage_layers,
                                   last_pipeline_stage_layers=last_pipeline_stage_layers)
    out = []
    for rule in (r for r in stored_rules(arch) if r.buffer):
        for layer in (i for i in layers if i in held_layers(rule, arch)):
            lp = LocalParam.of(rule, arch, tp=tp, tp_rank=tp_rank, layer=layer, expert=None)
            out.append((_state_name(lp, layers.start, 0), lp))
    return out


def _state_name(p: LocalParam, first_layer: int, first_expert: int) -> str:
    if p.rule.scope == "model":
        return p.rule.param
    assert p.layer is not None  # a layer or expert rule's parameter has its layer
    prefix = f"decoder.layers.{p.layer - first_layer}."
    if p.rule.scope == "expert":
        assert p.expert is not None
        prefix += f"mlp.experts.local_experts.{p.expert - first_expert}."
    return prefix + p.rule.param


def _canonical_chunks(arch: ModelShape, p: LocalParam, file: str, key: tuple,
                      start: int = 0) -> list[tuple[str, ChunkRef]]:
    return [(pc.name, ChunkRef(file=file, key=key, offsets=pc.offsets, lengths=pc.lengths,
                               storage_offset=pc.storage_offset))
            for pc in param_flat_pieces(arch, p, 0, p.numel, start)]


def _owned(p: LocalParam, tp_rank: int, ep_rank: int) -> bool:
    """Whether this rank's copy is the one indexed: TP-replicated tensors from TP rank 0, dense tensors from
    EP rank 0 (every EP rank's file holds them)."""
    return (p.rule.tp_dim is not None or tp_rank == 0) and (p.rule.scope == "expert" or ep_rank == 0)


# ---------------------------------------------------------------- reader

def _layout_from(args: Any, dirs: Mapping[str, Path], state: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """tp/pp/ep/vpp/dp from the saved args, checked against the rank directories present."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    try:
        tp, pp = int(a["tensor_model_parallel_size"]), int(a["pipeline_model_parallel_size"])
    except KeyError as err:
        raise CheckpointFormatError(f"{where}: args lack {err.args[0]!r}; cannot tell the layout") from None
    ep = int(a.get("expert_model_parallel_size") or 1)
    vpp = int(a.get("virtual_pipeline_model_parallel_size") or 1)
    chunks = sum(1 for k in state if re.fullmatch(r"model\d*", k))
    if chunks != vpp:
        raise CheckpointFormatError(f"{where}: holds {chunks} model chunks but args say "
                                    f"virtual_pipeline_model_parallel_size={vpp}")
    dp = a.get("data_parallel_size")
    want = {rank_dir(tp_rank=t, pp_rank=p, ep_rank=e, pp=pp, ep=ep)
            for t in range(tp) for p in range(pp) for e in range(ep)}
    missing, extra = sorted(want - set(dirs)), sorted(set(dirs) - want)
    if missing or extra:
        raise CheckpointFormatError(f"{where.parent.parent}: rank directories for tp={tp} pp={pp} ep={ep}: missing "
                                    f"{missing or 'none'}, unexpected {extra or 'none'}")
    split = {k: v for k, v in layout_from_args(a, where=str(where)).items() if k in PIPELINE_STAGE_FIELDS}
    return {"tp": tp, "pp": pp, "ep": ep, "vpp": vpp, "dp": None if dp is None else int(dp), **split}


def _load(path: Path, trust: bool) -> Any:
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: file is missing (a rank's legacy checkpoint file)")
    return safe_load.load(path, mmap=True, trust_checkpoint=trust)


def read_megatron_legacy(path: str | Path, *, trust_checkpoint: bool = False, expect_tp: int | None = None,
                         expect_pp: int | None = None, expect_ep: int | None = None,
                         expect_dp: int | None = None, model_config: Mapping[str, Any] | None = None
                         ) -> CheckpointIndex:
    """Index a legacy checkpoint: every rank file is opened with mmap (pickles read, tensor data left on disk).

    Raises CheckpointFormatError naming the file for a missing/truncated rank file or a tensor the rules do not
    explain, LayoutMismatchError when the declared layout differs from the saved one."""
    root = resolve_iteration_dir(path)
    if not is_legacy_checkpoint(root):
        raise CheckpointFormatError(f"{root}: not a Megatron-LM legacy checkpoint (no mp_rank_*/{MODEL_FILE})")
    dirs = {p.name: p for p in sorted(root.iterdir()) if RANK_DIR_RE.match(p.name) and p.is_dir()}
    first = dirs[min(dirs)] / MODEL_FILE
    head = _load(first, trust_checkpoint)
    layout = _layout_from(head.get("args"), dirs, head, first)
    for name, want in (("tp", expect_tp), ("pp", expect_pp), ("ep", expect_ep), ("dp", expect_dp)):
        if want is not None and layout[name] is not None and want != layout[name]:
            raise LayoutMismatchError(f"{root}: declared {name}={want} but the checkpoint was saved at "
                                      f"{name}={layout[name]}")
    arch, overridden = arch_of_common(head, first, model_config)
    arch = _untied(arch, str(first))
    tp, pp, ep = layout["tp"], layout["pp"], layout["ep"]
    acc: dict[TensorKey, tuple[str, list[ChunkRef]]] = {}
    shapes = dict(canonical_tensors(arch))

    def put(kind: Kind, dtype: str, pieces: list[tuple[str, ChunkRef]]) -> None:
        for name, ref in pieces:
            acc.setdefault(TensorKey(name=name, kind=kind), (dtype, []))[1].append(ref)

    rng_objects: dict[tuple[int, int], list[dict[str, Any]]] = {}
    groups: list[Any] = []
    sharding = None
    saved: dict[str, dict[str, Any]] = {}  # per rank file: what every rank file of one save agrees on
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                rel = rank_dir(tp_rank=t, pp_rank=p, ep_rank=e, pp=pp, ep=ep)
                model_rel, optim_rel = f"{rel}/{MODEL_FILE}", f"{rel}/{OPTIM_FILE}"
                state = head if root / model_rel == first else _load(root / model_rel, trust_checkpoint)
                saved[str(root / model_rel)] = _save_identity(state)
                params = _index_model(arch, state, layout, t, p, e, root / model_rel, model_rel, put)
                if e == 0 and state.get("rng_state"):
                    rng_objects[(p, t)] = [from_megatron(st, where=f"{root / model_rel}: rng_state")
                                           for st in state["rng_state"]]
                if (root / optim_rel).is_file():
                    sharding = "dp_zero"
                    dtypes = {lp.rule.key: dtype_name(state["model" if len(params) == 1 else f"model{v}"][name].dtype)
                              for v, chunk in enumerate(params) for name, lp in chunk}
                    found = _index_distrib_optim(arch, _load(root / optim_rel, trust_checkpoint), layout, t, p, e,
                                                 root / optim_rel, optim_rel, put, dtypes)
                    if (t, p, e) == (0, 0, 0):
                        groups = _distopt_groups(state.get("optimizer"), found, root / model_rel)
                elif isinstance(state.get("optimizer"), Mapping) and "fp32_from_fp16_params" in state["optimizer"]:
                    raise CheckpointFormatError(f"{root / model_rel}: plain bf16/fp16 optimizer state (Megatron-Core's "
                                                f"Float16Optimizer) is not supported; save with the "
                                                f"DistributedOptimizer")
                elif isinstance(state.get("optimizer"), Mapping) and "state" in state["optimizer"]:
                    sharding = "plain"
                    _index_plain_optim(arch, state["optimizer"], params, t, e, root / model_rel, model_rel, put)
                    if (t, p, e) == (0, 0, 0):
                        groups = [_plain_groups(state["optimizer"], root / model_rel)]
                elif state.get("optimizer") is not None:
                    raise CheckpointFormatError(f"{root / optim_rel}: file is missing (the DistributedOptimizer's "
                                                f"parameter state) and {root / model_rel} holds no plain "
                                                f"optimizer state")
    for field in next(iter(saved.values())):
        check_agreement(field, {f: ident[field] for f, ident in saved.items()})
    entries = []
    for key in sorted(acc, key=lambda k: (k.name, str(k.kind))):
        dtype, chunks = acc[key]
        entry = TensorEntry(key=key, shape=shapes[key.name], dtype=dtype, chunks=tuple(chunks))
        entry.check_complete()
        entries.append(entry)
    common = {k: head[k] for k in ("iteration", "checkpoint_version", "migrate", "args",
                                   "num_floating_point_operations_so_far") if k in head}
    rng = None
    if rng_objects:
        dp = layout["dp"] or max(len(v) for v in rng_objects.values())
        src = roles(tp=tp, pp=pp, dp=dp, ep=ep)
        rng = {"states": expand_megatron_rng(rng_objects, src, where=f"{root}: rng_state"),
               "roles": [r.as_dict() for r in src]}
    params_dtype = next((e.dtype for e in entries if e.key.kind is Kind.PARAM), "float32")
    meta = {"arch": arch.tensor_fields(), **layout, "sharding": sharding,
            "common": common, "optimizer_groups": groups, "iteration": head.get("iteration"),
            "model_dtype": params_dtype, "args": _plain_args(head.get("args")), "arch_overrides": overridden,
            "megatron_args": args_summary(head.get("args")), "model_spec": saved_model_spec(common),
            "opt_param_scheduler": head.get("opt_param_scheduler"),
            "train_state": canonical_train_state(arch, common, groups, rng)}
    files = tuple(sorted({c.file for e in entries for c in e.chunks}))
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=files, meta=meta)


_IDENTITY_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "world_size", "data_parallel_size", "consumed_train_samples",
                  "num_layers", "hidden_size", "use_distributed_optimizer")


def _save_identity(state: Mapping[str, Any]) -> dict[str, Any]:
    """What every rank file of one Megatron-LM save holds alike: iteration, checkpoint_version, the layout and
    size args, and the optimizer's step per param group."""
    a = vars(state["args"]) if isinstance(state.get("args"), argparse.Namespace) else dict(state.get("args") or {})
    optim = state.get("optimizer")
    chained = optim if isinstance(optim, list) else [optim]
    steps = [[scalar(pg.get("step")) for pg in (o.get("optimizer") or o).get("param_groups", [])]
             for o in chained if isinstance(o, Mapping) and isinstance((o.get("optimizer") or o), Mapping)]
    return {"iteration": state.get("iteration"), "checkpoint_version": state.get("checkpoint_version"),
            "args (layout and sizes)": {k: a.get(k) for k in _IDENTITY_ARGS},
            "the optimizer's step per param group": steps}


def _plain_args(args: Any) -> dict[str, Any]:
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return {k: v for k, v in a.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _index_model(arch: ModelShape, state: Mapping[str, Any], layout: Mapping[str, int], t: int, p: int, e: int,
                 where: Path, rel: str, put: Any) -> list[list[tuple[str, LocalParam]]]:
    """Index one rank file's model chunks; returns the rank's params per chunk (named_parameters order)."""
    tp, pp, ep, vpp = layout["tp"], layout["pp"], layout["ep"], layout["vpp"]
    out = []
    for v in range(vpp):
        mkey = "model" if vpp == 1 else f"model{v}"
        sd = state.get(mkey)
        if not isinstance(sd, Mapping):
            raise CheckpointFormatError(f"{where}: no {mkey!r} state dict (keys: {sorted(state)})")
        params = local_params(arch, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=t, pp_rank=p, ep_rank=e, vp_stage=v,
                              **pipeline_split_of(layout))
        buffers = local_buffers(arch, tp=tp, pp=pp, vpp=vpp, tp_rank=t, pp_rank=p, vp_stage=v,
                                **pipeline_split_of(layout))
        known = {name for name, _ in params + buffers}
        unknown = sorted(k for k, val in sd.items() if k not in known and not k.endswith("._extra_state"))
        if unknown:
            raise CheckpointFormatError(f"{where}: {mkey} holds tensors the {arch.architecture} rules do not explain "
                                        f"for tp_rank={t} pp_rank={p} ep_rank={e} vp_stage={v}: {unknown}")
        for name, lp in params + buffers:
            tensor = sd.get(name)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointFormatError(f"{where}: {mkey}.{name} missing (tp_rank={t} pp_rank={p} ep_rank={e})")
            if tuple(tensor.shape) != lp.shape:
                raise LayoutMismatchError(f"{where}: {mkey}.{name} has shape {tuple(tensor.shape)} but the rules "
                                          f"give {lp.shape} at tp={tp} (tp_rank={t})")
            if _owned(lp, t, e):
                put(Kind.PARAM, dtype_name(tensor.dtype), _canonical_chunks(arch, lp, rel, (mkey, name)))
        out.append(params)
    return out


def _buffer_states(raw: Any, where: Path) -> list[tuple[int, Any]]:
    """[(chained optimizer index, its `get_parameter_state_dp_zero` dict or None)]."""
    if isinstance(raw, Mapping):
        return [(0, raw)]
    if isinstance(raw, list):
        return list(enumerate(raw))
    raise CheckpointFormatError(f"{where}: holds {type(raw).__name__}, not a DistributedOptimizer parameter state")


def _index_distrib_optim(arch: ModelShape, raw: Any, layout: Mapping[str, int], t: int, p: int, e: int, where: Path,
                         rel: str, put: Any, dtypes: Mapping[str, str]) -> int:
    """Index `distrib_optim.pt` of one rank dir (`dtypes`: the stored dtype per model key of its model file,
    which decides the grad buffers); returns how many chained optimizers it describes."""
    tp, pp, ep, vpp = layout["tp"], layout["pp"], layout["ep"], layout["vpp"]
    states = _buffer_states(raw, where)
    moe = arch.num_experts > 0
    for chain, st in states:
        if st is None:
            continue
        if not st.get("buckets_coalesced"):
            raise CheckpointFormatError(f"{where}: pre-2024 (uncoalesced) distributed optimizer format is not "
                                        f"supported")
        experts = moe and len(states) > 1 and chain == 1
        buffers = grad_buffers(arch, dtypes, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=t, pp_rank=p, ep_rank=e,
                               experts=experts, **pipeline_split_of(layout))
        for g, (param_dtype, params, _) in enumerate(buffers):
            if g not in st or not isinstance(st[g], Mapping) or len(st[g]) != 1:
                raise CheckpointFormatError(f"{where}: optimizer {chain} has no single-dtype grad buffer {g} "
                                            f"(keys {sorted(map(str, st))}; {len(buffers)} buffer(s) for "
                                            f"{vpp} model chunk(s), one per param dtype)")
            dkey, bufs = next(iter(st[g].items()))
            saved = dtype_name(dkey[0]) if isinstance(dkey, tuple) and dkey else str(dkey)
            if saved != param_dtype:
                raise CheckpointFormatError(f"{where}: optimizer {chain} grad buffer {g} is keyed {dkey} but the model "
                                            f"file's weights give {param_dtype} params for it")
            placed, numel = bucket_offsets(params)
            got = int(bufs.get("numel_unpadded", -1))
            sizes = {k: tuple(bufs[k].shape) for k in STATE_KINDS if isinstance(bufs.get(k), torch.Tensor)}
            if got != numel or set(sizes.values()) != {(numel,)} or len(sizes) != 3:
                raise LayoutMismatchError(f"{where}: optimizer {chain} buffer {g}: numel_unpadded {got}, tensors "
                                          f"{sizes}, but the rules give {numel} for tp_rank={t} pp_rank={p} "
                                          f"ep_rank={e} ({len(params)} params)")
            for name, kind in STATE_KINDS.items():
                for lp, start in placed:
                    if _owned(lp, t, e):
                        put(kind, dtype_name(bufs[name].dtype),
                            _canonical_chunks(arch, lp, rel, (*((chain,) if len(states) > 1 else ()), g, dkey, name),
                                              start))
    return len(states)


def _distopt_groups(optimizer: Any, chained: int, where: Path) -> list[Any]:
    """The optimizer param groups per chained optimizer ({"param_groups": [...]}, Megatron's `step` included)."""
    per = optimizer if isinstance(optimizer, list) else [optimizer]
    if len(per) != chained or not all(isinstance(o, Mapping) and "optimizer" in o for o in per):
        raise CheckpointFormatError(f"{where}: optimizer state holds {len(per)} DistributedOptimizer state dicts, "
                                    f"distrib_optim.pt {chained}")
    return [dict(o["optimizer"]) for o in per]


def plain_order(params: list[list[tuple[str, LocalParam]]]) -> list[tuple[str, LocalParam]]:
    """Megatron-Core's plain-optimizer parameter order: chunks' named_parameters, weight-decay group (matrices)
    first, then the no-decay group (1-D norms), as `_get_param_groups` sorts them."""
    flat = [x for chunk in params for x in chunk]
    return [x for x in flat if not x[1].vector] + [x for x in flat if x[1].vector]


def _index_plain_optim(arch: ModelShape, optim: Mapping[str, Any], params: list[list[tuple[str, LocalParam]]], t: int,
                       e: int, where: Path, rel: str, put: Any) -> None:
    if arch.num_experts:
        raise CheckpointFormatError(f"{where}: plain (non-distributed) optimizer state of an MoE model is not "
                                    f"supported; save with the DistributedOptimizer")
    order = plain_order(params)
    ids = [i for g in optim["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        raise CheckpointFormatError(f"{where}: optimizer lists {len(ids)} params but the rank holds {len(order)}")
    for idx, (name, lp) in zip(ids, order):
        st = optim["state"].get(idx)
        if st is None:
            raise CheckpointFormatError(f"{where}: optimizer.state[{idx}] ({name}) missing")
        for kind_name, kind in (("exp_avg", Kind.EXP_AVG), ("exp_avg_sq", Kind.EXP_AVG_SQ)):
            tensor = st.get(kind_name)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != lp.shape:
                raise LayoutMismatchError(f"{where}: optimizer.state[{idx}].{kind_name} has shape "
                                          f"{getattr(tensor, 'shape', None)} but {name} is {lp.shape}")
            if _owned(lp, t, e):
                put(kind, dtype_name(tensor.dtype), _canonical_chunks(arch, lp, rel, ("optimizer", "state", idx,
                                                                                     kind_name)))


def _plain_groups(optim: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The plain optimizer's param groups with Megatron's per-group `step` (torch Adam keeps it per param)."""
    steps = {float(st["step"]) for st in optim["state"].values() if "step" in st}
    if len(steps) > 1:
        raise CheckpointFormatError(f"{where}: parameters hold different Adam steps {sorted(steps)}")
    step = steps.pop() if steps else 0.0
    return {"param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                             for g in optim["param_groups"]]}


# ---------------------------------------------------------------- target (DistributedOptimizer form)

def legacy_args(arch: ModelShape, layout: ParallelLayout, base: Mapping[str, Any] | None, *, iteration: int,
                dtype: str) -> argparse.Namespace:
    """Megatron-LM's args for the target layout: the source's plain args with the layout fields replaced."""
    a = dict(base or {})
    a |= {"num_layers": arch.num_layers, "hidden_size": arch.hidden_size, "ffn_hidden_size": arch.ffn_hidden_size,
          "num_attention_heads": arch.num_attention_heads, "num_query_groups": arch.num_query_groups,
          "group_query_attention": arch.num_query_groups != arch.num_attention_heads,
          "swiglu": arch.architecture in SWIGLU_ARCHITECTURES, "vocab_size": arch.vocab_size,
          "add_qkv_bias": arch.qkv_bias, "qk_layernorm": arch.qk_norm or arch.is_mla,
          "moe_ffn_hidden_size": arch.expert_ffn_hidden_size if arch.num_experts else None,
          "padded_vocab_size": arch.padded_vocab_size(layout.tp), "num_experts": arch.num_experts or None,
          "make_vocab_size_divisible_by": arch.make_vocab_size_divisible_by,
          "untie_embeddings_and_output_weights": not arch.tied_embeddings,
          "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
          "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
          **{arg: layout.pipeline_split[field] for field, arg in PIPELINE_STAGE_ARGS.items()},
          "expert_model_parallel_size": layout.ep, "data_parallel_size": layout.dp, "world_size": layout.world_size,
          "use_distributed_optimizer": True, "ckpt_format": "torch", "use_dist_ckpt": False, "iteration": iteration,
          "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
          "params_dtype": getattr(torch, dtype)}
    return argparse.Namespace(**a)


def megatron_legacy_target(source: CheckpointIndex, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                           vpp: int = 1, first_pipeline_stage_layers: int | None = None,
                           last_pipeline_stage_layers: int | None = None,
                           model_config: Mapping[str, Any] | None = None) -> TargetSpec:
    """The source's state as a legacy checkpoint at (tp, pp, vpp, ep, dp) with the DistributedOptimizer: per
    (tp, pp, ep) rank dir a `model_optim_rng.pt` (local weights of every chunk, optimizer param groups, args,
    RNG, ours) and a `distrib_optim.pt` (flat fp32 master / exp_avg / exp_avg_sq per grad buffer; the dense
    optimizer's state in the EP rank 0 dir, None elsewhere, as Megatron-Core's DP-rank-0 gather leaves it).
    Raises PlanError when the source lacks the optimizer state or the architecture."""
    refuse_shared_params(source, "megatron-legacy")
    refuse_frozen_params(source, "megatron-legacy")
    refuse_unplaced_state(source, target="megatron-legacy",
                          why="distrib_optim.pt holds Adam's param, exp_avg and exp_avg_sq per grad buffer")
    arch = _untied(source_arch(source, model_config), f"source {source.root}")
    m = source.meta if source.format in (FORMAT, DIST_FORMAT) else {**source.meta, **megatron_meta_from(source, arch)}
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER,
                            first_pipeline_stage_layers=first_pipeline_stage_layers,
                            last_pipeline_stage_layers=last_pipeline_stage_layers)
    check_pipeline_split(arch, layout)
    moe = arch.num_experts > 0
    chained = moe and ep > 1
    if ep > 1 and not moe:
        raise PlanError(f"target ep={ep} but the {arch.architecture} model has no experts")
    if not any(e.key.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ) for e in source.entries):
        raise PlanError(f"source {source.root} holds no Adam moments; a DistributedOptimizer checkpoint needs them")
    if not m.get("optimizer_groups") or "common" not in m:
        raise PlanError(f"source {source.root} ({source.format}) lacks Megatron optimizer param groups / common state")
    check_padded_vocab(source, arch, tp)
    dtype = m.get("model_dtype", "float32")
    dtypes = param_dtypes(source, arch, dtype)
    state = target_training_state(m, layout)
    iteration = int(state["common"].get("iteration") or 0)
    it = iteration_dir_name(iteration)
    optimizer_groups = target_optimizer_groups(m["optimizer_groups"], chained=chained)
    args = legacy_args(arch, layout, as_mapping(m["common"].get("args")) or m.get("args"), iteration=iteration,
                       dtype=dtype)
    entries: dict[TensorKey, list[ChunkRef]] = defaultdict(list)
    entry_dtype: dict[TensorKey, str] = {}  # a weight's dtype (optimizer state is fp32)
    files = []
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                rel = f"{it}/{rank_dir(tp_rank=t, pp_rank=p, ep_rank=e, pp=pp, ep=ep)}"
                writer = layout.rank_of(tp=t, dp=e, pp=p)  # DP rank e: the (expert) DP rank 0 of EP rank e
                model_bufs = []
                for v in range(vpp):
                    mkey = "model" if vpp == 1 else f"model{v}"
                    chunk = local_params(arch, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=t, pp_rank=p, ep_rank=e,
                                         vp_stage=v, **layout.pipeline_split)
                    chunk += local_buffers(arch, tp=tp, pp=pp, vpp=vpp, tp_rank=t, pp_rank=p, vp_stage=v,
                                           **layout.pipeline_split)
                    for name, lp in chunk:
                        model_bufs.append(TargetBuffer(key=(mkey, name), shape=lp.shape, dtype=dtypes[lp.rule.key]))
                        for cname, ref in _canonical_chunks(arch, lp, f"{rel}/{MODEL_FILE}", (mkey, name)):
                            entries[TensorKey(name=cname, kind=Kind.PARAM)].append(ref)
                            entry_dtype[TensorKey(name=cname, kind=Kind.PARAM)] = dtypes[lp.rule.key]
                rng = state["rng"].get((p, t))
                files.append(TargetFile(path=f"{rel}/{MODEL_FILE}", role="model", rank=writer,
                                        buffers=tuple(model_bufs), values=model_file_values(
                                            state["common"], args=args, optimizer_groups=optimizer_groups,
                                            scheduler=m.get("opt_param_scheduler"), layout=layout,
                                            rng=None if rng is None else [to_megatron(st) for st in rng])))
                optim_bufs: list[TargetBuffer] = []
                for chain in (0, 1) if chained else (0,):
                    experts = chain == 1
                    if chained and not experts and e != 0:
                        continue
                    buffers = grad_buffers(arch, dtypes, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=t, pp_rank=p,
                                           ep_rank=e, experts=experts, **layout.pipeline_split)
                    for g, (param_dtype, params, _) in enumerate(buffers):
                        placed, numel = bucket_offsets(params)
                        path = (chain,) if chained else ()
                        dkey = (getattr(torch, param_dtype), torch.float32)  # (param, grad) dtype: grads in fp32
                        for name, kind in STATE_KINDS.items():
                            key = (*path, g, dkey, name)
                            optim_bufs.append(TargetBuffer(key=key, shape=(numel,), dtype="float32"))
                            for lp, start in placed:
                                for cname, ref in _canonical_chunks(arch, lp, f"{rel}/{OPTIM_FILE}", key, start):
                                    entries[TensorKey(name=cname, kind=kind)].append(ref)
                files.append(TargetFile(path=f"{rel}/{OPTIM_FILE}", role="distrib_optim", rank=writer,
                                        buffers=tuple(optim_bufs)))
    shapes = dict(canonical_tensors(arch))
    out = [TensorEntry(key=k, shape=shapes[k.name], dtype=entry_dtype.get(k, "float32"), chunks=tuple(c))
           for k, c in sorted(entries.items(), key=lambda kv: (kv[0].name, str(kv[0].kind)))]
    if state.get("state_report"):  # what the conversion did with each training state, for the resume stage
        files.append(TargetFile(path=STATE_REPORT_FILE, role="state_report", rank=None))
    files.append(TargetFile(path=TRACKER_FILE, role="tracker", rank=None,
                            values=(ValueItem(key=(), role=ValueRole.COMMON, value=tracker_text(state["common"])),)))
    meta = {"arch": arch.tensor_fields(), "tp": tp, "pp": pp, "dp": dp, "ep": ep, "vpp": vpp,
            **layout.pipeline_split, "chained": chained, "state_report": state["state_report"]}
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(out), files=tuple(f.path for f in files), meta=meta)
    return TargetSpec(index=index, files=tuple(files), commit=(TRACKER_FILE,))


def model_file_values(common: Mapping[str, Any], *, args: Any, optimizer_groups: list[Any], scheduler: Any,
                      layout: ParallelLayout, rng: list[Any] | None) -> tuple[ValueItem, ...]:
    """What a rank's `model_optim_rng.pt` holds beside its weights, as Megatron-LM's `save_checkpoint` writes
    it: args, checkpoint version, iteration, the optimizer's param groups (without param ids), the scheduler,
    the rank's `rng_state` (when carried), the FLOP count and our record of the layout."""
    groups = [{"optimizer": {**g, "param_groups": [dict(pg) for pg in g["param_groups"]]}} for g in optimizer_groups]
    for g in groups:
        for pg in g["optimizer"]["param_groups"]:
            pg.pop("params", None)
            if isinstance(pg.get("betas"), list):
                pg["betas"] = tuple(pg["betas"])
    scheduler = scheduler or common.get("opt_param_scheduler")
    ours = {k: v for k, v in (("tp", layout.tp), ("pp", layout.pp), ("vpp", layout.vpp), ("ep", layout.ep),
                              ("dp", layout.dp), *layout.pipeline_split.items()) if v is not None}
    held: list[tuple[str, ValueRole, Any]] = [
        ("args", ValueRole.ARGS, args), ("checkpoint_version", ValueRole.COMMON, 3.0),
        ("iteration", ValueRole.COMMON, common.get("iteration", 0)),
        ("optimizer", ValueRole.COMMON, groups[0] if len(groups) == 1 else groups),
        *([("opt_param_scheduler", ValueRole.COMMON, scheduler)] if scheduler is not None else []),
        *([("rng_state", ValueRole.RNG, rng)] if rng is not None else []),
        ("num_floating_point_operations_so_far", ValueRole.COMMON,
         common.get("num_floating_point_operations_so_far", 0)),
        ("migrate", ValueRole.COMMON, {**dict(common.get("migrate") or {}), "layout": ours})]
    return tuple(ValueItem(key=(name,), role=role, value=value) for name, role, value in held)


class MegatronLegacyWriter:
    """Assembles each rank dir's `model_optim_rng.pt` and `distrib_optim.pt` from filled buffers (in memory:
    the grad-buffer states are keyed by dtype pairs, which the in-place streaming path cannot address)."""

    def assemble(self, file: TargetFile, buffers: Mapping[Any, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role == "state_report":
            return json.dumps(meta["state_report"], indent=1)
        if file.role == "tracker":  # Megatron-LM's commit point, written last
            return file.values[0].value
        if file.role == "model":
            return _model_file(file, buffers)
        if file.role == "distrib_optim":
            return _optim_file(file, buffers)
        raise PlanError(f"Megatron legacy writer: unknown file role {file.role!r} for {file.path}")


def _model_file(file: TargetFile, buffers: Mapping[Any, torch.Tensor]) -> dict:
    """The file's values with each model chunk's weights (keys `(chunk, name)` of its buffers) and the `None`
    `_extra_state` Megatron-LM's modules save beside them."""
    state: dict[str, Any] = {item.key[0]: item.value for item in file.values}
    for b in file.buffers:
        mkey, name = b.key
        sd = state.setdefault(mkey, OrderedDict())
        sd[name] = buffers[b.key]
        module = name.rsplit(".", 1)[0]
        if any(module.endswith(m) for m in _EXTRA_STATE) or module == "output_layer":
            sd[f"{module}._extra_state"] = None
    return state


def _optim_file(file: TargetFile, buffers: Mapping[Any, torch.Tensor]) -> Any:
    """Megatron-Core's DistributedOptimizer state of the file's buffers, keyed `([chain,] grad buffer, dtype
    pair, state name)`: per grad buffer each state's flat tensor and its unpadded numel; with a chained
    expert optimizer a list of two, `None` where this rank holds none of a chain's buffers."""
    chained = any(len(b.key) == 4 for b in file.buffers)
    out: list[Any] = []
    for chain in (0, 1) if chained else (0,):
        held = [b for b in file.buffers if not chained or b.key[0] == chain]
        if chained and not held:
            out.append(None)
            continue
        st: dict[Any, Any] = {"buckets_coalesced": True}
        for b in held:
            g, dkey, name = b.key[-3:]
            st.setdefault(g, {}).setdefault(dkey, {})[name] = buffers[b.key]
            st[g][dkey]["numel_unpadded"] = b.shape[0]
        out.append(st)
    return out if chained else out[0]


# ---------------------------------------------------------------- registration

def _read(path: Path, opts: Any) -> CheckpointIndex:
    return read_megatron_legacy(path, trust_checkpoint=opts.trust_checkpoint, expect_tp=opts.expect.tp, expect_pp=opts.expect.pp,
                                expect_ep=opts.expect.ep, expect_dp=opts.expect.dp, model_config=opts.model_config)


def _target(index: CheckpointIndex, opts: Any) -> TargetSpec:
    """Target layout: given sizes, else the source's (Megatron sources), else 1."""
    megatron = index.format in (FORMAT, DIST_FORMAT)

    def pick(given: int | None, name: str) -> int:
        return given if given is not None else int(index.meta.get(name) or 1) if megatron else 1
    asked = opts.layout
    return megatron_legacy_target(index, tp=pick(asked.tp, "tp"), pp=pick(asked.pp, "pp"), dp=pick(asked.dp, "dp"),
                                  ep=pick(asked.ep, "ep"), vpp=target_vpp(index, opts, (FORMAT, DIST_FORMAT)),
                                  **target_pipeline_split(index, opts, (FORMAT, DIST_FORMAT)),
                                  model_config=opts.model_config)


def _spec() -> Any:
    from checkpoint.formats.base import CheckpointFormat

    return CheckpointFormat(
        name=FORMAT, description="Megatron-LM legacy per-rank files (mp_rank_*/model_optim_rng.pt + distrib_optim.pt)",
        detect=is_legacy_checkpoint, read=_read, target=_target, writer=MegatronLegacyWriter(),
        names="canonical")


SPEC = _spec()
