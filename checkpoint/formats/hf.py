"""Hugging Face safetensors weights: reader and writer; names through the tables of `checkpoint.rules.names`.

Weights only: a HF checkpoint holds no optimizer state, so converting it into a training format
gives a weights-only target (the plan summary says so). Canonical names are the built-in decoder's
(`layers.0.self_attn.q_proj.weight`, the names DeepSpeed and DCP checkpoints carry); the map turns
them into the HF names of `llama` (LlamaForCausalLM), `mixtral` (MixtralForCausalLM, the per-expert
w1/w2/w3 names `save_pretrained` writes) and `gpt` (Starcoder2ForCausalLM with use_bias=False: rotary,
LayerNorm, non-gated GELU MLP). Files: `model.safetensors` or shards listed in
`model.safetensors.index.json`, beside `config.json` (the architecture is read from it). The writer writes
what `save_pretrained` writes: the weights split into shards of at most `--max-shard-size` (huggingface_hub's
`split_torch_state_dict_into_shards`, as transformers calls it) with the index when there are several, each
streamed tensor by tensor in the layout `safetensors.torch.save` gives (same header, same tensor order, same
bytes), `generation_config.json` when the source had one, and `config.json` last (`from_pretrained`'s entry
point, so it is the commit point).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from checkpoint.errors import CheckpointFormatError, PlanError
from checkpoint.io.buffers import bytes_of
from checkpoint.io.sources import SAFETENSORS
from checkpoint.write import StreamPayload
from checkpoint.formats.base import CheckpointFormat, ReadOptions, TargetOptions, refuse_shared_params
from checkpoint.formats.hf_config import check_config, config_json, fields_from_megatron_args, fields_from_model_shape
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey
from checkpoint.paths import inside
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec, ValueItem, ValueRole, WriteMode
from checkpoint.rules.megatron import HF_MODEL_TYPES, arch_from_config
from checkpoint.rules.names import TABLES, rename
from checkpoint.state.training_state import CLIENT_STATE_KEY, our_client_state

FORMAT = "hf"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
ARCH_KEY = "migrate_architecture"

def is_hf_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / WEIGHTS).is_file() or (path / INDEX).is_file())


def _files(root: Path) -> list[str]:
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise CheckpointFormatError(f"{root / INDEX}: no readable weight_map ({err})") from err
        if not isinstance(weight_map, dict):
            raise CheckpointFormatError(f"{root / INDEX}: weight_map is {type(weight_map).__name__}, not a mapping")
        files = sorted({str(f) for f in weight_map.values()})
        for f in files:
            inside(root, f, what=f"{root / INDEX}: weight_map")
    else:
        files = [WEIGHTS]
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise CheckpointFormatError(f"{root}: safetensors files {missing} are missing")
    return files


def json_object_file(path: Path) -> dict[str, Any] | None:
    """A JSON object file's content; None when the file is absent."""
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(content, dict):
        raise CheckpointFormatError(f"{path}: holds a JSON {type(content).__name__}, not an object")
    return content


def _architecture(root: Path, config: Mapping[str, Any] | None, header: Mapping[str, str], names: list[str]) -> str:
    """The name map of the weights: config.json's model_type, else our header entry, else by the names."""
    if config is not None:
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise CheckpointFormatError(f"{root / CONFIG}: model_type {model_type!r} has no name map; known: "
                                        f"{sorted(HF_MODEL_TYPES)}")
        return HF_MODEL_TYPES[model_type]
    if header.get(ARCH_KEY) in TABLES:
        return header[ARCH_KEY]
    if any(".block_sparse_moe." in n for n in names):
        return "mixtral"
    if any(n.endswith(".self_attn.q_norm.weight") for n in names):
        return "qwen3_moe" if any(".mlp.experts." in n for n in names) else "qwen3"
    if any(n.endswith(".self_attn.q_proj.bias") for n in names):
        return "qwen2"
    return "gpt" if any(".mlp.c_fc." in n for n in names) else "llama"


