"""Megatron-Core dist checkpoints (torch_dist): metadata-only reader and a fully-reshardable writer.

On disk (`iter_NNNNNNN/`): `metadata.json` (backend), `common.pt` (non-sharded state: iteration,
optimizer param groups, ours), DCP's `.metadata` and `__{rank}_{thread}.distcp` files holding one
`torch.save` blob per stored chunk. Model tensors are stored stacked over layers (and experts) under
the keys of `checkpoint.rules.megatron`; the DistributedOptimizer state is either
* dp_reshardable (what the training engine writes): per (TP, PP[, EP]) domain one flat bucket per
  grad buffer, `[chained_{c}.]optimizer.distributed.dp_group_idx_{d}.gbuf_idx_{g}.dtype_{..}.
  bucket_idx_{b}.{param|exp_avg|exp_avg_sq}`, params in reverse named_parameters order, each start
  padded to 64 elements (Megatron-Core's `_ParamAndGradBuffer`; tied embeddings at PP > 1 get a bucket of
  their own), or
* fully_reshardable (what the writer emits): `[chained_{c}.]optimizer.state.{param|exp_avg|exp_avg_sq}.<model key>`
  with the model tensor's global shape, loadable by Megatron-Core at any TP/PP/EP/DP (`chained_` only under
  expert parallelism, where Megatron-Core gives the experts their own optimizer). The writer lays the
  chunks out for a target layout: each (TP, PP, EP) shard, one box per layer/expert, goes to one of its
  data-parallel ranks (balanced by bytes), rank r writing `__{r}_0.distcp`; common.pt records the layout.
Chunks point into DCP blobs with key `(BYTE_RANGE, byte offset, byte length)`; the index is canonical
(HF-style names, QKV and GLU unfused, vocab padding dropped, tied embeddings one tensor), so any layout
maps onto any other, and onto other frameworks' formats.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint import safe_load
from checkpoint.formats.megatron_paths import TRACKER_FILE, iteration_dir_name
from checkpoint.errors import CheckpointFormatError, LayoutMismatchError, PlanError, UntrustedCheckpointError
from checkpoint.io.sources import BYTE_RANGE, load_range
from checkpoint.write import FileRecord, StreamPayload
from checkpoint.formats.base import refuse_frozen_params, refuse_shared_params
from checkpoint.formats.dcp import check_data_files, storage_by_index
from checkpoint.formats.dcp_metadata import PlacedItem, build_metadata, placed_values, save_values
from checkpoint.formats.hf_config import ModelFields, fields_from_hf_config, fields_from_model_shape
from checkpoint.formats.megatron_args import (args_summary, arch_from_args, grad_bucket_size, layout_from_args,
                                              overrides, synthesized_args, target_args, vocab_is_padded)
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, TensorEntry, TensorKey, dtype_name, dtype_size
from checkpoint.layout import PIPELINE_STAGE_FIELDS, OptimizerSharding, ParallelLayout
from checkpoint.plan import SourceBytes, TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole, WriteMode
from checkpoint.state.rng import (MEGATRON_RNG_KEY, expand_megatron_rng, from_megatron, megatron_rng_objects,
                                  role_from_dict, roles, to_megatron)
from checkpoint.state.optimizer_state import refuse_unplaced_state
from checkpoint.state.training_state import (CLIENT_STATE_KEY, STATE_REPORT_FILE, convert_model_state,
                                             our_client_state, report_dict)
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import (OUTPUT_KEY, RULES, TensorRule, arch_from_config, canonical_name,
                                       canonical_shape, canonical_tensors, expert_range, flat_run_boxes, held_layers,
                                       hf_order, holds_model_tensor, layer_key, per_layer_keys, split_layer_key,
                                       holds_output_copy, matrix_shape, segments, stacked_shape, pipeline_stage_layer_counts,
                                       pipeline_stage_layers, stored_rules, tp_local_cols, tp_local_rows)

FORMAT = "megatron"
LEGACY_FORMAT = "megatron-legacy"  # checkpoint.formats.megatron_legacy's (which imports this module)
STATE_KINDS = {"param": Kind.MASTER, "exp_avg": Kind.EXP_AVG, "exp_avg_sq": Kind.EXP_AVG_SQ}
_DPR_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                     r"dtype_(.+)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_FR_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.(param|exp_avg|exp_avg_sq)\.(.+)$")
_RANK_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
PARAM_ALIGN = 64  # Megatron-Core pads each param start in a grad buffer to 64 elements


def tracker_iteration_dir(path: Path) -> Path:
    """The `iter_*` (or `release`) directory that `path/latest_checkpointed_iteration.txt` names, as
    Megatron-LM's `read_metadata` reads it: an iteration number or `release`; anything else raises
    CheckpointFormatError naming the tracker file."""
    tracker = path / TRACKER_FILE
    try:
        text = tracker.read_text(encoding="utf-8", errors="strict")[:64].strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{tracker}: unreadable ({err})") from err
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise CheckpointFormatError(f"{tracker}: holds {text!r}; Megatron-LM's tracker holds an iteration number "
                                    f"or 'release'")
    return path / iteration_dir_name(int(text))


def tracker_text(common: Mapping[str, Any]) -> str:
    """What `latest_checkpointed_iteration.txt` holds for a checkpoint whose common state is `common`."""
    return str(int(common.get("iteration") or 0))


def resolve_iteration_dir(path: str | Path) -> Path:
    """An `iter_*` directory as is, or the one a save dir's latest_checkpointed_iteration.txt names."""
    path = Path(path)
    if (path / TRACKER_FILE).is_file():
        return tracker_iteration_dir(path)
    return path


def backend_metadata(d: Path) -> dict[str, Any] | None:
    """Megatron-Core's `metadata.json` of checkpoint dir `d` (None when absent); raises CheckpointFormatError
    naming the file when it is present but not a JSON object."""
    path = d / "metadata.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes()[:1 << 20])
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err}); Megatron-Core writes "
                                    f'{{"sharded_backend": "torch_dist", ...}} there') from err
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: holds {type(data).__name__}, not a JSON object with sharded_backend")
    return data


def is_megatron_checkpoint(path: str | Path) -> bool:
    """Whether `path` (an iteration dir, or a save dir with the tracker) is a torch_dist checkpoint. A tracker
    naming a missing directory, or a `metadata.json` that is not JSON, raises CheckpointFormatError naming it."""
    given = Path(path)
    d = resolve_iteration_dir(given)
    if d != given and not d.is_dir():
        raise CheckpointFormatError(f"{given / TRACKER_FILE}: names {d.name}, but {d} is not a directory")
    backend = backend_metadata(d)
    return backend is not None and "sharded_backend" in backend  # Megatron-Core's: read_megatron names what is off


# ---------------------------------------------------------------- box -> canonical chunks (pure)

@dataclass(frozen=True, kw_only=True, slots=True)
class _Piece:
    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    storage_offset: int


def _pieces(rule: TensorRule, arch: ModelShape, layer: int | None, expert: int | None, rows: tuple[int, int],
            cols: tuple[int, int] | None, start: int) -> list[_Piece]:
    """Canonical pieces of a contiguous stored block: global matrix rows (start, n) x cols (c0, nc), or for a
    vector (cols None: a norm, or a fused QKV bias split per query group like its weight's rows) its elements
    (start, n); first element at `start` of the stored blob."""
    out = []
    for seg in segments(rule, arch):
        lo, hi = max(rows[0], seg.start), min(rows[0] + rows[1], seg.start + seg.length)
        if lo >= hi:
            continue
        name = canonical_name(rule, seg, layer, expert)
        shape = canonical_shape(rule, arch, seg)
        if cols is None:
            out.append(_Piece(name=name, shape=shape, offsets=(seg.dst + lo - seg.start,), lengths=(hi - lo,),
                              storage_offset=start + lo - rows[0]))
        else:
            c0, nc = cols
            out.append(_Piece(name=name, shape=shape, offsets=(seg.dst + lo - seg.start, c0), lengths=(hi - lo, nc),
                              storage_offset=start + (lo - rows[0]) * nc))
    return out


def box_pieces(rule: TensorRule, arch: ModelShape, offsets: tuple[int, ...], lengths: tuple[int, ...],
               start: int = 0) -> list[_Piece]:
    """Canonical pieces of a stored chunk that is the box (offsets, lengths) of the stacked key tensor."""
    lead = {"model": 0, "layer": 1, "expert": 2}[rule.scope]
    mat_o, mat_n = offsets[lead:], lengths[lead:]
    block = math.prod(mat_n)
    out = []
    lead_idx = [range(o, o + n) for o, n in zip(offsets[:lead], lengths[:lead])]
    combos = [()] if lead == 0 else ([(i,) for i in lead_idx[0]] if lead == 1 else
                                     [(i, j) for i in lead_idx[0] for j in lead_idx[1]])
    for k, idx in enumerate(combos):
        layer = idx[0] if lead >= 1 else None
        expert = idx[1] if lead == 2 else None
        if len(mat_n) == 1:
            out += _pieces(rule, arch, layer, expert, (mat_o[0], mat_n[0]), None, start + k * block)
        else:
            if mat_n[1] != matrix_shape(rule, arch, 1)[1] and len(segments(rule, arch)) > 1:
                raise CheckpointFormatError(f"{rule.key}: chunk {offsets}+{lengths} splits the columns of a fused "
                                            f"tensor; its rows are not contiguous per canonical part")
            out += _pieces(rule, arch, layer, expert, (mat_o[0], mat_n[0]), (mat_o[1], mat_n[1]), start + k * block)
    return out


# ---------------------------------------------------------------- dp_reshardable bucket layout (pure)

