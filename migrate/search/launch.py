"""Start the built-in workload from the configs a search emitted (the proof that they run).

``run_spec_from_configs(dir, ...)`` reads ``megatron_args.txt`` (parsed with the flag names
Megatron-LM's own ``pretrain_gpt.py`` uses) or ``deepspeed.json`` plus ``target_layout.yaml``
and returns the ``RunSpec`` that runs the workload at exactly that layout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import yaml

from checkpoint.layout import ParallelLayout
from checkpoint.model_shape import ModelShape
from migrate.workload.run_spec import RunSpec, TrainSpec


def _megatron_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", add_help=False)
    for flag in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
                 "expert-model-parallel-size", "micro-batch-size", "global-batch-size", "num-layers", "hidden-size",
                 "ffn-hidden-size", "num-attention-heads", "seq-length", "max-position-embeddings",
                 "make-vocab-size-divisible-by", "num-layers-per-virtual-pipeline-stage", "num-query-groups",
                 "num-experts", "moe-router-topk", "recompute-num-layers"):
        p.add_argument(f"--{flag}", type=int)
    for flag in ("position-embedding-type", "normalization", "recompute-granularity", "recompute-method"):
        p.add_argument(f"--{flag}")
    for flag in ("disable-bias-linear", "group-query-attention", "swiglu", "untie-embeddings-and-output-weights",
                 "sequence-parallel", "use-distributed-optimizer", "overlap-grad-reduce", "recompute-activations",
                 "bf16", "fp16"):
        p.add_argument(f"--{flag}", action="store_true")
    for flag in ("lr", "min-lr", "weight-decay", "adam-beta1", "adam-beta2", "adam-eps", "clip-grad", "norm-epsilon"):
        p.add_argument(f"--{flag}", type=float)
    for flag in ("lr-warmup-iters", "lr-decay-iters", "train-iters", "seed", "rotary-base"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--optimizer", choices=("adam", "sgd"))
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    return p


def _megatron_recipe(args: argparse.Namespace, train: TrainSpec) -> TrainSpec:
    """`train` with the optimizer, schedule and seed the arguments state (those they leave out stay)."""
    if args.optimizer not in (None, "adam"):
        raise ValueError(f"--optimizer {args.optimizer}: the built-in workloads train with Adam(W)")
    if args.lr_decay_style not in (None, "constant", "linear", "cosine"):
        raise ValueError(f"--lr-decay-style {args.lr_decay_style}: the built-in workloads run constant, linear or cosine")
    opt = train.optimizer
    values = {"lr": args.lr, "weight_decay": args.weight_decay, "beta1": args.adam_beta1, "beta2": args.adam_beta2,
              "eps": args.adam_eps, "clip_grad": args.clip_grad}
    opt = dataclasses.replace(opt, **{k: v for k, v in values.items() if v is not None})
    sched = train.lr_schedule
    changes: dict = {}
    if args.lr_decay_style:
        changes["kind"] = args.lr_decay_style
    if args.lr_warmup_iters is not None:
        changes["warmup_steps"] = args.lr_warmup_iters
    if args.lr_decay_iters is not None:
        changes["decay_steps"] = args.lr_decay_iters
    if args.min_lr is not None and opt.lr:
        changes["min_lr_ratio"] = args.min_lr / opt.lr
    return dataclasses.replace(train, optimizer=opt, lr_schedule=dataclasses.replace(sched, **changes),
                               seed=train.seed if args.seed is None else args.seed)


def _deepspeed_recipe(config: dict, train: TrainSpec) -> TrainSpec:
    """`train` with the optimizer and clipping of a DeepSpeed config (those it leaves out stay)."""
    optimizer = config.get("optimizer") or {}
    if optimizer and str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        raise ValueError(f"deepspeed.json: optimizer {optimizer.get('type')!r}: the built-in workloads train with AdamW")
    params = optimizer.get("params", {})
    opt = train.optimizer
    betas = params.get("betas", (opt.beta1, opt.beta2))
    opt = dataclasses.replace(opt, lr=params.get("lr", opt.lr), weight_decay=params.get("weight_decay", opt.weight_decay),
                              beta1=betas[0], beta2=betas[1], eps=params.get("eps", opt.eps),
                              clip_grad=config.get("gradient_clipping", opt.clip_grad))
    return dataclasses.replace(train, optimizer=opt)


def run_spec_from_configs(directory: str | Path, model: ModelShape, train: TrainSpec, steps: int) -> RunSpec:
    """The built-in run the emitted configs describe; raises when they disagree with the model."""
    directory = Path(directory)
    layout = ParallelLayout.from_dict(yaml.safe_load((directory / "target_layout.yaml").read_text())["target"]["layout"])
    megatron = directory / "megatron_args.txt"
    if megatron.is_file():
        args = _megatron_parser().parse_args(shlex.split(megatron.read_text()))
        mismatch = {name: (getattr(args, name), getattr(model, name)) for name in
                    ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length")
                    if getattr(args, name) != getattr(model, name)}
        if mismatch:
            raise ValueError(f"{megatron}: arguments disagree with the model (args, model): {mismatch}")
        vpp = model.num_layers // (args.pipeline_model_parallel_size * args.num_layers_per_virtual_pipeline_stage) \
            if args.num_layers_per_virtual_pipeline_stage else 1
        spec = RunSpec(engine="megatron", model=model, steps=steps,
                       train=dataclasses.replace(_megatron_recipe(args, train), micro_batch_size=args.micro_batch_size,
                                                 global_batch_size=args.global_batch_size),
                       tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                       ep=args.expert_model_parallel_size, vpp=vpp, sequence_parallel=args.sequence_parallel,
                       distributed_optimizer=args.use_distributed_optimizer)
    else:
        config = json.loads((directory / "deepspeed.json").read_text())
        spec = RunSpec(engine="deepspeed", model=model, steps=steps,
                       train=dataclasses.replace(_deepspeed_recipe(config, train),
                                                 micro_batch_size=config["train_micro_batch_size_per_gpu"],
                                                 global_batch_size=config["train_batch_size"]),
                       zero_stage=config["zero_optimization"]["stage"])
    if (spec.tp, spec.pp, spec.ep, spec.vpp) != (layout.tp, layout.pp, layout.ep, layout.vpp):
        raise ValueError(f"{directory}: configs say tp{spec.tp} pp{spec.pp} ep{spec.ep} vpp{spec.vpp}, "
                         f"target_layout.yaml says {layout.describe()}")
    return spec
