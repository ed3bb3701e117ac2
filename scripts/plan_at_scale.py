"""Plan a DeepSeek-V3-sized Megatron-Core checkpoint conversion PP16·EP64 -> PP16·EP32 (2,048 -> 1,024 ranks) from
metadata alone, and print what it costs per target rank and where the imbalance comes from.

The model is DeepSeek-V3's main model (671B: 61 layers, the first 3 dense, 256 routed + 1 shared expert of 2048,
top-8, MLA with q_lora 1536 / kv_lora 512 / qk 128 + rope 64 / v 128, vocab 129280 untied; its MTP layer is not
part of it). 61 layers do not split over 16 pipeline ranks evenly: the run puts `--first-pipeline-stage-layers` on the
first rank and `--last-pipeline-stage-layers` on the last (Megatron-LM's --decoder-first/last-pipeline-num-layers), the rest
evenly; the target keeps that split. The source checkpoint's metadata (DCP `.metadata` + `common.pt` with
Megatron-LM's args, DistributedOptimizer dp_reshardable, bf16 weights, fp32 master and Adam moments, one key per
layer as Megatron-Core stores DeepSeek's non-homogeneous layers) is synthesized from the architecture rules and the
layout (`checkpoint.formats.megatron_synth`) and read by the real Megatron reader; the planner and the
fully-reshardable Megatron target are the ones `migrate convert` uses. No tensor data exists or is read.

Usage: .venv/bin/python scripts/plan_at_scale.py [--ep 32 --dp 64 --first-pipeline-stage-layers 4 --last-pipeline-stage-layers 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.api import LayoutRequest, plan_conversion
from checkpoint.errors import CheckpointError
from checkpoint.formats.megatron_synth import pipeline_balance, plan_figures, render_balance, synthetic_index
from checkpoint.index import Kind
from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape

DEEPSEEK_V3 = ModelShape(architecture="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
                         num_attention_heads=128, num_query_groups=128, vocab_size=129280, seq_length=4096,
                         make_vocab_size_divisible_by=128, num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048,
                         q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                         first_k_dense=3, shared_expert_ffn_hidden_size=2048, tied_embeddings=False)
DIST_OPT = OptimizerSharding.DISTRIBUTED_OPTIMIZER


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source-ep", type=int, default=64)
    ap.add_argument("--source-dp", type=int, default=128)
    ap.add_argument("--pp", type=int, default=16, help="pipeline size of source and target")
    ap.add_argument("--first-pipeline-stage-layers", type=int, default=4, help="layers on the first pipeline rank")
    ap.add_argument("--last-pipeline-stage-layers", type=int, default=1, help="layers on the last pipeline rank")
    ap.add_argument("--ep", type=int, default=32, help="target expert-parallel size")
    ap.add_argument("--dp", type=int, default=64, help="target data-parallel size")
    args = ap.parse_args(argv)
    try:
        source = ParallelLayout(tp=1, pp=args.pp, dp=args.source_dp, ep=args.source_ep, sharding=DIST_OPT,
                                first_pipeline_stage_layers=args.first_pipeline_stage_layers,
                                last_pipeline_stage_layers=args.last_pipeline_stage_layers)
        start = time.perf_counter()
        index = synthetic_index(DEEPSEEK_V3, source)
        indexed = time.perf_counter()
        plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(tp=1, pp=args.pp, dp=args.dp, ep=args.ep))
        planned = time.perf_counter()
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    target = ParallelLayout.from_dict(plan.target.index.meta["target_layout"])
    params = sum(e.numel for e in index.entries if e.key.kind is Kind.PARAM)
    print(f"DeepSeek-V3 ({params / 1e9:.2f} B params), Megatron-Core torch_dist: {source.describe()} "
          f"({source.world_size} ranks) -> {target.describe()} ({target.world_size} ranks)")
    print(plan_figures(plan).render())
    print("bytes written per target pipeline stage:")
    print(render_balance(pipeline_balance(plan, DEEPSEEK_V3, target)))
    print(f"time: source index from metadata {indexed - start:.2f} s, plan {planned - indexed:.2f} s, "
          f"total {planned - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
