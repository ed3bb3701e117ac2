"""DeepSpeed ZeRO 1/2/3 checkpoints: reader (metadata-only index) and writer (any DP size, any stage).

On-disk layout (DeepSpeed 0.19, one model-parallel rank):
* ZeRO 1/2: `<tag>/mp_rank_00_model_states.pt` (full module weights, `param_shapes`, scheduler,
  step counters, client state) and `<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` with
  each param group's params flattened in order, padded to a multiple of 2*dp, cut into dp equal
  partitions (padding at the end: the last ranks). exp_avg/exp_avg_sq are saved padded, the fp32
  partition without the padding (`group_paddings`).
* ZeRO 3: `<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt` (module with empty params) and optim
  files with `fp32_flat_groups`: every param is cut separately into dp pieces of ceil(numel/dp)
  (zero-padded on the last ranks), pieces concatenated per rank in param order, in sub-groups
  of about `sub_group_size` elements.
* Tied weights: `shared_params` {module name: param it is}; the module state holds the alias as the
  param's very tensor (ZeRO-1/2) or an empty one (ZeRO-3).
* Frozen params (no optimizer state): whole in `module` at ZeRO-1/2 (ZeRO-2 also lists them in
  `frozen_param_shapes` / `frozen_param_fragments`); at ZeRO-3 `frozen_param_shapes` and each rank's
  ceil(numel/dp) elements in its model file's `frozen_param_fragments`.
The partition math below is shared by the reader (where is each element) and the writer (where
must it go), so both describe a layout the same way.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError, PlanError
from checkpoint.formats.adam_step import derived_step, step_tensor
from checkpoint.formats.base import (CheckpointFormat, ReadOptions, TargetOptions, check_agreement,
                                     refuse_tied_embeddings, scalar)
from checkpoint.formats.hf_trainer import (TRAINER_ROLE, is_trainer_folder, new_trainer_state, read_trainer_files,
                                          trainer_file_bytes, trainer_files, trainer_rng)
from checkpoint.index import (CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey, dtype_name,
                              state_kind)
from checkpoint.paths import tag_name
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole, WriteMode
from checkpoint.state.rng import roles
from checkpoint.state.optimizer_state import StateShape, refuse_split_state, state_entries, state_kinds
from checkpoint.state.training_state import CLIENT_STATE_KEY, STATE_REPORT_FILE, convert_model_state, report_dict

FORMAT = "deepspeed"
DS_META_FORMATS = (FORMAT, "deepspeed-universal")  # indexes whose meta is DeepSpeed's own (see universal.py)
OSD = "optimizer_state_dict"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
ZERO_OPTIMIZER, BF16_OPTIMIZER = "zero", "bf16_optimizer"  # which DeepSpeed optimizer wrote the optimizer files
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# DeepSpeed's pipeline-engine layer files and MoE expert / expert-optimizer files (not read here)
_PIPELINE_OR_MOE_RE = re.compile(r"^(layer_\d+-model_\d+-model_states|layer_\d+_expert_\d+_mp_rank_\d+_model_states"
                                 r"|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")
STANDARD_MODEL_KEYS = ("module", "param_shapes")
_FROZEN_KEYS = ("frozen_param_shapes", "frozen_param_fragments")  # rebuilt by the writer for the target layout
# what DeepSpeed's engine itself puts in model_states (everything else is the caller's client state)
ENGINE_MODEL_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ---------------------------------------------------------------- partition math (pure)

def z12_partition_size(group: Sequence[Param], dp: int) -> tuple[int, int]:
    """(partition numel per rank, padding) of one ZeRO-1/2 param group at dp ranks."""
    total = sum(p.numel for p in group)
    align = 2 * dp
    padded = -(-total // align) * align
    return padded // dp, padded - total


def z12_chunks(group: Sequence[Param], dp: int) -> dict[str, list[tuple[int, tuple[int, int], int]]]:
    """Per param: [(rank, flat range in the param, storage offset in the rank's partition)]."""
    size, _ = z12_partition_size(group, dp)
    out: dict[str, list[tuple[int, tuple[int, int], int]]] = {}
    offset = 0
    for p in group:
        pieces = []
        for r in range(dp):
            lo, hi = max(offset, r * size), min(offset + p.numel, (r + 1) * size)
            if lo < hi:
                pieces.append((r, (lo - offset, hi - offset), lo - r * size))
        out[p.name] = pieces
        offset += p.numel
    return out


def z3_piece(numel: int, dp: int) -> int:
    """Elements of one param every ZeRO-3 rank holds (ceil(numel/dp), the last ranks zero-padded)."""
    return -(-numel // dp)


def z3_sub_groups(params: Sequence[Param], dp: int, sub_group_size: int) -> list[list[Param]]:
    """DeepSpeed stage3 `_create_fp16_sub_groups`: cut a param group once a sub-group's partition
    numel reaches sub_group_size."""
    if sub_group_size >= sum(z3_piece(p.numel, dp) for p in params):
        return [list(params)]
    groups, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += z3_piece(p.numel, dp)
        if size >= sub_group_size or p is params[-1]:
            groups.append(cur)
            cur, size = [], 0
    return groups


def z3_chunks(sub_group: Sequence[Param], dp: int) -> dict[str, list[tuple[int, tuple[int, int], int]]]:
    """Per param of a sub-group: [(rank, flat range in the param, storage offset in the sub-group)]."""
    out: dict[str, list[tuple[int, tuple[int, int], int]]] = {}
    offset = 0
    for p in sub_group:
        c = z3_piece(p.numel, dp)
        out[p.name] = [(r, (r * c, min((r + 1) * c, p.numel)), offset) for r in range(dp) if r * c < p.numel]
        offset += c
    return out


# ---------------------------------------------------------------- file names

def optim_file(tag: str, rank: int, bf16: bool) -> str:
    return f"{tag}/{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def model_file(tag: str, stage: int, rank: int = 0) -> str:
    return f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else f"{tag}/mp_rank_00_model_states.pt"


def plain_data(obj: Any) -> Any:
    """Non-tensor checkpoint values as plain data (torch.Size -> list; enums -> value; objects -> dict)."""
    if isinstance(obj, torch.Tensor):
        raise CheckpointFormatError("unexpected tensor in DeepSpeed metadata")
    if isinstance(obj, Mapping):
        return {k: plain_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain_data(v) for v in obj]
    if hasattr(obj, "value") and type(obj).__name__.endswith("Enum"):
        return obj.value
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        name = getattr(type(obj), "pickle_name", f"{type(obj).__module__}.{type(obj).__qualname__}")
        return {"__class__": name, **plain_data(vars(obj))}
    return obj


# ---------------------------------------------------------------- reader

def resolve_tag_dir(path: str | Path, tag: str | None = None) -> tuple[Path, str]:
    """(checkpoint root, tag) from a checkpoint directory (holding `latest`) or a tag directory."""
    path = Path(path)
    if tag is not None:
        return path, tag_name(tag, what="tag")
    if (path / "latest").is_file():
        try:
            text = (path / "latest").read_bytes()[:4096].decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointFormatError(f"{path / 'latest'}: unreadable ({err}); DeepSpeed's latest holds a tag "
                                        f"name") from err
        tag = tag_name(text, what=str(path / "latest"))
        if not (path / tag).is_dir():
            raise CheckpointFormatError(f"{path / 'latest'}: names tag {tag!r}, but {path / tag} is not a directory")
        return path, tag
    if any(path.glob("*model_states.pt")):
        return path.parent, path.name
    raise CheckpointFormatError(f"{path}: not a DeepSpeed checkpoint (no `latest` file and no *model_states.pt)")


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    if (path / "latest").is_file():
        return True  # claimed by its `latest`: the reader names what is wrong with it
    try:
        root, tag = resolve_tag_dir(path)
    except CheckpointFormatError:
        return False
    return (root / tag).is_dir() and any((root / tag).glob("*model_states.pt"))


def _rank_files(tag_dir: Path) -> tuple[dict[int, str], bool]:
    files: dict[int, str] = {}
    bf16 = set()
    other = sorted(f.name for f in tag_dir.iterdir() if _PIPELINE_OR_MOE_RE.match(f.name))
    if other:
        raise CheckpointFormatError(f"{tag_dir}: {other[0]} ({len(other)} such files): DeepSpeed pipeline-parallel "
                                    f"(layer_XX-model_YY) and MoE (expert / expp_rank) checkpoints are not supported; "
                                    f"only data-parallel ZeRO 1/2/3 ones (mp_rank_00)")
    for f in tag_dir.iterdir():
        if m := _OPTIM_RE.match(f.name):
            if m.group(3) != "00":
                raise CheckpointFormatError(f"{f}: model-parallel DeepSpeed checkpoints (mp_rank {m.group(3)}) "
                                            f"are not supported; only mp_rank_00")
            files[int(m.group(2))] = f.name
            bf16.add(bool(m.group(1)))
    if not files:
        raise CheckpointFormatError(f"{tag_dir}: no zero_pp_rank_*_optim_states.pt files")
    if len(bf16) > 1:
        raise CheckpointFormatError(f"{tag_dir}: both bf16_ and plain optimizer files present")
    return files, bf16.pop()


def read_deepspeed(path: str | Path, *, tag: str | None = None, trust_checkpoint: bool = False,
                   expect_dp: int | None = None, expect_stage: int | None = None) -> CheckpointIndex:
    """Index a DeepSpeed ZeRO checkpoint from its metadata (files opened with mmap; no tensor data read).

    Raises CheckpointFormatError for missing/truncated shards and LayoutMismatchError when the files
    contradict each other or the expected dp size / stage.
    """
    root, tag = resolve_tag_dir(path, tag)
    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise CheckpointFormatError(f"{tag_dir}: tag directory missing (latest says {tag!r})")
    optim_names, bf16 = _rank_files(tag_dir)
    z3_models = sorted(f.name for f in tag_dir.iterdir() if _Z3_MODEL_RE.match(f.name))
    stage3 = bool(z3_models)
    model_rel = model_file(tag, 3 if stage3 else 1)
    model_sd = safe_load.load(root / model_rel, mmap=True, trust_checkpoint=trust_checkpoint)
    dp = _model_states_dp(model_sd, root / model_rel)
    missing = [r for r in range(dp) if r not in optim_names]
    extra = sorted(r for r in optim_names if r >= dp)
    if missing or extra:
        raise CheckpointFormatError(
            f"{tag_dir}: {model_rel} says dp_world_size={dp} but optimizer shards for ranks {missing} are missing"
            + (f" and ranks {extra} are unexpected" if extra else "")
            + f" (expected {optim_file(tag, missing[0] if missing else 0, bf16).split('/')[-1]} ...)")
    if stage3 and len(z3_models) != dp:
        raise CheckpointFormatError(f"{tag_dir}: ZeRO-3 needs {dp} model_states files, found {len(z3_models)}")
    if expect_dp is not None and expect_dp != dp:
        raise LayoutMismatchError(f"{root}: declared dp={expect_dp} but the checkpoint was saved at dp={dp}")
    optim = [safe_load.load(tag_dir / optim_names[r], mmap=True, trust_checkpoint=trust_checkpoint)
             for r in range(dp)]
    for r, o in enumerate(optim):
        if not isinstance(o, Mapping) or not isinstance(o.get(OSD), Mapping):
            raise CheckpointFormatError(f"{tag_dir / optim_names[r]}: holds no {OSD} mapping (DeepSpeed's ZeRO "
                                        f"optimizer shard)")
    osd0 = optim[0][OSD]
    # DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 with fp32 gradient accumulation) partitions as ZeRO-1 but
    # stores no zero_stage and keeps the fp32 partitions with their alignment padding
    bf16_optimizer = "zero_stage" not in osd0 and "single_partition_of_fp32_groups" in osd0
    if "zero_stage" not in osd0 and not bf16_optimizer:
        raise CheckpointFormatError(f"{tag_dir / optim_names[0]}: {OSD} holds neither zero_stage (ZeRO optimizer) "
                                    f"nor single_partition_of_fp32_groups (BF16_Optimizer): keys {sorted(osd0)}")
    stage = 1 if bf16_optimizer else int(plain_data(osd0["zero_stage"]))
    if stage3 != (stage == 3):
        raise LayoutMismatchError(f"{tag_dir}: file layout says {'ZeRO-3' if stage3 else 'ZeRO-1/2'} but "
                                  f"{optim_names[0]} says zero_stage={stage}")
    if expect_stage is not None and expect_stage != stage:
        raise LayoutMismatchError(f"{root}: declared zero stage {expect_stage} but the checkpoint is stage {stage}")
    _check_rank_files_agree(optim, [tag_dir / optim_names[r] for r in range(dp)], stage,
                            [tag_dir / n for n in z3_models], trust_checkpoint)
    groups = [[Param(name=n, shape=tuple(s)) for n, s in g.items()] for g in model_sd["param_shapes"]]
    module = model_sd["module"]
    buffer_names = list(model_sd.get("buffer_names", []))
    trainable = {p.name for g in groups for p in g}
    shared = shared_params(model_sd, trainable, root / model_rel)
    frozen = frozen_params(model_sd, trainable, set(buffer_names), shared, stage3, root / model_rel)
    model_dtype = dtype_name(next(iter(module.values())).dtype) if module else "float32"
    entries: list[TensorEntry] = []
    for name in buffer_names:
        t = module[name]
        entries.append(full_entry(TensorKey(name=name, kind=Kind.PARAM), model_rel, ("module", name), t))
    if not stage3:
        for p in [*(p for g in groups for p in g), *frozen]:  # ZeRO-1/2 keep every param whole in the module
            entries.append(full_entry(TensorKey(name=p.name, kind=Kind.PARAM), model_rel, ("module", p.name),
                                       module[p.name], shape=p.shape))
        entries += _z12_entries(groups, dp, tag, bf16, optim, root, padded_masters=bf16_optimizer)
        hparams = [group_hparams(pg) for pg in osd0["base_optimizer_state"]["param_groups"]]
    else:
        sub_size = int(model_sd.get("ds_config", {}).get("zero_optimization", {}).get(
            "sub_group_size", DEFAULT_SUB_GROUP_SIZE))
        entries += _z3_entries(groups, dp, tag, bf16, optim, root, sub_size)
        entries += _z3_frozen_entries(frozen, dp, tag, tag_dir, trust_checkpoint)
        hparams = [group_hparams(pg) for pg in osd0[OSD]["param_groups"]]
    for e in entries:
        e.check_complete()
    loss_scaler = osd0.get("loss_scaler")
    meta = {
        "stage": stage, "dp": dp, "tag": tag, "dtype": model_dtype, "bf16_files": bf16,
        "optimizer_flavor": BF16_OPTIMIZER if bf16_optimizer else ZERO_OPTIMIZER,
        "param_groups": [[(p.name, list(p.shape)) for p in g] for g in groups],
        "module_keys": list(module.keys()), "buffer_names": buffer_names,
        "shared_params": shared, "frozen_params": [(p.name, list(p.shape)) for p in frozen],
        "param_group_hparams": hparams,
        "model_state": {k: v for k, v in model_sd.items() if k not in STANDARD_MODEL_KEYS + _FROZEN_KEYS},
        "loss_scaler": None if loss_scaler is None else plain_data(loss_scaler),
        "optimizer_flags": {k: osd0[k] for k in ("dynamic_loss_scale", "overflow", "clip_grad") if k in osd0},
        "ds_version": str(optim[0].get("ds_version", model_sd.get("ds_version", ""))),
        "global_steps": model_sd.get("global_steps"),
        "train_state": {
            "step": model_sd.get("global_steps"),
            "lr_scheduler": model_sd.get("lr_scheduler"),
            "client": {k: v for k, v in model_sd.items() if k not in ENGINE_MODEL_KEYS},
            "param_names": [p.name for g in groups for p in g],
            "optimizer_param_groups": hparams,
            "optimizer_group_params": [[p.name for p in g] for g in groups],
        },
    }
    model_files = [f"{tag}/{n}" for n in z3_models] if stage3 else [model_rel]
    files = (*model_files, *(f"{tag}/{optim_names[r]}" for r in range(dp)))
    if is_trainer_folder(root):  # an HF-Trainer checkpoint-N/ folder: its own files beside the engine's
        trainer = read_trainer_files(root, trust_checkpoint=trust_checkpoint)
        meta["hf_trainer"] = trainer
        meta.update({k: trainer[k] for k in ("hf_config", "generation_config") if trainer[k] is not None})
        files += tuple(trainer["files"])
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=files, meta=plain_data(meta))


def _model_states_dp(model_sd: Any, where: Path) -> int:
    """The DP size of DeepSpeed's model states, after checking they hold what DeepSpeed's engine saves."""
    if not isinstance(model_sd, Mapping):
        raise CheckpointFormatError(f"{where}: holds {type(model_sd).__name__}, not DeepSpeed's model states dict")
    missing = [k for k in ("module", "param_shapes", "dp_world_size") if k not in model_sd]
    if missing:
        raise CheckpointFormatError(f"{where}: DeepSpeed's model states lack {missing} (keys: {sorted(model_sd)[:12]})")
    dp = model_sd["dp_world_size"]
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise CheckpointFormatError(f"{where}: dp_world_size is {dp!r}; expected a positive integer")
    if not isinstance(model_sd["param_shapes"], (list, tuple)) or not all(
            isinstance(g, Mapping) for g in model_sd["param_shapes"]):
        raise CheckpointFormatError(f"{where}: param_shapes is {type(model_sd['param_shapes']).__name__}; expected a "
                                    f"list of {{name: shape}} per param group")
    return dp


def _check_rank_files_agree(optim: Sequence[Any], optim_paths: Sequence[Path], stage: int,
                            z3_model_paths: Sequence[Path], trust_checkpoint: bool) -> None:
    """Every rank's optimizer file agrees on Adam's step per param group, the ZeRO stage, the partition
    counts and the DeepSpeed version, and (ZeRO-3) every rank's model file on the step counters and the DP
    size; a file saved at another step (e.g. copied in from an older save) is named."""
    state_path = _state_path(stage, 0)[:-1]

    def steps(r: int) -> dict[Any, Any]:
        st = _at(optim, r, state_path)
        if st is _ABSENT or not isinstance(st, Mapping):
            return {}
        return {g: scalar(s.get("step")) for g, s in st.items() if isinstance(s, Mapping)}

    per = {str(p): optim[r] for r, p in enumerate(optim_paths)}
    check_agreement("Adam's step per param group", {str(p): steps(r) for r, p in enumerate(optim_paths)})
    for field in ("zero_stage", "partition_count"):
        check_agreement(field, {p: plain_data(o[OSD].get(field)) for p, o in per.items()})
    check_agreement("ds_version", {p: o.get("ds_version") for p, o in per.items()})
    if z3_model_paths:
        models = {str(p): safe_load.load(p, mmap=True, trust_checkpoint=trust_checkpoint) for p in z3_model_paths}
        for field in ("global_steps", "global_samples", "dp_world_size", "skipped_steps"):
            check_agreement(field, {p: m.get(field) for p, m in models.items()})


def shared_params(model_sd: Mapping[str, Any], trainable: set[str], where: Path) -> dict[str, str]:
    """DeepSpeed's `shared_params`: {module name that is not stored separately: the param it is}
    (tied weights, e.g. an output layer tied to the input embedding), checked against the module."""
    shared = model_sd.get("shared_params") or {}
    if not isinstance(shared, Mapping):
        raise CheckpointFormatError(f"{where}: shared_params is {type(shared).__name__}, expected a dict "
                                    f"{{alias: param name}}")
    module = model_sd["module"]
    frozen = set(model_sd.get("frozen_param_shapes") or ())
    for alias, owner in shared.items():
        if alias not in module:
            raise CheckpointFormatError(f"{where}: shared_params names {alias!r} (-> {owner!r}), which the module "
                                        f"state does not hold")
        if owner not in trainable and owner not in frozen and owner not in module:
            raise CheckpointFormatError(f"{where}: shared_params ties {alias!r} to {owner!r}, which is neither a "
                                        f"parameter in param_shapes nor in the module state")
    return {str(a): str(o) for a, o in shared.items()}


def frozen_params(model_sd: Mapping[str, Any], trainable: set[str], buffers: set[str], shared: Mapping[str, str],
                  stage3: bool, where: Path) -> list[Param]:
    """The parameters no optimizer owns (`requires_grad=False`), in module order.

    ZeRO-1/2 keep them whole in `module` (every module tensor that is not a trained param, a buffer or
    a tied alias; ZeRO-2 also lists them in `frozen_param_shapes`); ZeRO-3 lists them in
    `frozen_param_shapes` and keeps each rank's piece in its `frozen_param_fragments`.
    """
    module = model_sd["module"]
    listed = {str(n): tuple(s) for n, s in (model_sd.get("frozen_param_shapes") or {}).items()}
    if stage3:
        unknown = [k for k in module if k not in trainable and k not in buffers and k not in shared
                   and k not in listed]
        if unknown:
            raise CheckpointFormatError(f"{where}: module tensors {unknown[:4]} are neither in param_shapes, "
                                        f"frozen_param_shapes, buffer_names nor shared_params")
        return [Param(name=n, shape=s) for n, s in listed.items()]
    out = []
    for name, t in module.items():
        if name in trainable or name in buffers or name in shared:
            continue
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{where}: module entry {name!r} is {type(t).__name__}, not a tensor")
        if name in listed and listed[name] != tuple(t.shape):
            raise LayoutMismatchError(f"{where}: frozen param {name} has shape {tuple(t.shape)} but "
                                      f"frozen_param_shapes says {listed[name]}")
        out.append(Param(name=name, shape=tuple(t.shape)))
    missing = sorted(set(listed) - {p.name for p in out})
    if missing:
        raise CheckpointFormatError(f"{where}: frozen_param_shapes lists {missing[:4]}, which the module state "
                                    f"does not hold")
    return out


def z3_frozen_entry(p: Param, dtype: str, files: Sequence[str]) -> TensorEntry:
    """A ZeRO-3 frozen param: rank r's model file (`files[r]`) holds its flat elements [r * c, (r + 1) * c)
    in `frozen_param_fragments[name]`, c = ceil(numel / dp), zero-padded on the last ranks."""
    c = z3_piece(p.numel, len(files))
    return TensorEntry(key=TensorKey(name=p.name, kind=Kind.PARAM), shape=p.shape, dtype=dtype, chunks=tuple(
        ChunkRef(file=f, key=("frozen_param_fragments", p.name), offsets=(0,) * len(p.shape), lengths=p.shape,
                 flat_range=(r * c, min((r + 1) * c, p.numel)))
        for r, f in enumerate(files) if r * c < p.numel))


def _z3_frozen_entries(frozen: Sequence[Param], dp: int, tag: str, tag_dir: Path,
                       trust_checkpoint: bool) -> list[TensorEntry]:
    """Entries of ZeRO-3 frozen params (`z3_frozen_entry`), each rank's fragment checked."""
    if not frozen:
        return []
    files = [model_file(tag, 3, r) for r in range(dp)]
    states = [safe_load.load(tag_dir.parent / f, mmap=True, trust_checkpoint=trust_checkpoint) for f in files]
    entries = []
    for p in frozen:
        c, dtypes = z3_piece(p.numel, dp), set()
        for r, st in enumerate(states):
            frag = (st.get("frozen_param_fragments") or {}).get(p.name)
            if not isinstance(frag, torch.Tensor) or frag.numel() != c:
                got = f"a tensor of {frag.numel()} elements" if isinstance(frag, torch.Tensor) else repr(frag)
                raise LayoutMismatchError(f"{tag_dir.parent / files[r]}: frozen_param_fragments[{p.name!r}] is {got}; "
                                          f"ZeRO-3 at dp={dp} keeps {c} of its {p.numel} elements per rank")
            dtypes.add(dtype_name(frag.dtype))
        if len(dtypes) != 1:
            raise LayoutMismatchError(f"{tag_dir}: frozen param {p.name} stored as {sorted(dtypes)} across ranks")
        entries.append(z3_frozen_entry(p, dtypes.pop(), files))
    return entries


def group_hparams(pg: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer param group's hyperparameters (lr, betas, ...): everything but its `params`."""
    return {k: v for k, v in pg.items() if k != "params"}


def full_entry(key: TensorKey, file: str, path: KeyPath, t: torch.Tensor,
               shape: tuple[int, ...] | None = None) -> TensorEntry:
    """The entry of a tensor stored whole at `path` of `file` (of `shape`, else its own); raises
    CheckpointFormatError when the stored tensor has another shape."""
    shape = tuple(t.shape) if shape is None else shape
    if tuple(t.shape) != shape:
        raise LayoutMismatchError(f"{file}: {key.name} has shape {tuple(t.shape)} but param_shapes says {shape}")
    return TensorEntry(key=key, shape=shape, dtype=dtype_name(t.dtype),
                       chunks=(ChunkRef(file=file, key=path, offsets=(0,) * len(shape), lengths=shape),))


def _master_path(stage: int, group: int) -> KeyPath:
    """Where flat group `group`'s fp32 master partition sits in a rank's optimizer file."""
    return (OSD, "fp32_flat_groups", group) if stage == 3 else (OSD, "single_partition_of_fp32_groups", group)


def _state_path(stage: int, group: int, name: Kind | str | None = None) -> KeyPath:
    """Where the wrapped torch optimizer keeps flat group `group`'s state (`name`: one state tensor of it)."""
    root = (OSD, OSD, "state", group) if stage == 3 else (OSD, "base_optimizer_state", "state", group)
    return root if name is None else (*root, str(name))


def _optimizer_paths(stage: int, group: int, kinds: Sequence[Kind | str]) -> dict[Kind | str, KeyPath]:
    """The key paths of flat group `group`'s fp32 master and of its optimizer state `kinds`."""
    return {Kind.MASTER: _master_path(stage, group)} | {k: _state_path(stage, group, k) for k in kinds}


_ABSENT = object()


def _at(optim: Sequence[Any], rank: int, path: KeyPath) -> Any:
    """The value at `path` in rank `rank`'s optimizer state, or _ABSENT."""
    cur: Any = optim[rank]
    for k in path:
        try:
            cur = cur[k]
        except (KeyError, IndexError):
            return _ABSENT
    return cur


def _stored(optim: Sequence[Any], rank: int, path: KeyPath, where: str) -> torch.Tensor | None:
    cur = _at(optim, rank, path)
    if cur is _ABSENT:
        return None
    if not isinstance(cur, torch.Tensor):
        raise CheckpointFormatError(f"{where}: {list(path)} is {type(cur).__name__}, not a tensor")
    return cur


def _stored_scalar(optim: Sequence[Any], rank: int, path: KeyPath, where: str) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) of a stored scalar state such as Adam's `step`. torch's Adam keeps a 0-d float32
    tensor; DeepSpeed's own FusedAdam and DeepSpeedCPUAdam (built from the config's "optimizer") keep a
    Python int, indexed as a 0-d int64 (the executor reads it as one, DeepSpeed writers store an int)."""
    cur = _at(optim, rank, path)
    if isinstance(cur, int) and not isinstance(cur, bool):
        return (), "int64"
    if not isinstance(cur, torch.Tensor):
        raise CheckpointFormatError(f"{where}: {list(path)} is {type(cur).__name__}, not a tensor or an int")
    return tuple(cur.shape), dtype_name(cur.dtype)


def step_as_stored(step: torch.Tensor) -> torch.Tensor | int:
    """A filled step buffer as the optimizer keeps it: an int for a 0-d int64 (FusedAdam, CPUAdam), else the tensor."""
    return int(step) if step.dtype == torch.int64 and step.dim() == 0 else step


def _group_state(optim: Sequence[Any], stage: int, gid: int, partition: int, where: str
                 ) -> tuple[list[Kind | str], list[Kind | str]]:
    """(elementwise kinds, scalar kinds) of flat group `gid`'s optimizer state as rank 0 stores it: tensors of
    the partition's size (Adam's moments, momentum buffers, ...) and scalars (Adam's step: a 0-d tensor or an
    int). Raises CheckpointFormatError naming a state of any other size (factored or quantized state has no
    piece per parameter in a flat partition)."""
    st = _at(optim, 0, _state_path(stage, gid))
    if st is _ABSENT:
        return [], []
    if not isinstance(st, Mapping):
        raise CheckpointFormatError(f"{where}: {list(_state_path(stage, gid))} is {type(st).__name__}, not a dict")
    flat, scalars = [], []
    for name, value in st.items():
        kind = state_kind(str(name))
        if isinstance(value, int) and not isinstance(value, bool) or (
                isinstance(value, torch.Tensor) and value.dim() == 0):
            scalars.append(kind)
        elif isinstance(value, torch.Tensor) and value.numel() == partition:
            flat.append(kind)
        elif isinstance(value, torch.Tensor):
            raise CheckpointFormatError(
                f"{where}: optimizer state {name!r} of flat group {gid} holds {value.numel()} elements "
                f"({list(value.shape)}), not the partition's {partition}: state not shaped like its parameters "
                f"(factored or quantized, as Adafactor's or 8-bit Adam's) has no piece per parameter")
        elif value is not None:
            raise CheckpointFormatError(f"{where}: optimizer state {name!r} of flat group {gid} is "
                                        f"{type(value).__name__}, not a tensor or a number")
    return flat, scalars


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatGroup:
    """One flat optimizer group as ZeRO stores it: its position among the flat groups (the optimizer state's
    group id), the param group it belongs to, its params in order, each param's pieces per rank, the fp32
    master's elements per rank and the partition size at which every rank stores the state tensors."""

    index: int
    param_group: int
    params: tuple[Param, ...]
    chunks: Mapping[str, Sequence[tuple[int, tuple[int, int], int]]]  # name -> (rank, flat range, storage offset)
    master_numels: tuple[int, ...]
    partition: int

    @property
    def padding(self) -> int:
        """Elements of the dp partitions that no param fills (alignment)."""
        return self.partition * len(self.master_numels) - sum(p.numel for p in self.params)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStatesLayout:
    """What a DeepSpeed target's `*_model_states.pt` is built from besides its buffers and values: the ZeRO
    stage and model dtype, the module's keys in order (a tied alias stored as the param it shares,
    `shared_params`) and the frozen params with their shapes."""

    stage: int
    dtype: str
    module_keys: tuple[str, ...]
    shared_params: Mapping[str, str]
    frozen_params: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, m: Mapping[str, Any], stage: int) -> ModelStatesLayout:
        """From a DeepSpeed-style index's metadata `m`, for a target at ZeRO `stage`."""
        return cls(stage=stage, dtype=str(m["dtype"]), module_keys=tuple(m["module_keys"]),
                   shared_params=dict(m.get("shared_params") or {}),
                   frozen_params=tuple((str(n), tuple(s)) for n, s in m.get("frozen_params") or ()))


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroFiles:
    """How a DeepSpeed target's files are laid out, what its writer builds around buffers and values: the model
    states, the dp ranks' optimizer files (the flat groups, BF16_Optimizer's or a ZeRO optimizer's form, the
    optimizer's state kinds: flat tensors and per-group scalars) and the tag `latest` names."""

    model: ModelStatesLayout
    dp: int
    tag: str
    flat_groups: tuple[FlatGroup, ...]
    bf16_optimizer: bool
    state_kinds: tuple[str, ...]
    scalar_kinds: tuple[str, ...]