@dataclass(frozen=True, kw_only=True, slots=True)
class LocalParam:
    """One DDP parameter of a (TP, PP, EP) domain: its rule, layer/expert, TP-local rows/cols, numel."""

    rule: TensorRule
    layer: int | None
    expert: int | None
    row_runs: tuple[tuple[int, int], ...]
    cols: tuple[int, int]
    vector: bool

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(n for _, n in self.row_runs)
        return (rows,) if self.vector else (rows, self.cols[1])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, rule: TensorRule, arch: ModelShape, *, tp: int, tp_rank: int, layer: int | None,
           expert: int | None) -> LocalParam:
        """The TP rank's piece of `rule`'s tensor at `layer` (and `expert`)."""
        return cls(rule=rule, layer=layer, expert=expert, vector=len(matrix_shape(rule, arch)) == 1,
                   row_runs=tp_local_rows(rule, arch, tp, tp_rank), cols=tp_local_cols(rule, arch, tp, tp_rank))


def domain_params(arch: ModelShape, *, tp: int, pp: int, vpp: int, ep: int, tp_rank: int, pp_rank: int,
                  vp_stage: int, ep_rank: int, experts: bool, first_pipeline_stage_layers: int | None = None,
                  last_pipeline_stage_layers: int | None = None) -> list[LocalParam]:
    """The params of one model chunk's dense (or expert) grad buffer, in named_parameters order (the chunk's
    layers as `pipeline_stage_layers` gives them).

    Under expert parallelism (ep > 1) the experts have their own buffer (`experts=True`); at ep 1
    Megatron-Core keeps them in the dense buffer, after the router: per expert, fc1 then fc2."""
    inline = not experts and ep == 1 and arch.num_experts > 0
    rules = RULES[arch.architecture]
    stored = set(stored_rules(arch))
    out: list[LocalParam] = []

    def add(rule: TensorRule, layer: int | None, expert: int | None) -> None:
        out.append(LocalParam.of(rule, arch, tp=tp, tp_rank=tp_rank, layer=layer, expert=expert))

    first, last = rules.model[0], rules.model[1:]
    if not experts and holds_model_tensor(first, pp, vpp, pp_rank, vp_stage):
        add(first, None, None)
    for layer in pipeline_stage_layers(arch.num_layers, pp, vpp, pp_rank, vp_stage,
                                       first_pipeline_stage_layers=first_pipeline_stage_layers,
                                       last_pipeline_stage_layers=last_pipeline_stage_layers):
        held = [r for r in rules.layer if r in stored and not r.buffer and layer in held_layers(r, arch)]
        for rule in held:
            if rule.scope == "expert":
                if experts:
                    for e in expert_range(arch.num_experts, ep, ep_rank):
                        add(rule, layer, e)
                elif inline and rule is next(r for r in held if r.scope == "expert"):
                    for e in range(arch.num_experts):
                        for expert_rule in (r for r in held if r.scope == "expert"):
                            add(expert_rule, layer, e)
            elif not experts:
                add(rule, layer, None)
    if experts:  # experts are named mlp.experts.local_experts.{i}.linear_fc{1,2}: per expert, fc1 then fc2
        out.sort(key=lambda p: (p.layer, p.expert))
    elif all(holds_model_tensor(r, pp, vpp, pp_rank, vp_stage) for r in last):
        for rule in last:  # tied embeddings: the last stage's output weight only when it is not the first stage
            if rule.key != OUTPUT_KEY or holds_output_copy(arch, pp, vpp):
                add(rule, None, None)
    return out


def bucket_offsets(params: list[LocalParam]) -> tuple[list[tuple[LocalParam, int]], int]:
    """[(param, start element)] in the flat bucket and the bucket's unpadded numel (reverse order, 64-aligned)."""
    placed, pos, end = [], 0, 0
    for p in reversed(params):
        pos = math.ceil(pos / PARAM_ALIGN) * PARAM_ALIGN
        placed.append((p, pos))
        end = pos + p.numel
        pos = end
    return placed, end


def separate_bucket_keys(arch: ModelShape, pp: int) -> frozenset[str]:
    """Keys whose param Megatron-Core's DistributedOptimizer buckets alone: the shared embedding and the
    last stage's output copy of tied embeddings at PP > 1 (`shared_embedding`)."""
    return frozenset({"embedding.word_embeddings.weight", OUTPUT_KEY}) if arch.tied_embeddings and pp > 1 \
        else frozenset()


def buffer_buckets(params: list[LocalParam], separate: frozenset[str] = frozenset(), bucket_size: int | None = None
                   ) -> list[tuple[list[tuple[LocalParam, int]], int]]:
    """Megatron-Core's buckets of one grad buffer (`_ParamAndGradBuffer`): params in reverse order, each start
    64-aligned; a bucket closes after the param that brings it to `bucket_size` elements (None: never), and
    a param whose key is in `separate` gets a bucket of its own. Per bucket [(param, start element in the
    bucket)] and the bucket's unpadded numel (the next bucket starts at the padded end: element 0)."""
    buckets: list[tuple[list[tuple[LocalParam, int]], int]] = []
    cur: list[tuple[LocalParam, int]] = []
    pos = end = 0
    for p in reversed(params):
        if p.rule.key in separate and cur:
            buckets.append((cur, end))
            cur, pos = [], 0
        pos = math.ceil(pos / PARAM_ALIGN) * PARAM_ALIGN
        cur.append((p, pos))
        end = pos = pos + p.numel
        if p.rule.key in separate or (bucket_size is not None and end >= bucket_size):
            buckets.append((cur, end))
            cur, pos = [], 0
    if cur:
        buckets.append((cur, end))
    return buckets


def param_flat_pieces(arch: ModelShape, p: LocalParam, lo: int, hi: int, start: int) -> list[_Piece]:
    """Canonical pieces of elements [lo, hi) of local param `p`, the element lo stored at `start`."""
    out = []
    for offs, lens, first in flat_run_boxes(p.shape, lo, hi):
        st = start + first - lo
        r, nr = offs[0], lens[0]
        local = 0
        for g0, n in p.row_runs:
            a, b = max(r, local), min(r + nr, local + n)
            if a < b:
                cols = None if p.vector else (p.cols[0] + offs[1], lens[1])
                out += _pieces(p.rule, arch, p.layer, p.expert, (g0 + a - local, b - a), cols,
                               st + (a - r) * (1 if p.vector else p.shape[1]))
            local += n
    return out


# ---------------------------------------------------------------- reader

def arch_of_common(common: Mapping[str, Any], where: Path,
                   model_config: Mapping[str, Any] | None = None) -> tuple[ModelShape, list[str]]:
    """The architecture of a Megatron checkpoint and the fields `model_config` overrode: the built-in engine's
    spec (`migrate.model`), else Megatron-LM's `args`, each overridden by a given `model_config` (an HF
    config.json or ModelShape fields); `model_config` alone when the checkpoint holds neither. Raises
    CheckpointFormatError naming the file and what is missing."""
    given = None if model_config is None else arch_from_config(model_config, where="--model-config")
    model = (common.get("migrate") or {}).get("model")
    if isinstance(model, Mapping):
        saved = ModelShape.from_dict(dict(model))
    elif common.get("args") is not None:
        saved = arch_from_args(common["args"], where=f"{where}: args")
    elif given is not None:
        return given, []
    else:
        raise CheckpointFormatError(f"{where}: holds neither Megatron-LM's args nor a model shape (migrate.model); "
                                    f"pass --model-config FILE (an HF config.json or a job's model section)")
    if given is None:
        return saved, []
    if "make_vocab_size_divisible_by" not in (model_config or {}):  # an HF config does not say how Megatron padded
        given = dataclasses.replace(given, make_vocab_size_divisible_by=saved.make_vocab_size_divisible_by)
    return given, overrides(saved, given)


def _storage(md: Any, root: Path) -> dict[tuple[str, tuple[int, ...]], Any]:
    """DCP storage entries by (fqn, offsets; () for objects), storage paths checked (`dcp.storage_by_index`)."""
    return {(fqn, offsets or ()): info for (fqn, offsets), info in storage_by_index(md, root).items()}


