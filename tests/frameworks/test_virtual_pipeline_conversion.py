"""A virtual-pipeline run moved to a plain pipeline (and back) continues the same loss curve: the vPP
chunks' layers land where Megatron-Core executes them, and the interleaved schedule computes the same
model as the 1F1B one (on Gloo only with one point-to-point op at a time: see migrate.workload.megatron.engine)."""

from __future__ import annotations

import dataclasses

import pytest

from checkpoint.api import LayoutRequest, convert, read_index
from migrate.workload.fixtures import TINY_LLAMA, launch
from migrate.workload.run_spec import RunSpec, TrainSpec


@pytest.mark.slow
def test_vpp2_checkpoint_resumes_at_pp2_with_the_losses_of_its_own_run(tmp_path):
    model = dataclasses.replace(TINY_LLAMA, num_layers=4)
    spec = RunSpec(engine="megatron", model=model, steps=3, pp=2, vpp=2, distributed_optimizer=True, save_every=2,
                   save_dir=str(tmp_path / "vpp2"), train=TrainSpec(global_batch_size=12, precision="fp32"))
    own = launch(spec, 2)[0].losses  # steps 1-3 of the vPP2 run; it saved iter_0000002
    flat = tmp_path / "pp2"
    convert(tmp_path / "vpp2" / "iter_0000002", flat, to="megatron", target=LayoutRequest(vpp=1))
    assert read_index(flat).meta["vpp"] == 1
    resumed = launch(dataclasses.replace(spec, vpp=1, load_dir=str(flat), save_dir=None, save_every=0), 2)[0].losses
    assert resumed[0] == pytest.approx(own[2], rel=1e-6), (resumed, own)