ZERO_FILES = "zero_files"  # the target index's metadata entry holding its ZeroFiles


def _flat_entries(groups: Sequence[FlatGroup], stage: int, tag: str, bf16: bool, optim: Sequence[Any],
                  root: Path) -> list[TensorEntry]:
    """Entries for the fp32 master and every optimizer state tensor (Adam's moments and step, momentum buffers,
    ...) of the flat groups, checking stored sizes on every rank."""
    entries: list[TensorEntry] = []
    for fg in groups:
        gid, params, chunks, master_numels, padded = fg.index, fg.params, fg.chunks, fg.master_numels, fg.partition
        flat, scalars = _group_state(optim, stage, gid, padded, str(root / optim_file(tag, 0, bf16)))
        paths = _optimizer_paths(stage, gid, flat + scalars)
        for kind in [Kind.MASTER, *flat]:
            path = paths[kind]
            for r in range(len(optim)):
                where = str(root / optim_file(tag, r, bf16))
                t = _stored(optim, r, path, where)
                if t is None:
                    raise CheckpointFormatError(f"{where}: {list(path)} missing" + (
                        "" if kind is Kind.MASTER else " (rank 0 stores it)"))
                want = master_numels[r] if kind is Kind.MASTER else padded
                if t.numel() != want:
                    raise LayoutMismatchError(
                        f"{where}: {list(path)} holds {t.numel()} elements, but ZeRO-{stage} at dp={len(optim)} "
                        f"for params {[p.name for p in params][:4]}... needs {want}")
        for p in params:
            for kind in [Kind.MASTER, *flat]:
                refs = tuple(ChunkRef(file=optim_file(tag, r, bf16), key=paths[kind], offsets=(0,) * len(p.shape),
                                      lengths=p.shape, flat_range=fr, storage_offset=so)
                             for r, fr, so in chunks[p.name])
                entries.append(TensorEntry(key=TensorKey(name=p.name, kind=kind), shape=p.shape, dtype="float32",
                                           chunks=refs))
            for kind in scalars:
                shape, dt = _stored_scalar(optim, 0, paths[kind], str(root / optim_file(tag, 0, bf16)))
                entries.append(TensorEntry(key=TensorKey(name=p.name, kind=kind), shape=shape, dtype=dt,
                                           chunks=(ChunkRef(file=optim_file(tag, 0, bf16), key=paths[kind],
                                                            offsets=(0,) * len(shape), lengths=shape),)))
    return entries