def stack_layer_keys(tensors: Mapping[str, Any], storage: Mapping[tuple[str, tuple[int, ...]], Any],
                     num_layers: int, root: Path) -> tuple[dict[str, Any], dict[tuple[str, tuple[int, ...]], Any], bool]:
    """Per-layer keys (Megatron-Core's non-homogeneous layers: `decoder.layers.{i}.<rest>`, their optimizer
    state likewise) as chunks of their stacked key's (L, ...) tensor at layer i, so that the rules read both
    forms alike; the storage of each chunk under its stacked key too. Returns the tensors, the storage and
    whether any key was per-layer. Raises CheckpointFormatError for a layer past `num_layers` or layers of one
    key that disagree in shape or dtype."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    out: dict[str, Any] = {}
    stacked: dict[str, list[tuple[int, Any, str]]] = {}
    for key, tmd in tensors.items():
        base, layer = split_layer_key(key)
        if layer is None:
            out[key] = tmd
        else:
            stacked.setdefault(base, []).append((layer, tmd, key))
    store = dict(storage)
    for base, layers in stacked.items():
        first = layers[0][1]
        for layer, tmd, key in layers:
            if layer >= num_layers:
                raise CheckpointFormatError(f"{root}: {key}: layer {layer} but the model has {num_layers} layers")
            if tuple(tmd.size) != tuple(first.size) or tmd.properties.dtype != first.properties.dtype:
                raise CheckpointFormatError(f"{root}: {key} is {tuple(tmd.size)} {tmd.properties.dtype} but "
                                            f"{layers[0][2]} is {tuple(first.size)} {first.properties.dtype}")
        chunks = []
        for layer, tmd, key in layers:
            for c in tmd.chunks:
                offsets, sizes = (layer, *c.offsets), (1, *c.sizes)
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                store[(base, offsets)] = storage[(key, tuple(c.offsets))]
        out[base] = TensorStorageMetadata(properties=first.properties, size=torch.Size((num_layers, *first.size)),
                                          chunks=chunks)
    return out, store, bool(stacked)


def _chunk_ref(info: Any, offsets: tuple[int, ...], lengths: tuple[int, ...], storage_offset: int) -> ChunkRef:
    return ChunkRef(file=info.relative_path, key=(BYTE_RANGE, int(info.offset), int(info.length)), offsets=offsets,
                    lengths=lengths, storage_offset=storage_offset)


def read_megatron(path: str | Path, *, trust_checkpoint: bool = False, expect_tp: int | None = None,
                  expect_pp: int | None = None, expect_ep: int | None = None, expect_dp: int | None = None,
                  model_config: Mapping[str, Any] | None = None) -> CheckpointIndex:
    """Index a torch_dist checkpoint from `.metadata`, `metadata.json` and `common.pt` (no tensor data read).

    Raises CheckpointFormatError naming the key/file for anything the rules do not explain, and
    LayoutMismatchError when the declared layout differs from the one in the files.
    """
    given = Path(path)
    root = resolve_iteration_dir(given)
    if root != given and not root.is_dir():
        raise CheckpointFormatError(f"{given / TRACKER_FILE}: names {root.name}, but {root} is not a directory")
    backend = backend_metadata(root)
    if not (root / "common.pt").is_file():
        raise CheckpointFormatError(f"{root / 'common.pt'}: file is missing (a torch_dist checkpoint holds "
                                    f"metadata.json, common.pt, .metadata and *.distcp)")
    if backend is None or backend.get("sharded_backend") != "torch_dist":
        raise CheckpointFormatError(f"{root / 'metadata.json'}: sharded_backend is "
                                    f"{None if backend is None else backend.get('sharded_backend')!r}; "
                                    f"expected 'torch_dist' (a Megatron-Core dist checkpoint)")
    common = safe_load.load(root / "common.pt", trust_checkpoint=trust_checkpoint)
    if not isinstance(common, Mapping):
        raise CheckpointFormatError(f"{root / 'common.pt'}: holds {type(common).__name__}, not the common state dict")
    md = safe_load.read_dcp_metadata(root, trust_checkpoint=trust_checkpoint)
    check_data_files(md, root)
    return index_from_metadata(md, common, root, expect_tp=expect_tp, expect_pp=expect_pp, expect_ep=expect_ep,
                               expect_dp=expect_dp, trust_checkpoint=trust_checkpoint, model_config=model_config)


def index_from_metadata(md: Any, common: Mapping[str, Any], root: Path, *, expect_tp: int | None = None,
                        expect_pp: int | None = None, expect_ep: int | None = None,
                        expect_dp: int | None = None, trust_checkpoint: bool = False,
                        model_config: Mapping[str, Any] | None = None) -> CheckpointIndex:
    """The index of a torch_dist checkpoint from DCP `Metadata` and the `common.pt` state (pure except for
    the optimizer param-group objects, read from `root` when the metadata lists them as bytes)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    arch, overridden = arch_of_common(common, root / "common.pt", model_config)
    rules = RULES[arch.architecture].by_key()
    tensors, storage, per_layer = stack_layer_keys(
        {k: v for k, v in md.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)},
        _storage(md, root), arch.num_layers, root)
    vocab_key = OUTPUT_KEY if OUTPUT_KEY in tensors else "embedding.word_embeddings.weight"  # tied: one tensor
    out_rows = tensors[vocab_key].size[0] if vocab_key in tensors else arch.padded_vocab_size(1)
    layout = _infer_layout(tensors, storage, common, root)
    for name, want, got in (("tp", expect_tp, layout["tp"]), ("pp", expect_pp, layout["pp"]),
                            ("ep", expect_ep, layout["ep"]), ("dp", expect_dp, layout["dp"])):
        if want is not None and got is not None and want != got:
            raise LayoutMismatchError(f"{root}: declared {name}={want} but the checkpoint was saved at {name}={got}")
    acc: dict[TensorKey, tuple[tuple[int, ...], str, list[ChunkRef]]] = {}

    def put(kind: Kind, dtype: str, pieces: list[_Piece], info: Any) -> None:
        for pc in pieces:
            key = TensorKey(name=pc.name, kind=kind)
            acc.setdefault(key, (pc.shape, dtype, []))[2].append(
                _chunk_ref(info, pc.offsets, pc.lengths, pc.storage_offset))

    sharding = None
    for key, tmd in tensors.items():
        dtype = dtype_name(tmd.properties.dtype)
        if key in rules:
            rule = rules[key]
            _check_shape(key, tuple(tmd.size), stacked_shape(rule, arch, layout["tp"]) if not rule.vocab else
                         (out_rows, arch.hidden_size), root)
            for c in tmd.chunks:
                put(Kind.PARAM, dtype, box_pieces(rule, arch, tuple(c.offsets), tuple(c.sizes)),
                    storage[(key, tuple(c.offsets))])
        elif m := _FR_RE.match(key):
            sharding = "fully_reshardable"
            found = rules.get(m.group(3))
            if found is None:
                raise CheckpointFormatError(f"{root}: optimizer key {key} names model key {m.group(3)!r}, unknown to "
                                            f"the {arch.architecture} rules")
            rule = found
            for c in tmd.chunks:
                put(STATE_KINDS[m.group(2)], dtype, box_pieces(rule, arch, tuple(c.offsets), tuple(c.sizes)),
                    storage[(key, tuple(c.offsets))])
        elif _DPR_RE.match(key):
            sharding = "dp_reshardable"
        else:
            raise CheckpointFormatError(f"{root}: tensor key {key!r} is not explained by the {arch.architecture} rules")
    sharding = _check_sharding_type(common, sharding, root)
    if sharding == "dp_reshardable":
        for key, kind, dtype, pieces_by_chunk in _dp_reshardable_pieces(tensors, arch, layout, root):
            for c, pieces in pieces_by_chunk:
                put(kind, dtype, pieces, storage[(key, tuple(c.offsets))])
    objects, groups = _objects(md, storage, root, common, trust_checkpoint)
    entries = []
    for tensor_key in sorted(acc, key=lambda k: (k.name, str(k.kind))):
        shape, dtype, chunks = acc[tensor_key]
        entries.append(TensorEntry(key=tensor_key, shape=shape, dtype=dtype, chunks=tuple(chunks)))
    _dedupe_check(entries, root)
    meta = {"arch": arch.tensor_fields(), **layout, "per_layer_keys": per_layer,
            "sharding": sharding, "common": _common_meta(common), "arch_overrides": overridden,
            "vocab_padded": _vocab_from_padded_args(common, overridden),
            "megatron_args": args_summary(common.get("args")), "model_spec": saved_model_spec(common),
            "objects": objects, "optimizer_groups": groups, "iteration": common.get("iteration"),
            "model_dtype": dtype_name(tensors["embedding.word_embeddings.weight"].properties.dtype),
            "train_state": canonical_train_state(arch, common, groups,
                                                 _rng_from_metadata(md, storage, root, layout, trust_checkpoint))}
    files = tuple(sorted({info.relative_path for info in storage.values()} | {"common.pt", "metadata.json", ".metadata"}))
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=files, meta=meta)


def _check_shape(key: str, got: tuple[int, ...], want: tuple[int, ...], root: Path) -> None:
    if got != want:
        raise LayoutMismatchError(f"{root}: {key} has global shape {got} but the model shape gives {want}")


def _dedupe_check(entries: list[TensorEntry], root: Path) -> None:
    for e in entries:
        e.check_complete()


def _vocab_from_padded_args(common: Mapping[str, Any], overridden: list[str]) -> bool:
    """Whether the rules' vocabulary is Megatron-LM's padded size (the architecture came from args that do
    not record the unpadded one, and no --model-config replaced it)."""
    ours = isinstance((common.get("migrate") or {}).get("model"), Mapping)
    return common.get("args") is not None and not ours and not overridden and vocab_is_padded(common["args"])


def _check_sharding_type(common: Mapping[str, Any], found: str | None, root: Path) -> str | None:
    """The DistributedOptimizer sharding type: what the keys show, checked against what Megatron-LM's
    `content_metadata` says (its `load_checkpoint` decides by the latter); raises CheckpointFormatError when
    they differ or when the metadata names a type the rules do not read."""
    content = common.get("content_metadata")
    declared = content.get("distrib_optim_sharding_type") if isinstance(content, Mapping) else None
    if declared is None or found is None:
        if declared not in (None, "dp_reshardable", "fully_reshardable"):
            raise CheckpointFormatError(f"{root / 'common.pt'}: content_metadata.distrib_optim_sharding_type is "
                                        f"{declared!r}; readable: 'dp_reshardable', 'fully_reshardable'")
        return found
    if declared != found:
        raise CheckpointFormatError(f"{root / 'common.pt'}: content_metadata says distrib_optim_sharding_type="
                                    f"{declared!r} but the optimizer keys in .metadata are {found!r}")
    return found


def _infer_layout(tensors: Mapping[str, Any], storage: Mapping[Any, Any], common: Mapping[str, Any],
                  root: Path) -> dict[str, Any]:
    """The layout the converter wrote into `common.pt` (migrate.layout), else Megatron-LM's args (tp checked
    against the output layer's vocab split), else: tp from that split, pp/vpp/ep from the optimizer domains,
    dp from the number of rank files (None if unknown)."""
    declared = (common.get("migrate") or {}).get("layout")
    if isinstance(declared, Mapping):
        return {k: int(declared[k]) for k in ("tp", "pp", "vpp", "ep", "dp")} | pipeline_split_of(declared)
    out = tensors.get("output_layer.weight") or tensors["embedding.word_embeddings.weight"]
    tp = len({tuple(c.offsets) for c in out.chunks})
    if common.get("args") is not None:
        where = f"{root / 'common.pt'}: args"
        layout = layout_from_args(common["args"], where=where)
        layout["bucket_size"] = grad_bucket_size(common["args"], dp=layout["dp"] or 1, where=where)
        if layout["tp"] != tp:
            raise LayoutMismatchError(f"{root}: args say tensor_model_parallel_size={layout['tp']} but the output "
                                      f"layer is stored in {tp} vocab shard(s)")
        return layout
    ranks = {m.group(1) for info in storage.values() if (m := _RANK_FILE_RE.match(info.relative_path))}
    dense: set[int] = set()
    expert: set[int] = set()
    gbufs, dtypes, dp = set(), set(), None
    for key in tensors:
        if m := _DPR_RE.match(key):
            (expert if m.group(1) == "1" else dense).add(int(m.group(2)))
            if m.group(1) in (None, "0"):
                gbufs.add(int(m.group(3)))
                dtypes.add(m.group(4))
    pp = len(dense) // tp if dense else None
    ep = len(expert) // (tp * pp) if expert and pp else (1 if dense else None)
    if pp and ranks and len(ranks) % (tp * pp) == 0:
        dp = len(ranks) // (tp * pp)
    return {"tp": tp, "pp": pp, "vpp": len(gbufs) // len(dtypes) if gbufs else None, "ep": ep, "dp": dp,
            **dict.fromkeys(PIPELINE_STAGE_FIELDS)}


