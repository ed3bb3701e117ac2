"""Parameter names as data: per architecture, one row per model tensor naming it in every convention.

Conventions (`Naming`): `canonical`, the built-in decoder's names (`layers.0.self_attn.q_proj.weight`) that
the Megatron rules and the HF writer map from; `hf`, transformers' module names (`model.layers.0...`,
`lm_head.weight`; Mixtral's `block_sparse_moe.experts.N.w1`, Starcoder2's `mlp.c_fc`, Qwen2's q/k/v biases,
Qwen3's `self_attn.q_norm`, DeepSeek-V3's `self_attn.kv_a_proj_with_mqa`), as `save_pretrained`,
an HF-Trainer DeepSpeed run or an FSDP2-wrapped transformers model store them; `torchtitan`, torchtitan's
Llama (`tok_embeddings`, `attention.wq`, `feed_forward.w1`, `output`), whose wq/wk rows are in Meta's
interleaved RoPE order: torchtitan's `Llama3StateDictAdapter` permutes them to and from transformers' order
(`rope_rows`); torchtitan's Qwen3 (`attention.q_norm`), whose rows are in transformers' order. Templates hold
`{L}` (layer), `{E}` (expert) and `{P}` (weight|bias). A name no row holds is an error naming it and the closest
known names.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from checkpoint.errors import CheckpointFormatError

Naming = Literal["canonical", "hf", "torchtitan"]
NAMINGS: tuple[Naming, ...] = ("canonical", "hf", "torchtitan")
RopeRows = Literal["", "q", "kv"]


@dataclass(frozen=True, slots=True)
class NameRow:
    """One tensor's name in each convention (None: that convention has no such tensor); `rope` says whether
    its rows are per query head (`q`) or per key/value head (`kv`) and permuted between hf and torchtitan."""

    canonical: str
    hf: str
    torchtitan: str | None = None
    rope: RopeRows = ""


def _attention(norm: str, *, interleaved_rope: bool = True) -> tuple[NameRow, ...]:
    """`interleaved_rope`: torchtitan's model of the family rotates interleaved pairs (its Llama 3), so its wq/wk
    rows are permuted against transformers'; off where it rotates halves as transformers does (its Qwen3)."""
    return (
        NameRow(f"layers.{{L}}.input_layernorm.{norm}", f"model.layers.{{L}}.input_layernorm.{norm}",
                f"layers.{{L}}.attention_norm.{norm}"),
        NameRow("layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.q_proj.weight",
                "layers.{L}.attention.wq.weight", rope="q" if interleaved_rope else ""),
        NameRow("layers.{L}.self_attn.k_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
                "layers.{L}.attention.wk.weight", rope="kv" if interleaved_rope else ""),
        NameRow("layers.{L}.self_attn.v_proj.weight", "model.layers.{L}.self_attn.v_proj.weight",
                "layers.{L}.attention.wv.weight"),
        NameRow("layers.{L}.self_attn.o_proj.weight", "model.layers.{L}.self_attn.o_proj.weight",
                "layers.{L}.attention.wo.weight"),
        NameRow(f"layers.{{L}}.post_attention_layernorm.{norm}", f"model.layers.{{L}}.post_attention_layernorm.{norm}",
                f"layers.{{L}}.ffn_norm.{norm}"),
    )