def _z12_flat_groups(groups: Sequence[Sequence[Param]], dp: int, padded_masters: bool = False) -> list[FlatGroup]:
    """ZeRO-1/2: one flat group per param group. Each rank's fp32 master is stored without the alignment
    padding, BF16_Optimizer's with it (`padded_masters`)."""
    out = []
    for gid, g in enumerate(groups):
        size, pad = z12_partition_size(g, dp)
        master = tuple(size if padded_masters else size - max(0, min(size, (r + 1) * size - (dp * size - pad)))
                       for r in range(dp))
        out.append(FlatGroup(index=gid, param_group=gid, params=tuple(g), chunks=z12_chunks(g, dp),
                             master_numels=master, partition=size))
    return out


def _z3_flat_groups(groups: Sequence[Sequence[Param]], dp: int, sub_group_size: int) -> list[FlatGroup]:
    """ZeRO-3: each param group cut into sub-groups of at most `sub_group_size` elements, one flat group each."""
    out: list[FlatGroup] = []
    for pg, g in enumerate(groups):
        for sg in z3_sub_groups(g, dp, sub_group_size):
            numel = sum(z3_piece(p.numel, dp) for p in sg)
            out.append(FlatGroup(index=len(out), param_group=pg, params=tuple(sg), chunks=z3_chunks(sg, dp),
                                 master_numels=(numel,) * dp, partition=numel))
    return out


