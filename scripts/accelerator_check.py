#!/usr/bin/env python
"""One prepared check for the minutes an accelerator is lent: device facts against the shipped profile,
operator numerics, checkpoints written on the device converted and loaded on the CPU (and the reverse),
and the memory and cost models against measured single-device runs. Writes report.json and report.md.

    python scripts/accelerator_check.py --device cuda --out docs/accelerator/h200-2026-12-03
    python scripts/accelerator_check.py --device cpu --out /tmp/check --size small   # what the test suite runs
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from migrate.accelerator.check import SIZES, run_check

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", required=True, help="cuda, npu or cpu (cuda:1, npu:2: another device)")
    parser.add_argument("--out", required=True, help="folder for report.json and report.md")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="small (the CPU in the suite) or full (an accelerator); default: full on an accelerator")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds the whole check may take")
    args = parser.parse_args()
    device = args.device if ":" in args.device or args.device == "cpu" else f"{args.device}:0"
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError:
            print("error: --device npu needs torch_npu (Ascend's PyTorch adapter), which is not installed", file=sys.stderr)
            sys.exit(2)
    result = run_check(device, args.out, size=args.size or ("small" if device == "cpu" else "full"),
                       budget_s=args.budget_s)
    print(f"report: {os.path.join(args.out, 'report.md')}")
    sys.exit(0 if result["passed"] else 1)
