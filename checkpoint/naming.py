"""An index seen in another parameter-naming convention (pure): the name tables of `checkpoint.rules.names`
applied to every tensor and to the name lists of its metadata.

Writers that map names themselves (HF, Megatron) take `canonical` names; a source whose names are
transformers' (an HF-Trainer DeepSpeed run, FSDP2 over a transformers model) or torchtitan's is renamed
before planning. torchtitan's wq/wk rows are in another RoPE order than transformers': their chunks are
re-expressed row by row (each row of a stored piece becomes a one-row chunk at its permuted place), so the
plan copies permuted rows with no tensor transformed in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from checkpoint.errors import CheckpointFormatError
from checkpoint.index import ChunkRef, CheckpointIndex, Kind, TensorEntry, TensorKey
from checkpoint.rules.names import TABLES, Naming, architectures_of, find_row, naming_of, rename, rope_rows

# meta fields holding parameter names: lists of names, lists of [name, shape], or {name: name}
_NAME_LISTS = ("module_keys", "buffer_names")
_NAME_SHAPE_LISTS = ("frozen_params",)
_TRAIN_STATE_LISTS = ("param_names",)


def param_names(index: CheckpointIndex) -> list[str]:
    """The names of the model's tensors (params, masters), in index order."""
    return list(dict.fromkeys(e.key.name for e in index.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)))


def source_naming(index: CheckpointIndex, arch: str | None = None) -> tuple[str, Naming]:
    """(architecture, naming) of `index`'s tensor names: under `arch` when given (error naming the first unknown
    name and the closest known ones), else the first table that knows every name."""
    names = param_names(index)
    if arch is not None:
        return arch, naming_of(names, arch)
    found = architectures_of(names)
    if found:
        return found[0]
    # no table knows every name: the llama table's error names the first misfit (the family most checkpoints are)
    return "llama", naming_of(names, "llama")


HeadsFn = Callable[[], tuple[int, int]]


def renamed(index: CheckpointIndex, *, arch: str, src: Naming, dst: Naming, heads: HeadsFn | None = None
            ) -> CheckpointIndex:
    """`index` with every tensor and meta name list in convention `dst`. `heads()` gives (attention heads, key/value
    heads) when a wq/wk permutation is needed (hf/canonical <-> torchtitan); each permuted tensor's chunks become
    one-row chunks. Raises CheckpointFormatError naming a tensor the table lacks."""
    if src == dst:
        return index
    permute = "torchtitan" in (src, dst)  # hf and canonical share transformers' RoPE order
    counts: tuple[int, int] | None = None
    entries = []
    for e in index.entries:
        row = find_row(e.key.name, arch, src)
        name = (_in_naming(e.key.name, row, arch, src, dst) if row is not None
                else rename(e.key.name, arch, src=src, dst=dst))  # a name the table lacks: its error
        chunks = e.chunks
        if permute and row is not None and row[0].rope and e.key.kind is not Kind.STEP:
            if counts is None:
                if heads is None:
                    raise CheckpointFormatError(f"{e.key.name}: the RoPE row order of torchtitan's wq/wk needs the "
                                                f"attention heads: pass --model-config FILE")
                counts = heads()
            n = counts[0] if row[0].rope == "q" else counts[1]
            chunks = _permuted_rows(e, rope_rows(e.shape[0], n, to=dst if dst == "torchtitan" else "hf"))
        entries.append(dataclasses.replace(e, key=TensorKey(name=name, kind=e.key.kind), chunks=chunks))
    meta = _renamed_meta(index.meta, lambda n: _rename_known(n, arch, src, dst))
    return dataclasses.replace(index, entries=tuple(entries), meta={**meta, "param_naming": dst,
                                                                   "source_param_naming": src})


def _in_naming(name: str, found: tuple[Any, dict[str, str]], arch: str, src: Naming, dst: Naming) -> str:
    """The `dst` name of `name`, from its `find_row` match (row and fields) without matching it again; rename's
    error when the `dst` convention has no such tensor."""
    row, fields = found
    template = getattr(row, dst)
    return template.format(**fields) if template is not None else rename(name, arch, src=src, dst=dst)


def _rename_known(name: str, arch: str, src: Naming, dst: Naming) -> str:
    """Meta lists may hold buffers beside parameters: a name the table lacks stays as it is there."""
    found = find_row(name, arch, src)
    return name if found is None else _in_naming(name, found, arch, src, dst)