def _z12_entries(groups, dp, tag, bf16, optim, root, padded_masters: bool = False) -> list[TensorEntry]:
    for gid in range(len(groups)):
        for r in range(dp):
            pc = optim[r][OSD].get("partition_count")
            count = pc[gid] if isinstance(pc, list) else pc
            if count != dp:
                raise LayoutMismatchError(f"{root / optim_file(tag, r, bf16)}: partition_count {count} != "
                                          f"dp_world_size {dp} (group {gid})")
    return _flat_entries(_z12_flat_groups(groups, dp, padded_masters), 2, tag, bf16, optim, root)


def _z3_entries(groups, dp, tag, bf16, optim, root, sub_group_size) -> list[TensorEntry]:
    flat = _z3_flat_groups(groups, dp, sub_group_size)
    stored = len(optim[0][OSD]["fp32_flat_groups"])
    if stored != len(flat):
        raise LayoutMismatchError(f"{root / optim_file(tag, 0, bf16)}: {stored} fp32 sub-groups stored, the "
                                  f"params and sub_group_size={sub_group_size} give {len(flat)}")
    return _flat_entries(flat, 3, tag, bf16, optim, root)


# ---------------------------------------------------------------- writer

GRADIENT_CLIPPING_DEFAULT = 1.0  # deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT (not imported: ~0.7 s)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedWriter:
    """Writes DeepSpeed's own files from filled buffers (see `deepspeed_target` for what is written). Every
    buffer sits unchanged at its key path in the assembled object, so the target is written in place unless
    the writer derives values (`deepspeed_target`)."""

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role == "latest":
            return meta[ZERO_FILES].tag
        if file.role == "state_report":
            return json.dumps(meta["state_report"], indent=1)
        if file.role == "model_states":
            return model_states_object(file, buffers, meta[ZERO_FILES].model)
        if file.role == "optim_states":
            return _optim_states(file, buffers, meta[ZERO_FILES])
        if file.role == TRAINER_ROLE:  # an HF-Trainer source's own files, for dp processes
            return trainer_file_bytes(file)
        raise PlanError(f"DeepSpeed writer: unknown file role {file.role!r} for {file.path}")