def read_hf(path: str | Path) -> CheckpointIndex:
    """Index safetensors weights from the file headers (no tensor data read) as canonical params; the
    architecture from `config.json` (kept whole in meta `hf_config`, with `generation_config.json`)."""
    from safetensors import safe_open

    root = Path(path)
    config = json_object_file(root / CONFIG)
    generation = json_object_file(root / GENERATION_CONFIG)
    files = _files(root)
    found: list[tuple[str, str, tuple[int, ...], str]] = []
    header: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(root / f), framework="pt", device="cpu") as st:
                header.update(st.metadata() or {})
                for k in st.keys():
                    sl = st.get_slice(k)
                    found.append((f, k, tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), root / f, k)))
        except (OSError, Exception) as err:  # safetensors raises SafetensorError on a bad header
            if isinstance(err, CheckpointFormatError):
                raise
            raise CheckpointFormatError(f"{root / f}: unreadable safetensors file: {err}") from err
    arch = _architecture(root, config, header, [k for _, k, _, _ in found])
    entries = [TensorEntry(key=TensorKey(name=rename(k, arch, src="hf", dst="canonical"), kind=Kind.PARAM), shape=shape, dtype=dt,
                           chunks=(ChunkRef(file=f, key=(SAFETENSORS, k), offsets=(0,) * len(shape), lengths=shape),))
               for f, k, shape, dt in found]
    dtype = entries[0].dtype if entries else "float32"
    meta: dict[str, Any] = {
        "architecture": arch, "dtype": dtype, "dp": 1,
        "train_state": {"step": None, "lr_scheduler": None,
                        "client": {CLIENT_STATE_KEY: {"hf_config": config}} if config is not None else {},
                        "param_names": [e.key.name for e in entries], "optimizer_param_groups": [],
                        "optimizer_group_params": []}}
    if config is not None:
        meta["hf_config"] = config
        try:  # the rules' architecture (Megatron targets); a model they cannot map is named when one is asked for
            spec = arch_from_config(config, where=str(root / CONFIG))
            # a Megatron target pads the vocabulary as Megatron-LM does by default (--make-vocab-size-divisible-by
            # 128 times tp); a job YAML given as --model-config says otherwise
            meta["arch"] = {f: getattr(spec, f) for f in spec.__dataclass_fields__} | {
                "make_vocab_size_divisible_by": 128}
        except CheckpointFormatError:
            pass
    if generation is not None:
        meta["generation_config"] = generation
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=tuple(files) + tuple(
        f for f in (CONFIG, GENERATION_CONFIG) if (root / f).is_file()), meta=meta)


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _st_dtype(code: str, file: Path, name: str) -> str:
    try:
        return _ST_DTYPES[code]
    except KeyError:
        raise CheckpointFormatError(f"{file}: tensor {name} has unsupported dtype {code}") from None


def _client_model(source: CheckpointIndex) -> Mapping[str, Any] | None:
    """The model shape the built-in engines save (ModelShape fields): as a Megatron reader found it (meta
    `model_spec`), else in the client state (DeepSpeed, DCP); None when there is none."""
    if isinstance(source.meta.get("model_spec"), Mapping):
        return source.meta["model_spec"]
    model = our_client_state(source.meta).get("model")
    return model if isinstance(model, Mapping) else None


def target_config(source: CheckpointIndex, model_config: Mapping[str, Any] | None, *, vocab_rows: int,
                  dtype: str) -> tuple[dict[str, Any], str]:
    """The target's `config.json` and where it came from: a given HF config as it is, or one built from given
    ModelShape-style fields; else the source's own config.json; else built from Megatron-LM's args or the
    built-in engines' model shape. Raises PlanError naming what is missing."""
    if model_config is not None:
        if "model_type" in model_config:
            return dict(model_config), "--model-config"
        fields = fields_from_model_shape(model_config, origin="--model-config")
    elif source.meta.get("hf_config"):
        return dict(source.meta["hf_config"]), f"{source.root}/{CONFIG}"
    elif (carried := our_client_state(source.meta).get("hf_config")) is not None:  # an HF start converted on
        return dict(carried), f"{source.root}: the config.json of the HF checkpoint it was converted from"
    elif source.meta.get("megatron_args"):
        fields = fields_from_megatron_args(source.meta["megatron_args"], origin=f"{source.root}: Megatron-LM args")
    elif (model := _client_model(source)) is not None:
        fields = fields_from_model_shape(model, origin=f"{source.root}: {CLIENT_STATE_KEY}.model")
    else:
        raise PlanError(f"source {source.root} ({source.format}) does not record the model's configuration (norm "
                        f"epsilon, RoPE base, heads) that the HF config.json needs: pass --model-config FILE (an HF "
                        f"config.json or the job YAML's model section)")
    return config_json(fields, vocab_rows=vocab_rows, dtype=dtype), fields.origin