def _renamed_meta(meta: Mapping[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    out = dict(meta)
    for k in _NAME_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [fn(n) for n in out[k]]
    for k in _NAME_SHAPE_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [[fn(n), s] for n, s in out[k]]
    if isinstance(out.get("param_groups"), list):  # DeepSpeed's [[name, shape], ...] per group
        out["param_groups"] = [[[fn(n), s] for n, s in g] for g in out["param_groups"]]
    if isinstance(out.get("shared_params"), Mapping):
        out["shared_params"] = {fn(k): fn(v) for k, v in out["shared_params"].items()}
    ts = out.get("train_state")
    if isinstance(ts, Mapping):
        ts = dict(ts)
        for k in _TRAIN_STATE_LISTS:
            if isinstance(ts.get(k), list):
                ts[k] = [fn(n) for n in ts[k]]
        if isinstance(ts.get("optimizer_group_params"), list):
            ts["optimizer_group_params"] = [[fn(n) for n in g] for g in ts["optimizer_group_params"]]
        out["train_state"] = ts
    return out


def _permuted_rows(e: TensorEntry, out_rows: Sequence[int]) -> tuple[ChunkRef, ...]:
    """The chunks of `e` re-expressed for the tensor whose row i is `e`'s row out_rows[i]: each stored row
    (or the part of it a flat range holds) becomes a one-row chunk at its new place."""
    if len(e.shape) != 2:
        raise CheckpointFormatError(f"{e.key}: RoPE row permutation needs a 2-d weight, shape is {e.shape}")
    place = {src: dst for dst, src in enumerate(out_rows)}
    out = []
    for c in e.chunks:
        (r0, c0), (nr, w) = c.offsets, c.lengths
        lo, hi = c.flat_range if c.flat_range is not None else (0, nr * w)
        for i in range(lo // w if w else 0, -(-hi // w) if w else 0):
            a, b = max(lo, i * w), min(hi, (i + 1) * w)
            if a >= b:
                continue
            partial = (a - i * w, b - i * w) if (a, b) != (i * w, (i + 1) * w) else None
            out.append(ChunkRef(file=c.file, key=c.key, offsets=(place[r0 + i], c0), lengths=(1, w),
                                flat_range=partial, storage_offset=c.storage_offset + (a - lo)))
    return tuple(out)



def architecture_hint(index: CheckpointIndex, model_config: Mapping[str, Any] | None = None) -> str | None:
    """The name table the source's own records point to (its config.json's model_type, the rules' or the
    built-in engines' architecture), else None (the names decide)."""
    from checkpoint.rules.megatron import HF_MODEL_TYPES
    from checkpoint.state.training_state import our_client_state

    meta = index.meta
    for config in (model_config, meta.get("hf_config"), our_client_state(meta).get("hf_config")):
        if isinstance(config, Mapping) and config.get("model_type") in HF_MODEL_TYPES:
            return HF_MODEL_TYPES[config["model_type"]]
    for spec in (model_config, meta.get("arch"), meta.get("model_spec"), our_client_state(meta).get("model")):
        if isinstance(spec, Mapping) and spec.get("architecture") in TABLES:
            return str(spec["architecture"])
    return meta.get("architecture") if meta.get("architecture") in TABLES else None


def attention_heads(index: CheckpointIndex, model_config: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(attention heads, key/value heads) from the model config the source records or `model_config`."""
    from checkpoint.rules.megatron import arch_from_config
    from checkpoint.state.training_state import our_client_state

    meta = index.meta
    for config in (model_config, meta.get("hf_config"), meta.get("arch"), meta.get("model_spec"),
                   our_client_state(meta).get("hf_config"), our_client_state(meta).get("model")):
        if isinstance(config, Mapping):
            spec = arch_from_config(config, where=f"{index.root}: model config")
            return spec.num_attention_heads, spec.num_query_groups
    raise CheckpointFormatError(f"{index.root}: torchtitan's wq/wk rows are in another RoPE order than "
                                f"transformers'; permuting them needs the attention heads: pass --model-config FILE")


def named_for_target(index: CheckpointIndex, *, target_names: str, want: Naming | None = None,
                     arch: str | None = None, model_config: Mapping[str, Any] | None = None) -> CheckpointIndex:
    """`index` as a target builder takes it: canonical names for builders that map names themselves
    (`target_names == "canonical"`), else the `want` convention when asked, else unchanged. A source whose names
    no table holds is left as it is when nothing asks for a convention (its own writer judges it)."""
    dst: Naming | None = "canonical" if target_names == "canonical" else want
    if dst is None:
        return index
    hint = arch if arch in TABLES else architecture_hint(index, model_config)
    names = param_names(index)
    if not names:
        return index
    if want is None:
        found = [(a, n) for a, n in architectures_of(names) if hint is None or a == hint]
        if not found:
            return index
        table, src = found[0]
    else:
        table, src = source_naming(index, hint)
    out = renamed(index, arch=table, src=src, dst=dst, heads=lambda: attention_heads(index, model_config))
    return tied_head_as_one(out) if dst == "canonical" else out


TIED_HEAD = {"lm_head.weight": "embed_tokens.weight"}


def tied_head_as_one(index: CheckpointIndex) -> CheckpointIndex:
    """A source whose only shared parameter is the LM head tied to the embedding (DeepSpeed's `shared_params` of a
    model with tie_word_embeddings) as the canonical writers hold a tied model: the embedding alone, no alias."""
    if dict(index.meta.get("shared_params") or {}) != TIED_HEAD:
        return index
    meta = {k: v for k, v in index.meta.items() if k != "shared_params"}
    return dataclasses.replace(index, meta=meta | {"tied_head": True})