def deepspeed_target(source: CheckpointIndex, *, dp: int, zero_stage: int) -> TargetSpec:
    """The files and chunks of `source`'s training state as a DeepSpeed ZeRO-`zero_stage` checkpoint at dp.

    The source must carry DeepSpeed-style metadata (param groups, scheduler, ...): a DeepSpeed or
    DeepSpeed-universal index. Precision is kept: bf16/fp16 sources give bf16/fp16 targets. A source that
    keeps Adam's step per param group (Megatron) gets torch Adam's per-flat-group step
    (`adam_step.derived_step`), planned as a value of each optimizer file, so its files are assembled in
    memory. What is not a tensor (the engine's counters, config and client state, the optimizer's param
    groups and loss scaler, an HF-Trainer source's own files) is planned as the files' values."""
    if dp < 1 or zero_stage not in (1, 2, 3):
        raise PlanError(f"DeepSpeed target needs dp >= 1 and zero_stage in 1..3, got dp={dp} zero_stage={zero_stage}")
    m = source.meta if source.format in DS_META_FORMATS else deepspeed_meta_from(source)
    for k in ("param_groups", "tag", "dtype", "model_state", "param_group_hparams"):
        if k not in m:
            raise PlanError(f"source {source.root} ({source.format}) lacks DeepSpeed metadata {k!r}")
    if source.meta.get("source_param_naming"):  # written in another naming (--param-names): that model's order
        m = in_module_order(source, m)
    tag, dtype, bf16 = m["tag"], m["dtype"], m["dtype"] == "bfloat16"
    groups = [[Param(name=n, shape=tuple(s)) for n, s in g] for g in m["param_groups"]]
    src = source.by_key()
    shapes = state_entries(source)
    refuse_split_state(source, target="deepspeed", shapes=shapes,
                       how=f"ZeRO-{zero_stage} flattens every parameter's state into one flat partition per rank")
    flat_kinds = state_kinds(shapes, StateShape.ELEMENTWISE)
    scalar_kinds = state_kinds(shapes, StateShape.SCALAR)
    entries: list[TensorEntry] = []
    buffers: dict[str, list[TargetBuffer]] = {}

    def add(file: str, key: KeyPath, shape: tuple[int, ...], dt: str) -> None:
        buffers.setdefault(file, []).append(TargetBuffer(key=key, shape=shape, dtype=dt))

    model_files = [model_file(tag, zero_stage, r) for r in range(dp if zero_stage == 3 else 1)]
    for name in m["buffer_names"]:
        e = src[TensorKey(name=name, kind=Kind.PARAM)]
        for mf in model_files:
            add(mf, ("module", name), e.shape, e.dtype)
        entries.append(TensorEntry(key=e.key, shape=e.shape, dtype=e.dtype, chunks=tuple(
            ChunkRef(file=mf, key=("module", name), offsets=(0,) * len(e.shape), lengths=e.shape)
            for mf in model_files)))
    frozen = [(Param(name=n, shape=tuple(s)), src[TensorKey(name=n, kind=Kind.PARAM)].dtype)
              for n, s in m.get("frozen_params") or ()]
    # a BF16_Optimizer source stays one at ZeRO-1 (what the same DeepSpeed config saves); DeepSpeed's
    # ZeRO optimizers and BF16_Optimizer each load the other's ZeRO-1 files as well
    flavor = BF16_OPTIMIZER if m.get("optimizer_flavor") == BF16_OPTIMIZER and zero_stage == 1 else ZERO_OPTIMIZER
    if zero_stage != 3:
        _check_module_covered(m, groups, frozen, source)
        for p, dt in [(p, dtype) for g in groups for p in g] + frozen:
            add(model_files[0], ("module", p.name), p.shape, dt)
            entries.append(TensorEntry(key=TensorKey(name=p.name, kind=Kind.PARAM), shape=p.shape, dtype=dt,
                                       chunks=(ChunkRef(file=model_files[0], key=("module", p.name),
                                                        offsets=(0,) * len(p.shape), lengths=p.shape),)))
        flat = _z12_flat_groups(groups, dp, padded_masters=flavor == BF16_OPTIMIZER)
    else:
        sub = int(m["model_state"].get("ds_config", {}).get("zero_optimization", {}).get(
            "sub_group_size", DEFAULT_SUB_GROUP_SIZE))
        flat = _z3_flat_groups(groups, dp, sub)
        for p, dt in frozen:  # each rank's model file keeps its piece
            for mf in model_files:
                add(mf, ("frozen_param_fragments", p.name), (z3_piece(p.numel, dp),), dt)
            entries.append(z3_frozen_entry(p, dt, model_files))
    scalar_dtypes = {k: next(e.dtype for e in source.entries if e.key.kind == k) for k in scalar_kinds}
    for fg in flat:
        gid, params, chunks, master_numels, padded = fg.index, fg.params, fg.chunks, fg.master_numels, fg.partition
        _check_state_complete(src, params, flat_kinds + scalar_kinds, gid)
        paths = _optimizer_paths(zero_stage, gid, scalar_kinds + flat_kinds)
        kinds = [Kind.MASTER, *flat_kinds]
        for r in range(dp):
            of = optim_file(tag, r, bf16)
            for kind in kinds:
                add(of, paths[kind], (master_numels[r] if kind is Kind.MASTER else padded,), "float32")
            for kind in scalar_kinds:
                add(of, paths[kind], (), scalar_dtypes[kind])
        for p in params:
            for kind in kinds:
                entries.append(TensorEntry(key=TensorKey(name=p.name, kind=kind), shape=p.shape, dtype="float32",
                                           chunks=tuple(ChunkRef(file=optim_file(tag, r, bf16), key=paths[kind],
                                                                 offsets=(0,) * len(p.shape), lengths=p.shape,
                                                                 flat_range=fr, storage_offset=so)
                                                        for r, fr, so in chunks[p.name])))
        for kind in scalar_kinds:  # one per flat group (the torch optimizer sees one flat parameter): the first's
            entries.append(TensorEntry(key=TensorKey(name=params[0].name, kind=kind), shape=(),
                                       dtype=scalar_dtypes[kind],
                                       chunks=tuple(ChunkRef(file=optim_file(tag, r, bf16), key=paths[kind],
                                                             offsets=(), lengths=()) for r in range(dp))))
    model_state, state_report = target_training_state(m, dp=dp, zero_stage=zero_stage)
    # a source with Adam's step per param group (Megatron): torch Adam's per-parameter step, one per flat group
    # in each rank's file, planned as a value, so the optimizer files are assembled in memory (the in-place
    # path only copies buffers)
    step = None if Kind.STEP in scalar_kinds else derived_step(source)
    steps = () if step is None else tuple(
        ValueItem(key=_state_path(zero_stage, gid, Kind.STEP), role=ValueRole.STEP, value=step_tensor(step))
        for gid in range(len(flat)))
    zero = ZeroFiles(model=ModelStatesLayout.of(m, zero_stage), dp=dp, tag=tag, flat_groups=tuple(flat),
                     bf16_optimizer=flavor == BF16_OPTIMIZER, state_kinds=tuple(str(k) for k in flat_kinds),
                     scalar_kinds=tuple(str(k) for k in scalar_kinds))
    meta = {**{k: v for k, v in m.items() if k != "model_state"}, "state_report": state_report,
            "stage": zero_stage, "dp": dp, "optimizer_flavor": flavor, ZERO_FILES: zero}
    if m.get("hf_trainer"):  # the decision behind each process's RNG file, for the plan and the report
        meta["trainer_rng"] = trainer_rng(m["hf_trainer"], world_size=dp)[1]
    files = [TargetFile(path="latest", role="latest", rank=None)]
    if CLIENT_STATE_KEY in m["model_state"]:  # the report of the training state the built-in workloads save
        files.append(TargetFile(path=STATE_REPORT_FILE, role="state_report", rank=None))
    model_values = model_states_values(m, model_state, stage=zero_stage, dp=dp)
    files += [TargetFile(path=mf, role="model_states", rank=(r if zero_stage == 3 else None),
                         buffers=tuple(buffers.get(mf, ())), values=model_values) for r, mf in enumerate(model_files)]
    # beside the optimizer state: the config and version DeepSpeed saved (top level), the derived steps
    ds_config = target_ds_config(model_state, zero_stage)
    optim_values = (*optimizer_values(m, flat, stage=zero_stage, bf16_optimizer=zero.bf16_optimizer,
                                      ds_config=ds_config),
                    ValueItem(key=("ds_config",), role=ValueRole.ARGS, value=ds_config),
                    ValueItem(key=("ds_version",), role=ValueRole.COMMON, value=m["ds_version"]), *steps)
    files += [TargetFile(path=optim_file(tag, r, bf16), role="optim_states", rank=r,
                         buffers=tuple(buffers[optim_file(tag, r, bf16)]), values=optim_values) for r in range(dp)]
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(entries), files=tuple(f.path for f in files),
                            meta=meta)
    # an HF-Trainer source's own files (trainer_state.json, config.json, per-process RNG, ...) beside the engine's
    trainer = trainer_files(m["hf_trainer"], world_size=dp) if m.get("hf_trainer") else ()
    return TargetSpec(index=index, files=tuple(files), commit=("latest",), described=trainer,
                      write_mode=WriteMode.IN_PLACE if step is None else WriteMode.IN_MEMORY)