def pipeline_split_of(layout: Mapping[str, Any]) -> dict[str, int | None]:
    """The first/last pipeline stage layer counts a layout dict records (None: even, or not recorded)."""
    return {k: None if layout.get(k) is None else int(layout[k]) for k in PIPELINE_STAGE_FIELDS}


def grad_buffers(arch: ModelShape, param_dtypes: Mapping[str, str], *, tp: int, pp: int, vpp: int, ep: int,
                 tp_rank: int, pp_rank: int, ep_rank: int, experts: bool, bucket_size: int | None = None,
                 first_pipeline_stage_layers: int | None = None, last_pipeline_stage_layers: int | None = None
                 ) -> list[tuple[str, list[LocalParam], int | None]]:
    """The grad buffers of one (TP, PP[, EP]) domain in `gbuf_idx` order, as (param dtype, params, bucket size):
    per model chunk, Megatron-Core's DDP keeps one buffer per param dtype, in the order the dtypes first occur
    in named_parameters (e.g. bf16 weights, then fp32 norms). `param_dtypes`: the stored dtype per model key;
    `bucket_size` applies to the first chunk on pipeline rank 0 only (Megatron-LM disables the rest)."""
    out = []
    for v in range(vpp):
        by_dtype: dict[str, list[LocalParam]] = {}
        for p in domain_params(arch, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=tp_rank, pp_rank=pp_rank, vp_stage=v,
                               ep_rank=ep_rank, experts=experts, first_pipeline_stage_layers=first_pipeline_stage_layers,
                               last_pipeline_stage_layers=last_pipeline_stage_layers):
            key = "embedding.word_embeddings.weight" if p.rule.key == OUTPUT_KEY and arch.tied_embeddings \
                else p.rule.key
            by_dtype.setdefault(param_dtypes.get(key, "float32"), []).append(p)
        size = bucket_size if v == 0 and pp_rank == 0 else None
        out += [(dtype, params, size) for dtype, params in by_dtype.items()]
    return out


def _dp_reshardable_pieces(tensors: Mapping[str, Any], arch: ModelShape, layout: Mapping[str, Any], root: Path):
    tp, pp, vpp, ep = layout["tp"], layout["pp"], layout["vpp"], layout["ep"]
    moe = arch.num_experts > 0
    param_dtypes = {k: dtype_name(t.properties.dtype) for k, t in tensors.items()}
    buffers_of: dict[tuple[bool, int, int, int], list] = {}  # one domain's buffers serve its many keys
    buckets_of: dict[tuple[bool, int, int, int, int], list] = {}
    for key, tmd in tensors.items():
        m = _DPR_RE.match(key)
        if not m:
            continue
        chain, d, g, bucket = int(m.group(1) or 0), int(m.group(2)), int(m.group(3)), int(m.group(5))
        experts = moe and chain == 1
        tp_rank = d % tp
        ep_rank = (d // tp) % ep if experts else 0
        pp_rank = d // (tp * ep) if experts else d // tp
        domain = (experts, tp_rank, pp_rank, ep_rank)
        if domain not in buffers_of:
            buffers_of[domain] = grad_buffers(arch, param_dtypes, tp=tp, pp=pp, vpp=vpp, ep=ep, tp_rank=tp_rank,
                                              pp_rank=pp_rank, ep_rank=ep_rank, experts=experts,
                                              bucket_size=layout.get("bucket_size"), **pipeline_split_of(layout))
        buffers = buffers_of[domain]
        if g >= len(buffers):
            raise CheckpointFormatError(f"{root}: {key}: grad buffer {g} but the rules give {len(buffers)} for "
                                        f"tp_rank={tp_rank} pp_rank={pp_rank} ep_rank={ep_rank} "
                                        f"({vpp} model chunk(s); one buffer per param dtype in each)")
        param_dtype, params, bucket_size = buffers[g]
        saved_dtype = m.group(4).strip("()").split(",")[0].strip().removeprefix("torch.")
        if saved_dtype != param_dtype:
            raise CheckpointFormatError(f"{root}: {key}: grad buffer {g} holds {saved_dtype} params but the model "
                                        f"tensors give {param_dtype} for that buffer")
        if (*domain, g) not in buckets_of:
            buckets_of[(*domain, g)] = buffer_buckets(params, separate_bucket_keys(arch, pp) if not experts
                                                      else frozenset(), bucket_size)
        buckets = buckets_of[(*domain, g)]
        if bucket >= len(buckets):
            raise CheckpointFormatError(f"{root}: {key}: bucket {bucket} but the rules give {len(buckets)} bucket(s) "
                                        f"for this grad buffer at bucket size {bucket_size} (from Megatron-LM's "
                                        f"args overlap_grad_reduce / ddp_bucket_size; None without them)")
        placed, numel = buckets[bucket]
        if (numel,) != tuple(tmd.size):
            raise LayoutMismatchError(
                f"{root}: {key} holds {tuple(tmd.size)} elements but the rules give {numel} for tp_rank={tp_rank} "
                f"pp_rank={pp_rank} ep_rank={ep_rank} grad buffer {g} ({param_dtype}, {len(params)} params)")
        kind = STATE_KINDS[m.group(6)]
        out = []
        for c in tmd.chunks:
            c0, cn = c.offsets[0], c.sizes[0]
            pieces = []
            for p, start in placed:
                if p.rule.tp_dim is None and tp_rank != 0:
                    continue  # a TP-replicated param: every TP domain holds a copy; index TP rank 0's
                if p.rule.key == OUTPUT_KEY and arch.tied_embeddings:
                    continue  # the last stage's copy of tied embeddings: its state is the embedding's
                lo, hi = max(c0, start), min(c0 + cn, start + p.numel)
                if lo < hi:
                    pieces += param_flat_pieces(arch, p, lo - start, hi - start, lo - c0)
            out.append((c, pieces))
        yield key, kind, dtype_name(tmd.properties.dtype), out


def saved_model_spec(common: Mapping[str, Any]) -> dict[str, Any] | None:
    """The model shape the built-in engines save (`migrate.model`: ModelShape fields), None when absent."""
    model = (common.get("migrate") or {}).get("model")
    return dict(model) if isinstance(model, Mapping) else None


def canonical_train_state(arch: ModelShape, common: Mapping[str, Any], groups: list[Any],
                 rng: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The canonical training state other formats' writers start from: step, LR schedule position (the
    built-in engines' `ScheduledLR` state), the client state of the built-in workloads (sampler, step,
    data position), params in the HF module order as one group with the first Megatron group's
    hyper-parameters (Megatron's no-decay group for norms/biases differs only in wd_mult), and every
    source rank's RNG state with its role (`rng`: {"states", "roles"}, None when none was saved)."""
    ours = dict(common.get("migrate") or {})
    step = ours.get("step", common.get("iteration"))
    hparams = []
    if groups and isinstance(groups[0], Mapping) and groups[0].get("param_groups"):
        first = dict(groups[0]["param_groups"][0])
        hparams = [{k: v for k, v in first.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}]
    client = {k: v for k, v in ours.items() if k not in ("model", "layout")}
    return {"step": step, "lr_scheduler": None if step is None else {"last_step": int(step)},
            "client": {CLIENT_STATE_KEY: client} if client else {}, "param_names": hf_order(arch),
            "optimizer_param_groups": hparams, "optimizer_group_params": [hf_order(arch)], "rng": rng}


# ---------------------------------------------------------------- training state: RNG, data position, counters

RNG_OBJECT_RE = re.compile(rf"^{MEGATRON_RNG_KEY}/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")


def _rng_from_metadata(md: Any, storage: Mapping[tuple[str, tuple[int, ...]], Any], root: Path,
                       layout: Mapping[str, Any], trust_checkpoint: bool = False) -> dict[str, Any] | None:
    """Every saved rank's RNG state (plain data) and role from Megatron-LM's `rng_state` ShardedObjects
    (one per (pp, tp), holding one state for all DP ranks or one per DP rank); None when none was saved.
    Reads only those small objects."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects: dict[tuple[int, int], list[dict[str, Any]]] = {}
    grids = set()
    for fqn, tmd in md.state_dict_metadata.items():
        m = RNG_OBJECT_RE.match(fqn)
        if not m or not isinstance(tmd, BytesStorageMetadata):
            continue
        pp_rank, tp_rank, pp, tp = map(int, m.groups())
        grids.add((pp, tp))
        info = storage[(fqn, ())]
        value = load_range(root / info.relative_path, int(info.offset), int(info.length),
                           trust_checkpoint=trust_checkpoint)
        states = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
        if not isinstance(states, list) or not states:
            raise CheckpointFormatError(f"{root}: {fqn} holds {type(states).__name__}, not a list of RNG states")
        objects[(pp_rank, tp_rank)] = [from_megatron(st, where=f"{root}: {fqn}") for st in states]
    if not objects:
        return None
    if grids != {(layout["pp"], layout["tp"])}:
        raise CheckpointFormatError(f"{root}: rng_state objects saved for (pp, tp) grids {sorted(grids)} but the "
                                    f"checkpoint's layout is pp={layout['pp']} tp={layout['tp']}")
    dp = layout["dp"] or max(len(v) for v in objects.values())
    src = roles(tp=layout["tp"], pp=layout["pp"], dp=dp, ep=layout["ep"] or 1)
    return {"states": expand_megatron_rng(objects, src, where=f"{root}: {MEGATRON_RNG_KEY}"),
            "roles": [r.as_dict() for r in src]}


def target_training_state(m: Mapping[str, Any], layout: ParallelLayout) -> dict[str, Any]:
    """The target's training state: `common` with ours converted (data position for the target DP, counters
    carried), `rng` ({(pp rank, tp rank): states} per target `rng_state` object, each rank's state carried /
    copied from a DP peer / derived by `checkpoint.state.rng`'s policy) and the `state_report` (policy and
    reason per state). Pure; raises DataPositionError on inconsistent per-rank positions."""
    common = dict(m["common"])
    ours = dict(common.get("migrate") or {})
    client = {k: v for k, v in ours.items() if k not in ("model", "layout")}
    rng = (m.get("train_state") or {}).get("rng")
    if rng:
        client["rng"], client["roles"] = rng["states"], rng["roles"]
    target_roles = roles(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep)
    counters = {k: common[k] for k in ("iteration",) if common.get(k) is not None}
    converted, report = convert_model_state({CLIENT_STATE_KEY: client, **counters}, target_roles)
    new = dict(converted[CLIENT_STATE_KEY])
    states, saved_roles = new.pop("rng", None), new.pop("roles", None)
    grid = {} if states is None else megatron_rng_objects(states, [role_from_dict(r) for r in saved_roles])
    common["migrate"] = {**new, **{k: ours[k] for k in ("model",) if k in ours}}
    src = f"megatron tp={m.get('tp')} pp={m.get('pp')} dp={m.get('dp')} ep={m.get('ep')}"
    dst = f"megatron tp={layout.tp} pp={layout.pp} dp={layout.dp} ep={layout.ep}"
    return {"common": common, "rng": dict(sorted(grid.items())),
            "state_report": report_dict(report, source=src, target=dst) if client else None}


def _common_meta(common: Mapping[str, Any]) -> dict[str, Any]:
    """Plain non-tensor common state carried to the target (iteration, ours, optimizer param groups)."""
    return {k: v for k, v in common.items() if k != "optimizer"}


# ---------------------------------------------------------------- target (fully_reshardable, full tensors)

def owner_boxes(rule: TensorRule, arch: ModelShape, layout: ParallelLayout, *, tp_rank: int, pp_rank: int,
                ep_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (offsets, lengths) of the stacked key tensor that the (tp, pp, ep) rank owns at `layout`.

    Layers follow PP and virtual PP ownership, experts EP ownership, rows/cols the TP split (fused GLU:
    a gate run and an up run); TP-replicated tensors are owned by TP rank 0 only (Megatron's replica 0).
    """
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    mat = matrix_shape(rule, arch, tp)
    if rule.tp_dim is None and tp_rank != 0:
        return []
    if rule.scope == "model":
        if not any(holds_model_tensor(rule, pp, vpp, pp_rank, v) for v in range(vpp)):
            return []
        leads: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    else:
        held = held_layers(rule, arch)
        runs = [range(max(r.start, held.start), min(r.stop, held.stop))
                for r in (pipeline_stage_layers(arch.num_layers, pp, vpp, pp_rank, v, **layout.pipeline_split)
                          for v in range(vpp))]
        leads = [((r.start,), (len(r),)) for r in runs if len(r)]
        if rule.scope == "expert":
            ex = expert_range(arch.num_experts, layout.ep, ep_rank)
            leads = [((*o, ex.start), (*n, len(ex))) for o, n in leads]
    mats: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if len(mat) == 1:  # a norm (whole) or a QKV bias (rows per query group, as its weight's)
        mats = [((r0,), (nr,)) for r0, nr in tp_local_rows(rule, arch, tp, tp_rank)]
    else:
        c0, nc = tp_local_cols(rule, arch, tp, tp_rank)
        mats = [((r0, c0), (nr, nc)) for r0, nr in tp_local_rows(rule, arch, tp, tp_rank)]
    return [((*lo, *mo), (*ln, *mn)) for lo, ln in leads for mo, mn in mats]


def layer_boxes(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], lead: int):
    """Split boxes of a stacked key into one box per layer (and expert), as Megatron stores them;
    `lead` is the number of leading stacked dims (0 model, 1 layer, 2 expert)."""
    for o, n in boxes:
        if lead == 0:
            yield o, n
            continue
        idx = [range(o[i], o[i] + n[i]) for i in range(lead)]
        combos = [(i,) for i in idx[0]] if lead == 1 else [(i, j) for i in idx[0] for j in idx[1]]
        for c in combos:
            yield (*c, *o[lead:]), (*(1,) * lead, *n[lead:])


