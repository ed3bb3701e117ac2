"""Successive halving over real measured steps, with the cost model learning from each one.

Call sequence (driver)::

    plan = plan_space(problem)                      # enumerate, memory-prune, predict: pure
    result = run_search(problem, profile, cache, SearchConfig(...))

``profile(candidate, steps) -> Measurement`` is any callable (the orchestrator's runs warm-up
and ``steps`` timed steps of the workload on the target devices); the library never starts a
process itself. Every measurement is appended to a JSONL :class:`ProfileCache` before it is
used, so a search killed midway resumes without re-profiling what it already measured.

Rungs: the best ``initial`` candidates by prediction (one per structure first) are measured with
``min_steps`` timed steps; after each measurement the cost model is refitted and candidates
not yet measured whose prediction beats the rung's survivors join the next rung; the best
1/eta by measured time go on with eta times more steps, until one is left. When the best
measured MFU is below ``target_mfu`` the search escalates: the next best predicted
candidates are measured while the budget lasts.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Iterable, Mapping

from checkpoint.model_shape import ModelShape
from parallel_search.cost import Calibration, CostOptions, CostTerms, cost_terms, fit_calibration, mfu, predict
from parallel_search.memory import MemoryEstimate, estimate_memory, fits
from parallel_search.profiles import DeviceProfile
from parallel_search.space import Candidate, Space, SpaceOptions, enumerate_space
from parallel_search.spec import ClusterShape, TrainingShape


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What profiling one candidate gave: timed step seconds and peak bytes, or why it failed.

    `fault`: the run was lost to the infrastructure (a rank that died or hung, a killed command), not to the
    candidate (out of memory, unsupported): such a failure is never cached, so the next search measures the
    candidate again."""

    key: str
    ok: bool
    step_times_s: tuple[float, ...] = ()
    peak_memory_bytes: int | None = None
    reason: str | None = None
    warmup_steps: int = 0
    wall_s: float = 0.0
    fault: bool = False

    def __post_init__(self) -> None:
        if self.ok and not self.step_times_s:
            raise ValueError(f"measurement of {self.key}: ok but no timed steps")
        if not self.ok and not self.reason:
            raise ValueError(f"measurement of {self.key}: failed without a reason")
        object.__setattr__(self, "step_times_s", tuple(float(t) for t in self.step_times_s))

    @property
    def steps(self) -> int:
        return len(self.step_times_s)

    @property
    def step_time_s(self) -> float:
        """Median of the timed steps (robust to one slow step)."""
        return float(statistics.median(self.step_times_s))

    def truncated(self, steps: int) -> Measurement:
        """The same measurement as if only its first ``steps`` timed steps had been run."""
        if not self.ok or steps >= self.steps:
            return self
        return replace(self, step_times_s=self.step_times_s[:steps])

    def to_dict(self) -> dict:
        return asdict(self) | {"step_times_s": list(self.step_times_s)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Measurement:
        return cls(**{**data, "step_times_s": tuple(data.get("step_times_s", ()))})


class Profiler(Protocol):
    """Runs warm-up plus ``steps`` timed steps of ``candidate`` on the target; never raises for a
    candidate that fails (OOM, unsupported): it returns ``Measurement(ok=False, reason=...)``."""

    def __call__(self, candidate: Candidate, steps: int) -> Measurement: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """What is searched: the model, recipe, cluster, device, the space's knobs and the engine's behaviour."""

    model: ModelShape
    train: TrainingShape
    cluster: ClusterShape
    device: DeviceProfile
    space: SpaceOptions = SpaceOptions()
    cost: CostOptions = CostOptions()

    def fingerprint(self, workload: str = "") -> str:
        """Hash of everything a measurement depends on (cache entries of another problem never match)."""
        body = json.dumps({"model": asdict(self.model), "train": asdict(self.train), "cluster": asdict(self.cluster),
                           "device": self.device.name, "device_type": self.device.device_type, "workload": workload},
                          sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


class ProfileCache:
    """Measurements as JSON lines (one per profile call), keyed by (problem fingerprint, candidate key).

    ``get`` returns a stored measurement with at least the requested timed steps (truncated to
    them) or a stored failure; ``put`` appends and flushes at once, so a killed search loses
    at most the measurement in progress. A failure by fault (`Measurement.fault`) is kept for this
    search only, never written. ``path=None`` keeps everything in memory.
    """

    def __init__(self, path: str | Path | None, fingerprint: str) -> None:
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self._entries: dict[str, list[Measurement]] = {}
        self.loaded = 0
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill: the measurement is simply redone
                if record.get("fingerprint") != fingerprint or record.get("measurement", {}).get("fault"):
                    continue
                self._entries.setdefault(record["key"], []).append(Measurement.from_dict(record["measurement"]))
                self.loaded += 1

    def get(self, key: str, steps: int) -> Measurement | None:
        found = self._entries.get(key, [])
        failures = [m for m in found if not m.ok]
        if failures:
            return failures[-1]
        enough = [m for m in found if m.steps >= steps]
        return enough[0].truncated(steps) if enough else None  # the first one: a resumed search replays exactly

    def put(self, key: str, measurement: Measurement) -> None:
        self._entries.setdefault(key, []).append(measurement)
        if self.path is not None and not measurement.fault:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"fingerprint": self.fingerprint, "key": key,
                                    "measurement": measurement.to_dict()}) + "\n")
                f.flush()

    def keys(self) -> set[str]:
        return set(self._entries)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchConfig:
    """Budget and schedule. ``max_trials``: distinct candidates profiled at most (None:
    ``max_fraction`` of the memory-feasible ones, at least 2); ``initial``: first rung size
    (None: two thirds of the trial budget, one per distinct structure first); ``max_seconds``: wall-clock budget for profiling."""

    max_trials: int | None = None
    max_fraction: float = 0.25
    initial: int | None = None
    eta: int = 2
    min_steps: int = 2
    max_steps: int = 8
    max_seconds: float | None = None
    target_mfu: float = 0.0

    def __post_init__(self) -> None:
        if self.eta < 2 or self.min_steps < 1 or self.max_steps < self.min_steps:
            raise ValueError(f"search: eta({self.eta}) >= 2, min_steps({self.min_steps}) >= 1 and "
                             f"max_steps({self.max_steps}) >= min_steps are required")
        if not 0 < self.max_fraction <= 1:
            raise ValueError(f"search.max_fraction={self.max_fraction} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One candidate in the final table; ``status`` is measured, failed, unmeasured or over_memory."""

    candidate: Candidate
    status: str
    predicted_s: float
    memory: MemoryEstimate
    measured_s: float | None = None
    measured_steps: int = 0
    measured_peak_bytes: int | None = None
    reason: str | None = None
    predicted_mfu: float = 0.0
    measured_mfu: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The ranked rows (measured first by time, then the rest by prediction), the choice and the trail."""

    rows: tuple[Row, ...]
    chosen: Row | None
    calibration: Calibration
    space_size: int
    rejected: int
    feasible: int
    profiled: int
    profile_calls: int
    cache_hits: int
    events: tuple[str, ...]
    target_mfu: float
    reason_counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def target_met(self) -> bool:
        return self.chosen is not None and (self.chosen.measured_mfu or 0.0) >= self.target_mfu

    @property
    def profiled_fraction(self) -> float:
        return self.profiled / self.feasible if self.feasible else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The pruned, predicted space before any measurement."""

    space: Space
    feasible: tuple[Candidate, ...]
    over_memory: tuple[tuple[Candidate, str], ...]
    memory: Mapping[str, MemoryEstimate]
    terms: Mapping[str, CostTerms]


def plan_space(problem: Problem) -> Plan:
    """Enumerate, drop what the memory model says cannot fit, compute every cost term. Pure."""
    space = enumerate_space(problem.model, problem.train, problem.cluster, problem.space)
    feasible, over, memory, terms = [], [], {}, {}
    for cand in space.valid:
        est = estimate_memory(problem.model, problem.train, cand, problem.device, problem.cost.flash_attention)
        memory[cand.key] = est
        terms[cand.key] = cost_terms(problem.model, problem.train, problem.cluster, cand, problem.device, problem.cost)
        reason = fits(est, problem.device)
        if reason:
            over.append((cand, reason))
        else:
            feasible.append(cand)
    return Plan(space=space, feasible=tuple(feasible), over_memory=tuple(over), memory=memory, terms=terms)


def _ranked(cands: Iterable[Candidate], plan: Plan, calibration: Calibration) -> list[Candidate]:
    return sorted(cands, key=lambda c: (predict(plan.terms[c.key], calibration), c.key))


def _diverse(ranked: list[Candidate], n: int) -> list[Candidate]:
    """The best predicted candidate of each structure (framework, tp, pp, vpp, cp, ep) first, so the
    first calibration sees every cost term; then the next best by prediction up to ``n``."""
    seen: set[tuple] = set()
    first: list[Candidate] = []
    rest: list[Candidate] = []
    for cand in ranked:
        lay = cand.layout
        shape = (cand.framework, lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep)
        (rest if shape in seen else first).append(cand)
        seen.add(shape)
    return (first + rest)[:n]


def run_search(problem: Problem, profile: Callable[[Candidate, int], Measurement], cache: ProfileCache,
               config: SearchConfig = SearchConfig(), plan: Plan | None = None,
               clock: Callable[[], float] = time.monotonic) -> SearchResult:
    """Successive halving under the trial and time budgets; see the module docstring."""
    plan = plan or plan_space(problem)
    feasible = list(plan.feasible)
    budget = config.max_trials or max(2, math.floor(config.max_fraction * len(feasible)))
    budget = min(budget, len(feasible))
    started = clock()
    measured: dict[str, Measurement] = {}
    events: list[str] = []
    calls = hits = 0
    calibration = Calibration()

    def out_of_time() -> bool:
        return config.max_seconds is not None and clock() - started > config.max_seconds

    def measure(cand: Candidate, steps: int) -> Measurement:
        nonlocal calls, hits, calibration
        cached = cache.get(cand.key, steps)
        if cached is not None:
            hits += 1
            result = cached
        else:
            calls += 1
            result = profile(cand, steps)
            cache.put(cand.key, result)
        measured[cand.key] = result
        if result.ok and result.peak_memory_bytes and result.peak_memory_bytes > problem.device.memory_bytes:
            result = replace(result, ok=False, reason=f"out of memory (measured): peak "
                             f"{result.peak_memory_bytes / 1e9:.2f} GB > {problem.device.memory_gb:g} GB")
            measured[cand.key] = result
        samples = [(plan.terms[k], m.step_time_s) for k, m in measured.items() if m.ok]
        calibration = fit_calibration(samples)
        return result

    def distinct() -> int:
        return len(measured)

    pool = _diverse(_ranked(feasible, plan, calibration), max(1, min(config.initial or math.ceil(2 * budget / 3), budget)))
    steps = config.min_steps
    rung = 0
    last_steps = steps
    while pool and not out_of_time():
        rung += 1
        last_steps = steps
        results = []
        for cand in pool:
            if out_of_time():
                events.append(f"rung {rung}: time budget of {config.max_seconds} s spent")
                break
            m = measure(cand, steps)
            if m.ok:
                results.append((m.step_time_s, cand.key, cand))
            else:
                events.append(f"rung {rung}: {cand.label()} infeasible: {m.reason}")
        results.sort(key=lambda r: (r[0], r[1]))
        events.append(f"rung {rung}: {len(pool)} candidate(s) at {steps} timed step(s), {len(results)} ran; "
                      f"calibration fit error {calibration.fit_error if calibration.fit_error is not None else 'n/a'}")
        if len(results) <= 1 and distinct() >= budget:
            break
        keep = max(1, math.ceil(len(results) / config.eta))
        survivors = [c for _, _, c in results[:keep]]
        # Learn: candidates not yet measured whose calibrated prediction beats the slowest survivor join.
        bar = max((measured[c.key].step_time_s for c in survivors), default=math.inf)
        fresh = [c for c in _ranked(feasible, plan, calibration)
                 if c.key not in measured and predict(plan.terms[c.key], calibration) < bar]
        room = budget - distinct()
        added = fresh[: max(0, min(room, keep))]
        if added:
            events.append(f"rung {rung}: recalibrated model promotes {', '.join(c.label() for c in added)}")
        if len(survivors) == 1 and not added:
            break
        pool = survivors + added
        steps = min(steps * config.eta, config.max_steps)
        if steps == config.max_steps and len(pool) == 1 and not added:
            break
    # Escalation: below the target MFU, measure the next best predictions while the budget lasts.
    def best_mfu() -> float:
        ok = [(k, m) for k, m in measured.items() if m.ok]
        if not ok:
            return 0.0
        k, m = min(ok, key=lambda kv: kv[1].step_time_s)
        return mfu(plan.terms[k].model_flops, m.step_time_s, problem.cluster.device_count, problem.device,
                   problem.train.precision)

    while config.target_mfu > 0 and best_mfu() < config.target_mfu and distinct() < budget and not out_of_time():
        nxt = [c for c in _ranked(feasible, plan, calibration) if c.key not in measured]
        if not nxt:
            break
        events.append(f"escalation: best MFU {best_mfu():.3f} < target {config.target_mfu:.3f}; "
                      f"profiling {nxt[0].label()}")
        measure(nxt[0], last_steps)
    if config.target_mfu > 0 and best_mfu() < config.target_mfu:
        events.append(f"target MFU {config.target_mfu:.3f} not reached: best measured {best_mfu():.3f} after "
                      f"{distinct()} of {len(feasible)} feasible candidates (budget {budget})")
    rows = _rows(problem, plan, measured, calibration)
    finalists = [r for r in rows if r.status == "measured" and r.measured_steps >= last_steps]
    chosen = min(finalists, key=lambda r: r.measured_s or 0.0) if finalists else None  # finalists are measured
    return SearchResult(rows=tuple(rows), chosen=chosen, calibration=calibration, space_size=plan.space.size,
                        rejected=len(plan.space.rejected), feasible=len(feasible), profiled=distinct(),
                        profile_calls=calls, cache_hits=hits, events=tuple(events), target_mfu=config.target_mfu,
                        reason_counts=plan.space.reason_counts()
                        | ({"out of memory (predicted)": len(plan.over_memory)} if plan.over_memory else {}))


def _rows(problem: Problem, plan: Plan, measured: Mapping[str, Measurement], calibration: Calibration) -> list[Row]:
    world, dtype = problem.cluster.device_count, problem.train.precision
    tokens = problem.train.global_batch_size * problem.model.seq_length
    rows = []
    for cand in list(plan.feasible) + [c for c, _ in plan.over_memory]:
        terms = plan.terms[cand.key]
        predicted = predict(terms, calibration)
        m = measured.get(cand.key)
        base: dict[str, Any] = dict(candidate=cand, predicted_s=predicted, memory=plan.memory[cand.key],
                                    predicted_mfu=mfu(terms.model_flops, predicted, world, problem.device, dtype))
        if m is None:
            over = next((r for c, r in plan.over_memory if c.key == cand.key), None)
            rows.append(Row(status="over_memory" if over else "unmeasured", reason=over, **base))
        elif not m.ok:
            rows.append(Row(status="failed", reason=m.reason, measured_peak_bytes=m.peak_memory_bytes, **base))
        else:
            rows.append(Row(status="measured", measured_s=m.step_time_s, measured_steps=m.steps,
                            measured_peak_bytes=m.peak_memory_bytes,
                            measured_mfu=mfu(terms.model_flops, m.step_time_s, world, problem.device, dtype),
                            tokens_per_s=tokens / m.step_time_s, **base))
    order = {"measured": 0, "unmeasured": 1, "failed": 2, "over_memory": 3}
    rows.sort(key=lambda r: (order[r.status], -r.measured_steps, r.measured_s or 0.0, r.predicted_s, r.candidate.key))
    return rows


def rank_analytic(problem: Problem, plan: Plan | None = None, calibration: Calibration = Calibration()) -> SearchResult:
    """No measurement: every feasible candidate ranked by the (calibrated) cost model; the best is chosen."""
    plan = plan or plan_space(problem)
    rows = _rows(problem, plan, {}, calibration)
    unmeasured = [r for r in rows if r.status == "unmeasured"]
    return SearchResult(rows=tuple(rows), chosen=unmeasured[0] if unmeasured else None, calibration=calibration,
                        space_size=plan.space.size, rejected=len(plan.space.rejected), feasible=len(plan.feasible),
                        profiled=0, profile_calls=0, cache_hits=0, events=("analytic ranking only: nothing profiled",),
                        target_mfu=0.0, reason_counts=plan.space.reason_counts()
                        | ({"out of memory (predicted)": len(plan.over_memory)} if plan.over_memory else {}))