def _check_state_complete(src: Mapping[TensorKey, TensorEntry], params: Sequence[Param], kinds: Sequence[Kind | str],
                          gid: int) -> None:
    """Raise PlanError unless every parameter of flat group `gid` has every optimizer state `kinds`: the wrapped
    optimizer keeps one state per flat partition, which a parameter without it would leave with a hole."""
    missing = [(p.name, k) for k in kinds for p in params if TensorKey(name=p.name, kind=k) not in src]
    if missing:
        have = next((p.name for p in params if all(TensorKey(name=p.name, kind=k) in src for k in kinds)), None)
        raise PlanError(f"deepspeed target: parameter {missing[0][0]} has no optimizer state {missing[0][1]} "
                        f"({len(missing)} missing in flat group {gid}; {have or 'no parameter'} has all of "
                        f"{[str(k) for k in kinds]}): ZeRO keeps one state per flat group, so each of its parameters "
                        f"needs the same state")


def module_order(source: CheckpointIndex, naming: str) -> tuple[list[str], dict[str, Any] | None]:
    """The parameter order of the model a DeepSpeed target in `naming` is loaded into, and the HF config it comes
    from: transformers' model class built from the config on the meta device (`named_parameters()`, what ZeRO
    flattens), or the built-in decoder's order for canonical names."""
    from checkpoint.formats.hf import target_config
    from checkpoint.formats.megatron import source_arch
    from checkpoint.rules.megatron import hf_order

    if naming == "canonical":
        return hf_order(source_arch(source)), None
    if naming != "hf":
        raise PlanError(f"--param-names {naming}: a DeepSpeed target is written in canonical or hf names (the "
                        f"parameter order of the model it is loaded into must be known)")
    import transformers

    embed = next((e.shape for e in source.entries if e.key.name == "model.embed_tokens.weight"), None)
    if embed is None:
        raise PlanError(f"source {source.root} ({source.format}) has no embedding (model.embed_tokens.weight): not a "
                        f"decoder a transformers model class holds")
    dtype = str(source.meta.get("dtype", "float32"))
    config, _ = target_config(source, None, vocab_rows=embed[0], dtype=dtype)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(str(config["model_type"]), **fields))
    return [n for n, _ in model.named_parameters()], config


