"""A user's own launch line as a workload: template filling, torchrun env per rank, metrics from logs."""
import sys

import pytest

from convergence.readers import read_metrics
from migrate.workload.external import render_command, run_external

MEGATRON = ("pretrain_gpt.py --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
            "--load {load} --save {save}")


def test_template_is_filled_and_quoted():
    argv = render_command(MEGATRON, {"tp": 2, "pp": 4, "load": "/ck pt/in", "save": "/out"})
    assert argv == ["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                    "--load", "/ck pt/in", "--save", "/out"]


def test_template_names_unknown_and_missing_placeholders():
    with pytest.raises(ValueError, match=r"unknown placeholders \['tpp'\]"):
        render_command("x {tpp}", {"tpp": 1})
    with pytest.raises(ValueError, match=r"needs values for \['save'\]"):
        render_command(MEGATRON, {"tp": 1, "pp": 1, "load": "a"})


def test_megatron_log_lines_become_metrics(tmp_path):
    log = "\n".join([
        " [2026-01-01 10:00:00] iteration        1/      10 | consumed samples:            8 | elapsed time per "
        "iteration (ms): 812.5 | learning rate: 1.500000E-04 | global batch size:     8 | lm loss: 1.093750E+01 | "
        "loss scale: 1.0 | grad norm: 3.217 | number of skipped iterations:   0 |",
        "some other line",
        " [2026-01-01 10:00:01] iteration        2/      10 | consumed samples:           16 | elapsed time per "
        "iteration (ms): 640.1 | learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 1.012500E+01 | "
        "loss scale: 1.0 | grad norm: nan |"])
    (tmp_path / "rank0.log").write_text(log)
    run = read_metrics(tmp_path / "rank0.log")
    loss, grad_norm, lr = run.find("loss"), run.find("grad_norm"), run.find("lr")
    assert loss.steps == (1, 2) and loss.values == (10.9375, 10.125)
    assert grad_norm.values[0] == 3.217 and grad_norm.values[1] != grad_norm.values[1]  # NaN kept
    assert lr.values == (1.5e-4, 3e-4)


def test_tensorboard_scalars_become_metrics(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step, loss in [(1, 5.0), (2, 4.5)]:
            writer.add_scalar("lm loss", loss, step)
            writer.add_scalar("grad-norm", 1.0 / step, step)
    run = read_metrics(tmp_path)
    assert run.find("loss").values == (5.0, 4.5) and run.find("grad_norm").values == (1.0, 0.5)


@pytest.mark.slow
def test_command_runs_on_every_rank_with_torchrun_env(tmp_path):
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group

    script = ("import os; print('iteration 1/1 | lm loss: %s |' % os.environ['RANK'], os.environ['WORLD_SIZE'], "
              "os.environ['MASTER_PORT'])")
    with start_worker_group(WorkerGroupSpec(world_size=2, mode="local", init_distributed=False)) as group:
        results = group.run(run_external, [sys.executable, "-c", script], str(tmp_path))
    assert [r.returncode for r in results] == [0, 0]
    for r in results:
        text = open(r.log_path).read()
        assert read_metrics(r.log_path, "megatron").find("loss").values == (float(r.rank),)
        assert text.split()[-2] == "2"
