"""Hugging Face safetensors weights: reader and writer, with a parameter-name map per architecture.

Weights only: a HF checkpoint holds no optimizer state, so converting it into a training format
gives a weights-only target (the plan summary says so). Canonical names are the built-in decoder's
(`layers.0.self_attn.q_proj.weight`, the names DeepSpeed and DCP checkpoints carry); the map turns
them into the HF names of `llama` (LlamaForCausalLM), `mixtral` (MixtralForCausalLM) and `gpt`
(GPTNeoForCausalLM naming: separate q/k/v, LayerNorm, non-gated MLP). Files: `model.safetensors`
or shards listed in `model.safetensors.index.json`; the writer writes one `model.safetensors`
whose header metadata records the architecture, streaming it tensor by tensor in the layout
`safetensors.torch.save` gives (same header, same tensor order, same bytes; metadata keys sorted).
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
from checkpoint.execute import SAFETENSORS, StreamPayload
from checkpoint.formats.base import CheckpointFormat, ReadOptions, TargetOptions, refuse_tied_embeddings
from checkpoint.index import CheckpointIndex, ChunkRef, Kind, KeyPath, TensorEntry, TensorKey
from checkpoint.paths import inside
from checkpoint.plan import TargetBuffer, TargetFile, TargetSpec

FORMAT = "hf"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ARCH_KEY = "migrate_architecture"

_LLAMA = [
    ("embed_tokens.{P}", "model.embed_tokens.{P}"),
    ("layers.{L}.{R}", "model.layers.{L}.{R}"),
    ("norm.{P}", "model.norm.{P}"),
    ("lm_head.{P}", "lm_head.{P}"),
]
_MIXTRAL = [
    ("layers.{L}.mlp.gate.{P}", "model.layers.{L}.block_sparse_moe.gate.{P}"),
    ("layers.{L}.mlp.experts.{E}.gate_proj.{P}", "model.layers.{L}.block_sparse_moe.experts.{E}.w1.{P}"),
    ("layers.{L}.mlp.experts.{E}.down_proj.{P}", "model.layers.{L}.block_sparse_moe.experts.{E}.w2.{P}"),
    ("layers.{L}.mlp.experts.{E}.up_proj.{P}", "model.layers.{L}.block_sparse_moe.experts.{E}.w3.{P}"),
    *_LLAMA,
]
_GPT = [
    ("embed_tokens.{P}", "transformer.wte.{P}"),
    ("layers.{L}.input_layernorm.{P}", "transformer.h.{L}.ln_1.{P}"),
    ("layers.{L}.post_attention_layernorm.{P}", "transformer.h.{L}.ln_2.{P}"),
    ("layers.{L}.self_attn.o_proj.{P}", "transformer.h.{L}.attn.attention.out_proj.{P}"),
    ("layers.{L}.self_attn.{Q}_proj.{P}", "transformer.h.{L}.attn.attention.{Q}_proj.{P}"),
    ("layers.{L}.mlp.up_proj.{P}", "transformer.h.{L}.mlp.c_fc.{P}"),
    ("layers.{L}.mlp.down_proj.{P}", "transformer.h.{L}.mlp.c_proj.{P}"),
    ("norm.{P}", "transformer.ln_f.{P}"),
    ("lm_head.{P}", "lm_head.{P}"),
]
NAME_MAPS: dict[str, list[tuple[str, str]]] = {"llama": _LLAMA, "mixtral": _MIXTRAL, "gpt": _GPT}
_HF_MODEL_TYPES = {"llama": "llama", "mixtral": "mixtral", "gpt_neo": "gpt"}
_FIELD = {"L": r"\d+", "E": r"\d+", "P": r"weight|bias", "Q": r"[qkv]", "R": r".+"}


def _regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[A-Z]\})", template)
    body = "".join(f"(?P<{p[1]}>{_FIELD[p[1]]})" if re.fullmatch(r"\{[A-Z]\}", p) else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


def rename(name: str, arch: str, *, to_hf: bool) -> str:
    """Canonical -> HF name (to_hf) or back, by the first matching rule of `arch`'s map."""
    if arch not in NAME_MAPS:
        raise PlanError(f"no HF name map for architecture {arch!r}; known: {sorted(NAME_MAPS)}")
    for canonical, hf in NAME_MAPS[arch]:
        src, dst = (canonical, hf) if to_hf else (hf, canonical)
        m = _regex(src).match(name)
        if m:
            return dst.format(**m.groupdict())
    side = "canonical" if to_hf else "HF"
    raise CheckpointFormatError(f"{side} parameter {name!r} has no rule in the {arch} name map")


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