def _ends(norm: str) -> tuple[NameRow, ...]:
    return (NameRow("embed_tokens.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
            NameRow(f"norm.{norm}", f"model.norm.{norm}", f"norm.{norm}"),
            NameRow("lm_head.weight", "lm_head.weight", "output.weight"))


def _llama_mlp() -> tuple[NameRow, ...]:
    return (NameRow("layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.gate_proj.weight",
                    "layers.{L}.feed_forward.w1.weight"),
            NameRow("layers.{L}.mlp.up_proj.weight", "model.layers.{L}.mlp.up_proj.weight",
                    "layers.{L}.feed_forward.w3.weight"),
            NameRow("layers.{L}.mlp.down_proj.weight", "model.layers.{L}.mlp.down_proj.weight",
                    "layers.{L}.feed_forward.w2.weight"))


def _without_torchtitan(rows: Iterable[NameRow]) -> tuple[NameRow, ...]:
    return tuple(NameRow(r.canonical, r.hf) for r in rows)


TABLES: dict[str, tuple[NameRow, ...]] = {
    # LlamaForCausalLM / MistralForCausalLM; torchtitan's Llama 3
    "llama": (*_attention("weight"), *_llama_mlp(), *_ends("weight")),
    # MixtralForCausalLM (per-expert w1/w2/w3 as save_pretrained writes them); torchtitan stacks its experts
    # into one grouped tensor, which is not a renaming
    "mixtral": _without_torchtitan((
        *_attention("weight"),
        NameRow("layers.{L}.mlp.gate.weight", "model.layers.{L}.block_sparse_moe.gate.weight"),
        NameRow("layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight"),
        NameRow("layers.{L}.mlp.experts.{E}.down_proj.weight", "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"),
        NameRow("layers.{L}.mlp.experts.{E}.up_proj.weight", "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight"),
        *_ends("weight"))),
    # Qwen2ForCausalLM: Llama with q/k/v biases
    "qwen2": _without_torchtitan((
        *(r for r in _attention("weight") if "o_proj" not in r.canonical and "post_attention" not in r.canonical),
        *(NameRow(f"layers.{{L}}.self_attn.{q}_proj.bias", f"model.layers.{{L}}.self_attn.{q}_proj.bias")
          for q in ("q", "k", "v")),
        *(r for r in _attention("weight") if "o_proj" in r.canonical or "post_attention" in r.canonical),
        *_llama_mlp(), *_ends("weight"))),
    # Qwen3ForCausalLM: Llama with per-head q/k RMSNorm; torchtitan's Qwen3 (its v0.2 `Qwen3StateDictAdapter`
    # names, RoPE by halves as transformers': no row permutation)
    "qwen3": (
        *_attention("weight", interleaved_rope=False),
        *(NameRow(f"layers.{{L}}.self_attn.{q}_norm.weight", f"model.layers.{{L}}.self_attn.{q}_norm.weight",
                  f"layers.{{L}}.attention.{q}_norm.weight") for q in ("q", "k")),
        *_llama_mlp(), *_ends("weight")),
    # Qwen3MoeForCausalLM (per-expert gate/up/down as save_pretrained writes them): Qwen3 attention, routed experts;
    # torchtitan stacks its experts into grouped tensors (`moe.experts.w1`), which is not a renaming
    "qwen3_moe": _without_torchtitan((
        *_attention("weight"),
        *(NameRow(f"layers.{{L}}.self_attn.{q}_norm.weight", f"model.layers.{{L}}.self_attn.{q}_norm.weight")
          for q in ("q", "k")),
        NameRow("layers.{L}.mlp.gate.weight", "model.layers.{L}.mlp.gate.weight"),
        *(NameRow(f"layers.{{L}}.mlp.experts.{{E}}.{w}_proj.weight", f"model.layers.{{L}}.mlp.experts.{{E}}.{w}_proj.weight")
          for w in ("gate", "up", "down")),
        *_ends("weight"))),
    # DeepseekV3ForCausalLM (per-expert gate/up/down as save_pretrained writes them): MLA (q a/b projections and
    # norm, or one q projection; kv a projection with the shared rotary key, its norm, kv b projection), dense MLPs
    # in the first-k layers, then the router with its expert bias, routed and shared experts
    "deepseek_v3": _without_torchtitan((
        *(r for r in _attention("weight") if "norm" in r.canonical or "o_proj" in r.canonical or "q_proj" in r.canonical),
        *(NameRow(f"layers.{{L}}.self_attn.{n}.weight", f"model.layers.{{L}}.self_attn.{n}.weight")
          for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")),
        *_llama_mlp(),
        NameRow("layers.{L}.mlp.gate.weight", "model.layers.{L}.mlp.gate.weight"),
        NameRow("layers.{L}.mlp.gate.e_score_correction_bias", "model.layers.{L}.mlp.gate.e_score_correction_bias"),
        *(NameRow(f"layers.{{L}}.mlp.experts.{{E}}.{w}_proj.weight", f"model.layers.{{L}}.mlp.experts.{{E}}.{w}_proj.weight")
          for w in ("gate", "up", "down")),
        *(NameRow(f"layers.{{L}}.mlp.shared_experts.{w}_proj.weight",
                  f"model.layers.{{L}}.mlp.shared_experts.{w}_proj.weight") for w in ("gate", "up", "down")),
        *_ends("weight"))),
    # Starcoder2ForCausalLM with use_bias=False: LayerNorm (weight and bias), non-gated MLP c_fc/c_proj
    "gpt": _without_torchtitan((
        *(r for p in ("weight", "bias") for r in _attention(p) if "norm" in r.canonical),
        *(r for r in _attention("weight") if "norm" not in r.canonical),
        NameRow("layers.{L}.mlp.up_proj.weight", "model.layers.{L}.mlp.c_fc.weight"),
        NameRow("layers.{L}.mlp.down_proj.weight", "model.layers.{L}.mlp.c_proj.weight"),
        *_ends("weight"), *(r for r in _ends("bias") if "norm" in r.canonical))),
}

_FIELDS = {"L": r"\d+", "E": r"\d+", "P": r"weight|bias"}


@functools.cache
def _regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[A-Z]\})", template)
    body = "".join(f"(?P<{p[1]}>{_FIELDS[p[1]]})" if re.fullmatch(r"\{[A-Z]\}", p) else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


def _table(arch: str) -> tuple[NameRow, ...]:
    if arch not in TABLES:
        raise CheckpointFormatError(f"no name table for architecture {arch!r}; known: {sorted(TABLES)}")
    return TABLES[arch]


def find_row(name: str, arch: str, naming: Naming) -> tuple[NameRow, dict[str, str]] | None:
    """The row whose `naming` template matches `name`, with the matched fields; None when none does."""
    for row in _table(arch):
        template = getattr(row, naming)
        if template is not None and (m := _regex(template).match(name)):
            return row, m.groupdict()
    return None


def closest_names(name: str, arch: str, naming: Naming, n: int = 3) -> list[str]:
    """The `naming` templates of `arch` most like `name` (its numbers read as {L}/{E})."""
    templates = [t for r in _table(arch) if (t := getattr(r, naming)) is not None]
    shape = re.sub(r"\d+", "{L}", name, count=1)
    shape = re.sub(r"(experts\.)\d+", r"\1{E}", shape)
    return difflib.get_close_matches(shape, templates, n=n, cutoff=0.0)


def rename(name: str, arch: str, *, src: Naming, dst: Naming) -> str:
    """`name` in convention `src` as convention `dst` names it. Raises CheckpointFormatError naming the name and
    the closest names of `src` when no row holds it, or the row when `dst` has no such tensor."""
    if src == dst:
        return name
    found = find_row(name, arch, src)
    if found is None:
        raise CheckpointFormatError(f"{src} parameter {name!r} is not in the {arch} name table; closest known: "
                                    f"{', '.join(closest_names(name, arch, src))}")
    row, fields = found
    template = getattr(row, dst)
    if template is None:
        raise CheckpointFormatError(f"{src} parameter {name!r}: the {arch} name table has no {dst} name for it "
                                    f"({dst} does not hold {arch} models this way)")
    return template.format(**fields)


def naming_of(names: Sequence[str], arch: str) -> Naming:
    """The convention every one of `names` is in (canonical first where names fit several, as `norm.weight`
    does). Raises CheckpointFormatError naming the first name the closest convention lacks."""
    best: tuple[int, Naming] | None = None
    for naming in NAMINGS:
        missing = [n for n in names if find_row(n, arch, naming) is None]
        if not missing:
            return naming
        if best is None or len(missing) < best[0]:
            best = (len(missing), naming)
            first = missing[0]
    assert best is not None
    naming = best[1]
    raise CheckpointFormatError(f"parameter {first!r} ({best[0]} of {len(names)} names) is in no {arch} naming "
                                f"(canonical, hf, torchtitan); closest {naming} names: "
                                f"{', '.join(closest_names(first, arch, naming))}")


def architectures_of(names: Sequence[str]) -> list[tuple[str, Naming]]:
    """Every (architecture, naming) of the tables under which all of `names` are known, table order."""
    out = []
    for arch in TABLES:
        for naming in NAMINGS:
            if all(find_row(n, arch, naming) is not None for n in names):
                out.append((arch, naming))
                break
    return out


def rope_rows(rows: int, heads: int, *, to: Naming) -> list[int]:
    """Row map of a wq/wk weight between transformers' RoPE order and torchtitan's (Meta's interleaved pairs):
    `out[i]` is the row of the stored tensor that row `i` of the `to` convention's tensor is. torchtitan's
    `_permute` (torchtitan -> hf) views each head's rows as (head_dim/2, 2) and transposes them; its
    `_reverse_permute` undoes it."""
    if heads < 1 or rows % (2 * heads):
        raise CheckpointFormatError(f"RoPE permutation: {rows} rows are not {heads} heads of an even head_dim")
    hd = rows // heads
    half = hd // 2
    out = []
    for h in range(heads):
        for r in range(hd):
            if to == "torchtitan":  # torchtitan row 2j+i <- hf row i*half+j
                j, i = divmod(r, 2)
                out.append(h * hd + i * half + j)
            else:  # hf row i*half+j <- torchtitan row 2j+i
                i, j = divmod(r, half)
                out.append(h * hd + 2 * j + i)
    return out
