"""Runnable configs for a chosen candidate: Megatron-LM arguments, a DeepSpeed JSON, the job's
``target.layout`` section. Pure functions returning plain values; ``write_configs`` writes them.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from checkpoint.layout import OptimizerSharding
from parallel_search.space import Candidate
from parallel_search.spec import ModelShape, TrainingShape


def megatron_args(model: ModelShape, train: TrainingShape, cand: Candidate, *, overlap_grad_reduce: bool = False) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for the model, batch and parallel plan."""
    lay = cand.layout
    if cand.framework != "megatron":
        raise ValueError(f"{cand.key}: Megatron-LM arguments need a megatron candidate, got {cand.framework}")
    args = [
        "--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
        "--context-parallel-size", str(lay.cp), "--expert-model-parallel-size", str(lay.ep),
        "--micro-batch-size", str(cand.micro_batch_size), "--global-batch-size", str(train.global_batch_size),
        "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
        "--ffn-hidden-size", str(model.ffn_hidden_size), "--num-attention-heads", str(model.num_attention_heads),
        "--seq-length", str(model.seq_length), "--max-position-embeddings", str(model.seq_length),
        "--make-vocab-size-divisible-by", str(model.make_vocab_size_divisible_by),
        "--position-embedding-type", "rope", "--disable-bias-linear",
    ]
    if lay.vpp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(model.num_layers // (lay.pp * lay.vpp))]
    if model.num_query_groups != model.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.gated_ffn:
        args += ["--swiglu", "--normalization", "RMSNorm"]
    if not model.tied_embeddings:
        args += ["--untie-embeddings-and-output-weights"]
    if model.is_moe:
        args += ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_top_k)]
    if cand.sequence_parallel:
        args += ["--sequence-parallel"]
    if lay.sharding is OptimizerSharding.DISTRIBUTED_OPTIMIZER:
        args += ["--use-distributed-optimizer"]
    if overlap_grad_reduce:
        args += ["--overlap-grad-reduce"]
    if cand.recompute == "selective":
        args += ["--recompute-activations"]
    elif cand.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if train.precision in ("bf16", "fp16"):
        args += [f"--{train.precision}"]
    return args


def deepspeed_config(train: TrainingShape, cand: Candidate) -> dict:
    """A DeepSpeed config for the plan (batch sizes, ZeRO stage, precision, activation checkpointing)."""
    lay = cand.layout
    per_step = cand.micro_batch_size * lay.dp
    config: dict = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": cand.micro_batch_size,
        "gradient_accumulation_steps": train.global_batch_size // per_step,
        "zero_optimization": {"stage": lay.zero_stage},
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16"},
    }
    if cand.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": lay.tp > 1, "contiguous_memory_optimization": False}
    return config


def job_target_layout(cand: Candidate) -> dict:
    """The ``target.layout`` mapping of a migrate job (``ParallelLayout`` fields)."""
    return cand.layout.to_dict()


def job_target_section(cand: Candidate) -> dict:
    """The part of a migrate job's ``target`` section the plan decides: ``layout`` and ``micro_batch_size``."""
    return {"layout": job_target_layout(cand), "micro_batch_size": cand.micro_batch_size}


def write_configs(directory: str | Path, model: ModelShape, train: TrainingShape, cand: Candidate,
                  *, overlap_grad_reduce: bool = False) -> dict[str, Path]:
    """Write ``megatron_args.txt`` (megatron candidates), ``deepspeed.json`` and ``target_layout.yaml``."""
    import yaml

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if cand.framework == "megatron":
        paths["megatron_args"] = directory / "megatron_args.txt"
        paths["megatron_args"].write_text(
            shlex.join(megatron_args(model, train, cand, overlap_grad_reduce=overlap_grad_reduce)) + "\n", encoding="utf-8")
    paths["deepspeed"] = directory / "deepspeed.json"
    paths["deepspeed"].write_text(json.dumps(deepspeed_config(train, cand), indent=2) + "\n", encoding="utf-8")
    paths["target_layout"] = directory / "target_layout.yaml"
    paths["target_layout"].write_text(yaml.safe_dump({"target": job_target_section(cand)}, sort_keys=False),
                                      encoding="utf-8")
    return paths