def _architecture(root: Path, header: Mapping[str, str], names: list[str]) -> str:
    if (root / "config.json").is_file():
        try:
            config = json.loads((root / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise CheckpointFormatError(f"{root / 'config.json'}: not valid JSON ({err})") from err
        model_type = config.get("model_type") if isinstance(config, dict) else None
        if model_type in _HF_MODEL_TYPES:
            return _HF_MODEL_TYPES[model_type]
    if header.get(ARCH_KEY) in NAME_MAPS:
        return header[ARCH_KEY]
    if any(".block_sparse_moe." in n for n in names):
        return "mixtral"
    return "gpt" if any(n.startswith("transformer.h.") for n in names) else "llama"


def read_hf(path: str | Path) -> CheckpointIndex:
    """Index safetensors weights from the file headers (no tensor data read) as canonical params."""
    from safetensors import safe_open

    root = Path(path)
    found: list[tuple[str, str, tuple[int, ...], str]] = []
    header: dict[str, str] = {}
    for f in _files(root):
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
    arch = _architecture(root, header, [k for _, k, _, _ in found])
    entries = [TensorEntry(key=TensorKey(name=rename(k, arch, to_hf=False), kind=Kind.PARAM), shape=shape, dtype=dt,
                           chunks=(ChunkRef(file=f, key=(SAFETENSORS, k), offsets=(0,) * len(shape), lengths=shape),))
               for f, k, shape, dt in found]
    dtype = entries[0].dtype if entries else "float32"
    meta = {"architecture": arch, "dtype": dtype, "dp": 1,
            "train_state": {"step": None, "lr_scheduler": None, "client": {},
                            "param_names": [e.key.name for e in entries], "optimizer_param_groups": [],
                            "optimizer_group_params": []}}
    return CheckpointIndex(format=FORMAT, root=str(root), entries=tuple(entries), files=tuple(_files(root)), meta=meta)


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _st_dtype(code: str, file: Path, name: str) -> str:
    try:
        return _ST_DTYPES[code]
    except KeyError:
        raise CheckpointFormatError(f"{file}: tensor {name} has unsupported dtype {code}") from None


def hf_target(source: CheckpointIndex, *, arch: str | None) -> TargetSpec:
    """One `model.safetensors` with every parameter of `source` under its HF name, in the model dtype
    (params from fp32 masters when the source keeps only those, e.g. ZeRO-3)."""
    refuse_tied_embeddings(source, "hf")
    arch = arch or source.meta.get("architecture") or "llama"
    if arch not in NAME_MAPS:
        raise PlanError(f"no HF name map for architecture {arch!r}; known: {sorted(NAME_MAPS)}")
    dtype = source.meta.get("dtype", "float32")
    names = list(dict.fromkeys(e.key.name for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)))
    shapes = {e.key.name: e.shape for e in source.entries if e.key.kind in (Kind.PARAM, Kind.MASTER)}
    params = {e.key.name: e for e in source.entries if e.key.kind is Kind.PARAM}
    entries, buffers = [], []
    for name in names:
        dt = params[name].dtype if name in params else dtype
        hf_name = rename(name, arch, to_hf=True)
        key = (SAFETENSORS, hf_name)
        buffers.append(TargetBuffer(key=key, shape=shapes[name], dtype=dt))
        entries.append(TensorEntry(key=TensorKey(name=name, kind=Kind.PARAM), shape=shapes[name], dtype=dt,
                                   chunks=(ChunkRef(file=WEIGHTS, key=key, offsets=(0,) * len(shapes[name]),
                                                    lengths=shapes[name]),)))
    file = TargetFile(path=WEIGHTS, role="weights", rank=None, buffers=tuple(buffers))
    meta = {"architecture": arch, "dtype": dtype, "dp": 1, "weights_only": True}
    index = CheckpointIndex(format=FORMAT, root="", entries=tuple(entries), files=(WEIGHTS,), meta=meta)
    return TargetSpec(index=index, files=(file,))


_ST_CODES = {v: k for k, v in _ST_DTYPES.items()} | {"uint16": "U16", "uint32": "U32", "uint64": "U64"}
# safetensors stores tensors by dtype (its Dtype enum, largest first), then by name: the order kept here
_ST_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8", "BOOL")


def safetensors_layout(tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]
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


@dataclass(frozen=True, kw_only=True, slots=True)
class HFWriter:
    """Writes the weights as safetensors (architecture in the header metadata), streaming: the header
    first (shapes and dtypes are known from the plan), then each tensor's bytes as it is filled."""

    streaming: bool = True

    def assemble(self, file: TargetFile, buffers: Mapping[KeyPath, torch.Tensor], meta: Mapping[str, Any]) -> Any:
        if file.role != "weights":
            raise PlanError(f"HF writer: unknown file role {file.role!r} for {file.path}")
        keys = {b.key[1]: b for b in file.buffers}
        header, spans = safetensors_layout([(n, b.dtype, tuple(b.shape)) for n, b in keys.items()],
                                           {"format": "pt", ARCH_KEY: meta["architecture"]})

        def write(stream: BinaryIO) -> None:
            stream.write(header)
            for name, begin, end in spans:
                t = buffers[keys[name].key]
                data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                if len(data) != end - begin:
                    raise PlanError(f"{file.path}: tensor {name!r} filled with {len(data)} bytes, the header says "
                                    f"{end - begin}")
                stream.write(data)
                del t, data

        return StreamPayload(write=write)


def _read(path: Path, opts: ReadOptions) -> CheckpointIndex:
    return read_hf(path)


def _target(index: CheckpointIndex, opts: TargetOptions) -> TargetSpec:
    if (opts.dp or 1, opts.tp or 1, opts.pp or 1, opts.ep or 1) != (1, 1, 1, 1):
        raise PlanError(f"HF safetensors hold unsharded weights: no dp/tp/pp/ep; got dp={opts.dp} tp={opts.tp} "
                        f"pp={opts.pp} ep={opts.ep}")
    return hf_target(index, arch=opts.arch)


SPEC = CheckpointFormat(name=FORMAT, description="Hugging Face safetensors weights (llama, mixtral, gpt names)",
                        detect=is_hf_checkpoint, read=_read, target=_target, writer=HFWriter())
