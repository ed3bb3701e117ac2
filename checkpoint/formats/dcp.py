"""PyTorch Distributed Checkpoint (DCP) as FSDP2/torchtitan write it: reader and writer, model + optimizer state.

On-disk layout (torch 2.x `FileSystemWriter`, no storage transforms): `.metadata` (a pickled
`Metadata`, unpickled here with DCP's metadata classes only: `safe_load.read_dcp_metadata`) and one
`__<rank>_0.distcp` per rank holding, at byte ranges listed in `storage_data`, each chunk the
rank saved (a `torch.save`d tensor) and each non-tensor value (a `torch.save`d object).
State-dict layout (torchtitan / `get_model_state_dict` + `get_optimizer_state_dict`):
`model.<param>`, `optimizer.state.<param>.<state>` (Adam's `exp_avg`, `exp_avg_sq`, `step`, or any other
optimizer's per-parameter state: `momentum_buffer`, `max_exp_avg_sq`, ...),
`optimizer.param_groups.<i>.<hparam>`, plus any other non-tensor values (`lr_scheduler.*`,
`migrate.*`) which the writer carries over unchanged.

Canonical names are the model's parameter names, as in DeepSpeed's `param_shapes`. The writer
shards every tensor along dim 0 in `world_size` pieces (FSDP2's `torch.chunk` split); DCP's own
loader reshards on load anyway, so any world size loads it.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import pickle
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from checkpoint import safe_load
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError, PlanError
from checkpoint.io.sources import BYTE_RANGE, load_range
from checkpoint.write import FileRecord, StreamPayload
from checkpoint.formats.adam_step import derived_step, step_tensor
from checkpoint.formats.base import (CheckpointFormat, ReadOptions, TargetOptions, refuse_frozen_params,
                                     refuse_tied_embeddings)
from checkpoint.formats.dcp_layout import (DCPLayout, find_layout, optimizer_item, optimizer_roots, param_groups,
                                           param_name)
from checkpoint.formats.dcp_metadata import PlacedItem, build_metadata, placed_values, save_values
from checkpoint.index import (CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey, dtype_name, dtype_size,
                              is_optimizer_state, state_kind)
from checkpoint.paths import inside
from checkpoint.state.optimizer_state import refuse_split_state
from checkpoint.state.training_state import (CLIENT_STATE_KEY, COUNTERS, STATE_REPORT_FILE, StateEntry,
                                             our_client_state, report_dict)
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole, WriteMode

FORMAT = "dcp"
METADATA = ".metadata"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


LAYOUTS = ("nested", "torchtitan")


def fqn_path(key: TensorKey, layout: str = "nested") -> tuple[str, ...]:
    """The state-dict path of a canonical tensor. nested (FSDP2's get_*_state_dict under model/optimizer):
    ('model', name), ('optimizer', 'state', name, kind); torchtitan (CheckpointManager: the model flattened to the
    top level, the optimizer saved with flatten_optimizer_state_dict): (name,), ('optimizer', 'state.name.kind')."""
    if key.kind is Kind.PARAM:
        return (key.name,) if layout == "torchtitan" else ("model", key.name)
    if is_optimizer_state(key.kind):
        kind = str(key.kind)
        return ("optimizer", f"state.{key.name}.{kind}") if layout == "torchtitan" else (
            "optimizer", "state", key.name, kind)
    raise PlanError(f"DCP has no place for tensor {key} (kinds written: param and the optimizer's state)")


def _fqn(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / METADATA).is_file() and any(path.glob("*.distcp"))


def storage_by_index(md: Any, root: Path) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """DCP's storage entries by (fqn, chunk offsets or None for a value), each storage path checked to stay
    inside `root` (`paths.inside`) and each entry to be a plain (untransformed) torch_save record."""
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in md.storage_data.items():
        where = f"{root / METADATA}: storage of {idx.fqn}"
        inside(root, str(info.relative_path), what=where)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(f"{root}: {idx.fqn} is stored with transforms {info.transform_descriptors}; "
                                        f"only plain torch_save DCP files are supported")
        if not isinstance(info.offset, int) or not isinstance(info.length, int) or info.offset < 0 or info.length < 0:
            raise CheckpointFormatError(f"{where}: byte range offset={info.offset!r} length={info.length!r} is not "
                                        f"two non-negative integers")
        storage[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = info
    return storage


def check_data_files(md: Any, root: Path) -> list[str]:
    """The data files `.metadata` lists (sorted); raises CheckpointFormatError naming the missing ones."""
    files = sorted({str(info.relative_path) for info in md.storage_data.values()})
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointFormatError(f"{root}: .metadata lists data files {missing[:5]}{more} that are missing "
                                    f"({len(missing)} of {len(files)})")
    return files


def _nest(flat: Mapping[tuple[Any, ...], Any]) -> dict[Any, Any]:
    """{('a', 0, 'b'): v} -> {'a': [{'b': v}]} (integer keys become list positions)."""
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        cur = root
        for k in path[:-1]:
            cur = cur.setdefault(k, {})
        cur[path[-1]] = value

    def lists(obj: Any) -> Any:
        if isinstance(obj, dict):
            if obj and all(isinstance(k, int) for k in obj):
                return [lists(obj[k]) for k in sorted(obj)]
            return {k: lists(v) for k, v in obj.items()}
        return obj

    return lists(root)


def read_dcp(path: str | Path, *, expect_dp: int | None = None, expect_tp: int | None = None,
             trust_checkpoint: bool = False) -> CheckpointIndex:
    """Index a DCP checkpoint from `.metadata`; non-tensor values are loaded (weights_only) into meta.

    Chunks may be boxes in any dims (FSDP2's dim-0 pieces, DTensor TP's row/column pieces, both on
    a dp x tp mesh); the layout (dp, tp) follows from the chunks (`_saved_layout`). Raises
    CheckpointFormatError for missing data files, storage transforms, tensors this reader does not
    understand or a tp that does not divide the rank files, LayoutMismatchError when `expect_dp` /
    `expect_tp` differ from the layout.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    root = Path(path)
    md = safe_load.read_dcp_metadata(root, trust_checkpoint=trust_checkpoint)
    storage = storage_by_index(md, root)
    files = check_data_files(md, root)
    planner_data = dict(md.planner_data or {})
    # DCP's flattened paths keep list positions as ints (param_groups.0.lr); the index speaks in strings,
    # and the carried values are nested again by the typed paths so that their lists come back as lists.
    typed = {fqn: tuple(planner_data.get(fqn, tuple(fqn.split(".")))) for fqn in md.state_dict_metadata}
    paths = {fqn: tuple(str(p) for p in path) for fqn, path in typed.items()}
    list_positions = {paths[fqn]: path for fqn, path in typed.items()}
    tensor_bytes = {paths[fqn]: math.prod(item.size) * dtype_size(dtype_name(item.properties.dtype))
                    for fqn, item in md.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}
    layout = find_layout(tensor_bytes, where=str(root), roots=optimizer_roots(paths.values()))
    entries: list[TensorEntry] = []
    values: dict[tuple[Any, ...], Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        path_ = paths[fqn]
        if isinstance(item, BytesStorageMetadata):
            info = storage.get((fqn, None))
            if info is None:
                raise CheckpointFormatError(f"{root}: no storage entry for value {fqn}")
            values[path_] = load_range(root / info.relative_path, info.offset, info.length,
                                       trust_checkpoint=trust_checkpoint)
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointFormatError(f"{root}: {fqn} has unknown metadata {type(item).__name__}")
        key = _tensor_key(layout, path_)
        if key is None:  # neither model nor optimizer state (torchtitan's train_state.step, ...): carried as a value
            values[path_] = _small_tensor(root, fqn, item, storage, trust_checkpoint)
            continue
        chunks = []
        for c in item.chunks:
            info = storage.get((fqn, tuple(c.offsets)))
            if info is None:
                raise CheckpointFormatError(f"{root}: no storage entry for {fqn} chunk at {list(c.offsets)}")
            chunks.append(ChunkRef(file=info.relative_path, key=(BYTE_RANGE, info.offset, info.length),
                                   offsets=tuple(c.offsets), lengths=tuple(c.sizes)))
        entry = TensorEntry(key=key, shape=tuple(item.size), dtype=dtype_name(item.properties.dtype),
                            chunks=tuple(chunks))
        entry.check_complete()
        entries.append(entry)
    _check_names(entries, root)
    world = len([f for f in files if f.endswith(".distcp")])
    dp, tp = _saved_layout(entries, world, root)
    if expect_dp is not None and expect_dp != dp:
        raise LayoutMismatchError(f"{root}: declared dp={expect_dp} but the checkpoint was saved at dp={dp} "
                                  f"(tp={tp}, {world} rank files)")
    if expect_tp is not None and expect_tp != tp:
        raise LayoutMismatchError(f"{root}: declared tp={expect_tp} but the checkpoint was saved at tp={tp} "
                                  f"(dp={dp}, {world} rank files)")
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=(METADATA, *files),
                           meta=_meta(entries, values, layout, world, dp=dp, tp=tp, typed_paths=list_positions))


_SMALL_TENSOR = 1 << 20  # bytes: a counter or buffer beside the model, not a weight


def _small_tensor(root: Path, fqn: str, item: Any, storage: Mapping[Any, Any], trust_checkpoint: bool) -> Any:
    """A tensor outside the model and optimizer, loaded whole to be carried as a value."""
    size = math.prod(item.size) * dtype_size(dtype_name(item.properties.dtype))
    if size > _SMALL_TENSOR or len(item.chunks) != 1:
        raise CheckpointFormatError(f"{root}: tensor {fqn} ({list(item.size)}, {len(item.chunks)} chunks) is neither "
                                    f"a model parameter nor optimizer state and too large to "
                                    f"carry as a value")
    info = storage.get((fqn, tuple(item.chunks[0].offsets)))
    if info is None:
        raise CheckpointFormatError(f"{root}: no storage entry for {fqn}")
    return load_range(root / info.relative_path, info.offset, info.length, trust_checkpoint=trust_checkpoint)


def _check_names(entries: Sequence[TensorEntry], root: Path) -> None:
    """Every parameter with optimizer state has a weight (the model and optimizer name the same parameters)."""
    params = {e.key.name for e in entries if e.key.kind is Kind.PARAM}
    orphans = sorted({e.key.name for e in entries if e.key.kind is not Kind.PARAM} - params)
    if orphans:
        close = difflib.get_close_matches(orphans[0], sorted(params), n=3)
        raise CheckpointFormatError(f"{root}: optimizer state for {orphans[:3]}{'...' if len(orphans) > 3 else ''} but no "
                                    f"model tensor of that name (closest: {close})")


def _saved_layout(entries: Sequence[TensorEntry], world: int, root: Path) -> tuple[int, int]:
    """(dp, tp) from the chunk geometry: tp is the most pieces any matrix is split into along a dim
    other than 0 (DTensor RowwiseParallel splits dim 1; FSDP2 splits only dim 0), dp = world / tp.
    Read from the chunks rather than from values a converter may have carried over."""
    tp = 1
    for e in entries:
        if len(e.shape) >= 2:
            for d in range(1, len(e.shape)):
                tp = max(tp, len({c.offsets[d] for c in e.chunks}))
    if world % tp:
        raise CheckpointFormatError(f"{root}: tensors are split {tp} ways along dims > 0 (tp={tp}) but the "
                                    f"checkpoint has {world} rank files, not a multiple of {tp}")
    return world // tp, tp


def _tensor_key(layout: DCPLayout, path: tuple[str, ...]) -> TensorKey | None:
    """The canonical key of the tensor at `path`: optimizer state, a model parameter, or None (carried as a value)."""
    root = layout.optimizer_root
    if root is not None and (item := optimizer_item(path, (root,))) is not None and item[0] == root:
        return TensorKey(name=item[1], kind=state_kind(item[2]))
    name = param_name(layout, path)
    return None if name is None else TensorKey(name=name, kind=Kind.PARAM)


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _meta(entries: Sequence[TensorEntry], values: Mapping[tuple[Any, ...], Any], layout: DCPLayout, world: int, *,
          dp: int | None = None, tp: int = 1,
          typed_paths: Mapping[tuple[str, ...], tuple[Any, ...]] | None = None) -> dict[str, Any]:
    params = [e for e in entries if e.key.kind is Kind.PARAM]
    names = [e.key.name for e in params]
    groups = param_groups(layout, values, names)
    optim_root = layout.optimizer_root
    outside = {p: v for p, v in values.items() if optim_root is None or p[:len(optim_root)] != optim_root}
    others = _nest({(typed_paths or {}).get(p, p): v for p, v in outside.items()})
    client = {k: v for k, v in others.items() if k != "lr_scheduler"}
    step = None
    if isinstance(client.get("migrate"), Mapping):
        step = client["migrate"].get("step")
    elif isinstance(client.get("train_state"), Mapping) and client["train_state"].get("step") is not None:
        step = int(_scalar(client["train_state"]["step"]))  # torchtitan's TrainState
    return {
        "dp": world if dp is None else dp,
        "tp": tp,
        "world_size": world,
        "dtype": params[0].dtype if params else "float32",
        "global_steps": step,
        "dcp_layout": layout.describe(),
        "dcp_values": others,
        "train_state": {
            "step": step,
            "lr_scheduler": others.get("lr_scheduler"),
            "client": client,
            "param_names": names,
            "optimizer_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "optimizer_group_params": [list(g.get("params", [])) for g in groups],
        },
    }


# ---------------------------------------------------------------- writer

def dim0_pieces(shape: tuple[int, ...], world: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """FSDP2's `torch.chunk` split along dim 0: [(rank, offsets, lengths)] of the non-empty pieces.

    0-d tensors (Adam's step) are one piece on rank 0.
    """
    if not shape:
        return [(0, (), ())]
    size = -(-shape[0] // world) if shape[0] else 0
    out = []
    for r in range(world):
        lo, hi = r * size, min((r + 1) * size, shape[0])
        if lo < hi:
            out.append((r, (lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:])))
    return out or [(0, (0,) * len(shape), shape)]


def _values_from(index: CheckpointIndex, names: Sequence[str], layout: str = "nested") -> dict[str, Any]:
    """The non-tensor values to write: the source's own DCP values, else built from its train state; the
    optimizer's param groups nested (`param_groups` list) or, for torchtitan, one entry per parameter and field
    (`param_groups.<fqn>.<field>`, as flatten_optimizer_state_dict writes them), and torchtitan's `train_state`
    (its step as an int32 tensor, empty loss histories) when the source has none."""
    m = index.meta
    if "dcp_values" in m:
        values = dict(m["dcp_values"])
    else:
        ts = m.get("train_state") or {}
        values = dict(ts.get("client") or {})
        if ts.get("lr_scheduler") is not None:
            values["lr_scheduler"] = ts["lr_scheduler"]
    ts = m.get("train_state") or {}
    adam = any(e.key.kind is Kind.EXP_AVG for e in index.entries)
    groups = [dict(g) for g in ts.get("optimizer_param_groups") or [{}]]
    owners = ts.get("optimizer_group_params") or []
    if len(groups) == 1 or not owners:
        owners = [list(names)] + [[] for _ in groups[1:]]
    for g, own in zip(groups, owners):
        g.pop("params", None)
        g.update(_torch_hparams(g, adam))
        g["params"] = list(own)
    if layout != "torchtitan":
        values["optimizer"] = {"param_groups": groups}
        return values
    values["optimizer"] = {f"param_groups.{name}.{field}": value for g in groups for name in g["params"]
                           for field, value in g.items() if field != "params"}
    if not isinstance(values.get("train_state"), Mapping):
        step = ts.get("step") if ts.get("step") is not None else m.get("global_steps")
        values["train_state"] = {"step": torch.tensor(int(step or 0), dtype=torch.int32),
                                 **{k: _bytes_io([]) for k in ("global_avg_losses", "global_max_losses", "log_steps")}}
    return values


def _bytes_io(value: Any) -> io.BytesIO:
    """`value` torch.save'd into a BytesIO, as torchtitan's TrainState keeps its histories."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def _torch_hparams(g: Mapping[str, Any], adam: bool) -> dict[str, Any]:
    """torch.optim.Adam/AdamW param-group fields DCP's optimizer loader expects (kept when present) for an Adam
    group (`adam`: the source holds Adam's moments, or the group its `betas`); another optimizer's group (SGD,
    Muon, ...) as saved."""
    if not adam and "betas" not in g:
        return {}
    out = {"betas": tuple(g["betas"])} if isinstance(g.get("betas"), (list, tuple)) else {}
    # decoupled_weight_decay (torch >= 2.6 Adam/AdamW): absent in Megatron's train state, whose Adam decouples it
    for k, default in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                       ("differentiable", False), ("fused", None), ("decoupled_weight_decay", True)):
        out[k] = g.get(k, default)
    return out


def _flatten(obj: Any, prefix: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    """DCP's `flatten_state_dict` for plain values: nested dicts and lists become paths (lists kept
    whole when they hold only scalars or strings, as DCP does for `params`)."""
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in _flatten(v, (*prefix, k))]
    if isinstance(obj, list) and obj and all(isinstance(v, Mapping) for v in obj):
        return [p for i, v in enumerate(obj) for p in _flatten(v, (*prefix, i))]
    return [(prefix, obj)]


def _dataloader_at(values: dict[str, Any], world: int) -> tuple[dict[str, Any], str | None]:
    """torchtitan's dataloader state at `world` ranks: carried when the DP size is the source's; else not written,
    with the plan's note. Its ParallelAwareDataloader keeps one opaque per-rank blob (`dp_rank_<r>`, a pickle
    the converter never opens) with the `world_size` it was saved at, and asserts that size on load: a rank's
    position in its data shard has no meaning in another rank's shard."""
    loader = values.get("dataloader")
    if not isinstance(loader, Mapping) or "world_size" not in loader:
        return values, None
    saved = int(_scalar(loader["world_size"]))
    if saved == world:
        return values, None
    out = {k: v for k, v in values.items() if k != "dataloader"}
    return out, (f"torchtitan's dataloader state was saved for dp {saved}; torchtitan does not reshard it (its "
                 f"loader asserts the dp degree), so it is not written at dp {world}: launch with "
                 f"--checkpoint.exclude_from_loading dataloader (the data stream restarts)")


def state_report(source: CheckpointIndex, values: Mapping[str, Any], note: str | None, world: int) -> dict[str, Any]:
    """The conversion's report of the training state a DCP target holds (`STATE_REPORT_FILE`); pure.
    DCP holds no per-rank RNG state: `absent` when the source held none either, else `dropped`."""
    client = our_client_state(source.meta)
    entries = [StateEntry(state="rng", policy="dropped", reason="the source holds per-rank RNG states; a DCP "
                                                                "checkpoint of this layout holds none") if client.get("rng")
               else StateEntry(state="rng", policy="absent", reason="the source holds no RNG state")]
    if CLIENT_STATE_KEY in values:
        entries.append(StateEntry(state="data position", policy="carry",
                                  reason="the sampler's global position (consumed samples, epoch) is layout-independent"))
    if note:
        entries.append(StateEntry(state="dataloader", policy="not written", reason=note))
    for key, why in COUNTERS.items():
        if source.meta.get(key) is not None:
            entries.append(StateEntry(state=key, policy="carry", reason=why))
    return report_dict(entries, source=str(source.meta.get("layout", source.format)), target=f"dcp dp{world}")


def dcp_target(source: CheckpointIndex, *, world: int, layout: str = "nested") -> TargetSpec:
    """The files and chunks of `source`'s model weights and optimizer state as a DCP checkpoint saved by
    `world` ranks; params are written in fp32 (FSDP2 keeps fp32 sharded params). Every per-parameter optimizer
    state tensor is written under its own name, split along dim 0 like its parameter; state of another shape
    (factored) only at world 1, where FSDP2 keeps each parameter whole (`refuse_split_state`). A source that
    keeps Adam's step per param group (Megatron) gets torch Adam's per-parameter step
    (`adam_step.derived_step`), written by rank 0's file."""
    if world < 1:
        raise PlanError(f"DCP target needs world size >= 1, got {world}")
    if layout not in LAYOUTS:
        raise PlanError(f"--dcp-layout {layout!r}: known layouts are {', '.join(LAYOUTS)}")
    refuse_tied_embeddings(source, "dcp")
    refuse_frozen_params(source, "dcp")
    if world > 1:
        refuse_split_state(source, target="dcp", how=f"FSDP2 shards each parameter along dim 0 over {world} ranks")
    src = source.by_key()
    state: dict[str, list[TensorEntry]] = {}
    for e in source.entries:
        if is_optimizer_state(e.key.kind):
            state.setdefault(e.key.name, []).append(e)
    params = [e for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)]
    names = list(dict.fromkeys(e.key.name for e in params))
    buffers: dict[str, list[TargetBuffer]] = {data_file(r): [] for r in range(world)}
    entries: list[TensorEntry] = []
    for name in names:
        shape = (src.get(TensorKey(name=name, kind=Kind.PARAM)) or src[TensorKey(name=name, kind=Kind.MASTER)]).shape
        kinds = [(Kind.PARAM, shape, "float32")] + [(e.key.kind, e.shape, e.dtype) for e in state.get(name, ())]
        for kind, shp, dt in kinds:
            key = TensorKey(name=name, kind=kind)
            fqn = _fqn(fqn_path(key, layout))
            chunks = []
            for r, offs, lens in dim0_pieces(shp, world):
                bkey = ("chunk", fqn, offs)
                buffers[data_file(r)].append(TargetBuffer(key=bkey, shape=lens, dtype=dt))
                chunks.append(ChunkRef(file=data_file(r), key=bkey, offsets=offs, lengths=lens))
            entries.append(TensorEntry(key=key, shape=shp, dtype=dt, chunks=tuple(chunks)))
    values, note = _dataloader_at(_values_from(source, names, layout), world)
    report = state_report(source, values, note, world)
    step = derived_step(source)  # a source with Adam's step per param group (Megatron): one per param here
    derived = [] if step is None else [
        ValueItem(key=fqn_path(TensorKey(name=n, kind=Kind.STEP), layout), role=ValueRole.STEP, value=step_tensor(step))
        for n in names if TensorKey(name=n, kind=Kind.EXP_AVG) in src]
    # the train state's values (tensors among them, as torchtitan's train_state.step, stay whole tensors)
    stored = [ValueItem(key=tuple(p), role=ValueRole.OBJECT, value=v) for p, v in _flatten(values, ())]
    meta = {"dp": world, "dtype": "float32", "global_steps": source.meta.get("global_steps"),
            "tensors": [[list(fqn_path(e.key, layout)), list(e.shape), e.dtype] for e in entries],
            "dcp_layout": layout, "state_report": report, **({"start_note": note} if note else {})}
    files = [TargetFile(path=data_file(r), role="data", rank=r, buffers=tuple(buffers[data_file(r)]),
                        values=tuple(derived + stored) if r == 0 else ()) for r in range(world)]
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(entries),
                            files=(METADATA, *(f.path for f in files)), meta=meta)
    return TargetSpec(index=index, files=tuple(files), commit=(METADATA,), write_mode=WriteMode.STREAMING)


