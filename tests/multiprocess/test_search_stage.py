"""``migrate search``: the stage on a CPU job (real Gloo profiling), its files, resume, and
``--measure`` filling a device profile from live ranks."""
from __future__ import annotations

import json

import pytest
import yaml

JOB = {
    "name": "search-cpu",
    "source": {"layout": {"dp": 2}, "cluster": {"device_type": "cpu", "device_count": 2}},
    "target": {"device_type": "cpu", "device_count": 2, "backend": "gloo", "device_profile": "cpu", "timeout_s": 300},
    "model": {"architecture": "llama", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
              "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 128, "seq_length": 32,
              "make_vocab_size_divisible_by": 8},
    "training": {"global_batch_size": 8, "precision": "fp32"},
    "stages": {"search": {"micro_batch_sizes": [1, 2], "vpp": [1], "sequence_parallel": "both",
                          "max_fraction": 0.5, "min_steps": 1, "max_steps": 2}},
}


class _Tracker:
    def __init__(self):
        self.logged = []

    def log_metrics(self, step, metrics, prefix=""):
        self.logged.append((prefix, dict(metrics)))

    def log_table(self, stage, name, columns, rows):
        self.logged.append((f"{stage}/{name}", {"rows": len(rows)}))


@pytest.fixture
def job(tmp_path, monkeypatch):
    from migrate.job.load import load_job
    from migrate.stages import STAGES
    from migrate.stages.search import STAGE

    monkeypatch.setitem(STAGES, "search", STAGE)  # until the lead registers it in _STAGE_MODULES
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB))
    return load_job(path)


def _local_group(world):
    from migrate.runtime.worker_group import WorkerGroupSpec, start_worker_group

    return lambda **_: start_worker_group(WorkerGroupSpec(world_size=world, mode="local", backend="gloo",
                                                          env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                                                          timeout_s=300))


@pytest.mark.slow
def test_search_stage_profiles_ranks_emits_and_resumes(job, tmp_path):
    from migrate.pipeline.stage import StageContext
    from migrate.stages.search import STAGE

    work = tmp_path / "work"
    work.mkdir()
    ctx = StageContext(job=job, options=job.stage_options["search"], work_dir=work, upstream={}, tracker=_Tracker(),
                       start_group=_local_group(2), stage="search")
    outcome = STAGE.run(ctx)
    assert outcome.verdict == "pass", outcome.reasons
    ranking = json.loads((work / "ranking.json").read_text())
    assert ranking["chosen"]["status"] == "measured" and ranking["profiled"] >= 2
    assert ranking["profiled_fraction"] <= 0.5
    statuses = {r["status"] for r in ranking["rows"]}
    assert "measured" in statuses and "unmeasured" in statuses
    failed = [r for r in ranking["rows"] if r["status"] == "failed"]
    assert all(r["reason"] for r in failed)
    assert (work / "chosen" / "target_layout.yaml").is_file() and (work / "chosen" / "deepspeed.json").is_file()
    assert "| # | candidate |" in (work / "ranking.md").read_text()
    lines = (work / "profiles.jsonl").read_text().splitlines()
    assert len(lines) == outcome.metrics["profile_calls"]
    again = STAGE.run(ctx)  # everything comes from the cache now
    assert again.metrics["profile_calls"] == 0 and again.metrics["cache_hits"] >= len(lines)
    assert again.metrics["chosen"] == outcome.metrics["chosen"]


def test_search_stage_analytic_only(job, tmp_path):
    from migrate.job.load import load_job
    from migrate.pipeline.stage import StageContext
    from migrate.stages.search import STAGE

    data = dict(JOB) | {"stages": {"search": {"profile": False}}}
    path = tmp_path / "analytic.yaml"
    path.write_text(yaml.safe_dump(data))
    analytic = load_job(path)
    ctx = StageContext(job=analytic, options=analytic.stage_options["search"], work_dir=tmp_path, upstream={},
                       tracker=_Tracker(), start_group=lambda **_: pytest.fail("analytic search started ranks"),
                       stage="search")
    outcome = STAGE.run(ctx)
    assert outcome.verdict == "pass" and outcome.metrics["profiled"] == 0
    assert (tmp_path / "chosen" / "target_layout.yaml").is_file()


@pytest.mark.slow
def test_measure_mode_fills_a_profile_from_live_ranks(tmp_path):
    from migrate.search.measure import measure_rank, measured_profile
    from parallel_search.profiles import dump_profile, load_profile

    with _local_group(2)() as group:
        results = group.run(measure_rank, 128, 4, 1, 2, ("fp32",))
    profile = measured_profile(load_profile("cpu"), results, name="this-host")
    again = load_profile(dump_profile(profile, tmp_path / "this-host.yaml"))
    assert again.name == "this-host" and again.peak_tflops["fp32"] > 0
    assert again.intra_node_bandwidth_gbps > 0 and again.memory_bandwidth_gbps > 0
    assert "measured" in again.source["intra_node_bandwidth_gbps"]


def test_search_command_is_a_click_command_with_measure():
    from click.testing import CliRunner

    from migrate.commands.search import command

    out = CliRunner().invoke(command, ["--help"])
    assert out.exit_code == 0 and "--measure" in out.output
