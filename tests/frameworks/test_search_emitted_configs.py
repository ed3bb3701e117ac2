"""The configs a search emits: Megatron-LM arguments, DeepSpeed JSON and the job's target layout,
and the built-in workloads started from them at the chosen layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from checkpoint.layout import OptimizerSharding, ParallelLayout
from checkpoint.model_shape import ModelShape
from migrate.job.schema import LayoutSection
from parallel_search.emit import Recipe, deepspeed_config, job_target_layout, megatron_args, write_configs
from parallel_search.space import Candidate
from parallel_search.spec import TrainingShape

SHAPE = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, vocab_size=128, seq_length=32, make_vocab_size_divisible_by=1)
REPO = Path(__file__).resolve().parents[2]
TRAIN = TrainingShape(global_batch_size=8, precision="fp32")


def test_megatron_arguments_name_the_layout():
    cand = Candidate(framework="megatron", layout=ParallelLayout(tp=2, pp=2, vpp=1, dp=2,
                     sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER), micro_batch_size=2, sequence_parallel=True,
                     recompute="full")
    args = megatron_args(SHAPE, TrainingShape(global_batch_size=8, precision="bf16"), cand)
    text = " ".join(args)
    for piece in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2", "--micro-batch-size 2",
                  "--global-batch-size 8", "--sequence-parallel", "--use-distributed-optimizer",
                  "--recompute-granularity full", "--group-query-attention --num-query-groups 2", "--swiglu", "--bf16"):
        assert piece in text


def test_deepspeed_json_and_target_layout_validate():
    cand = Candidate(framework="deepspeed", layout=ParallelLayout(dp=4, sharding=OptimizerSharding.ZERO2), micro_batch_size=1)
    config = deepspeed_config(TRAIN, cand)
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"]["stage"] == 2
    section = LayoutSection(**job_target_layout(cand))
    assert section.to_layout() == cand.layout


def test_emitted_target_section_carries_the_micro_batch_into_a_valid_job(tmp_path):
    """The job fragment the search writes is the job's whole `target` decision: layout and micro batch;
    a job given it validates, and a micro batch the global batch cannot take is refused naming both."""
    from migrate.job.load import JobError, load_job

    cand = Candidate(framework="deepspeed", layout=ParallelLayout(dp=2, sharding=OptimizerSharding.ZERO1),
                     micro_batch_size=2)
    paths = write_configs(tmp_path / "chosen", SHAPE, TRAIN, cand)
    fragment = yaml.safe_load(paths["target_layout"].read_text())["target"]
    assert fragment == {"layout": cand.layout.to_dict(), "micro_batch_size": 2}
    base = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    base["target"].update(fragment)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(base))
    job = load_job(tmp_path / "job.yaml")
    assert job.spec.target.layout.to_layout() == cand.layout and job.spec.target.micro_batch_size == 2
    base["target"]["micro_batch_size"] = 3
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(JobError, match=r"target.layout: training.global_batch_size\(8\) is not a multiple of "
                                       r"micro_batch_size\(3\) \* dp\(2\) = 6"):
        load_job(tmp_path / "bad.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("cand", [
    Candidate(framework="megatron", layout=ParallelLayout(tp=1, pp=2, dp=1), micro_batch_size=2),
    Candidate(framework="deepspeed", layout=ParallelLayout(dp=2, sharding=OptimizerSharding.ZERO1), micro_batch_size=2),
], ids=["megatron-pp2", "deepspeed-zero1"])
def test_emitted_configs_start_the_workload_at_the_chosen_layout(tmp_path, cand):
    from migrate.search.launch import run_spec_from_configs
    from migrate.workload.fixtures import TINY_LLAMA, launch
    from migrate.workload.run_spec import TrainSpec

    paths = write_configs(tmp_path, SHAPE, TRAIN, cand)
    assert yaml.safe_load(paths["target_layout"].read_text())["target"]["layout"]["pp"] == cand.layout.pp
    json.loads(paths["deepspeed"].read_text())
    spec = run_spec_from_configs(tmp_path, TINY_LLAMA, TrainSpec(global_batch_size=8, precision="fp32"), steps=2)
    assert (spec.tp, spec.pp, spec.zero_stage, spec.train.micro_batch_size) == (
        cand.layout.tp, cand.layout.pp, cand.layout.zero_stage, cand.micro_batch_size)
    results = launch(spec, world_size=2)
    assert len(results) == 2 and all(len(r.metrics) == 2 for r in results)
    if cand.framework == "megatron":
        assert results[0].extra["pp"] == 2 and results[0].extra["dp"] == 1


# --- Judged by the frameworks' own code: Megatron-LM's parse_args + validate_args, DeepSpeed's DeepSpeedConfig
# and its LR schedulers, Megatron-Core's OptimizerParamScheduler.

MEGATRON_LM = REPO / ".venv" / "reference" / "megatron-lm"
RECIPES = {
    "cosine-warmup": Recipe(lr=3e-4, min_lr=3e-5, weight_decay=0.1, beta2=0.95, eps=1e-8, clip_grad=1.0,
                            warmup_iters=10, decay_iters=50, train_iters=60, seed=42, rotary_base=500000.0,
                            norm_eps=1e-5),
    "linear-cold": Recipe(lr=1e-3, min_lr=1e-4, warmup_iters=0, decay_style="linear", train_iters=40,
                          rotary_base=10000.0, norm_eps=1e-6),
    "constant-warmup": Recipe(lr=2e-4, warmup_iters=5, decay_style="constant", train_iters=30, clip_grad=0.0),
}


def _megatron_lm_judge(requests: list[dict]) -> list[dict]:
    """Megatron-LM's verdict on each request (argv, world size, environment) from one process."""
    import os
    import subprocess
    import sys

    assert (MEGATRON_LM / "megatron" / "training" / "arguments.py").is_file(), \
        f"{MEGATRON_LM}: Megatron-LM's reference sources are missing; run ./scripts/setup"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "reference" / "megatron_lm_arguments.py")],
                          input=json.dumps(requests), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(MEGATRON_LM)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _megatron_candidates() -> list[tuple[ModelShape, Candidate]]:
    """Every Megatron layout the search space offers for a dense and a MoE model on 8 devices and a dense one on 6,
    each once, with the micro batch, recompute and sequence-parallel choices taken in turn."""
    from parallel_search.space import SpaceOptions, enumerate_space
    from parallel_search.spec import ClusterShape

    moe = ModelShape(architecture="mixtral", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=4,
                     vocab_size=128, seq_length=32, make_vocab_size_divisible_by=1, num_experts=4, moe_top_k=2)
    dense = ModelShape(architecture="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128, seq_length=64, make_vocab_size_divisible_by=1)
    out = []
    for model, world, precision in ((dense, 8, "bf16"), (moe, 8, "bf16"), (dense, 6, "fp32")):
        space = enumerate_space(model, TrainingShape(global_batch_size=24 if world == 6 else 16, precision=precision),
                                ClusterShape(device_count=world, devices_per_node=8),
                                SpaceOptions(frameworks=("megatron",), micro_batch_sizes=(1, 2)))
        by_layout: dict = {}
        for cand in space.valid:
            by_layout.setdefault(cand.layout, []).append(cand)
        out += [(model, cands[i % len(cands)]) for i, cands in enumerate(by_layout.values())]
    return out


@pytest.mark.slow
def test_megatron_lm_parses_and_validates_every_emitted_plan(tmp_path):
    """Each Megatron plan the search can choose, with each recipe, goes through Megatron-LM 0.19.2's own
    `parse_args` and `validate_args` at its world size in the environment the emitted launch script sets, and
    Megatron-LM reads back the layout, batch, model, precision, optimizer and schedule the plan and recipe say."""
    plans = _megatron_candidates()
    assert len(plans) > 100
    cases, requests = [], []
    for i, (model, cand) in enumerate(plans):
        name, recipe = list(RECIPES.items())[i % len(RECIPES)]
        train = TrainingShape(global_batch_size=24 if cand.layout.world_size == 6 else 16,
                              precision="fp32" if cand.layout.world_size == 6 else "bf16")
        paths = write_configs(tmp_path / str(i), model, train, cand, recipe=recipe, devices_per_node=8)
        argv = __import__("shlex").split(paths["megatron_args"].read_text())
        assert paths["megatron_launch"].read_text().count(__import__("shlex").join(argv)) == 1
        cases.append((model, cand, train, recipe))
        requests.append({"argv": argv, "world_size": cand.layout.world_size})
    # The judge refuses what Megatron-LM refuses: an unknown flag, and TP > 1 outside the launch script's env.
    requests += [{"argv": ["--num-layers", "2", "--no-such-flag"], "world_size": 1},
                 {"argv": requests[0]["argv"], "world_size": requests[0]["world_size"]}]
    judged = _megatron_lm_judge([{**r, "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}} for r in requests[:-1]]
                                + [{**requests[-1], "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}}])
    assert "unrecognized arguments: --no-such-flag" in judged[-2]["error"]
    if plans[0][1].layout.tp > 1:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in judged[-1]["error"]
    errors = [f"{c[1].key}: {j['error']}" for c, j in zip(cases, judged) if "error" in j]
    assert not errors, "\n".join(errors)
    for (model, cand, train, recipe), result in zip(cases, judged):
        a, lay = result["args"], cand.layout
        expected = {
            "tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
            "context_parallel_size": lay.cp, "expert_model_parallel_size": lay.ep,
            "virtual_pipeline_model_parallel_size": lay.vpp if lay.vpp > 1 else None,
            "data_parallel_size": lay.world_size // (lay.tp * lay.pp * lay.cp),
            "micro_batch_size": cand.micro_batch_size, "global_batch_size": train.global_batch_size,
            "num_layers": model.num_layers, "hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "group_query_attention": model.num_query_groups != model.num_attention_heads,
            "seq_length": model.seq_length, "num_experts": model.num_experts or None,
            "params_dtype": {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[train.precision],
            "use_distributed_optimizer": lay.sharding is OptimizerSharding.DISTRIBUTED_OPTIMIZER,
            "sequence_parallel": cand.sequence_parallel,
            "recompute_granularity": {"none": None, "full": "full", "selective": "selective"}[cand.recompute],
            "swiglu": True, "normalization": "RMSNorm", "untie_embeddings_and_output_weights": True,
            "optimizer": "adam", "lr": recipe.lr, "min_lr": recipe.min_lr, "weight_decay": recipe.weight_decay,
            "adam_beta1": recipe.beta1, "adam_beta2": recipe.beta2, "adam_eps": recipe.eps,
            "clip_grad": recipe.clip_grad, "lr_decay_style": recipe.decay_style,
            "lr_warmup_iters": recipe.warmup_iters, "lr_decay_iters": recipe.decay_iters or recipe.train_iters,
            "train_iters": recipe.train_iters, "seed": recipe.seed, "rotary_base": recipe.rotary_base,
            "layernorm_epsilon": recipe.norm_eps,
        }
        if a["group_query_attention"]:
            expected["num_query_groups"] = model.num_query_groups
        got = {k: a[k] for k in expected}
        assert got == expected, (cand.key, {k: (got[k], v) for k, v in expected.items() if got[k] != v})


class _DataParallel:
    """What DeepSpeedConfig asks of an mpu: the data-parallel world size."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _lrs(scheduler_step, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(float(optimizer.param_groups[0]["lr"]))
        scheduler_step()
    return out


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_reads_the_emitted_config_and_schedules_megatron_lms_learning_rate(monkeypatch, recipe_name,
                                                                                    zero_stage):
    """DeepSpeed's own DeepSpeedConfig takes the emitted JSON at its data-parallel size (batch arithmetic, ZeRO
    stage, precision, AdamW, clipping), and the scheduler DeepSpeed builds from it gives, iteration by iteration,
    the learning rate Megatron-Core's OptimizerParamScheduler gives for the same recipe, within one iteration
    (three without warm-up)."""
    import deepspeed.comm
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DeepSpeedConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    recipe = RECIPES[recipe_name]
    sharding = {1: OptimizerSharding.ZERO1, 2: OptimizerSharding.ZERO2, 3: OptimizerSharding.ZERO3}[zero_stage]
    cand = Candidate(framework="deepspeed", layout=ParallelLayout(dp=3, sharding=sharding), micro_batch_size=2)
    train = TrainingShape(global_batch_size=12, precision="bf16")
    config = json.loads(write_configs(Path(__import__("tempfile").mkdtemp()), SHAPE, train, cand,
                                      recipe=recipe)["deepspeed"].read_text())
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    ds = DeepSpeedConfig(config, mpu=_DataParallel(cand.layout.dp))
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (12, 2, 2)
    assert (ds.zero_optimization_stage, ds.bfloat16_config.enabled, ds.optimizer_name) == (zero_stage, True, "adamw")
    assert ds.optimizer_params["lr"] == recipe.lr and ds.optimizer_params["betas"] == [recipe.beta1, recipe.beta2]
    assert ds.optimizer_params["weight_decay"] == recipe.weight_decay and ds.gradient_clipping == recipe.clip_grad

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=recipe.lr)

    ds_opt = optimizer()
    ds_sched = getattr(lr_schedules, ds.scheduler_name)(ds_opt, **ds.scheduler_params)
    ds_lrs = _lrs(ds_sched.step, ds_opt, recipe.train_iters)
    mg_opt, gbs = optimizer(), train.global_batch_size
    decay = recipe.decay_iters or recipe.train_iters
    mg_sched = OptimizerParamScheduler(mg_opt, init_lr=0.0, max_lr=recipe.lr, min_lr=recipe.min_lr,
                                       lr_warmup_steps=recipe.warmup_iters * gbs, lr_decay_steps=decay * gbs,
                                       lr_decay_style=recipe.decay_style, start_wd=recipe.weight_decay,
                                       end_wd=recipe.weight_decay, wd_incr_steps=decay * gbs, wd_incr_style="constant")
    mg_lrs = _lrs(lambda: mg_sched.step(increment=gbs), mg_opt, recipe.train_iters)
    # WarmupDecayLR warms up from min_lr (its decay ends where its warm-up starts): judged after warm-up.
    # Without warm-up DeepSpeed still spends two steps at the peak (it warms up for at least two): up to three.
    first = max(recipe.warmup_iters, 2) + 1 if recipe.decay_style == "linear" else 0
    reach = 1 if recipe.warmup_iters else 3
    for i in range(first, recipe.train_iters):
        near = mg_lrs[max(i - reach, 0):i + reach + 1]
        assert min(near) - 1e-12 <= ds_lrs[i] <= max(near) + 1e-12, (i, ds_lrs[i], near)
