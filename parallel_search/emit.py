"""Runnable configs for a chosen candidate: Megatron-LM arguments, a DeepSpeed JSON, the job's
``target.layout`` section. Pure functions returning plain values; ``write_configs`` writes them.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from checkpoint.layout import OptimizerSharding
from checkpoint.model_shape import ModelShape
from parallel_search.space import Candidate
from parallel_search.spec import TrainingShape


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """What a launch needs besides the model, the batch and the plan: the optimizer (AdamW: Megatron-LM's
    `adam` is decoupled weight decay), the learning-rate schedule, clipping, iterations, seed, and the model
    constants a config must state (rotary base, norm epsilon)."""

    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # None: train_iters
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    train_iters: int
    seed: int = 1234
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5


def _number(value: float) -> str:
    """A number as Megatron-LM's parser takes it (integral values without a fraction: its --rotary-base is an int)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def megatron_recipe_args(recipe: Recipe) -> list[str]:
    """Megatron-LM arguments of the optimizer, schedule, clipping, iterations, seed and model constants."""
    return ["--optimizer", "adam", "--lr", repr(recipe.lr), "--min-lr", repr(recipe.min_lr),
            "--weight-decay", repr(recipe.weight_decay), "--adam-beta1", repr(recipe.beta1),
            "--adam-beta2", repr(recipe.beta2), "--adam-eps", repr(recipe.eps), "--clip-grad", repr(recipe.clip_grad),
            "--lr-decay-style", recipe.decay_style, "--lr-warmup-iters", str(recipe.warmup_iters),
            "--lr-decay-iters", str(recipe.decay_iters or recipe.train_iters), "--train-iters", str(recipe.train_iters),
            "--seed", str(recipe.seed), "--rotary-base", _number(recipe.rotary_base),
            "--norm-epsilon", repr(recipe.norm_eps)]


def megatron_args(model: ModelShape, train: TrainingShape, cand: Candidate, *, overlap_grad_reduce: bool = False,
                  recipe: Recipe | None = None) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments for the model, batch and parallel plan, and with `recipe` the
    optimizer, schedule and the rest a launch needs (the data and tokenizer arguments stay the user's)."""
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
    if model.qkv_bias:
        args += ["--add-qkv-bias"]
    if model.qk_norm or model.is_mla:
        args += ["--qk-layernorm"]
    if model.is_mla:  # DeepSeek-V3: MLA, first-k dense layers, shared experts, the aux-loss-free router
        args += ["--multi-latent-attention", "--kv-lora-rank", str(model.kv_lora_rank),
                 "--qk-head-dim", str(model.qk_head_dim), "--qk-pos-emb-head-dim", str(model.qk_pos_emb_head_dim),
                 "--v-head-dim", str(model.v_head_dim), "--moe-layer-freq", f"[{','.join(map(str, model.moe_layer_freq))}]",
                 "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
        if model.q_lora_rank:
            args += ["--q-lora-rank", str(model.q_lora_rank)]
        if model.shared_expert_ffn_hidden_size:
            args += ["--moe-shared-expert-intermediate-size", str(model.shared_expert_ffn_hidden_size)]
    if not model.tied_embeddings:
        args += ["--untie-embeddings-and-output-weights"]
    if model.is_moe:
        args += ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_top_k)]
        if model.moe_ffn_hidden_size:
            args += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
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
    if recipe is not None:
        args += megatron_recipe_args(recipe)
    return args


def deepspeed_recipe(recipe: Recipe) -> dict:
    """The DeepSpeed config's optimizer (AdamW), scheduler and gradient clipping.

    DeepSpeed's schedulers with linear warm-up from 0 (WarmupCosineLR, WarmupDecayLR, WarmupLR) give, iteration
    by iteration, Megatron-LM's learning rate for the same recipe within one iteration: DeepSpeed steps its
    scheduler after the optimizer and counts from -1. Without warm-up they start at the peak and stay there for
    the two warm-up steps DeepSpeed always takes (its decay up to three iterations behind Megatron-LM's).
    WarmupDecayLR ends its linear decay at its warm-up start, so its warm-up starts at `min_lr` instead of 0, and
    without warm-up it still takes those two steps from `min_lr`."""
    decay = recipe.decay_iters or recipe.train_iters
    warmup = max(recipe.warmup_iters, 1)
    cold = recipe.warmup_iters == 0
    if recipe.decay_style == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": warmup, "warmup_type": "linear",
            "warmup_min_ratio": 1.0 if cold else 0.0, "cos_min_ratio": recipe.min_lr / recipe.lr if recipe.lr else 0.0}}
    elif recipe.decay_style == "linear":
        scheduler = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": warmup, "warmup_type": "linear",
            "warmup_min_lr": recipe.min_lr, "warmup_max_lr": recipe.lr}}
    else:
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_num_steps": warmup, "warmup_type": "linear", "warmup_min_lr": recipe.lr if cold else 0.0,
            "warmup_max_lr": recipe.lr}}
    return {"optimizer": {"type": "AdamW", "params": {"lr": recipe.lr, "betas": [recipe.beta1, recipe.beta2],
                                                      "eps": recipe.eps, "weight_decay": recipe.weight_decay}},
            "scheduler": scheduler, "gradient_clipping": recipe.clip_grad}


