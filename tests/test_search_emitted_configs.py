"""The configs a search emits: Megatron-LM arguments, DeepSpeed JSON and the job's target layout,
and the built-in workloads started from them at the chosen layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from checkpoint.layout import OptimizerSharding, ParallelLayout
from migrate.job.schema import LayoutSection
from parallel_search.emit import deepspeed_config, job_target_layout, megatron_args, write_configs
from parallel_search.space import Candidate
from parallel_search.spec import ModelShape, TrainingShape

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                   vocab_size=128, seq_length=32, make_vocab_size_divisible_by=1)
REPO = Path(__file__).resolve().parents[1]
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
    from migrate.workload.model_spec import TrainSpec

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