def writer_ranks(layout: ParallelLayout, *, tp_rank: int, pp_rank: int, ep_rank: int, expert: bool) -> list[int]:
    """The target ranks that share writing one owner box: its data-parallel (expert data-parallel) ranks."""
    dps = range(ep_rank, layout.dp, layout.ep) if expert else range(layout.dp)
    return [layout.rank_of(tp=tp_rank, dp=d, pp=pp_rank) for d in dps]


def source_arch(source: CheckpointIndex, model_config: Mapping[str, Any] | None = None) -> ModelShape:
    """The architecture of `source` for the rules: the Megatron reader's (meta 'arch'), else the model shape
    the built-in engines save in their client state (`migrate.model`), else the source's HF config.json (an
    HF-Trainer folder's), else `model_config` (an HF config or
    ModelShape fields, `arch_from_config`). A given `model_config` must agree with the checkpoint's.
    Raises PlanError naming the option to pass when none says it."""
    saved = source.meta.get("arch") or our_client_state(source.meta).get("model")
    if saved is None and isinstance(source.meta.get("hf_config"), Mapping):  # an HF-Trainer folder's config.json
        spec = arch_from_config(source.meta["hf_config"], where=f"{source.root}/config.json")
        # padded as Megatron-LM pads by default (--make-vocab-size-divisible-by 128 times tp)
        saved = dataclasses.asdict(spec) | {"make_vocab_size_divisible_by": 128}
    given = None if model_config is None else arch_from_config(model_config, where="--model-config")
    if saved is None:
        if given is None:
            raise PlanError(f"source {source.root} ({source.format}) does not record its architecture (Megatron's "
                            f"rules need num_layers, heads, query groups, GLU, vocab, padding): pass --model-config "
                            f"FILE (an HF config.json or the job YAML's model section)")
        return given
    arch = ModelShape.from_dict(dict(saved)) if source.format == FORMAT else arch_from_config(
        saved, where=f"{source.root}: {CLIENT_STATE_KEY}.model")
    if given is not None and given.tensor_fields() != arch.tensor_fields():
        raise PlanError(f"--model-config {given} disagrees with the architecture saved in {source.root}: {arch}")
    return arch


# the modules whose (empty) `_extra_state` Megatron-Core saves as one ShardedObject per layer (local spec)
_ATTENTION_EXTRA_STATE = ("decoder.layers.self_attention.linear_proj", "decoder.layers.self_attention.linear_qkv")
_DENSE_MLP_EXTRA_STATE = ("decoder.layers.mlp.linear_fc1", "decoder.layers.mlp.linear_fc2")
_TORCH_ADAMW_GROUP = {"amsgrad": False, "capturable": False, "decoupled_weight_decay": True, "differentiable": False,
                      "foreach": None, "fused": None, "maximize": False}


def megatron_meta_from(source: CheckpointIndex, arch: ModelShape) -> dict[str, Any]:
    """What a Megatron target needs that a source of another format (DeepSpeed, DCP) does not hold in
    Megatron's terms, built from its canonical train state: `common` (iteration, checkpoint_version and the
    built-in engines' state with the model shape; RNG not carried across frameworks), the optimizer param
    groups Megatron-Core builds (decay, then no-decay for norms/biases, each with the source's Adam
    hyper-parameters and its step), the model dtype and the layers' empty `_extra_state` objects."""
    ts = source.meta.get("train_state") or {}
    step = ts.get("step")
    if step is None:
        start = (" (it holds weights only: --to megatron writes it as a pretrained start for Megatron-LM's "
                 "--finetune)") if is_weights_only(source) else ""
        raise PlanError(f"source {source.root} ({source.format}) carries no train-state step: a Megatron "
                        f"checkpoint with optimizer state needs the iteration and Adam's step{start}")
    if arch.num_experts:
        raise PlanError(f"source {source.root} ({source.format}): converting a {arch.architecture} (MoE) model into "
                        f"Megatron is only supported from Megatron checkpoints")
    hp = dict((ts.get("optimizer_param_groups") or [{}])[0])
    group = {**_TORCH_ADAMW_GROUP, **{k: v for k, v in hp.items() if k in _TORCH_ADAMW_GROUP or k in (
        "lr", "betas", "eps", "weight_decay")}}
    if "lr" not in group:
        raise PlanError(f"source {source.root} ({source.format}): no optimizer hyper-parameters (lr) in its train "
                        f"state")
    group |= {"betas": tuple(group.get("betas", (0.9, 0.999))), "step": float(step), "default_config": True,
              "is_decoupled_lr": False, "is_expert_parallel": False, "lr_mult": 1.0, "max_lr": group["lr"],
              "min_lr": 0.0, "wd_mult": 1.0}  # Megatron-LM's --min-lr default
    client = dict(((ts.get("client") or {}).get(CLIENT_STATE_KEY)) or {})
    ours = {k: v for k, v in client.items() if k not in ("rng", "roles", "model", "layout")}
    model = dict(client.get("model") or {})  # the engines' whole spec (norm epsilon, RoPE base) stays
    ours |= {"step": int(step), "model": model | arch.tensor_fields()}
    if (hf := _hf_config(source)) is not None:
        ours["hf_config"] = hf  # an HF config.json the source came with: an HF target of this output reuses it
    params = [e for e in source.entries if e.key.kind is Kind.PARAM]
    batch = _global_batch(source)
    args = synthesized_args(arch, _model_fields(source), iteration=int(step), global_batch_size=batch,
                            weights_only=False, hf_tokenizer=hf is not None)
    samples = int(step) * batch if batch else 0
    scheduler, note = _scheduler_at(samples, lr=float(group["lr"]), weight_decay=float(group.get("weight_decay", 0.0)),
                                    known=batch is not None, source=source)
    return {"common": {"iteration": int(step), "checkpoint_version": 3.0, "migrate": ours, "args": args,
                       "opt_param_scheduler": scheduler}, "start_note": note,
            "optimizer_groups": [{"param_groups": [group, {**group, "wd_mult": 0.0}]}],
            "model_dtype": params[0].dtype if params else "float32", "objects": [],
            "new_objects": extra_state_objects(arch)}