def deepspeed_config(train: TrainingShape, cand: Candidate, recipe: Recipe | None = None) -> dict:
    """A DeepSpeed config for the plan (batch sizes, ZeRO stage, precision, activation checkpointing), and with
    `recipe` its optimizer, scheduler and clipping."""
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
    if recipe is not None:
        config.update(deepspeed_recipe(recipe))
    return config


def job_target_layout(cand: Candidate) -> dict:
    """The ``target.layout`` mapping of a migrate job (``ParallelLayout`` fields)."""
    return cand.layout.to_dict()


def job_target_section(cand: Candidate) -> dict:
    """The part of a migrate job's ``target`` section the plan decides: ``layout`` and ``micro_batch_size``."""
    return {"layout": job_target_layout(cand), "micro_batch_size": cand.micro_batch_size}


def megatron_launch_script(args: list[str], cand: Candidate, devices_per_node: int) -> str:
    """A bash script that starts Megatron-LM's ``pretrain_gpt.py`` with `args` under torchrun on every node: the
    environment Megatron-LM requires (CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism), the
    node count the layout needs, and the user's data and tokenizer arguments appended."""
    world = cand.layout.world_size
    per_node = min(devices_per_node, world)
    nodes = -(-world // per_node)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Megatron-LM pretrain_gpt.py at {cand.layout.describe()} on {world} devices ({nodes} node(s) of {per_node}),",
        "# written by migrate search. Run it on every node with NODE_RANK, MASTER_ADDR and MASTER_PORT set, and",
        "# MEGATRON_LM pointing at your Megatron-LM checkout; append the data and tokenizer arguments:",
        "#   MEGATRON_LM=~/Megatron-LM NODE_RANK=0 MASTER_ADDR=node0 ./megatron_launch.sh --data-path ... --tokenizer-type ...",
        "set -euo pipefail",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        f'exec torchrun --nproc-per-node "${{NPROC_PER_NODE:-{per_node}}}" --nnodes "${{NNODES:-{nodes}}}" '
        '--node-rank "${NODE_RANK:-0}" \\',
        '  --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \\',
        '  "${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}/pretrain_gpt.py" \\',
        f"  {shlex.join(args)} \"$@\"",
        ""])


def write_configs(directory: str | Path, model: ModelShape, train: TrainingShape, cand: Candidate,
                  *, overlap_grad_reduce: bool = False, recipe: Recipe | None = None,
                  devices_per_node: int = 8) -> dict[str, Path]:
    """Write ``megatron_args.txt`` and ``megatron_launch.sh`` (megatron candidates), ``deepspeed.json`` and
    ``target_layout.yaml``."""
    import yaml

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if cand.framework == "megatron":
        args = megatron_args(model, train, cand, overlap_grad_reduce=overlap_grad_reduce, recipe=recipe)
        paths["megatron_args"] = directory / "megatron_args.txt"
        paths["megatron_args"].write_text(shlex.join(args) + "\n", encoding="utf-8")
        paths["megatron_launch"] = directory / "megatron_launch.sh"
        paths["megatron_launch"].write_text(megatron_launch_script(args, cand, devices_per_node), encoding="utf-8")
        paths["megatron_launch"].chmod(0o755)
    paths["deepspeed"] = directory / "deepspeed.json"
    paths["deepspeed"].write_text(json.dumps(deepspeed_config(train, cand, recipe), indent=2) + "\n", encoding="utf-8")
    paths["target_layout"] = directory / "target_layout.yaml"
    paths["target_layout"].write_text(yaml.safe_dump({"target": job_target_section(cand)}, sort_keys=False),
                                      encoding="utf-8")
    return paths
