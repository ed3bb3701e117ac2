"""Megatron-Core architecture rules: sharding a reference tensor by the rules and merging it back.

A random unsharded reference (canonical q/k/v, gate/up, ...) is fused and split per TP rank the way
Megatron-Core lays out its local parameters; mapping every local element back through the rules
must rebuild the reference exactly, for each architecture and TP size.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.formats.megatron import LocalParam, param_flat_pieces
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import (RULES, canonical_tensors, expert_range, flat_run_boxes,
                                       matrix_shape, pipeline_stage_layers, tp_local_cols, tp_local_rows)

ARCHS = {
    "gpt": ModelShape(architecture="gpt", num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    num_query_groups=4, vocab_size=50, make_vocab_size_divisible_by=4),
    "llama": ModelShape(architecture="llama", num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                      num_query_groups=2, vocab_size=50, make_vocab_size_divisible_by=4),
    "mixtral": ModelShape(architecture="mixtral", num_layers=4, hidden_size=32, ffn_hidden_size=48,
                        num_attention_heads=8, num_query_groups=2, vocab_size=50, num_experts=4),
    "qwen2": ModelShape(architecture="qwen2", num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                      num_query_groups=4, vocab_size=50, make_vocab_size_divisible_by=4),
    "qwen3": ModelShape(architecture="qwen3", num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                      num_query_groups=2, vocab_size=50, make_vocab_size_divisible_by=4),
}


def _fused_reference(rule, arch, canon):
    """The Megatron global matrix (QKV interleaved per query group, GLU [gate; up], vocab padded)."""
    hd, per = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
    name = lambda part: rule.canonical.format(layer=0, expert=0, part=part)  # noqa: E731
    if rule.fuse == "qkv":
        q, k, v = canon[name("q")], canon[name("k")], canon[name("v")]
        return torch.cat([torch.cat([q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                          for g in range(arch.num_query_groups)])
    if rule.fuse == "glu":
        return torch.cat([canon[name("gate")], canon[name("up")]])
    part = "up" if rule.key.endswith("linear_fc1.weight") else ""
    t = canon[name(part)]
    if rule.vocab:
        return torch.cat([t, torch.zeros(arch.padded_vocab_size(4) - t.shape[0], t.shape[1])])
    return t


@pytest.mark.parametrize("arch_name", sorted(ARCHS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_merge_back_to_the_reference(arch_name, tp):
    arch = ARCHS[arch_name]
    torch.manual_seed(0)
    canon = {n: torch.randn(s) for n, s in canonical_tensors(arch)}
    for rule in RULES[arch_name].all():
        if rule.fuse == "qkv" and arch.num_query_groups % tp:
            continue
        fused = _fused_reference(rule, arch, canon)
        vector = fused.dim() == 1
        merged = {}
        for t in range(tp):
            rows = tp_local_rows(rule, arch, tp, t)  # a vector's elements: whole (norms) or per query group (bias)
            c0, nc = tp_local_cols(rule, arch, tp, t)
            local = torch.cat([fused[g:g + n] if vector else fused[g:g + n, c0:c0 + nc] for g, n in rows])
            p = LocalParam(rule=rule, layer=0 if rule.scope != "model" else None,
                           expert=0 if rule.scope == "expert" else None, row_runs=rows, cols=(c0, nc), vector=vector)
            assert p.shape == tuple(local.shape)
            flat = local.reshape(-1)
            cut = flat.numel() // 3 + 1  # two flat pieces, as a DP boundary would cut them
            for lo, hi in ((0, cut), (cut, flat.numel())):
                for pc in param_flat_pieces(arch, p, lo, hi, lo):
                    dst = merged.setdefault(pc.name, torch.full(pc.shape, float("nan")))
                    region = dst
                    for d, (o, n) in enumerate(zip(pc.offsets, pc.lengths)):
                        region = region.narrow(d, o, n)
                    region.copy_(flat[pc.storage_offset:pc.storage_offset + math.prod(pc.lengths)].view(pc.lengths))
        for name, t in merged.items():
            assert torch.equal(t, canon[name]), (arch_name, tp, rule.key, name)


def test_vocab_padding_depends_on_tp_and_divisor():
    arch = ARCHS["llama"]
    assert [arch.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [52, 56, 64, 64]
    emb = RULES["llama"].model[0]
    assert matrix_shape(emb, arch, 2) == (56, 32)


def test_pipeline_and_virtual_stage_layer_ownership():
    assert [list(pipeline_stage_layers(8, 2, 1, p, 0)) for p in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # interleaved: virtual stage v on pipeline rank p holds layers v*L/vpp + p*L/(pp*vpp) ...
    assert [list(pipeline_stage_layers(8, 2, 2, p, v)) for v in (0, 1) for p in (0, 1)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_expert_ownership_global_index():
    assert [list(expert_range(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_runs_cover_each_element_once(lengths, data):
    total = math.prod(lengths)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    seen = torch.zeros(total, dtype=torch.int64)
    ref = torch.arange(total).view(lengths)
    for offs, lens, first in flat_run_boxes(tuple(lengths), lo, hi):
        box = ref
        for d, (o, n) in enumerate(zip(offs, lens)):
            box = box.narrow(d, o, n)
        vals = box.reshape(-1)
        assert torch.equal(vals, torch.arange(first, first + vals.numel()))  # contiguous run starting at `first`
        seen[vals] += 1
    assert seen[lo:hi].eq(1).all() and seen.sum() == hi - lo


def test_tied_embeddings_are_one_canonical_tensor():
    """Tied input/output embeddings: the canonical model has no lm_head; at PP 2 the last stage's copy sits
    in its optimizer bucket (and is skipped: its state is the embedding's), at PP 1 it does not exist."""
    from checkpoint.api import LayoutRequest, plan_conversion
    from checkpoint.formats.megatron import buffer_buckets, domain_params, separate_bucket_keys
    from checkpoint.formats.megatron_synth import synthetic_index
    from checkpoint.index import Kind
    from checkpoint.layout import ParallelLayout

    tied = ModelShape(architecture="llama", num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                    num_query_groups=2, vocab_size=50, tied_embeddings=True)
    names = {n for n, _ in canonical_tensors(tied)}
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names

    def params(pp, pp_rank):
        return domain_params(tied, tp=1, pp=pp, vpp=1, ep=1, tp_rank=0, pp_rank=pp_rank, vp_stage=0, ep_rank=0,
                             experts=False)

    assert "output_layer.weight" not in [p.rule.key for p in params(1, 0)]
    assert params(2, 1)[-1].rule.key == "output_layer.weight"  # the last stage's copy
    separate = separate_bucket_keys(tied, 2)  # Megatron's shared_embedding: a bucket of its own (reverse order)

    def buckets(pp_rank):
        return [[p.rule.key for p, _ in b] for b, _ in buffer_buckets(params(2, pp_rank), separate)]

    assert len(buckets(0)) == 2 and buckets(0)[1] == ["embedding.word_embeddings.weight"]
    assert len(buckets(1)) == 2 and buckets(1)[0] == ["output_layer.weight"]
    for layout in (ParallelLayout(tp=1), ParallelLayout(tp=2, pp=2, dp=2)):
        index = synthetic_index(tied, layout)
        masters = {e.key.name for e in index.entries if e.key.kind is Kind.MASTER}
        assert masters == names, sorted(masters ^ names)
        plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(dp=1, tp=2, pp=1))
        assert {e.key.name for e in plan.target.index.entries} == names