def _shards(tensors: Sequence[tuple[str, str, tuple[int, ...]]], max_shard_size: int | str
            ) -> dict[str, list[str]]:
    """File name -> HF tensor names, as `save_pretrained` splits them (huggingface_hub, in tensor order)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {n: torch.empty(shape, dtype=getattr(torch, dt), device="meta") for n, dt, shape in tensors}
    try:
        split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
    except ValueError as err:
        raise PlanError(f"--max-shard-size {max_shard_size!r}: {err}") from None
    return dict(split.filename_to_tensors)


def hf_target(source: CheckpointIndex, *, arch: str | None = None, model_config: Mapping[str, Any] | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> TargetSpec:
    """Every parameter of `source` under its HF name, in the model dtype (params from fp32 masters when the
    source keeps only those, e.g. ZeRO-3), in shards of at most `max_shard_size` (an index when several),
    with the `config.json` `target_config` gives, checked against the weights (a tied model has no lm_head and
    says tie_word_embeddings)."""
    refuse_shared_params(source, "hf")
    dtype = source.meta.get("dtype", "float32")
    names = list(dict.fromkeys(e.key.name for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)))
    shapes = {e.key.name: e.shape for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)}
    params = {e.key.name: e for e in source.entries if e.key.kind is Kind.PARAM}
    embed = shapes.get("embed_tokens.weight")
    if embed is None:
        raise PlanError(f"source {source.root} ({source.format}) has no embed_tokens.weight: not a decoder the HF "
                        f"classes hold")
    dtypes = {n: params[n].dtype if n in params else dtype for n in names}
    model_dtype = max(set(dtypes.values()), key=list(dtypes.values()).count)
    config, origin = target_config(source, model_config, vocab_rows=embed[0], dtype=model_dtype)
    arch = arch or HF_MODEL_TYPES.get(str(config.get("model_type")))
    if arch not in TABLES:
        raise PlanError(f"{origin}: model_type {config.get('model_type')!r} has no HF name map; known: "
                        f"{sorted(HF_MODEL_TYPES)}")
    layers = {m.group(1) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}
    check_config(config, arch=arch, num_layers=len(layers), hidden_size=embed[1], vocab_rows=embed[0], where=origin)
    tied = bool(config.get("tie_word_embeddings", arch == "gpt"))  # Starcoder2 ties by default
    if tied == ("lm_head.weight" in names):
        raise PlanError(f"{origin}: tie_word_embeddings={tied} but the source {source.root} "
                        f"{'has' if tied else 'has no'} a separate lm_head.weight")
    hf_names = {name: rename(name, arch, src="canonical", dst="hf") for name in names}
    by_hf = {hf: name for name, hf in hf_names.items()}
    shards = _shards([(hf_names[n], dtypes[n], shapes[n]) for n in names], max_shard_size)
    sharded = len(shards) > 1
    entries, files, weight_map = [], [], {}
    for path, members in (shards.items() if sharded else [(WEIGHTS, next(iter(shards.values())))]):
        buffers = []
        for hf_name in members:
            name = by_hf[hf_name]
            key = (SAFETENSORS, hf_name)
            buffers.append(TargetBuffer(key=key, shape=shapes[name], dtype=dtypes[name]))
            entries.append(TensorEntry(key=TensorKey(name=name, kind=Kind.PARAM), shape=shapes[name],
                                       dtype=dtypes[name], chunks=(ChunkRef(file=path, key=key,
                                                                            offsets=(0,) * len(shapes[name]),
                                                                            lengths=shapes[name]),)))
            weight_map[hf_name] = path
        files.append(TargetFile(path=path, role="weights", rank=None, buffers=tuple(buffers)))
    generation = source.meta.get("generation_config")
    finals = {}
    if sharded:
        total = sum(b.nbytes for f in files for b in f.buffers)
        numel = sum(math.prod(b.shape) for f in files for b in f.buffers)
        finals[INDEX] = {"metadata": {"total_parameters": numel, "total_size": total}, "weight_map": weight_map}
    if generation:
        finals[GENERATION_CONFIG] = dict(generation)
    finals[CONFIG] = config  # last: from_pretrained starts here
    meta = {"architecture": arch, "dtype": dtype, "dp": 1, "weights_only": True, "hf_config_origin": origin}
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(entries), files=tuple(f.path for f in files),
                            meta=meta)
    described = tuple(TargetFile(path=path, role="json", rank=None, values=(ValueItem(key=(), role=ValueRole.OBJECT,
                                                                                      value=content),))
                      for path, content in finals.items())
    return TargetSpec(index=index, files=tuple(files), commit=tuple(finals), described=described,
                      write_mode=WriteMode.STREAMING)


_ST_CODES = {v: k for k, v in _ST_DTYPES.items()} | {"uint16": "U16", "uint32": "U32", "uint64": "U64"}
# safetensors stores tensors by dtype (its Dtype enum, largest first), then by name: the order kept here
_ST_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8", "BOOL")


def safetensors_spans(tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]
                       ) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The header bytes (length prefix included) of a safetensors file holding `tensors` (name, dtype,
    shape) and, in file order, each tensor's (name, data begin, data end) relative to the data section."""
    for name, dtype, _ in tensors:
        if dtype not in _ST_CODES:
            raise PlanError(f"safetensors cannot store tensor {name!r} of dtype {dtype}")
    ordered = sorted(tensors, key=lambda t: (_ST_ORDER.index(_ST_CODES[t[1]]), t[0]))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    spans, pos = [], 0
    for name, dtype, shape in ordered:
        end = pos + math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        header[name] = {"dtype": _ST_CODES[dtype], "shape": list(shape), "data_offsets": [pos, end]}
        spans.append((name, pos, end))
        pos = end
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, spans


