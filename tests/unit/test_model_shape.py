"""One model shape: the job's `model` section, the search, the built-in workloads and the checkpoint rules take the
same `checkpoint.model_shape.ModelShape`, and a shape that cannot do what is asked is refused naming the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from checkpoint.errors import CheckpointFormatError
from checkpoint.model_shape import TENSOR_FIELDS, ModelShape, ModelShapeError
from migrate.cli import main
from migrate.job.load import load_job
from migrate.job.schema import ModelSection
from migrate.search.problem import model_shape, workload_specs
from migrate.workload.from_job import run_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", ["demo_cpu.yaml", "mixtral_ep8_to_ep4.yaml", "llama70b_h100_to_910b.yaml"])
def test_a_job_model_is_the_shape_the_search_plans_and_the_workload_trains(config):
    job = load_job(REPO / "configs" / config)
    shape = model_shape(job)
    assert {f.name for f in dataclasses.fields(ModelShape)} == set(ModelSection.model_fields)
    assert shape == job.spec.model.to_shape() == workload_specs(job)[0]
    assert shape.make_vocab_size_divisible_by == job.spec.model.make_vocab_size_divisible_by
    if config == "demo_cpu.yaml":
        spec = run_spec(job.spec, job.spec.source.layout.to_layout(), engine="deepspeed", steps=1, save_dir=None,
                        load_dir=None, save_every=0, metrics_path=None)
        assert spec.model == shape


def test_a_shape_read_from_a_checkpoint_says_no_sequence_length_and_is_not_trained_or_searched():
    from migrate.workload.run_spec import RunSpec, TrainSpec
    from parallel_search.space import enumerate_space
    from parallel_search.spec import ClusterShape, SpecError, TrainingShape

    shape = ModelShape(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=128)
    assert shape.seq_length == 0 and set(shape.tensor_fields()) == set(TENSOR_FIELDS)
    with pytest.raises(ValueError, match=r"model.seq_length=0 must be >= 1 to train"):
        RunSpec(engine="deepspeed", model=shape, train=TrainSpec(), steps=1)
    with pytest.raises(SpecError, match=r"model.seq_length=0: the search needs"):
        enumerate_space(shape, TrainingShape(global_batch_size=8), ClusterShape(device_count=2, devices_per_node=2))


@pytest.mark.parametrize(("change", "message"), [
    ({"architecture": "gemma"}, "model.architecture='gemma': expected one of gpt, llama, mixtral"),
    ({"num_query_groups": 3}, r"num_attention_heads\(4\) is not divisible by num_query_groups\(3\)"),
    ({"hidden_size": 60, "num_attention_heads": 4}, r"head dim 60//4 must be even for rotary"),
    ({"architecture": "mixtral"}, "architecture 'mixtral' needs num_experts >= 2, got 0"),
    ({"num_experts": 4}, "model.num_experts=4 needs architecture 'mixtral' or 'qwen3_moe' or 'deepseek_v3', got 'llama'"),
])
def test_numbers_that_do_not_fit_name_the_field(change, message):
    base = dict(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, vocab_size=128)
    with pytest.raises(ModelShapeError, match=message) as caught:
        ModelShape(**(base | change))
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, CheckpointFormatError)


def test_a_job_with_an_odd_head_size_is_refused_by_validate(tmp_path):
    import yaml

    data = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    data["work_dir"] = str(tmp_path / "work")
    data["model"] |= {"hidden_size": 60, "num_attention_heads": 4, "num_query_groups": 2}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    assert "head dim 60//4 must be even for rotary" in result.output and "Traceback" not in result.output
