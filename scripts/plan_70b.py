"""Plan a Llama-70B Megatron-Core checkpoint conversion TP8·PP8·DP16 -> TP4·PP8·DP16 (1,024 -> 512 ranks)
from metadata alone, and print what it costs per target rank.

The source checkpoint's metadata (DCP `.metadata` + `common.pt`, DistributedOptimizer dp_reshardable,
bf16 weights, fp32 master and Adam moments) is synthesized from the architecture rules and the layout
(`checkpoint.formats.megatron_synth`) and read by the real Megatron reader; the planner and the
fully-reshardable Megatron target are the ones `migrate convert` uses. No tensor data exists or is read.

Usage: .venv/bin/python scripts/plan_70b.py [--tp 4 --pp 8 --dp 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.model_shape import ModelShape
from checkpoint.api import LayoutRequest, plan_conversion
from checkpoint.formats.megatron_synth import plan_figures, synthetic_index
from checkpoint.layout import OptimizerSharding, ParallelLayout

LLAMA_70B = ModelShape(architecture="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                     num_attention_heads=64, num_query_groups=8, vocab_size=128256, make_vocab_size_divisible_by=128)
SOURCE = ParallelLayout(tp=8, pp=8, dp=16, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=16)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    index = synthetic_index(LLAMA_70B, SOURCE)
    indexed = time.perf_counter()
    plan, _ = plan_conversion(index, to="megatron", target=LayoutRequest(dp=args.dp, tp=args.tp, pp=args.pp))
    planned = time.perf_counter()
    target = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.dp, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER)
    print(f"Llama-70B ({sum(e.numel for e in index.entries if e.key.kind == 'param') / 1e9:.2f} B params), "
          f"Megatron-Core torch_dist: {SOURCE.describe()} ({SOURCE.world_size} ranks) -> "
          f"{target.describe()} ({target.world_size} ranks)")
    print(plan_figures(plan).render())
    print(f"time: source index from metadata {indexed - start:.2f} s, plan {planned - indexed:.2f} s, "
          f"total {planned - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
