"""``migrate inspect CKPT [--json]``: what a checkpoint holds, from its metadata only."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import click

from checkpoint.api import read_index
from checkpoint.errors import CheckpointError
from checkpoint.index import CheckpointIndex, Kind
from checkpoint.layout import PIPELINE_STAGE_FIELDS

EXIT_BAD_INPUT = 2


def describe(index: CheckpointIndex) -> dict[str, Any]:
    """Format, layout, tensor count, bytes, dtypes, step and which state is present."""
    kinds = Counter(str(e.key.kind) for e in index.entries)
    meta = index.meta
    steps = [e for e in index.entries if e.key.kind is Kind.STEP]
    return {
        "path": index.root,
        "format": index.format,
        "layout": {"dp": meta.get("dp"), "zero_stage": meta.get("stage"), "tp": meta.get("tp") or 1,
                   "pp": meta.get("pp") or 1, "vpp": meta.get("vpp") or 1, "ep": meta.get("ep") or 1,
                   **{k: meta[k] for k in PIPELINE_STAGE_FIELDS if meta.get(k) is not None}},
        "tag": meta.get("tag"),
        "tensors": len(index.entries),
        "params": kinds.get(str(Kind.PARAM), 0) or kinds.get(str(Kind.MASTER), 0),
        "bytes": index.nbytes,
        "files": len(index.files),
        "dtypes": index.dtypes(),
        "model_dtype": meta.get("dtype") or meta.get("model_dtype"),
        "global_step": meta.get("global_steps") if meta.get("global_steps") is not None else meta.get("iteration"),
        "optimizer_steps": len(steps) > 0,
        "state": {k: kinds.get(str(k), 0) for k in Kind},
        "lr_scheduler": ((meta.get("model_state") or {}).get("lr_scheduler")
                         or (meta.get("train_state") or {}).get("lr_scheduler")) is not None,
        "tied_params": dict(meta.get("shared_params") or {}),
        "frozen_params": [name for name, _ in meta.get("frozen_params") or ()],
        "optimizer_sharding": meta.get("sharding"),
        "architecture": meta.get("arch"),
        "architecture_overrides": list(meta.get("arch_overrides") or ()),
        "megatron_args": dict(meta.get("megatron_args") or {}),
        "dcp_layout": meta.get("dcp_layout"),
        "hf_trainer": _trainer_summary(meta.get("hf_trainer")),
    }


def _trainer_summary(trainer: dict[str, Any] | None) -> dict[str, Any] | None:
    """What an HF-Trainer folder holds beside the engine's files (None for other checkpoints)."""
    if not trainer:
        return None
    return {"global_step": trainer["trainer_state"].get("global_step"),
            "model_type": (trainer.get("hf_config") or {}).get("model_type"), "rng_files": len(trainer["rng"]),
            "scheduler_file": trainer.get("scheduler") is not None, "files": list(trainer["files"])}


def render(info: dict[str, Any]) -> str:
    lay = info["layout"]
    state = ", ".join(f"{k} x{n}" for k, n in info["state"].items() if n) or "none"
    return "\n".join([
        f"{info['path']}",
        f"  format      {info['format']} (tag {info['tag']})",
        f"  layout      dp={lay['dp']} zero_stage={lay['zero_stage']} tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} "
        f"ep={lay['ep']}" + "".join(f" {k}={lay[k]}" for k in PIPELINE_STAGE_FIELDS if k in lay),
        f"  tensors     {info['tensors']} ({info['params']} params) in {info['files']} files, "
        f"{info['bytes'] / 2**20:.2f} MiB",
        f"  dtypes      {', '.join(info['dtypes'])} (model {info['model_dtype']})",
        f"  step        {info['global_step']}",
        f"  state       {state}; lr scheduler {'yes' if info['lr_scheduler'] else 'no'}",
    ] + _architecture_lines(info) + _tied_and_frozen_lines(info))


def _architecture_lines(info: dict[str, Any]) -> list[str]:
    lines = []
    if info["dcp_layout"]:
        lines.append(f"  found       {info['dcp_layout']}")
    if trainer := info.get("hf_trainer"):
        lines.append(f"  hf trainer  global_step {trainer['global_step']}, config.json model_type "
                     f"{trainer['model_type']}, {trainer['rng_files']} RNG file(s), scheduler.pt "
                     f"{'yes' if trainer['scheduler_file'] else 'no (DeepSpeed holds the scheduler)'}")
    if info["optimizer_sharding"]:
        lines.append(f"  optimizer   {info['optimizer_sharding']}")
    if arch := info["architecture"]:
        lines.append("  model       " + " ".join(f"{k}={v}" for k, v in arch.items()))
    if info["architecture_overrides"]:
        lines.append(f"  overridden  by --model-config: {'; '.join(info['architecture_overrides'])}")
    if args := info["megatron_args"]:
        items = [f"{k}={v}" for k, v in args.items()]
        lines.append("  megatron-lm " + "\n              ".join(" ".join(items[i:i + 6]) for i in range(0, len(items), 6)))
    return lines


def _tied_and_frozen_lines(info: dict[str, Any]) -> list[str]:
    lines = []
    if info["tied_params"]:
        lines.append(f"  tied        {', '.join(f'{a} is {o}' for a, o in info['tied_params'].items())}")
    if frozen := info["frozen_params"]:
        more = ", ..." if len(frozen) > 4 else ""
        lines.append(f"  frozen      {len(frozen)} params without optimizer state ({', '.join(frozen[:4])}{more})")
    return lines


@click.command(name="inspect", help="Describe the checkpoint at CKPT (format, layout, tensors, bytes, state).")
@click.argument("ckpt", type=click.Path(path_type=Path, exists=True))
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of text")
@click.option("--trust-checkpoint", is_flag=True, help="allow pickled classes outside the allow-list")
@click.option("--follow-symlinks", is_flag=True,
              help="read through symbolic links that lead outside the checkpoint (refused by default)")
def command(ckpt: Path, as_json: bool, trust_checkpoint: bool, follow_symlinks: bool) -> None:
    try:
        info = describe(read_index(ckpt, trust_checkpoint=trust_checkpoint, follow_symlinks=follow_symlinks))
    except CheckpointError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    click.echo(json.dumps(info, indent=2) if as_json else render(info))