def json_file_bytes(value: Any) -> bytes:
    """A JSON file as `save_pretrained` and the Trainer write them: keys sorted, indented by 2, a final newline."""
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


@dataclass(frozen=True, kw_only=True, slots=True)
class HFWriter:
    """Writes the weights as safetensors (architecture in the header metadata), streaming: the header
    first (shapes and dtypes are known from the plan), then each tensor's bytes as it is filled."""

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role == "json":  # the index (when sharded), generation_config.json, config.json
            return json_file_bytes(file.values[0].value)
        if file.role != "weights":
            raise PlanError(f"HF writer: unknown file role {file.role!r} for {file.path}")
        keys = {b.key[1]: b for b in file.buffers}
        header, spans = safetensors_spans([(n, b.dtype, tuple(b.shape)) for n, b in keys.items()],
                                           {"format": "pt", ARCH_KEY: meta["architecture"]})

        def write(stream: BinaryIO) -> None:
            stream.write(header)
            for name, begin, end in spans:
                t = buffers[keys[name].key]
                data = bytes_of(t.contiguous().reshape(-1))
                if len(data) != end - begin:
                    raise PlanError(f"{file.path}: tensor {name!r} filled with {len(data)} bytes, the header says "
                                    f"{end - begin}")
                stream.write(data)
                del t, data

        return StreamPayload(write=write)


def _read(path: Path, opts: ReadOptions) -> CheckpointIndex:
    return read_hf(path)


def _target(index: CheckpointIndex, opts: TargetOptions) -> TargetSpec:
    if (opts.layout.dp or 1, opts.layout.tp or 1, opts.layout.pp or 1, opts.layout.ep or 1) != (1, 1, 1, 1):
        raise PlanError(f"HF safetensors hold unsharded weights: no dp/tp/pp/ep; got dp={opts.layout.dp} tp={opts.layout.tp} "
                        f"pp={opts.layout.pp} ep={opts.layout.ep}")
    return hf_target(index, arch=opts.arch, model_config=opts.model_config,
                     max_shard_size=opts.max_shard_size or DEFAULT_MAX_SHARD_SIZE)


SPEC = CheckpointFormat(name=FORMAT,
                        description="Hugging Face save_pretrained folders (config.json, sharded safetensors; llama, mixtral, "
                                    "starcoder2, qwen2, qwen3, qwen3_moe)",
                        detect=is_hf_checkpoint, read=_read, target=_target, writer=HFWriter(), names="canonical")