def in_module_order(source: CheckpointIndex, m: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed metadata `m` with its param groups (and module keys) in the order of the model the renamed
    target is loaded into; an HF target also gets the config.json and trainer_state.json of a Trainer
    checkpoint-N folder when the source is not one. Raises PlanError naming the names the model and the
    checkpoint do not share."""
    naming = str(source.meta["param_naming"])
    order, config = module_order(source, naming)
    have = [n for g in m["param_groups"] for n, _ in g]
    if sorted(order) != sorted(have):
        raise PlanError(f"the {naming} model's parameters and the checkpoint's differ: only the model has "
                        f"{sorted(set(order) - set(have))[:4]}, only the checkpoint "
                        f"{sorted(set(have) - set(order))[:4]}")
    rank = {n: i for i, n in enumerate(order)}
    out = dict(m)
    out["param_groups"] = [sorted(g, key=lambda p: rank[p[0]]) for g in m["param_groups"]]
    out["module_keys"] = sorted(m["module_keys"], key=lambda n: rank.get(n, len(rank)))
    if config is not None and not m.get("hf_trainer"):
        step = int(m["model_state"].get("global_steps") or 0)
        # the per-process batch the Trainer compares its arguments with (a warning when they differ)
        micro = (m["model_state"].get("ds_config") or {}).get("train_micro_batch_size_per_gpu") or \
            (source.meta.get("megatron_args") or {}).get("micro_batch_size") or 1
        out["hf_trainer"] = {"trainer_state": new_trainer_state(global_step=step, train_batch_size=int(micro)),
                             "hf_config": config, "generation_config": None, "rng": [], "scheduler": None, "files": []}
    return out


def _check_module_covered(m: Mapping[str, Any], groups: Sequence[Sequence[Param]],
                          frozen: Sequence[tuple[Param, str]], source: CheckpointIndex) -> None:
    """ZeRO-1/2 store every module tensor whole: each module key must be a trained param, a frozen
    param, a buffer or a tied alias of one of them, or the target would hold an empty tensor there."""
    known = {p.name for g in groups for p in g} | {p.name for p, _ in frozen} | set(m["buffer_names"]) | \
        set(m.get("shared_params") or {})
    unknown = [k for k in m["module_keys"] if k not in known]
    if unknown:
        raise PlanError(f"source {source.root} ({source.format}): module tensors {unknown[:4]} are neither trained "
                        f"params, frozen params, buffers nor tied (shared) params of the index; a ZeRO-1/2 target "
                        f"stores every module tensor whole and cannot be written without them")


def target_training_state(m: Mapping[str, Any], *, dp: int, zero_stage: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source's client state and counters for dp target ranks (RNG per rank, data position), and
    the report of the policy applied to each state (`checkpoint.state.training_state`)."""
    target_roles = roles(dp=dp)
    model_state, report = convert_model_state(m["model_state"], target_roles)
    return model_state, report_dict(report, source=f"deepspeed dp={m.get('dp')} ZeRO-{m.get('stage')}",
                                    target=f"deepspeed dp={dp} ZeRO-{zero_stage}")


def deepspeed_meta_from(source: CheckpointIndex) -> dict[str, Any]:
    """DeepSpeed metadata for a source of another format, from its canonical `train_state`.

    Params keep the source's order and its param groups; the model dtype is the source params'
    (fp32 masters become the fp32 module). The client state (e.g. the job's sampler) is carried.
    """
    refuse_tied_embeddings(source, "deepspeed")
    ts = source.meta.get("train_state")
    if ts is None:
        raise PlanError(f"source {source.root} ({source.format}) carries no train_state (step, scheduler, "
                        f"param groups): cannot describe it as a DeepSpeed checkpoint")
    src = source.by_key()
    shapes = {e.key.name: e.shape for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)}
    owners = ts.get("optimizer_group_params") or [ts.get("param_names") or list(shapes)]
    if sorted(n for g in owners for n in g) != sorted(shapes):
        owners = [list(shapes)]
    groups = [[(n, list(shapes[n])) for n in g] for g in owners]
    param = next((src[TensorKey(name=n, kind=Kind.PARAM)] for n in shapes if TensorKey(name=n, kind=Kind.PARAM) in src),
                 None)
    dtype = param.dtype if param is not None else "float32"
    step = ts.get("step")
    hparams = [dict(g) for g in ts.get("optimizer_param_groups") or [{}]][:len(groups)]
    hparams += [dict(hparams[-1]) for _ in range(len(groups) - len(hparams))]
    from importlib.metadata import version

    scheduler = ts.get("lr_scheduler")
    if isinstance(scheduler, Mapping) and "last_step" in scheduler and "last_batch_iteration" not in scheduler:
        # the position as DeepSpeed's own schedulers (WarmupLR, WarmupDecayLR, OneCycle) keep it, beside the
        # built-in engines' ScheduledLR one: a config-built scheduler resumes at the same step
        scheduler = {**scheduler, "last_batch_iteration": int(scheduler["last_step"]) - 1}
    model_state = {"buffer_names": [], "optimizer": None, "frozen_param_shapes": None, "shared_params": {},
                   "frozen_param_fragments": None, "lr_scheduler": scheduler, "data_sampler": None,
                   "random_ltd": None, "skipped_steps": 0, "global_steps": int(step or 0), "global_samples": 0,
                   "dp_world_size": int(source.meta.get("dp", 1)), "mp_world_size": 1,
                   "ds_config": {"bf16": {"enabled": dtype == "bfloat16"}}, "ds_version": version("deepspeed"),
                   **dict(ts.get("client") or {})}
    return {"tag": f"global_step{int(step or 0)}", "dtype": dtype, "bf16_files": dtype == "bfloat16",
            "param_groups": groups, "module_keys": [n for g in groups for n, _ in g], "buffer_names": [],
            "param_group_hparams": hparams, "model_state": model_state, "loss_scaler": None,
            "optimizer_flags": {}, "ds_version": version("deepspeed"), "global_steps": step,
            "train_state": ts}


