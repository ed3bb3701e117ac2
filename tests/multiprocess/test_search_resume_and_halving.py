"""Successive halving over a profiler callable: budget, learning, failures, escalation, and a
search killed midway that resumes from its JSONL cache."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from checkpoint.model_shape import ModelShape
from parallel_search.cost import Calibration, predict
from parallel_search.profiles import load_profile
from parallel_search.search import Measurement, Problem, ProfileCache, SearchConfig, plan_space, run_search
from parallel_search.space import SpaceOptions
from parallel_search.spec import ClusterShape, TrainingShape

MODEL = ModelShape(architecture="llama", num_layers=8, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                   num_query_groups=8, vocab_size=32000, seq_length=2048, make_vocab_size_divisible_by=128)
PROBLEM = Problem(model=MODEL, train=TrainingShape(global_batch_size=64),
                  cluster=ClusterShape(device_count=16, devices_per_node=8),
                  device=load_profile("h100"), space=SpaceOptions(recompute=("none",), context_parallel=(1,)))
# The "hardware": analytic terms scaled by factors the search does not know.
TRUTH = Calibration(factors={"compute": 1.7, "bubble": 1.7, "overhead_megatron": 4.0, "overhead_deepspeed": 6.0,
                             "tp_comm": 1.5, "cp_comm": 1.0, "ep_comm": 1.0, "pp_comm": 2.0, "dp_allreduce": 0.8,
                             "dp_reduce_scatter": 0.8, "dp_allgather": 0.8, "zero3_gather": 1.2, "optimizer": 1.0})


class FakeHardware:
    """Deterministic step times from TRUTH; some candidates fail like an unsupported feature would."""

    def __init__(self, plan, fail_keys=(), interrupt_after=None):
        self.plan, self.fail_keys, self.interrupt_after = plan, set(fail_keys), interrupt_after
        self.calls = []

    def __call__(self, cand, steps):
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt("killed midway")
        self.calls.append((cand.key, steps))
        if cand.key in self.fail_keys:
            return Measurement(key=cand.key, ok=False, reason="unsupported: sequence parallel needs TE")
        t = predict(self.plan.terms[cand.key], TRUTH)
        return Measurement(key=cand.key, ok=True, step_times_s=tuple(t * (1 + 0.001 * i) for i in range(steps)),
                           peak_memory_bytes=int(self.plan.memory[cand.key].total * 0.8))


def test_search_finds_the_true_best_within_budget():
    plan = plan_space(PROBLEM)
    hw = FakeHardware(plan)
    result = run_search(PROBLEM, hw, ProfileCache(None, "t"), SearchConfig(), plan)
    truth = {c.key: predict(plan.terms[c.key], TRUTH) for c in plan.feasible}
    best = min(truth.values())
    assert truth[result.chosen.candidate.key] <= 1.05 * best
    assert result.profiled <= 0.25 * len(plan.feasible)
    assert result.profiled == len({k for k, _ in hw.calls})
    steps = [s for _, s in hw.calls]
    assert steps == sorted(steps) and max(steps) > min(steps)  # later rungs run more steps
    assert result.calibration.samples >= 2


def test_failures_are_infeasible_with_reason_and_search_continues():
    plan = plan_space(PROBLEM)
    first = sorted(plan.feasible, key=lambda c: predict(plan.terms[c.key]))[:3]
    hw = FakeHardware(plan, fail_keys=[c.key for c in first])
    result = run_search(PROBLEM, hw, ProfileCache(None, "t"), SearchConfig(), plan)
    failed = [r for r in result.rows if r.status == "failed"]
    assert {r.candidate.key for r in failed} == {c.key for c in first}
    assert all("sequence parallel needs TE" in r.reason for r in failed)
    assert result.chosen is not None and result.chosen.candidate.key not in hw.fail_keys


def test_escalation_profiles_more_when_target_mfu_is_missed():
    plan = plan_space(PROBLEM)
    low = run_search(PROBLEM, FakeHardware(plan), ProfileCache(None, "t"), SearchConfig(max_fraction=0.5), plan)
    high = run_search(PROBLEM, FakeHardware(plan), ProfileCache(None, "t"),
                      SearchConfig(max_fraction=0.5, target_mfu=0.99), plan)
    assert not high.target_met and high.profiled > low.profiled
    assert any(e.startswith("escalation") for e in high.events)
    assert any(e.startswith("target MFU 0.990 not reached") for e in high.events)


def test_killed_search_resumes_from_cache(tmp_path):
    plan = plan_space(PROBLEM)
    path = tmp_path / "profiles.jsonl"
    reference = run_search(PROBLEM, FakeHardware(plan), ProfileCache(None, "t"), SearchConfig(), plan)
    with pytest.raises(KeyboardInterrupt):
        run_search(PROBLEM, FakeHardware(plan, interrupt_after=4), ProfileCache(path, "fp"), SearchConfig(), plan)
    assert len(path.read_text().splitlines()) == 4
    with path.open("a") as f:
        f.write('{"fingerprint": "fp", "key": "cut sh')  # a line cut short by the kill
    again = FakeHardware(plan)
    cache = ProfileCache(path, "fp")
    resumed = run_search(PROBLEM, again, cache, SearchConfig(), plan)
    assert cache.loaded == 4 and resumed.cache_hits >= 4
    assert resumed.profile_calls == len(again.calls) == reference.profile_calls - 4
    assert resumed.chosen.candidate.key == reference.chosen.candidate.key
    other = ProfileCache(path, "another-problem")
    assert other.loaded == 0


def test_time_budget_stops_profiling():
    plan = plan_space(PROBLEM)
    now = [0.0]

    def clock():
        now[0] += 10.0
        return now[0]

    result = run_search(PROBLEM, FakeHardware(plan), ProfileCache(None, "t"), SearchConfig(max_seconds=35), plan, clock=clock)
    assert result.profiled <= 3
    assert any("time budget" in e for e in result.events) or result.profiled <= 3


_KILLABLE = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.multiprocess.test_search_resume_and_halving import PROBLEM, FakeHardware
    from parallel_search.search import ProfileCache, SearchConfig, plan_space, run_search
    plan = plan_space(PROBLEM)
    hw = FakeHardware(plan)
    def slow(cand, steps):
        time.sleep(0.4)
        return hw(cand, steps)
    result = run_search(PROBLEM, slow, ProfileCache({path!r}, "fp"), SearchConfig(), plan)
    print("CALLS", len(hw.calls), "HITS", result.cache_hits, "CHOSEN", result.chosen.candidate.key)
''')


@pytest.mark.slow
def test_search_process_killed_with_sigkill_resumes(tmp_path):
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    path = tmp_path / "profiles.jsonl"
    script = tmp_path / "search.py"
    script.write_text(_KILLABLE.format(root=root, path=str(path)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    done_before = len([line for line in path.read_text().splitlines() if line.strip()])
    assert done_before >= 3
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True).stdout
    fields = out.split()
    calls, hits = int(fields[fields.index("CALLS") + 1]), int(fields[fields.index("HITS") + 1])
    assert hits >= done_before - 1 and calls >= 1
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    assert len({r["key"] for r in records}) >= done_before
