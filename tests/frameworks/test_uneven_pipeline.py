"""Uneven pipeline stages: Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
(a 61-layer DeepSeek-V3 over PP16 cannot split evenly).

The split is Megatron-Core's own (`get_transformer_layer_offset`, `get_num_layers_to_build`, the checks of its
TransformerConfig) for every combination tried. A six-layer model trained by Megatron-Core with two layers on the
first of two pipeline ranks, saved the way Megatron-LM does (torch_dist dp_reshardable, whose flat optimizer buckets
follow the split, and the legacy per-rank files, whose layer names count from each stage's first layer), is read from
its args, converted with the split kept, changed and dropped, and loaded by Megatron-LM's load path at the target
layout (the target's model built with the target's split) with every weight, fp32 master and Adam state equal.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

from checkpoint.api import LayoutRequest, convert, read_index
from checkpoint.errors import CheckpointFormatError
from checkpoint.rules.megatron import pipeline_stage_layers
from migrate.commands.inspect import describe
from tests.cli_process import run_migrate
from tests.megatron_lm_fixtures import (DEEPSEEK, LLAMA, MegatronLMRun, assert_loads_with_every_state_equal,
                                      assert_synthesized_metadata_is_megatrons, saved_runs)

SIX = dataclasses.replace(LLAMA, num_layers=6)
RUNS = {"first2": MegatronLMRun(pp=2, dp=2, first_pipeline_stage_layers=2, model=SIX),
        "last1_legacy": MegatronLMRun(pp=2, last_pipeline_stage_layers=1, model=SIX, ckpt_format="torch", precision="bf16"),
        "deepseek_first1": MegatronLMRun(pp=2, first_pipeline_stage_layers=1, model=DEEPSEEK)}
# (source, target format, target run): the split kept (DP shrunk), changed (PP3 with both ends), dropped (PP1),
# kept in the legacy files; a legacy source's split dropped when the pipeline grows (PP3, even); a DeepSeek-V3-class
# model with its dense layer alone on the first stage (per-layer keys) to EP 2 with the split kept, as at scale
CASES = [("first2", "megatron", MegatronLMRun(pp=2, dp=1, first_pipeline_stage_layers=2)),
         ("first2", "megatron", MegatronLMRun(pp=3, first_pipeline_stage_layers=1, last_pipeline_stage_layers=1)),
         ("first2", "megatron", MegatronLMRun(pp=1, dp=2)),
         ("first2", "megatron-legacy", MegatronLMRun(pp=2, dp=2, first_pipeline_stage_layers=2, ckpt_format="torch")),
         ("last1_legacy", "megatron", MegatronLMRun(pp=3)),
         ("deepseek_first1", "megatron", MegatronLMRun(pp=2, dp=2, ep=2, first_pipeline_stage_layers=1))]


def _mcore_split(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> dict | str:
    """{(pp_rank, vp_stage): layers} as Megatron-Core builds them, or why it cannot."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                       pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                       virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                       num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        split = {}
        for p, v in itertools.product(range(pp), range(vpp)):
            stage = v if vpp > 1 else None
            start = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=p)
            split[p, v] = range(start, start + get_num_layers_to_build(config, vp_stage=stage, pp_rank=p))
    except (ValueError, AssertionError, ZeroDivisionError) as err:
        return type(err).__name__
    if sorted(i for r in split.values() for i in r) != list(range(num_layers)):
        return "layers not covered once"  # Megatron-LM's argument checks refuse these
    return split


def test_the_pipeline_split_is_megatron_cores():
    agreed = refused = 0
    for num_layers, pp, vpp, first, last in itertools.product((6, 7, 8, 12, 61), (2, 3, 4, 16), (1, 2),
                                                             (None, 1, 2, 4), (None, 1, 2, 3)):
        want = _mcore_split(num_layers, pp, vpp, first, last)
        try:
            got = {(p, v): pipeline_stage_layers(num_layers, pp, vpp, p, v, first_pipeline_stage_layers=first,
                                                 last_pipeline_stage_layers=last)
                   for p, v in itertools.product(range(pp), range(vpp))}
        except CheckpointFormatError as err:
            assert isinstance(want, str), f"{num_layers, pp, vpp, first, last}: refused ({err}) but Megatron-Core builds {want}"
            assert f"num_layers({num_layers})" in str(err) and f"pp({pp})" in str(err)
            refused += 1
            continue
        assert got == want, (num_layers, pp, vpp, first, last)
        agreed += 1
    assert agreed > 100 and refused > 100  # both sides exercised


@pytest.fixture(scope="session")
def uneven_checkpoint(tmp_path_factory):
    return saved_runs(tmp_path_factory, RUNS, "mlm_uneven_")


