"""DeepSpeed's universal checkpoint (what `deepspeed/checkpoint/ds_to_universal.py` writes): reader and writer.

On-disk layout (DeepSpeed 0.19), one directory per checkpoint tag, `latest_universal` next to it:
* `<tag>/mp_rank_00_model_states.pt` (ZeRO 1/2) or `<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt`
  (ZeRO 3): DeepSpeed's model-states file (module, param_shapes, scheduler, counters, client state);
* `<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`: the full fp32 master and Adam moments of each
  parameter, saved as `{"cat_dim": 0, "param": tensor}` (ds_to_universal keeps ZeRO-3 tensors flat
  and unwrapped; the reader accepts both), and `step.pt` (the optimizer step, a 0-d tensor);
* `<tag>/zero/optimizer_state.pt`: the optimizer's non-sharded state (loss scaler, flags, param groups;
  for ZeRO 3 also `optimizer_state_dict.state[0].step`, where DeepSpeed's ZeRO-3 loader reads the step).
DeepSpeed loads it at any dp size with `"checkpoint": {"load_universal": true}`; which model-states
file it looks for depends on the loading job's ZeRO stage, so the writer names it for `zero_stage`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError, PlanError
from checkpoint.formats import deepspeed as ds
from checkpoint.formats.base import (CheckpointFormat, ReadOptions, TargetOptions, check_agreement,
                                     refuse_frozen_params, refuse_tied_embeddings, scalar)
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey, dtype_name
from checkpoint.paths import inside, tag_name
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole, WriteMode
from checkpoint.state.optimizer_state import refuse_unplaced_state
from checkpoint.state.training_state import CLIENT_STATE_KEY, STATE_REPORT_FILE

FORMAT = "deepspeed-universal"
LATEST = "latest_universal"
OPTIMIZER_STATE = "zero/optimizer_state.pt"
TAG_SUFFIX = "_universal"
STATE_FILES: dict[Kind, str] = {Kind.MASTER: "fp32", Kind.EXP_AVG: "exp_avg", Kind.EXP_AVG_SQ: "exp_avg_sq"}
_Z3_STEP: KeyPath = (ds.OSD, "state", 0, "step")  # where DeepSpeed's ZeRO-3 universal loader reads the step


def state_file(tag: str, param: str, name: str) -> str:
    return f"{tag}/zero/{param}/{name}.pt"


# ---------------------------------------------------------------- reader

def resolve_universal(path: str | Path) -> tuple[Path, str]:
    """(checkpoint root, tag) from a root holding `latest_universal` or a universal tag directory."""
    path = Path(path)
    if (path / LATEST).is_file():
        return path, tag_name((path / LATEST).read_bytes()[:4096].decode("utf-8", "replace"), what=str(path / LATEST))
    if (path / OPTIMIZER_STATE).is_file():
        return path.parent, path.name
    raise CheckpointFormatError(f"{path}: not a DeepSpeed universal checkpoint (no {LATEST} file and no "
                                f"{OPTIMIZER_STATE})")


def is_universal_checkpoint(path: str | Path) -> bool:
    """A universal tag directory, or a root whose `latest_universal` names one (and no `latest`: a
    root holding both is read as the DeepSpeed checkpoint unless the format is named)."""
    path = Path(path)
    if (path / OPTIMIZER_STATE).is_file():
        return True
    if (path / "latest").exists() or not (path / LATEST).is_file():
        return False
    return True  # claimed by its latest_universal: the reader names what is wrong with it


def _model_states_file(root: Path, tag: str) -> str:
    for rel in (ds.model_file(tag, 1), ds.model_file(tag, 3, 0)):
        if (root / rel).is_file():
            return rel
    raise CheckpointFormatError(f"{root / tag}: no {Path(ds.model_file(tag, 1)).name} or "
                                f"{Path(ds.model_file(tag, 3, 0)).name}")


def _stored_key(obj: Any, where: str) -> KeyPath:
    if isinstance(obj, torch.Tensor):
        return ()
    if isinstance(obj, Mapping) and isinstance(obj.get("param"), torch.Tensor):
        if obj.get("cat_dim", 0) != 0 or any(k in obj for k in ("sub_param_shape", "param_n_sub_params",
                                                                 "vocab_tensor", "is_expert_param")):
            raise CheckpointFormatError(f"{where}: tensor-parallel / expert metadata "
                                        f"{sorted(k for k in obj if k != 'param')} is not supported (tp=1 only)")
        return ("param",)
    raise CheckpointFormatError(f"{where}: holds {type(obj).__name__}, not a tensor or {{'param': tensor}}")


def read_universal(path: str | Path, *, trust_checkpoint: bool = False) -> CheckpointIndex:
    """Index a universal checkpoint from its metadata (every file opened with mmap; no tensor data read).

    Raises CheckpointFormatError for missing files and LayoutMismatchError when a stored tensor's
    size contradicts `param_shapes`.
    """
    root, tag = resolve_universal(path)
    if not (root / tag / OPTIMIZER_STATE).is_file():
        raise CheckpointFormatError(f"{root / tag / OPTIMIZER_STATE}: missing ({LATEST} says {tag!r})")
    model_rel = _model_states_file(root, tag)
    model_sd = safe_load.load(root / model_rel, mmap=True, trust_checkpoint=trust_checkpoint)
    opt_rel = f"{tag}/{OPTIMIZER_STATE}"
    opt = safe_load.load(root / opt_rel, mmap=True, trust_checkpoint=trust_checkpoint)
    stage = int(ds.plain_data(opt.get("zero_stage", 1)))
    groups = [[ds.Param(name=n, shape=tuple(s)) for n, s in g.items()] for g in model_sd["param_shapes"]]
    module = model_sd["module"]
    buffer_names = list(model_sd.get("buffer_names", []))
    entries: list[TensorEntry] = []
    for name in buffer_names:
        entries.append(ds.full_entry(TensorKey(name=name, kind=Kind.PARAM), model_rel, ("module", name), module[name]))
    files = {model_rel, opt_rel}
    z3_step = opt.get(ds.OSD, {}).get("state", {}).get(0, {}).get("step") if isinstance(opt.get(ds.OSD), Mapping) \
        else None
    steps: dict[str, Any] = {}
    for p in (p for g in groups for p in g):
        t = module.get(p.name)
        if isinstance(t, torch.Tensor) and t.numel() == p.numel and t.numel() > 0:
            entries.append(ds.full_entry(TensorKey(name=p.name, kind=Kind.PARAM), model_rel, ("module", p.name), t,
                                          shape=p.shape))
        for kind, stem in STATE_FILES.items():
            rel = state_file(tag, p.name, stem)
            inside(root, rel, what=f"{root / model_rel}: param_shapes name {p.name!r}")
            if not (root / rel).is_file():
                raise CheckpointFormatError(f"{root / rel}: missing (param {p.name!r}, {kind})")
            obj = safe_load.load(root / rel, mmap=True, trust_checkpoint=trust_checkpoint)
            key = _stored_key(obj, str(root / rel))
            stored = obj if not key else obj["param"]
            if stored.numel() != p.numel:
                raise LayoutMismatchError(f"{root / rel}: holds {stored.numel()} elements (shape "
                                          f"{tuple(stored.shape)}), param_shapes says {p.shape} ({p.numel})")
            entries.append(TensorEntry(key=TensorKey(name=p.name, kind=kind), shape=p.shape,
                                       dtype=dtype_name(stored.dtype),
                                       chunks=(ChunkRef(file=rel, key=key, offsets=(0,) * len(p.shape),
                                                        lengths=p.shape),)))
            files.add(rel)
        step_rel = state_file(tag, p.name, "step")
        if (root / step_rel).is_file():
            step = safe_load.load(root / step_rel, mmap=True, trust_checkpoint=trust_checkpoint)
            ref: tuple[str, KeyPath] = (step_rel, ())
            files.add(step_rel)
        elif isinstance(z3_step, torch.Tensor):
            step, ref = z3_step, (opt_rel, _Z3_STEP)
        else:
            continue
        if not isinstance(step, torch.Tensor):
            raise CheckpointFormatError(f"{root / ref[0]}: step is {type(step).__name__}, not a tensor")
        steps[str(root / ref[0])] = scalar(step)
        entries.append(TensorEntry(key=TensorKey(name=p.name, kind=Kind.STEP), shape=tuple(step.shape),
                                   dtype=dtype_name(step.dtype),
                                   chunks=(ChunkRef(file=ref[0], key=ref[1], offsets=(0,) * step.dim(),
                                                    lengths=tuple(step.shape)),)))
    check_agreement("Adam's step", steps)
    for e in entries:
        e.check_complete()
    hparams = [ds.group_hparams(pg) for pg in opt.get("param_groups", [])]
    if len(hparams) == 0:
        raise CheckpointFormatError(f"{root / opt_rel}: no param_groups")
    model_dtype = next((dtype_name(t.dtype) for t in module.values() if isinstance(t, torch.Tensor)), "float32")
    loss_scaler = opt.get("loss_scaler")
    meta = {
        "stage": stage, "dp": int(model_sd.get("dp_world_size", 1)), "tag": tag.removesuffix(TAG_SUFFIX),
        "dtype": model_dtype, "bf16_files": model_dtype == "bfloat16",
        "param_groups": [[(p.name, list(p.shape)) for p in g] for g in groups],
        "module_keys": list(module.keys()), "buffer_names": buffer_names, "param_group_hparams": hparams,
        "model_state": {k: v for k, v in model_sd.items() if k not in ds.STANDARD_MODEL_KEYS},
        "loss_scaler": None if loss_scaler is None else ds.plain_data(loss_scaler),
        "optimizer_flags": {k: opt[k] for k in ("dynamic_loss_scale", "overflow", "clip_grad") if k in opt},
        "ds_version": str(opt.get("ds_version", model_sd.get("ds_version", ""))),
        "global_steps": model_sd.get("global_steps"),
        "train_state": {
            "step": model_sd.get("global_steps"),
            "lr_scheduler": model_sd.get("lr_scheduler"),
            "client": {k: v for k, v in model_sd.items() if k not in ds.ENGINE_MODEL_KEYS},
            "param_names": [p.name for g in groups for p in g],
            "optimizer_param_groups": hparams,
            "optimizer_group_params": [[p.name for p in g] for g in groups],
        },
    }
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=tuple(sorted(files)),
                           meta=ds.plain_data(meta))


# ---------------------------------------------------------------- writer

def universal_target(source: CheckpointIndex, *, zero_stage: int, dp: int) -> TargetSpec:
    """The files and chunks of `source`'s training state as a universal checkpoint.

    `zero_stage` picks the model-states file name DeepSpeed's loader looks for (1/2 vs 3); `dp` only
    sets the per-rank client state (RNG) and `dp_world_size` recorded in it. Needs Adam state.
    """
    if zero_stage not in (1, 2, 3) or dp < 1:
        raise PlanError(f"universal target needs zero_stage in 1..3 and dp >= 1, got zero_stage={zero_stage} dp={dp}")
    refuse_tied_embeddings(source, FORMAT)
    refuse_frozen_params(source, FORMAT)
    refuse_unplaced_state(source, target=FORMAT,
                          why="this writer writes DeepSpeed's fp32, exp_avg, exp_avg_sq and step files")
    m = source.meta if source.format in ds.DS_META_FORMATS else ds.deepspeed_meta_from(source)
    src = source.by_key()
    names = [n for g in m["param_groups"] for n, _ in g]
    missing = [n for n in names if TensorKey(name=n, kind=Kind.EXP_AVG) not in src]
    if missing:
        raise PlanError(f"universal checkpoint needs the Adam moments of every param; source {source.root} "
                        f"({source.format}) has none for {missing[:4]} ({len(missing)} of {len(names)} params)")
    step_entry = next((e for e in source.entries if e.key.kind is Kind.STEP), None)
    if step_entry is None and zero_stage == 3:
        raise PlanError(f"source {source.root} has no optimizer step, which DeepSpeed's ZeRO-3 universal loader "
                        f"reads from {OPTIMIZER_STATE}")
    tag = m["tag"] + TAG_SUFFIX
    model_rel = ds.model_file(tag, zero_stage, 0)
    opt_rel = f"{tag}/{OPTIMIZER_STATE}"
    entries: list[TensorEntry] = []
    files = [TargetFile(path=LATEST, role="latest", rank=None)]
    if CLIENT_STATE_KEY in m["model_state"]:
        files.append(TargetFile(path=STATE_REPORT_FILE, role="state_report", rank=None))
    model_buffers: list[TargetBuffer] = []

    def full(key: TensorKey, shape: tuple[int, ...], dtype: str, file: str, path: KeyPath) -> TensorEntry:
        return TensorEntry(key=key, shape=shape, dtype=dtype,
                           chunks=(ChunkRef(file=file, key=path, offsets=(0,) * len(shape), lengths=shape),))

    for name in m["buffer_names"]:
        e = src[TensorKey(name=name, kind=Kind.PARAM)]
        model_buffers.append(TargetBuffer(key=("module", name), shape=e.shape, dtype=e.dtype))
        entries.append(full(e.key, e.shape, e.dtype, model_rel, ("module", name)))
    state_files = []
    for n, shape in ((n, tuple(s)) for g in m["param_groups"] for n, s in g):
        if zero_stage != 3:
            model_buffers.append(TargetBuffer(key=("module", n), shape=shape, dtype=m["dtype"]))
            entries.append(full(TensorKey(name=n, kind=Kind.PARAM), shape, m["dtype"], model_rel, ("module", n)))
        for kind, stem in STATE_FILES.items():
            rel = state_file(tag, n, stem)
            state_files.append(TargetFile(path=rel, role="zero_state", rank=None,
                                          buffers=(TargetBuffer(key=("param",), shape=shape, dtype="float32"),)))
            entries.append(full(TensorKey(name=n, kind=kind), shape, "float32", rel, ("param",)))
        if step_entry is not None:
            rel = state_file(tag, n, "step")
            state_files.append(TargetFile(path=rel, role="zero_step", rank=None, buffers=(
                TargetBuffer(key=(), shape=step_entry.shape, dtype=step_entry.dtype),)))
            step = full(TensorKey(name=n, kind=Kind.STEP), step_entry.shape, step_entry.dtype, rel, ())
            if zero_stage == 3 and n == names[0]:
                step = TensorEntry(key=step.key, shape=step.shape, dtype=step.dtype, chunks=(
                    *step.chunks, ChunkRef(file=opt_rel, key=_Z3_STEP, offsets=(0,) * len(step.shape),
                                           lengths=step.shape)))
            entries.append(step)
    opt_buffers = (TargetBuffer(key=_Z3_STEP, shape=step_entry.shape, dtype=step_entry.dtype),) \
        if zero_stage == 3 and step_entry is not None else ()  # ZeRO-3 without a step is refused above
    model_state, state_report = ds.target_training_state(m, dp=dp, zero_stage=zero_stage)
    files.append(TargetFile(path=model_rel, role="model_states", rank=0, buffers=tuple(model_buffers),
                            values=ds.model_states_values(m, model_state, stage=zero_stage, dp=dp)))
    files += state_files
    files.append(TargetFile(path=opt_rel, role="optimizer_state", rank=None, buffers=opt_buffers,
                            values=optimizer_state_values(m, model_state, stage=zero_stage)))
    meta = {**{k: v for k, v in m.items() if k != "model_state"}, "state_report": state_report, "stage": zero_stage,
            "dp": dp, "universal_tag": tag, MODEL_STATES: ds.ModelStatesLayout.of(m, zero_stage)}
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(entries), files=tuple(f.path for f in files),
                            meta=meta)
    return TargetSpec(index=index, files=tuple(files), commit=(LATEST,), write_mode=WriteMode.IN_PLACE)


MODEL_STATES = "model_states_layout"  # the target index's metadata entry holding its ds.ModelStatesLayout


def optimizer_state_values(m: Mapping[str, Any], model_state: Mapping[str, Any], *, stage: int
                           ) -> tuple[ValueItem, ...]:
    """What ds_to_universal keeps of rank 0's optimizer file beside the step, each at its key: the param groups
    (one per source param group, its index as its param), the loss scaler (plain data) and flags and, below
    ZeRO-3, the gradient clipping and DeepSpeed's version."""
    flags = m["optimizer_flags"]
    groups = [{**copy.deepcopy(hp), "params": [i]} for i, hp in enumerate(m["param_group_hparams"])]
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    held: list[tuple[str, ValueRole, Any]] = [
        ("loss_scaler", ValueRole.OBJECT, m.get("loss_scaler")),
        ("dynamic_loss_scale", ValueRole.COMMON, flags.get("dynamic_loss_scale", False)),
        ("overflow", ValueRole.COMMON, flags.get("overflow", False))]
    if stage != 3:
        clip = flags.get("clip_grad", ds.target_ds_config(model_state, stage).get("gradient_clipping",
                                                                                   ds.GRADIENT_CLIPPING_DEFAULT))
        held += [("clip_grad", ValueRole.COMMON, clip), ("ds_version", ValueRole.COMMON, m["ds_version"])]
    held.append(("param_groups", ValueRole.COMMON, groups))
    return tuple(ValueItem(key=(name,), role=role, value=value) for name, role, value in held)


