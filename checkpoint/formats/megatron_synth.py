"""Megatron-Core torch_dist checkpoint metadata synthesized from the rules and a layout: planning at scale
without files.

`synthesize_metadata(arch, layout)` returns the DCP `Metadata` and `common.pt` state that Megatron-Core
would write for a GPTModel trained at `layout` with the DistributedOptimizer (dp_reshardable), as
`checkpoint.formats.megatron` reads them (`common.pt` with Megatron-LM's args for that layout): model keys
stacked over layers (one key per layer where the layers differ, as DeepSeek-V3's), one chunk per layer (and
expert; fused GLU as a gate and an up run) per TP/PP/EP shard, spread over the shard's data-parallel
ranks as Megatron's fully parallel save does; per (TP, PP[, EP]) domain and model chunk one flat bucket
per optimizer state (params in reverse order, 64-aligned, padded to lcm(dp, 128)), each DP rank storing
its contiguous range as one chunk (Megatron splits that range further at parameter boundaries; the bytes
per file are the same). `synthetic_index` feeds it through the real reader; `plan_figures` condenses a
conversion plan into the numbers a scale review needs, `pipeline_balance` splits the per-rank imbalance into
what the layout dictates (pipeline stage sizes) and what the planner adds.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.formats.dcp_metadata import PlacedItem, build_metadata
from checkpoint.formats.megatron import (buffer_buckets, domain_params, index_from_metadata, layer_boxes,
                                         owner_boxes, separate_bucket_keys, writer_ranks)
from checkpoint.formats.megatron_args import synthesized_args, target_args
from checkpoint.index import CheckpointIndex, dtype_size
from checkpoint.layout import ParallelLayout
from checkpoint.plan import ConversionPlan, rank_summaries
from checkpoint.model_shape import ModelShape
from checkpoint.rules.megatron import layer_key, per_layer_keys, pipeline_stage_layers, stacked_shape, stored_rules

STATES = ("param", "exp_avg", "exp_avg_sq")


class _Files:
    """Byte offsets per rank file, as a DCP writer appends chunks."""

    def __init__(self) -> None:
        self.ends: dict[int, int] = defaultdict(int)

    def place(self, rank: int, nbytes: int) -> tuple[str, int, int]:
        start = self.ends[rank]
        self.ends[rank] = start + nbytes
        return f"__{rank}_0.distcp", start, nbytes


def synthesize_metadata(arch: ModelShape, layout: ParallelLayout, *, model_dtype: str = "bfloat16",
                        iteration: int = 1) -> tuple[Any, dict[str, Any]]:
    """(DCP Metadata, common state) of a dp_reshardable torch_dist checkpoint of `arch` at `layout`."""
    files = _Files()
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    placed: list[PlacedItem] = []

    def add(fqn: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
            rank: int) -> None:
        tensors.setdefault(fqn, (shape, dtype))
        path, start, length = files.place(rank, math.prod(sizes) * dtype_size(dtype))
        placed.append(PlacedItem(fqn=fqn, file=path, offset=start, length=length, box=(offsets, sizes)))

    moe = arch.num_experts > 0
    per_layer = per_layer_keys(arch)
    for rule in stored_rules(arch):
        shape = stacked_shape(rule, arch, layout.tp)
        lead = {"model": 0, "layer": 1, "expert": 2}[rule.scope]
        dtype = "float32" if rule.buffer else model_dtype  # Megatron-Core keeps the router's expert bias in fp32
        for pp_rank in range(layout.pp):
            for tp_rank in range(layout.tp):
                for ep_rank in range(layout.ep if rule.scope == "expert" else 1):
                    ranks = writer_ranks(layout, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank,
                                          expert=rule.scope == "expert")
                    boxes = owner_boxes(rule, arch, layout, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank)
                    for i, (o, n) in enumerate(layer_boxes(boxes, lead)):
                        if per_layer and lead:  # Megatron-Core's non-homogeneous layers: one key per layer
                            add(layer_key(rule.key, o[0]), shape[1:], dtype, o[1:], n[1:], ranks[i % len(ranks)])
                        else:
                            add(rule.key, shape, dtype, o, n, ranks[i % len(ranks)])
    gbuf_dtype = f"(torch.{model_dtype}, torch.float32)"  # (param dtype, grad dtype) of the grad buffer
    chained = moe and layout.ep > 1  # experts get their own optimizer only under expert parallelism
    chains = (0, 1) if chained else (0,)
    for chain in chains:
        experts = chain == 1
        eps = layout.ep if experts else 1
        for pp_rank in range(layout.pp):
            for ep_rank in range(eps):
                for tp_rank in range(layout.tp):
                    d = pp_rank * layout.tp * eps + ep_rank * layout.tp + tp_rank
                    ranks = writer_ranks(layout, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank, expert=experts)
                    for g in range(layout.vpp):
                        params = domain_params(arch, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep,
                                               tp_rank=tp_rank, pp_rank=pp_rank, vp_stage=g, ep_rank=ep_rank,
                                               experts=experts, **layout.pipeline_split)
                        if not params:
                            continue
                        separate = separate_bucket_keys(arch, layout.pp) if not experts else frozenset()
                        for b, (_, unpadded) in enumerate(buffer_buckets(params, separate)):
                            divisor = math.lcm(len(ranks), 128)
                            local = math.ceil(unpadded / divisor) * divisor // len(ranks)
                            prefix = f"chained_{chain}." if chained else ""
                            for state in STATES:
                                fqn = (f"{prefix}optimizer.distributed.dp_group_idx_{d}.gbuf_idx_{g}."
                                       f"dtype_{gbuf_dtype}.bucket_idx_{b}.{state}")
                                for r, rank in enumerate(ranks):
                                    lo, hi = r * local, min((r + 1) * local, unpadded)
                                    if lo < hi:
                                        add(fqn, (unpadded,), "float32", (lo,), (hi - lo,), rank)
    md = build_metadata(placed, tensors)
    # hyper-parameters are not in the layout; planning does not read them (typical Llama pre-training values)
    group = {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": iteration,
                               "params": []}]}
    optim = {c: {"optimizer": group, "param_state_sharding_type": "dp_reshardable"} for c in chains}
    args = target_args(synthesized_args(arch, None, iteration=iteration, global_batch_size=None, weights_only=False,
                                        hf_tokenizer=False), arch, layout, ckpt_format="torch_dist",
                       fully_reshardable=False)
    common = {"iteration": iteration, "checkpoint_version": 3.0, "args": args,
              "migrate": {"model": arch.tensor_fields()},
              "optimizer": optim if chained else optim[0]}
    return md, common


def synthetic_index(arch: ModelShape, layout: ParallelLayout, *, model_dtype: str = "bfloat16") -> CheckpointIndex:
    """The index the Megatron reader builds for the synthesized checkpoint (root names the layout; no files)."""
    md, common = synthesize_metadata(arch, layout, model_dtype=model_dtype)
    root = Path(f"synthetic-{arch.architecture}-{layout.describe().replace('·', '-').replace(' ', '-')}")
    return index_from_metadata(md, common, root)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanFigures:
    """What a conversion plan costs per target rank (bytes are tensor bytes, without file headers)."""

    source_files: int
    target_files: int
    target_ranks: int
    copy_items: int
    bytes_read: int
    bytes_written: int
    read_per_rank: tuple[int, int, int]  # min, median, max
    written_per_rank: tuple[int, int, int]
    largest_rank: int | None
    largest_share: float  # the largest target rank's bytes written / all bytes written
    max_source_files_per_rank: int  # source files one target rank reads from, at most
    max_target_files_per_rank: int

    def render(self) -> str:
        gib = 1 << 30
        rd, wr = (tuple(f"{v / gib:.2f}" for v in t) for t in (self.read_per_rank, self.written_per_rank))
        return "\n".join([
            f"files: {self.source_files} source -> {self.target_files} target ({self.target_ranks} target ranks), "
            f"{self.copy_items} copy items",
            f"bytes read {self.bytes_read / gib:.1f} GiB, written {self.bytes_written / gib:.1f} GiB",
            f"per target rank read  GiB min/median/max: {' / '.join(rd)}",
            f"per target rank write GiB min/median/max: {' / '.join(wr)}; at most {self.max_target_files_per_rank} "
            f"file(s) written and {self.max_source_files_per_rank} source files read per target rank",
            f"largest target rank: {self.largest_rank} writes {self.largest_share:.3%} of the bytes "
            f"({self.written_per_rank[2] / gib:.2f} GiB)"])


def plan_figures(plan: ConversionPlan) -> PlanFigures:
    """Condense `plan` into per-target-rank read/write figures (pure)."""
    ranks = rank_summaries(plan)
    src_files: dict[int | None, set[str]] = defaultdict(set)
    rank_of_file = {f.path: f.rank for f in plan.target.files}
    for it in plan.items:
        src_files[rank_of_file[it.dst.file]].add(it.src.file)
    reads = sorted(r.bytes_read for r in ranks)
    writes = sorted(r.bytes_written for r in ranks)
    largest = max(ranks, key=lambda r: r.bytes_written)
    total_w = sum(writes)
    return PlanFigures(
        source_files=len([f for f in plan.source.files if f.endswith(".distcp")]) or len(plan.source.files),
        target_files=len(plan.target.files), target_ranks=len(ranks), copy_items=len(plan.items),
        bytes_read=sum(reads), bytes_written=total_w,
        read_per_rank=(reads[0], int(statistics.median(reads)), reads[-1]),
        written_per_rank=(writes[0], int(statistics.median(writes)), writes[-1]),
        largest_rank=largest.rank, largest_share=largest.bytes_written / total_w if total_w else 0.0,
        max_source_files_per_rank=max((len(v) for v in src_files.values()), default=0),
        max_target_files_per_rank=max((len(r.files) for r in ranks), default=0))


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStageBalance:
    """The bytes one pipeline stage's target ranks write: the pipeline stage's bytes over its ranks is what the
    layout dictates (which layers, embedding and head it holds); its fullest rank over that mean is what the
    planner adds (whole per-layer / per-expert chunks spread over the pipeline stage's data-parallel ranks)."""

    pp_rank: int
    layers: tuple[int, ...]  # global decoder layers held (every virtual stage)
    ranks: int
    bytes_written: int

    @property
    def mean(self) -> float:
        return self.bytes_written / self.ranks

    def render(self, fullest: int) -> str:
        gib = 1 << 30
        held = f"{self.layers[0]}-{self.layers[-1]}" if self.layers else "-"
        return (f"  pp_rank {self.pp_rank:>3}  layers {held:>7} ({len(self.layers):>2})  ranks {self.ranks:>5}  "
                f"mean {self.mean / gib:7.2f} GiB  fullest {fullest / gib:7.2f} GiB  "
                f"planner x{fullest / self.mean if self.mean else 0:.4f}")


def pipeline_balance(plan: ConversionPlan, arch: ModelShape,
                     layout: ParallelLayout) -> list[tuple[PipelineStageBalance, int]]:
    """Per pipeline stage of the target `layout`: its PipelineStageBalance and the bytes its fullest rank writes
    (pure)."""
    by_pp_rank: dict[int, list[int]] = defaultdict(list)
    for summary in rank_summaries(plan):
        if summary.rank is not None:
            by_pp_rank[layout.coordinates(summary.rank).pp].append(summary.bytes_written)
    out = []
    for pp_rank in range(layout.pp):
        layers = tuple(i for v in range(layout.vpp)
                       for i in pipeline_stage_layers(arch.num_layers, layout.pp, layout.vpp, pp_rank, v,
                                                      **layout.pipeline_split))
        written = by_pp_rank[pp_rank]
        out.append((PipelineStageBalance(pp_rank=pp_rank, layers=layers, ranks=len(written),
                                         bytes_written=sum(written)), max(written, default=0)))
    return out


def render_balance(balance: list[tuple[PipelineStageBalance, int]]) -> str:
    """The per-pipeline-stage table, and the fullest rank's bytes over the mean rank's split exactly into the
    layout's factor (its pipeline stage's mean over the mean rank) and the planner's (the fullest rank over that
    mean)."""
    mean = sum(b.bytes_written for b, _ in balance) / sum(b.ranks for b, _ in balance)
    stage, fullest = max(balance, key=lambda bf: bf[1])
    lines = [b.render(f) for b, f in balance]
    lines.append(f"fullest rank / mean rank x{fullest / mean:.4f} = the layout's x{stage.mean / mean:.4f} (pp_rank "
                 f"{stage.pp_rank}'s mean over the mean rank) * the planner's x{fullest / stage.mean:.4f} (the fullest "
                 f"rank over its pipeline stage's mean)")
    return "\n".join(lines)