def _scheduler_at(samples: int, *, lr: float, weight_decay: float, known: bool, source: CheckpointIndex
                  ) -> tuple[dict[str, Any], str]:
    """Megatron-LM's `opt_param_scheduler` state for a source of another framework, and the plan's note on it.
    Megatron counts its schedule in samples; another framework's schedule (DeepSpeed's WarmupLR, the Trainer's)
    has no Megatron equivalent, so the state holds the source's last learning rate and weight decay held constant
    from the samples consumed: Megatron-LM loads it with --use-checkpoint-opt_param-scheduler, or with
    --override-opt_param-scheduler runs the user's own schedule from that sample."""
    state = {"max_lr": lr, "min_lr": 0.0, "lr_warmup_steps": 0, "num_steps": samples, "lr_decay_style": "constant",
             "lr_decay_steps": max(samples, 1), "start_wd": weight_decay, "end_wd": weight_decay,
             "wd_incr_style": "constant", "wd_incr_steps": max(samples, 1)}
    where = (f"from sample {samples}" if known else
             f"from sample 0 ({source.root} does not record its global batch, so the samples consumed are unknown)")
    note = (f"Megatron's LR schedule: the source's last lr {lr:g} and weight decay {weight_decay:g} held constant "
            f"{where}; launch Megatron-LM with --override-opt_param-scheduler to run your own schedule from there, "
            f"or --use-checkpoint-opt_param-scheduler to keep it")
    return state, note


def _hf_config(source: CheckpointIndex) -> dict[str, Any] | None:
    """The HF config.json the source came with (its own, or carried by an earlier conversion); None if none."""
    config = source.meta.get("hf_config") or our_client_state(source.meta).get("hf_config")
    return dict(config) if isinstance(config, Mapping) else None


def _model_fields(source: CheckpointIndex) -> ModelFields | None:
    """The model's norm epsilon, RoPE base and positions as the source records them (its HF config, else the
    built-in engines' model shape); None when it records neither."""
    if (config := _hf_config(source)) is not None:
        return fields_from_hf_config(config, origin=f"{source.root}: config.json")
    model = our_client_state(source.meta).get("model")
    if isinstance(model, Mapping):
        try:
            return fields_from_model_shape(model, origin=f"{source.root}: {CLIENT_STATE_KEY}.model")
        except PlanError:
            return None
    return None


def _global_batch(source: CheckpointIndex) -> int | None:
    """The source run's global batch when it records one: DeepSpeed's train_batch_size, else its micro batch x
    gradient accumulation x dp (the rule DeepSpeed checks its config by)."""
    config = (source.meta.get("model_state") or {}).get("ds_config") or {}
    value = config.get("train_batch_size")
    if isinstance(value, int) and value > 0:
        return value
    micro, accumulation = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accumulation, int) and micro > 0 and accumulation > 0:
        return micro * accumulation * int(source.meta.get("dp", 1))
    return None


def extra_state_objects(arch: ModelShape) -> list[list[Any]]:
    """The layers' empty `_extra_state` ShardedObjects a torch_dist checkpoint holds and a source without them
    (another format, the legacy files) lacks: (key, [None]) per layer and module, per (layer, expert) for the
    experts' linears."""
    layers, experts = arch.num_layers, arch.num_experts
    if per_layer_keys(arch):
        return _per_layer_extra_state_objects(arch)
    per_layer = _ATTENTION_EXTRA_STATE + (() if experts else _DENSE_MLP_EXTRA_STATE)
    out = [[f"{mod}._extra_state/shard_{i}_{layers}", [None]] for i in range(layers) for mod in per_layer]
    # an MoE layer's experts: one object per (layer, expert), sharded over both (Megatron-Core's SequentialMLP)
    return out + [[f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{layers}.{experts}", [None]]
                  for i in range(layers) for e in range(experts) for fc in ("linear_fc1", "linear_fc2")]


def _per_layer_extra_state_objects(arch: ModelShape) -> list[list[Any]]:
    """`extra_state_objects` of a model stored one key per layer: each linear's object under its layer's key
    (`.../shard_0_1`), the routed experts' per expert (`.../shard_{e}_{E}`)."""
    q = ("linear_q_down_proj", "linear_q_up_proj") if arch.q_lora_rank else ("linear_q_proj",)
    att = ("linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj")
    out = []
    for i in range(arch.num_layers):
        mods = [f"decoder.layers.{i}.self_attention.{m}" for m in att]
        if not arch.is_moe_layer(i):
            mods += [f"decoder.layers.{i}.mlp.{fc}" for fc in ("linear_fc1", "linear_fc2")]
        elif arch.shared_expert_ffn_hidden_size:
            mods += [f"decoder.layers.{i}.mlp.shared_experts.{fc}" for fc in ("linear_fc1", "linear_fc2")]
        out += [[f"{mod}._extra_state/shard_0_1", [None]] for mod in mods]
        if arch.is_moe_layer(i):
            out += [[f"decoder.layers.{i}.mlp.experts.experts.{fc}._extra_state/shard_{e}_{arch.num_experts}", [None]]
                    for e in range(arch.num_experts) for fc in ("linear_fc1", "linear_fc2")]
    return out


def legacy_meta_for_dist(source: CheckpointIndex, arch: ModelShape) -> dict[str, Any]:
    """A legacy (`--ckpt-format torch`) source's state in the torch_dist writer's terms: its common state (args,
    iteration, checkpoint_version, FLOP count) with the scheduler, which torch_dist keeps in common.pt, its own
    optimizer param groups, and the `_extra_state` objects the legacy files do not hold."""
    common = dict(source.meta.get("common") or {})
    if source.meta.get("opt_param_scheduler") is not None:
        common["opt_param_scheduler"] = source.meta["opt_param_scheduler"]
    return {"common": common, "objects": [], "new_objects": extra_state_objects(arch)}


def is_weights_only(source: CheckpointIndex) -> bool:
    """Whether `source` holds weights and nothing of a training run (no fp32 master, no Adam state, no step):
    an HF checkpoint, a weights-only export."""
    kinds = {e.key.kind for e in source.entries}
    step = (source.meta.get("train_state") or {}).get("step")
    return kinds <= {Kind.PARAM} and step is None and source.format != FORMAT


def pretrained_meta(source: CheckpointIndex, arch: ModelShape) -> dict[str, Any]:
    """A weights-only source as a Megatron pretrained start (Megatron-LM's --finetune): iteration 0, no
    optimizer state or param groups, no RNG; the model shape and the layers' empty `_extra_state` objects."""
    params = [e for e in source.entries if e.key.kind is Kind.PARAM]
    spec = arch.tensor_fields()
    ours: dict[str, Any] = {"step": 0, "model": spec}
    if (hf := _hf_config(source)) is not None:
        ours["hf_config"] = hf
    args = synthesized_args(arch, _model_fields(source), iteration=0, global_batch_size=None, weights_only=True,
                            hf_tokenizer=hf is not None)
    return {"common": {"iteration": 0, "checkpoint_version": 3.0, "migrate": ours, "args": args},
            "optimizer_groups": [], "model_dtype": params[0].dtype if params else "float32", "objects": [],
            "new_objects": extra_state_objects(arch), "weights_only": True,
            "start_note": "a pretrained start (weights only, iteration 0, no optimizer or RNG state): load it with "
                          "Megatron-LM's --finetune (or --no-load-optim --no-load-rng)"}


def megatron_target(source: CheckpointIndex, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                    vpp: int = 1, first_pipeline_stage_layers: int | None = None, last_pipeline_stage_layers: int | None = None,
                    model_config: Mapping[str, Any] | None = None) -> TargetSpec:
    """The source's state as a fully-reshardable torch_dist checkpoint, written by the ranks of the target
    layout: every (tp, pp, ep) shard of each model key and of each optimizer state is split over its
    data-parallel ranks (one box per layer/expert and per TP shard of the embedding/output layer, balanced by
    bytes), and rank r writes its boxes to `__{r}_0.distcp` (DCP chunks of the global tensors); common.pt
    records the layout (migrate.layout).
    Megatron-Core loads it at any TP/PP/EP/DP; `tp` picks the vocab padding. Sources of other formats
    (DeepSpeed, DCP) get Megatron's common state and param groups from their train state
    (`megatron_meta_from`) and the architecture from the checkpoint or `model_config` (`source_arch`); an
    fp32 param stands in for a missing fp32 master. Raises PlanError when the source lacks the
    architecture or the optimizer state, CheckpointFormatError when the layout does not fit the model
    (e.g. query groups not divisible by tp, layers that do not split over the pipeline stages)."""
    refuse_shared_params(source, "megatron")
    refuse_frozen_params(source, "megatron")
    refuse_unplaced_state(source, target="megatron",
                          why="Megatron-Core's distributed optimizer saves Adam's param, exp_avg and exp_avg_sq")
    arch = source_arch(source, model_config)
    pretrained = is_weights_only(source)
    if pretrained:
        m = {**source.meta, **pretrained_meta(source, arch)}
    elif source.format == FORMAT:
        m = dict(source.meta)
    elif source.format == LEGACY_FORMAT:
        m = {**source.meta, **legacy_meta_for_dist(source, arch)}
    else:
        m = {**source.meta, **megatron_meta_from(source, arch)}
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, vpp=vpp, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER,
                            first_pipeline_stage_layers=first_pipeline_stage_layers,
                            last_pipeline_stage_layers=last_pipeline_stage_layers)
    check_pipeline_split(arch, layout)
    check_padded_vocab(source, arch, tp)
    state = target_training_state(m, layout)
    it = iteration_dir_name(state["common"].get("iteration") or 0)
    src = source.by_key()
    fp32_params = all(e.dtype == "float32" for e in source.entries if e.key.kind is Kind.PARAM)
    kinds = [Kind.PARAM]
    if not pretrained:
        kinds += [k for k in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
                  if any(key.kind is k for key in src) or k is Kind.MASTER and fp32_params]
    if Kind.MASTER not in kinds and not pretrained:
        raise PlanError(f"source {source.root} holds no fp32 master/optimizer state; a Megatron DistributedOptimizer "
                        f"checkpoint needs it")
    if m.get("optimizer_groups") is None or "common" not in m:
        raise PlanError(f"source {source.root} ({source.format}) lacks Megatron optimizer param groups / common state")
    moe = arch.num_experts > 0
    chained = moe and ep > 1  # Megatron-Core chains an expert optimizer only under expert parallelism
    if ep > 1 and not moe:
        raise PlanError(f"target ep={ep} but the {arch.architecture} model has no experts")
    dtype = m.get("model_dtype", "float32")
    dtypes = param_dtypes(source, arch, dtype)
    work: list[tuple[Any, ...]] = []  # (nbytes, order, writer ranks, rule, kind, dcp key, offsets, lengths)
    dcp_tensors = []
    per_layer = bool(m.get("per_layer_keys")) or per_layer_keys(arch)
    for rule in stored_rules(arch):  # tied embeddings: Megatron loads the last stage's copy from the embedding
        shape = stacked_shape(rule, arch, tp)
        lead = {"model": 0, "layer": 1, "expert": 2}[rule.scope]
        rule_kinds = [Kind.PARAM] if rule.buffer else kinds
        keys = [(kind, rule.key if kind is Kind.PARAM else _state_key(kind, rule, chained),
                 dtypes[rule.key] if kind is Kind.PARAM else "float32") for kind in rule_kinds]
        if per_layer and lead:
            dcp_tensors += [[layer_key(dkey, i), list(shape[1:]), dt] for _, dkey, dt in keys
                            for i in held_layers(rule, arch)]
        else:
            dcp_tensors += [[dkey, list(shape), dt] for _, dkey, dt in keys]
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                for ep_rank in range(ep if rule.scope == "expert" else 1):
                    ranks = tuple(writer_ranks(layout, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank,
                                               expert=rule.scope == "expert"))
                    boxes = owner_boxes(rule, arch, layout, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
                    for o, n in layer_boxes(boxes, lead):
                        for kind, dkey, dt in keys:
                            work.append((math.prod(n) * dtype_size(dt), len(work), ranks, rule, kind, dkey, o, n))
    # Megatron's fully parallel save balances whole chunks over the DP ranks: largest first, least loaded.
    load: dict[int, int] = defaultdict(int)
    per_rank: dict[int, list[TargetBuffer]] = defaultdict(list)
    entries: dict[TensorKey, list[ChunkRef]] = defaultdict(list)
    entry_dtype: dict[TensorKey, str] = {}
    for nbytes, _, ranks, rule, kind, dkey, o, n in sorted(work, key=lambda w: (-w[0], w[1])):
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += nbytes
        per_layer_box = per_layer and rule.scope != "model"
        bkey = (layer_key(dkey, o[0]), *o[1:]) if per_layer_box else (dkey, *o)
        file = f"{it}/__{rank}_0.distcp"
        dt = dtypes[rule.key] if kind is Kind.PARAM else "float32"
        per_rank[rank].append(TargetBuffer(key=bkey, shape=n[1:] if per_layer_box else n, dtype=dt))
        for pc in box_pieces(rule, arch, o, n):
            key = TensorKey(name=pc.name, kind=kind)
            entry_dtype[key] = dt
            entries[key].append(
                ChunkRef(file=file, key=bkey, offsets=pc.offsets, lengths=pc.lengths, storage_offset=pc.storage_offset))
    shapes = dict(canonical_tensors(arch))
    out = []
    for key, chunks in sorted(entries.items(), key=lambda kv: (kv[0].name, str(kv[0].kind))):
        out.append(TensorEntry(key=key, shape=shapes[key.name], dtype=entry_dtype[key], chunks=tuple(chunks)))
    if m.get("opt_param_scheduler") is not None:  # a legacy source keeps it beside its common state
        state["common"].setdefault("opt_param_scheduler", m["opt_param_scheduler"])
    common = target_common(state["common"], arch, layout, chained=chained)
    groups = [] if pretrained else target_optimizer_groups(m["optimizer_groups"], chained=chained)
    files = [TargetFile(path=f"{it}/__{r}_0.distcp", role="distcp", rank=r, buffers=tuple(per_rank[r]))
             for r in sorted(per_rank)]
    # the ShardedObjects (copied, or synthesized for other formats' sources) and RNG states: in the first file
    files[0] = dataclasses.replace(files[0], values=stored_objects(m, source.root, state["rng"], layout))
    common_file = TargetFile(path=f"{it}/common.pt", role="common", rank=None, values=(
        ValueItem(key=(), role=ValueRole.COMMON, value=saved_common(common, groups, layout)),))
    tracker = TargetFile(path=TRACKER_FILE, role="tracker", rank=None,
                         values=(ValueItem(key=(), role=ValueRole.COMMON, value=tracker_text(common)),))
    meta = {**{k: v for k, v in m.items() if k not in _VALUE_META}, "optimizer_groups": groups,
            "per_layer_keys": per_layer, "target_tp": tp, "target_layout": layout.to_dict(),
            "sharding": "fully_reshardable", "dcp_tensors": dcp_tensors, "iteration_dir": it,
            "state_report": state["state_report"]}
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(out), files=tuple(f.path for f in files), meta=meta)
    # Megatron-LM's commit point, the tracker, last; DCP's (.metadata) before it
    return TargetSpec(index=index, files=tuple(files), described=(common_file, tracker), write_mode=WriteMode.STREAMING,
                      commit=(f"{it}/.metadata", f"{it}/metadata.json", TRACKER_FILE))