def _optimizer_state(file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """What ds_to_universal keeps of rank 0's optimizer file: everything but the sharded tensors."""
    from checkpoint.safe_load import ZeroStageEnum  # DeepSpeed's, without importing deepspeed

    stage = meta["stage"]
    values = {item.key[0]: item.value for item in file.values}
    out: dict[str, Any] = {"loss_scaler": ds.loss_scaler_of(values["loss_scaler"]),
                           "dynamic_loss_scale": values["dynamic_loss_scale"], "overflow": values["overflow"]}
    if stage == 3:
        out |= {"zero_stage": ZeroStageEnum(3), "partition_count": meta["dp"],
                ds.OSD: {"state": {0: {"step": ds.step_as_stored(buffers[_Z3_STEP])}},
                         "param_groups": copy.deepcopy(values["param_groups"])}}
    else:
        out |= {"clip_grad": values["clip_grad"], "zero_stage": ZeroStageEnum(stage),
                "partition_count": [meta["dp"]] * len(values["param_groups"]), "ds_version": values["ds_version"]}
    out["param_groups"] = values["param_groups"]
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class UniversalWriter:
    """Writes the universal files from filled buffers; each buffer sits at its key path (written in place)."""

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role == "latest":
            return meta["universal_tag"]
        if file.role == "state_report":
            return json.dumps(meta["state_report"], indent=1)
        if file.role == "model_states":
            return ds.model_states_object(file, buffers, meta[MODEL_STATES])
        if file.role == "zero_state":
            return {"cat_dim": 0, "param": buffers[("param",)]}
        if file.role == "zero_step":
            return buffers[()]
        if file.role == "optimizer_state":
            return _optimizer_state(file, buffers, meta)
        raise PlanError(f"universal writer: unknown file role {file.role!r} for {file.path}")


# ---------------------------------------------------------------- registration

def _read(path: Path, opts: ReadOptions) -> CheckpointIndex:
    index = read_universal(path, trust_checkpoint=opts.trust_checkpoint)
    if opts.expect.zero_stage is not None and opts.expect.zero_stage != index.meta["stage"]:
        raise LayoutMismatchError(f"{path}: declared zero stage {opts.expect.zero_stage} but the universal checkpoint was "
                                  f"made from stage {index.meta['stage']}")
    return index


def _target(index: CheckpointIndex, opts: TargetOptions) -> TargetSpec:
    dp, stage = ds.target_dp_and_stage(index, opts, "universal")
    return universal_target(index, zero_stage=stage, dp=dp)


SPEC = CheckpointFormat(name=FORMAT, description="DeepSpeed universal checkpoint (ds_to_universal layout, tp=1)",
                        detect=is_universal_checkpoint, read=_read, target=_target, writer=UniversalWriter())