def target_ds_config(model_state: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The source's DeepSpeed config (in its model states) with the target's ZeRO stage."""
    cfg = copy.deepcopy(dict(model_state.get("ds_config", {})))
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    return cfg


def model_states_values(m: Mapping[str, Any], model_state: Mapping[str, Any], *, stage: int, dp: int
                        ) -> tuple[ValueItem, ...]:
    """What `engine.save_checkpoint` stores in a `*_model_states.pt` file beside the module's tensors, for the
    target's ZeRO `stage` and `dp`: the engine's counters, scheduler and config, the param shapes, the client
    state (`model_state` as converted for the target), each at its top-level key."""
    shared, frozen = m.get("shared_params") or {}, m.get("frozen_params") or []
    state = copy.deepcopy(dict(model_state))
    state["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in g) for g in m["param_groups"]]
    state["shared_params"] = dict(shared)
    if stage >= 2:  # as DeepSpeed saves them when it partitions gradients (ZeRO-2/3); the fragments: the writer's
        state["frozen_param_shapes"] = OrderedDict((n, torch.Size(s)) for n, s in frozen)
        state.pop("frozen_param_fragments", None)
    else:
        state["frozen_param_shapes"] = state["frozen_param_fragments"] = None
    state["dp_world_size"] = dp
    state["ds_config"] = target_ds_config(model_state, stage)
    return tuple(ValueItem(key=(k,), role=ValueRole.ARGS if k == "ds_config" else ValueRole.COMMON
                           if k in ENGINE_MODEL_KEYS else ValueRole.OBJECT, value=v) for k, v in state.items())


def model_states_object(file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], layout: ModelStatesLayout) -> dict:
    """The object `engine.save_checkpoint` stores in a `*_model_states.pt` file: the filled buffers as its
    module (and, at ZeRO-2/3, frozen param fragments) with the file's values."""
    dtype = getattr(torch, layout.dtype)
    shared = layout.shared_params
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in layout.module_keys:
        buf = buffers.get(("module", shared.get(name, name)))  # a tied alias is its param's very tensor
        module[name] = buf if buf is not None else torch.empty(0, dtype=dtype)
    state: dict[str, Any] = {"module": module} | {item.key[0]: item.value for item in file.values}
    if layout.stage >= 2:
        state["frozen_param_fragments"] = OrderedDict(
            (n, buffers[("frozen_param_fragments", n)] if layout.stage == 3 else module[n])
            for n, _ in layout.frozen_params)
    order = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments"]
    return {k: state[k] for k in order if k in state} | {k: v for k, v in state.items() if k not in order}


def loss_scaler_of(spec: Mapping[str, Any] | None) -> Any:
    """The loss scaler object DeepSpeed saved, rebuilt from its plain data (`spec`, the index's; a static scale
    of 1 when the source saved none)."""
    from checkpoint.safe_load import DynamicLossScaler, LossScaler  # DeepSpeed's, without importing deepspeed

    if spec is None:
        return LossScaler(scale=1.0)
    cls = DynamicLossScaler if spec.get("__class__", "").endswith("DynamicLossScaler") else LossScaler
    obj = cls.__new__(cls)
    obj.__dict__.update({k: v for k, v in spec.items() if k != "__class__"})
    return obj


def optimizer_values(m: Mapping[str, Any], flat_groups: Sequence[FlatGroup], *, stage: int, bf16_optimizer: bool,
                     ds_config: Mapping[str, Any]) -> tuple[ValueItem, ...]:
    """What a ZeRO optimizer's state dict holds beside its tensors, as DeepSpeed saves it for ZeRO `stage`
    (or BF16_Optimizer): the wrapped optimizer's param groups (hyperparameters, one flat group id each), the
    loss scaler (as plain data) and its flags, the gradient clipping, DeepSpeed's version. Raises PlanError
    when a flat group names a param group the source lacks."""
    flags, hparams = m["optimizer_flags"], m["param_group_hparams"]
    groups = [{**copy.deepcopy(hp), "params": []} for hp in hparams]
    for gid, fg in enumerate(flat_groups):
        if fg.param_group >= len(groups):
            raise PlanError(f"flat group {gid} belongs to param group {fg.param_group} but the source has "
                            f"{len(groups)} optimizer param groups")
        groups[fg.param_group]["params"].append(gid)
    for hp in groups:
        if isinstance(hp.get("betas"), list):
            hp["betas"] = tuple(hp["betas"])
    # what DeepSpeed itself stores: the saved value, else the config's gradient_clipping (default 1.0)
    clip = flags.get("clip_grad", ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
    held: list[tuple[KeyPath, ValueRole, Any]] = [((*_state_path(stage, 0)[:2], "param_groups"), ValueRole.COMMON,
                                                   groups)]
    if not bf16_optimizer:  # BF16_Optimizer.state_dict(): no loss scaler
        held += [((OSD, "loss_scaler"), ValueRole.OBJECT, m.get("loss_scaler")),
                 ((OSD, "dynamic_loss_scale"), ValueRole.COMMON, flags.get("dynamic_loss_scale", False)),
                 ((OSD, "overflow"), ValueRole.COMMON, flags.get("overflow", False))]
    if stage != 3:
        held += [((OSD, "clip_grad"), ValueRole.COMMON, clip), ((OSD, "ds_version"), ValueRole.COMMON, m["ds_version"])]
    return tuple(ValueItem(key=key, role=role, value=value) for key, role, value in held)


def _optim_states(file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], zero: ZeroFiles) -> dict:
    """A rank's optimizer file: its flat groups' fp32 partitions and state tensors (with derived steps) laid
    out as DeepSpeed's ZeRO optimizer (or BF16_Optimizer) saves them, around the file's values."""
    from checkpoint.safe_load import ZeroStageEnum, fragment_address  # DeepSpeed's, without importing deepspeed

    stage, dp, rank = zero.model.stage, zero.dp, file.rank
    values = {item.key: item.value for item in file.values}
    state: dict[int, dict[str, torch.Tensor]] = {}
    masters = []
    for gid in range(len(zero.flat_groups)):
        masters.append(buffers[_master_path(stage, gid)])
        st: dict[str, Any] = {}  # torch's order: the scalars (step) first, then the tensors as the source had them
        if (step_path := _state_path(stage, gid, Kind.STEP)) in values:
            st["step"] = values[step_path]
        for kind in zero.scalar_kinds:
            st[kind] = step_as_stored(buffers[_state_path(stage, gid, kind)])
        for kind in zero.state_kinds:
            st[kind] = buffers[_state_path(stage, gid, kind)]
        if st:
            state[gid] = st
    base_path = _state_path(stage, 0)[:2]
    base = {"state": state, "param_groups": values[(*base_path, "param_groups")]}
    if stage == 3:
        osd = {"zero_stage": ZeroStageEnum(3), "loss_scaler": loss_scaler_of(values[(OSD, "loss_scaler")]),
               "dynamic_loss_scale": values[(OSD, "dynamic_loss_scale")], "overflow": values[(OSD, "overflow")],
               "partition_count": dp, OSD: base, "fp32_flat_groups": masters}
    else:
        bf16_optimizer = zero.bf16_optimizer
        paddings, slice_maps = [], []
        for fg in zero.flat_groups:
            if rank != dp - 1:
                paddings.append(0)
            else:  # BF16_Optimizer: the group's whole padding; ZeRO-1/2: what its lean master lacks
                paddings.append(fg.padding if bf16_optimizer else fg.partition - fg.master_numels[rank])
            mapping = OrderedDict()
            for name in (p.name for p in fg.params):
                for r, (lo, hi), so in fg.chunks[name]:
                    if r == rank:
                        mapping[name] = fragment_address(numel=hi - lo, start=so)
            slice_maps.append(mapping)
        counts = [dp] * len(zero.flat_groups)
        clip = values[(OSD, "clip_grad")]
        if bf16_optimizer:  # BF16_Optimizer.state_dict(): no loss scaler, no zero_stage
            osd = {"clip_grad": clip, "base_optimizer_state": base, "single_partition_of_fp32_groups": masters,
                   "group_paddings": paddings, "partition_count": counts}
        else:
            osd = {"loss_scaler": loss_scaler_of(values[(OSD, "loss_scaler")]),
                   "dynamic_loss_scale": values[(OSD, "dynamic_loss_scale")], "overflow": values[(OSD, "overflow")],
                   "clip_grad": clip, "base_optimizer_state": base, "single_partition_of_fp32_groups": masters,
                   "zero_stage": ZeroStageEnum(stage), "group_paddings": paddings,
                   "param_alignment_paddings": [[0] * len(fg.params) for fg in zero.flat_groups],
                   "partition_count": counts}
        osd |= {"ds_version": values[(OSD, "ds_version")], "param_slice_mappings": slice_maps}
    return {OSD: osd} | {key[0]: value for key, value in values.items() if len(key) == 1}


# ---------------------------------------------------------------- registration

def _read(path: Path, opts: ReadOptions) -> CheckpointIndex:
    return read_deepspeed(path, trust_checkpoint=opts.trust_checkpoint, expect_dp=opts.expect.dp,
                          expect_stage=opts.expect.zero_stage)


def target_dp_and_stage(index: CheckpointIndex, opts: TargetOptions, what: str) -> tuple[int, int]:
    """(dp, ZeRO stage) of a data-parallel-only target: the options', else the source's."""
    asked = opts.layout
    if (asked.tp or 1, asked.pp or 1, asked.ep or 1) != (1, 1, 1):
        raise PlanError(f"{what} target is written at tp=1 pp=1 ep=1; got tp={asked.tp} pp={asked.pp} ep={asked.ep}")
    dp = asked.dp if asked.dp is not None else int(index.meta.get("dp", 1))
    stage = asked.zero_stage if asked.zero_stage is not None else int(index.meta.get("stage", 1))
    return dp, stage


def _target(index: CheckpointIndex, opts: TargetOptions) -> TargetSpec:
    dp, stage = target_dp_and_stage(index, opts, "DeepSpeed")
    return deepspeed_target(index, dp=dp, zero_stage=stage)


SPEC = CheckpointFormat(name=FORMAT, description="DeepSpeed ZeRO 1/2/3 (mp_rank_00, any dp)",
                        detect=is_deepspeed_checkpoint, read=_read, target=_target, writer=DeepSpeedWriter(),
                        names="any")