# a source's stored objects and common state: planned as the target's values (files[0]'s, common.pt's)
_VALUE_META = ("objects", "new_objects", "common")


def stored_objects(m: Mapping[str, Any], source_root: str, rng: Mapping[tuple[int, int], Any],
                   layout: ParallelLayout) -> tuple[ValueItem, ...]:
    """The torch_dist target's non-tensor items: the ShardedObjects synthesized for other formats' sources
    (`new_objects`: [fqn, value]), those copied byte for byte from a torch_dist source (`objects`: [fqn,
    file, offset, length]) and one Megatron-LM `rng_state` object per (pp, tp) rank of `layout` (`rng`)."""
    return (*(ValueItem(key=(fqn,), role=ValueRole.OBJECT, value=value) for fqn, value in m.get("new_objects", ())),
            *(ValueItem(key=(fqn,), role=ValueRole.OBJECT, copy=SourceBytes(path=str(Path(source_root) / file),
                                                                          offset=offset, length=length))
              for fqn, file, offset, length in m.get("objects", ())),
            *(ValueItem(key=(f"{MEGATRON_RNG_KEY}/shard_{pp_rank}.{tp_rank}_{layout.pp}.{layout.tp}",),
                        role=ValueRole.RNG, value=[[to_megatron(st) for st in states]])
              for (pp_rank, tp_rank), states in rng.items()))


def saved_common(common: Mapping[str, Any], groups: list[Any], layout: ParallelLayout) -> dict[str, Any]:
    """What the target's common.pt holds: its common state with our layout record and, but for a pretrained
    start (no `groups`), the optimizer's param groups as Megatron-Core's fully reshardable save keeps them."""
    out = dict(common)
    out["migrate"] = {**dict(out.get("migrate") or {}), "layout": layout.to_dict()}
    per = [{"optimizer": g, "param_state_sharding_type": "fully_reshardable"} for g in groups]
    if per:
        out["optimizer"] = per[0] if len(per) == 1 else dict(enumerate(per))
    return out


def param_dtypes(source: CheckpointIndex, arch: ModelShape, default: str) -> dict[str, str]:
    """The dtype of each Megatron model key's weights in `source` (its first canonical tensor's; `default`
    where the source holds none): a bf16 run may keep some weights in fp32 (e.g. norms), and Megatron-Core
    puts those in a grad buffer of their own."""
    params = {e.key.name: e.dtype for e in source.entries if e.key.kind is Kind.PARAM}
    out = {}
    for rule in stored_rules(arch):
        seg = segments(rule, arch)[0]
        layer = None if rule.scope == "model" else held_layers(rule, arch).start
        name = canonical_name(rule, seg, layer, 0 if rule.scope == "expert" else None)
        out[rule.key] = params.get(name, default)
    if arch.tied_embeddings:
        out[OUTPUT_KEY] = out["embedding.word_embeddings.weight"]
    return out


def check_padded_vocab(source: CheckpointIndex, arch: ModelShape, tp: int) -> None:
    """Refuse a target TP whose vocabulary padding differs from the source's when the source's unpadded
    vocabulary size is unknown (Megatron-LM's args record only the padded one)."""
    if source.meta.get("vocab_padded") and arch.padded_vocab_size(tp) != arch.vocab_size:
        raise PlanError(f"{source.root}: Megatron-LM's args hold padded_vocab_size={arch.vocab_size} but not the "
                        f"unpadded vocab size; at tp={tp} Megatron-LM pads to a multiple of "
                        f"{arch.make_vocab_size_divisible_by}*{tp} ({arch.padded_vocab_size(tp)} rows): pass "
                        f"--model-config with the tokenizer's vocab_size, or a tp that keeps {arch.vocab_size}")