@pytest.mark.slow
@pytest.mark.parametrize("name,to,target", CASES, ids=[f"{n}-to-{t}-{r.name.split('_')[0]}" for n, t, r in CASES])
def test_megatron_lm_loads_the_uneven_pipeline_conversion_with_every_state_equal(uneven_checkpoint, tmp_path, name, to,
                                                                                 target):
    src, saved, truth = uneven_checkpoint(name)
    source = RUNS[name]
    index = read_index(src)
    assert (index.meta["pp"], index.meta["first_pipeline_stage_layers"], index.meta["last_pipeline_stage_layers"]) == \
        (2, source.first_pipeline_stage_layers, source.last_pipeline_stage_layers)  # from Megatron-LM's args
    shown = describe(index)["layout"]  # what `migrate inspect` prints
    assert (shown.get("first_pipeline_stage_layers"), shown.get("last_pipeline_stage_layers")) == \
        (source.first_pipeline_stage_layers, source.last_pipeline_stage_layers)
    dst = tmp_path / "converted"
    request = LayoutRequest(tp=target.tp, pp=target.pp, dp=target.dp, ep=target.ep,
                            first_pipeline_stage_layers=target.first_pipeline_stage_layers,
                            last_pipeline_stage_layers=target.last_pipeline_stage_layers)
    if (target.pp, target.first_pipeline_stage_layers, target.last_pipeline_stage_layers) == \
            (source.pp, source.first_pipeline_stage_layers, source.last_pipeline_stage_layers):
        # kept from the source by default
        request = dataclasses.replace(request, first_pipeline_stage_layers=None, last_pipeline_stage_layers=None)
    convert(src, dst, to=to, target=request)
    out = read_index(dst)
    assert (out.meta["pp"], out.meta["first_pipeline_stage_layers"], out.meta["last_pipeline_stage_layers"]) == \
        (target.pp, target.first_pipeline_stage_layers, target.last_pipeline_stage_layers)
    run = dataclasses.replace(target, model=source.model, precision=source.precision)
    assert_loads_with_every_state_equal(run, dst, tmp_path / "loaded", truth, what=f"the {name} source")


@pytest.mark.slow
def test_splits_that_do_not_fit_are_refused_in_one_line(uneven_checkpoint, tmp_path):
    """A target pipeline the six layers do not split over, stage layers for a format without stages, and a Megatron-LM
    pipeline layout string the rules do not place: one line naming the numbers or the field, exit 2, nothing written."""
    src, _, _ = uneven_checkpoint("first2")
    cases = [(["--to", "megatron", "--pp", "4"], "num_layers(6) is not divisible by pp(4) * vpp(1)"),
             (["--to", "megatron", "--pp", "4", "--first-pipeline-stage-layers", "3", "--last-pipeline-stage-layers", "2"],
              "the 1 remaining layer(s) do not split evenly over 2 middle pipeline rank(s)"),
             (["--to", "dcp", "--first-pipeline-stage-layers", "3"], "only megatron and megatron-legacy targets place")]
    for i, (flags, expected) in enumerate(cases):
        out = run_migrate(["convert", str(src), str(tmp_path / f"out{i}"), *flags])
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert expected in out.stderr.strip().splitlines()[-1], out.stderr
        assert not (tmp_path / f"out{i}").exists()

    import shutil

    laid_out = tmp_path / "laid_out"
    shutil.copytree(src, laid_out, ignore=shutil.ignore_patterns("reference"))
    common_pt = next(laid_out.glob("iter_*/common.pt"))
    common = torch.load(common_pt, weights_only=False)
    common["args"].pipeline_model_parallel_layout = "Et|ttttL"
    torch.save(common, common_pt)
    out = run_migrate(["inspect", str(laid_out)])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "pipeline_model_parallel_layout" in out.stderr and "not read yet" in out.stderr, out.stderr


@pytest.mark.slow
def test_synthesized_metadata_of_an_uneven_split_is_megatron_lms(uneven_checkpoint):
    """The metadata `scripts/plan_at_scale.py` plans from, for this run's layout: the DCP keys, global sizes and dtypes
    Megatron-LM wrote (the dp_reshardable buckets sized by the split), and the same index after reading."""
    from checkpoint.layout import OptimizerSharding, ParallelLayout

    src, _, _ = uneven_checkpoint("first2")
    layout = ParallelLayout(pp=2, dp=2, first_pipeline_stage_layers=2, sharding=OptimizerSharding.DISTRIBUTED_OPTIMIZER)
    assert_synthesized_metadata_is_megatrons(next(src.glob("iter_*")), layout)