@dataclass(frozen=True, kw_only=True, slots=True)
class DCPWriter:
    """Writes each rank's `.distcp` chunk by chunk and, as the coordinator, DCP's `.metadata` last. Streaming:
    each chunk is filled when the payload looks it up and saved before the next one, so a worker holds one
    chunk, never the file."""

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role != "data":
            raise PlanError(f"DCP writer: unknown file role {file.role!r} for {file.path}")

        def write(stream: BinaryIO) -> dict[str, list[list[Any]]]:
            chunks: list[list[Any]] = []
            for b in file.buffers:
                start = stream.tell()
                torch.save(buffers[b.key], stream)
                chunks.append([b.key[1], list(b.key[2]), list(b.shape), start, stream.tell() - start])
            return {"chunks": chunks, "values": save_values(stream, file.values, _fqn)}

        return StreamPayload(write=write)

    def finalize(self, records: Sequence[FileRecord], meta: Mapping[str, Any]) -> dict[str, bytes]:
        tensors = {_fqn(p): (tuple(s), dt) for p, s, dt in meta["tensors"]}
        planner = {_fqn(p): tuple(p) for p, *_ in meta["tensors"]}
        placed = []
        for rec in records:
            placed += [PlacedItem(fqn=fqn, file=rec.path, offset=start, length=length, box=(tuple(offsets), tuple(sizes)))
                       for fqn, offsets, sizes, start, length in (rec.extra or {}).get("chunks", ())]
            rows = (rec.extra or {}).get("values", ())
            values, whole = placed_values(rows, rec.path)
            placed += values
            tensors |= whole
            planner |= {fqn: tuple(path) for fqn, path, *_ in rows}
        md = build_metadata(placed, tensors, planner_data=planner, save_id=str(uuid.uuid4()))
        files = {STATE_REPORT_FILE: json.dumps(meta["state_report"], indent=1).encode()} if meta.get("state_report") else {}
        return files | {METADATA: pickle.dumps(md)}  # .metadata last: DCP's commit point


# ---------------------------------------------------------------- registration

def _read(path: Path, opts: ReadOptions) -> CheckpointIndex:
    return read_dcp(path, expect_dp=opts.expect.dp, expect_tp=opts.expect.tp, trust_checkpoint=opts.trust_checkpoint)


def _target(index: CheckpointIndex, opts: TargetOptions) -> TargetSpec:
    asked = opts.layout
    if (asked.tp or 1, asked.pp or 1, asked.ep or 1) != (1, 1, 1):
        raise PlanError(f"DCP target is written for FSDP at tp=1 pp=1 ep=1; got tp={asked.tp} pp={asked.pp} ep={asked.ep}")
    return dcp_target(index, world=asked.dp if asked.dp is not None else int(index.meta.get("dp", 1)),
                      layout=opts.dcp_layout or "nested")


SPEC = CheckpointFormat(name=FORMAT, description="PyTorch DCP (FSDP2/torchtitan: model + Adam state)",
                        detect=is_dcp_checkpoint, read=_read, target=_target, writer=DCPWriter(), names="any")