def target_common(common: Mapping[str, Any], arch: ModelShape, layout: ParallelLayout, *, chained: bool
                  ) -> dict[str, Any]:
    """The target's common state: Megatron-LM's `args` (when the source had them) rewritten for `layout`, and
    the `content_metadata` Megatron-LM's `load_checkpoint` decides by (fully_reshardable; the chained expert
    optimizer's keys keep their `chained_` prefix)."""
    out = dict(common)
    if out.get("args") is not None:
        out["args"] = target_args(out["args"], arch, layout, ckpt_format="torch_dist", fully_reshardable=True)
    out["content_metadata"] = {"distrib_optim_sharding_type": "fully_reshardable",
                               "distrib_optim_fully_reshardable_mem_efficient": False,
                               "singleton_local_shards": False, "chained_optim_avoid_prefix": not chained}
    return out


def target_optimizer_groups(groups: list[Any], *, chained: bool) -> list[Any]:
    """The optimizer param groups Megatron-Core builds at the target: one optimizer (dense groups) unless
    expert parallel (ep > 1) chains a second one for the experts. An expert group missing in the source
    (ep 1) is the dense weight-decay group marked expert parallel."""
    all_pg = [dict(pg) for g in groups for pg in g["param_groups"]]
    dense = [pg for pg in all_pg if not pg.get("is_expert_parallel")]
    expert = [pg for pg in all_pg if pg.get("is_expert_parallel")]
    if not chained:
        return [{**groups[0], "param_groups": dense}]
    if not expert:
        decay = next((pg for pg in dense if pg.get("wd_mult", 1.0) == 1.0), dense[0])
        expert = [{**decay, "is_expert_parallel": True}]
    return [{**groups[0], "param_groups": dense}, {**groups[-1], "param_groups": expert}]


def _state_key(kind: Kind, rule: TensorRule, chained: bool) -> str:
    name = {Kind.MASTER: "param", Kind.EXP_AVG: "exp_avg", Kind.EXP_AVG_SQ: "exp_avg_sq"}[kind]
    prefix = f"chained_{1 if rule.scope == 'expert' else 0}." if chained else ""
    return f"{prefix}optimizer.state.{name}.{rule.key}"


_OPT_OBJ_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_0\.optimizer/shard_0_1$")


def _objects(md: Any, storage: Mapping[tuple[str, tuple[int, ...]], Any], root: Path,
             common: Mapping[str, Any], trust_checkpoint: bool = False) -> tuple[list[list[Any]], list[Any]]:
    """Model ShardedObjects (`_extra_state`) as (fqn, file, offset, length) to copy verbatim (each checked
    against `safe_load.OBJECT_GLOBALS`: Megatron-Core unpickles them freely at load), and the optimizer's
    non-tensor state (param groups with lr, betas, step) per chained optimizer."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects, groups = [], {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, BytesStorageMetadata):
            continue
        info = storage[(fqn, ())]
        if "._extra_state/" in fqn:
            refused = sorted(set(safe_load.range_globals(root / info.relative_path, int(info.offset),
                                                         int(info.length))) - safe_load.OBJECT_GLOBALS)
            if refused and not trust_checkpoint:
                raise UntrustedCheckpointError(f"{root / info.relative_path}: object {fqn} needs {', '.join(refused)} "
                                               f"(not in the allow-list); pass --trust-checkpoint if you trust it")
            objects.append([fqn, info.relative_path, int(info.offset), int(info.length)])
        elif m := _OPT_OBJ_RE.match(fqn):
            value = load_range(root / info.relative_path, int(info.offset), int(info.length),
                               trust_checkpoint=trust_checkpoint)
            groups[int(m.group(1) or 0)] = value[0] if isinstance(value, list) else value
    if not groups:  # fully_reshardable / no distributed optimizer: the optimizer state sits in common.pt
        optim = common.get("optimizer", {})
        per = optim if all(isinstance(k, int) for k in optim) else {0: optim}
        groups = {k: v["optimizer"] if "optimizer" in v else _plain_optimizer_groups(v, root) for k, v in per.items()}
    return objects, [groups[k] for k in sorted(groups)]


def _plain_optimizer_groups(optim: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """The param groups of Megatron-Core's non-distributed optimizer state (`optimizer.state.<kind>.<key>`
    tensors, `{"state": {"common_step": step}, "param_groups": [...]}` in common.pt) with the Adam step put in
    each group, as the DistributedOptimizer keeps it."""
    groups, state = optim.get("param_groups"), optim.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise CheckpointFormatError(f"{root / 'common.pt'}: optimizer holds {sorted(map(str, optim))}, neither a "
                                    f"DistributedOptimizer state nor param_groups with a state")
    step = state.get("common_step")
    return {"param_groups": [{**dict(g), **({"step": float(step)} if step is not None else {})} for g in groups]}


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronWriter:
    """Writes each rank's `.distcp` file (its tensor boxes; the copied ShardedObjects in the first file) and,
    as the coordinator, DCP's `.metadata` (every chunk with its byte range), `common.pt` and `metadata.json`.
    Streaming: each box is filled when the payload looks it up and saved before the next, so a worker holds
    one box, never a rank's file."""

    def assemble(self, file: TargetFile, buffers: Mapping[Any, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role == "common":
            buf = io.BytesIO()
            torch.save(file.values[0].value, buf, pickle_module=safe_load.PICKLE_MODULE)  # Megatron's classes by name
            return buf.getvalue()
        if file.role == "tracker":
            return file.values[0].value
        if file.role != "distcp":
            raise PlanError(f"Megatron writer: unknown file role {file.role!r} for {file.path}")

        def write(stream: Any) -> dict[str, list[list[Any]]]:
            chunks: list[list[Any]] = []  # [fqn, box offsets, box sizes, start, length]
            for b in file.buffers:
                start = stream.tell()
                torch.save(buffers[b.key], stream)
                chunks.append([b.key[0], list(b.key[1:]), list(b.shape), start, stream.tell() - start])
            return {"chunks": chunks, "values": save_values(stream, file.values, lambda key: key[0])}

        return StreamPayload(write=write)

    def finalize(self, records: list[FileRecord], meta: Mapping[str, Any]) -> dict[str, bytes | str]:
        import pickle
        import uuid

        tensors = {k: (tuple(shape), dt) for k, shape, dt in meta["dcp_tensors"]}
        it = meta["iteration_dir"]
        placed = []
        for rec in records:
            file = rec.path.removeprefix(f"{it}/")
            placed += [PlacedItem(fqn=fqn, file=file, offset=start, length=length, box=(tuple(offsets), tuple(sizes)))
                       for fqn, offsets, sizes, start, length in (rec.extra or {}).get("chunks", ())]
            values, whole = placed_values((rec.extra or {}).get("values", ()), file)
            placed += values
            tensors |= whole
        planner = {k: (k,) for k in (*tensors, *(p.fqn for p in placed))}
        md = build_metadata(placed, tensors, planner_data=planner, save_id=str(uuid.uuid4()))
        backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}
        files: dict[str, bytes | str] = {f"{it}/.metadata": pickle.dumps(md), f"{it}/metadata.json": json.dumps(backend)}
        if meta.get("state_report"):
            files[STATE_REPORT_FILE] = json.dumps(meta["state_report"], indent=1).encode()
        return files


# ---------------------------------------------------------------- registration

def _read(path: Path, opts: Any) -> CheckpointIndex:
    return read_megatron(path, trust_checkpoint=opts.trust_checkpoint, expect_tp=opts.expect.tp, expect_pp=opts.expect.pp,
                         expect_ep=opts.expect.ep, expect_dp=opts.expect.dp, model_config=opts.model_config)


def _target(index: CheckpointIndex, opts: Any) -> TargetSpec:
    """Target layout: given sizes, else the source's (Megatron sources), else 1."""
    def pick(given: int | None, name: str) -> int:
        return given if given is not None else int(index.meta.get(name) or 1) if index.format == FORMAT else 1
    return megatron_target(index, tp=pick(opts.layout.tp, "tp"), pp=pick(opts.layout.pp, "pp"), dp=pick(opts.layout.dp, "dp"),
                           ep=pick(opts.layout.ep, "ep"), vpp=target_vpp(index, opts, (FORMAT,)),
                           **target_pipeline_split(index, opts, (FORMAT,)), model_config=opts.model_config)


def target_pipeline_split(index: CheckpointIndex, opts: Any, megatron_formats: tuple[str, ...]) -> dict[str, int | None]:
    """First/last pipeline stage layers of the target: as given; else the source's when it is a Megatron
    checkpoint whose pipeline (pp and vpp) is kept; else None (an even split)."""
    given = {k: getattr(opts.layout, k) for k in PIPELINE_STAGE_FIELDS}
    if any(v is not None for v in given.values()):
        return given
    kept = (opts.layout.pp in (None, int(index.meta.get("pp") or 1))
            and opts.layout.vpp in (None, int(index.meta.get("vpp") or 1)))
    return pipeline_split_of(index.meta) if index.format in megatron_formats and kept else given


def check_pipeline_split(arch: ModelShape, layout: ParallelLayout) -> None:
    """Raise PlanError naming every number unless the model's layers split over the target's pipeline stages."""
    try:
        pipeline_stage_layer_counts(arch.num_layers, layout.pp, layout.vpp, layout.first_pipeline_stage_layers,
                                    layout.last_pipeline_stage_layers)
    except CheckpointFormatError as err:
        raise PlanError(f"target {layout.describe()}: {err}") from None


def target_vpp(index: CheckpointIndex, opts: Any, megatron_formats: tuple[str, ...]) -> int:
    """Virtual stages of the target: as given; else the source's when it is a Megatron checkpoint whose
    pipeline size is kept; else 1."""
    if opts.layout.vpp is not None:
        return opts.layout.vpp
    if index.format in megatron_formats and opts.layout.pp in (None, int(index.meta.get("pp") or 1)):
        return int(index.meta.get("vpp") or 1)
    return 1


def _spec() -> Any:
    from checkpoint.formats.base import CheckpointFormat

    return CheckpointFormat(
        name=FORMAT, description="Megatron-Core torch_dist (dp_/fully_reshardable DistributedOptimizer, any TP/PP/EP)",
        detect=is_megatron_checkpoint, read=_read, target=_target, writer=MegatronWriter(),
        names="canonical")


SPEC = _spec()
