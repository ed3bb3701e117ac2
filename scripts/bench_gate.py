"""The convergence gate's operating characteristics, measured: false alarms on good runs, detection of faults.

1. Good runs: `--seeds` real trainings of the built-in tiny Llama (FSDP2 engine, one Gloo rank, the job's
   default recipe) for `--real-steps` steps each, differing only in the seed (init, data order; the same
   dataset): loss, grad norm and learning
   rate per step, cached in OUT/runs.jsonl (a rerun trains only the seeds missing).
2. A noise model fitted to those runs, to reach 5,000 steps: the seeds' mean curve continued by a fitted
   a + b * (t + c)^-d (loss; log grad norm likewise), and each run's deviation from the mean as a run offset
   (the spread of the seeds' mean deviations), an AR(1) process with Student-t innovations (phi, sigma and
   the degrees of freedom fitted to the seeds' deviations) and a slow wander (AR(1), phi 0.99, its sd from the
   variance of 100-step means beyond what the fast part gives).
3. For run lengths 100 / 500 / 5,000 and 1, 2, 4 baselines: `--trials` good candidates (fresh draws of n
   baselines and one candidate from the noise model; at lengths the real runs reach, also every way of picking
   n + 1 real seeds) give the false-alarm rate; each fault at each size gives the detection rate and the median
   delay (steps from the fault's onset to the first failing step or window).
   Faults: a loss shift of 0.25-4 % over the last 200 steps (the whole run when shorter); the grad norm scaled
   1.2-3x over the last 200 steps; the LR schedule offset by 10 steps from the middle; a late divergence (loss
   growing e-fold every 25 steps over the last 50); one NaN at a random step; the run truncated at 80 %.
   For the loss shift, "best possible" is what the known-onset difference of means reaches at a 1 % false-alarm
   rate under the model: no rule that has to find the onset does better.
Targets: false alarms <= 1 % per run at every length; a sustained 1 % loss shift over 200 steps, a 1.5x
grad-norm change, any NaN and any truncation detected >= 99 %. The table ends with each target and the cells
that miss it.

    python scripts/bench_gate.py --out runs/bench_gate [--seeds 8] [--real-steps 600] [--trials 400]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convergence.decision import ar1_window_factor
from convergence.gate import evaluate
from convergence.series import RunMetrics, run_from_points
from convergence.tolerances import Tolerances

LENGTHS = (100, 500, 5000)
BASELINES = (1, 2, 4)
LOSS_SHIFTS = (0.0025, 0.005, 0.01, 0.02, 0.04)
GN_SCALES = (1.2, 1.5, 2.0, 3.0)
FAULT_SPAN = 200


# ---------------------------------------------------------------- real runs

def train_seeds(out: Path, seeds: int, steps: int, global_batch: int) -> list[dict[str, list[float]]]:
    """Loss, grad norm and lr per step of `seeds` real runs (cached in out/runs.jsonl)."""
    cache = out / "runs.jsonl"
    runs: dict[int, dict] = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            rec = json.loads(line)
            if rec["steps"] == steps and rec.get("global_batch") == global_batch:
                runs[rec["seed"]] = rec
    missing = [s for s in range(seeds) if s not in runs]
    if missing:
        from migrate.workload.fixtures import TINY_LLAMA, launch
        from migrate.workload.run_spec import RunSpec, TrainSpec

        for seed in missing:
            began = time.perf_counter()
            train = TrainSpec(seed=1000 + seed, data_seed=1000, global_batch_size=global_batch,
                              micro_batch_size=global_batch, dataset_size=global_batch * steps)
            metrics = launch(RunSpec(engine="fsdp", model=TINY_LLAMA, steps=steps, train=train), 1)[0].metrics
            rec = {"seed": seed, "steps": steps, "global_batch": global_batch, "loss": [m.loss for m in metrics],
                   "grad_norm": [m.grad_norm for m in metrics], "lr": [m.lr for m in metrics]}
            with cache.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            runs[seed] = rec
            print(f"  seed {seed}: {steps} steps in {time.perf_counter() - began:.1f} s, final loss "
                  f"{rec['loss'][-1]:.4f}", flush=True)
    return [runs[s] for s in range(seeds)]


# ---------------------------------------------------------------- noise model (fitted to the real runs)

SLOW_PHI = 0.99  # the wander's lag-1 correlation: a time constant of 100 steps


@dataclass(frozen=True)
class Component:
    """One metric's model: mean curve a + b (t + c)^-d, per-run offset sd, AR(1) phi / sigma / t dof, plus a
    slow AR(1) wander (phi SLOW_PHI, stationary sd `wander_sd`)."""

    curve: tuple[float, float, float, float]
    offset_sd: float
    phi: float
    sigma: float
    dof: float
    wander_sd: float = 0.0

    def mean(self, t: np.ndarray) -> np.ndarray:
        a, b, c, d = self.curve
        return a + b * (t + c) ** (-d)

    def deviation(self, rng: np.random.Generator, n: int) -> np.ndarray:
        e = rng.standard_t(self.dof, size=n) * self.sigma * math.sqrt((self.dof - 2) / self.dof)
        x = np.empty(n)
        prev = rng.standard_normal() * self.sigma / math.sqrt(max(1e-9, 1 - self.phi ** 2))
        for i in range(n):
            prev = self.phi * prev + e[i]
            x[i] = prev
        if self.wander_sd > 0:
            slow = np.empty(n)
            w = rng.standard_normal() * self.wander_sd
            kick = rng.standard_normal(n) * self.wander_sd * math.sqrt(1 - SLOW_PHI ** 2)
            for i in range(n):
                w = SLOW_PHI * w + kick[i]
                slow[i] = w
            x += slow
        return x + rng.standard_normal() * self.offset_sd


def _fit_curve(y: np.ndarray) -> tuple[float, float, float, float]:
    t = np.arange(1, len(y) + 1, dtype=float)
    best, best_err = (float(y[-1]), 0.0, 1.0, 1.0), math.inf
    for c in (0.0, 5.0, 20.0, 50.0):
        for d in np.linspace(0.1, 2.0, 39):
            basis = (t + c) ** (-d)
            A = np.stack([np.ones_like(t), basis], axis=1)
            (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
            err = float(np.mean((A @ [a, b] - y) ** 2))
            if err < best_err:
                best, best_err = (float(a), float(b), c, float(d)), err
    return best


def fit_component(rows: np.ndarray) -> Component:
    """Fit the model to runs x steps (after the first 10 steps, where the curve is steepest)."""
    mean = rows.mean(axis=0)
    dev = rows - mean
    offsets = dev[:, 10:].mean(axis=1)
    resid = dev[:, 10:] - offsets[:, None]
    x0, x1 = resid[:, :-1].ravel(), resid[:, 1:].ravel()
    phi = float(np.clip(np.dot(x0, x1) / max(np.dot(x0, x0), 1e-30), 0.0, 0.995))
    innov = (resid[:, 1:] - phi * resid[:, :-1]).ravel()
    sigma = float(np.std(innov))
    kurt = float(np.mean(innov ** 4) / max(np.mean(innov ** 2) ** 2, 1e-30)) - 3.0
    dof = float(np.clip(4 + 6 / kurt, 4.5, 60.0)) if kurt > 0 else 60.0
    n = rows.shape[0]
    # wander: the variance of 100-step block means beyond what the fast AR(1) gives, as a slow AR(1)
    block = 100
    k = resid.shape[1] // block
    blocks = resid[:, :k * block].reshape(n, k, block).mean(axis=2) if k else np.zeros((n, 0))
    fast_var = sigma ** 2 / (1 - phi ** 2)
    fast_block = fast_var * ar1_window_factor(phi, block)
    excess = max(0.0, float(np.mean(blocks ** 2)) * n / (n - 1) - fast_block) if k else 0.0
    wander_sd = math.sqrt(excess / ar1_window_factor(SLOW_PHI, block))
    return Component(curve=_fit_curve(mean), offset_sd=float(np.std(offsets, ddof=1)) * math.sqrt(n / (n - 1)),
                     phi=phi, sigma=sigma, dof=dof, wander_sd=wander_sd)


@dataclass(frozen=True)
class NoiseModel:
    loss: Component
    log_gn: Component
    lr_peak: float
    lr_warmup: int

    def lr(self, length: int) -> np.ndarray:
        t = np.arange(1, length + 1, dtype=float)
        warm = np.minimum(1.0, t / self.lr_warmup)
        return self.lr_peak * warm * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * np.clip(t / length, 0, 1))))

    def run(self, rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
        t = np.arange(1, length + 1, dtype=float)
        return {"loss": self.loss.mean(t) + self.loss.deviation(rng, length),
                "grad_norm": np.exp(self.log_gn.mean(t) + self.log_gn.deviation(rng, length)),
                "lr": self.lr(length)}


def fit_noise(runs: list[dict]) -> NoiseModel:
    loss = np.array([r["loss"] for r in runs])
    gn = np.log(np.array([r["grad_norm"] for r in runs]))
    lr = np.array(runs[0]["lr"])
    warmup = int(np.argmax(lr)) + 1
    return NoiseModel(loss=fit_component(loss), log_gn=fit_component(gn), lr_peak=float(lr.max()),
                      lr_warmup=max(1, warmup))


# ---------------------------------------------------------------- faults and trials

def as_run(name: str, metrics: dict[str, np.ndarray], length: int | None = None) -> RunMetrics:
    n = length or len(metrics["loss"])
    steps = range(1, n + 1)
    return run_from_points(name, {k: list(zip(steps, map(float, v[:n]))) for k, v in metrics.items()})


def inject(fault: str, size: float, metrics: dict[str, np.ndarray], rng: np.random.Generator
           ) -> tuple[dict[str, np.ndarray], int, int]:
    """The candidate with the fault, its onset step and how many steps the candidate keeps."""
    m = {k: v.copy() for k, v in metrics.items()}
    n = len(m["loss"])
    onset = max(1, n - FAULT_SPAN + 1)
    if fault == "loss_shift":
        m["loss"][onset - 1:] *= 1 + size
    elif fault == "grad_norm_scale":
        m["grad_norm"][onset - 1:] *= size
    elif fault == "lr_offset":
        onset = n // 2
        lr = m["lr"]
        m["lr"][onset - 1:] = lr[max(0, onset - 1 - 10): n - 10] if n > 10 else lr[onset - 1:]
    elif fault == "divergence":
        onset = max(1, n - 49)
        t = np.arange(n - onset + 1)
        m["loss"][onset - 1:] *= np.exp(t / 25)
    elif fault == "nan":
        onset = int(rng.integers(1, n + 1))
        m["loss"][onset - 1] = math.nan
    elif fault == "truncation":
        onset = int(0.8 * n) + 1
        return m, onset, onset - 1
    return m, onset, n


FAULTS = ([("loss_shift", s) for s in LOSS_SHIFTS] + [("grad_norm_scale", s) for s in GN_SCALES]
          + [("lr_offset", 10), ("divergence", 1), ("nan", 1), ("truncation", 0.8)])
TARGETS = {("loss_shift", 0.01), ("grad_norm_scale", 1.5), ("nan", 1), ("truncation", 0.8)}


def detection_step(verdict, onset: int) -> int | None:
    """Steps from the fault's onset to the earliest failing evidence (0 for whole-run checks)."""
    if verdict.passed:
        return None
    firsts = []
    for c in verdict.checks:
        if c.passed:
            continue
        steps = c.details.get("failing_steps") or []
        if steps:
            firsts.append(min(steps) - onset)
        else:
            firsts.append(0)
    return max(0, min(firsts)) if firsts else 0


def trial(model: NoiseModel, rng: np.random.Generator, length: int, n: int, fault: tuple[str, float] | None,
          tol: Tolerances) -> tuple[bool, int | None, tuple[str, ...]]:
    base = [as_run(f"baseline{i}", model.run(rng, length)) for i in range(n)]
    metrics = model.run(rng, length)
    onset, keep = 1, length
    if fault is not None:
        metrics, onset, keep = inject(fault[0], fault[1], metrics, rng)
    verdict = evaluate(base, as_run("candidate", metrics, keep), tol)
    return verdict.passed, detection_step(verdict, onset), verdict.failed_codes


def shift_bound(model: NoiseModel, rng: np.random.Generator, length: int, n: int, size: float,
                draws: int = 400) -> float:
    """The best detection any test can reach for a loss shift of `size` over the last FAULT_SPAN steps at a
    false-alarm rate of the gate's whole alpha (1 %): the known-onset difference of means (after minus before,
    or the level when the shift spans the run) against its noise under the model."""
    t = np.arange(1, length + 1, dtype=float)
    onset = max(0, length - FAULT_SPAN)
    stats_ = []
    for _ in range(draws):
        cand = model.loss.deviation(rng, length)
        centre = np.mean([model.loss.deviation(rng, length) for _ in range(n)], axis=0)
        r = cand - centre
        stats_.append(r[onset:].mean() - (r[:onset].mean() if onset else 0.0))
    effect = size * float(np.mean(model.loss.mean(t)[onset:]))
    from scipy import stats as sps
    return float(sps.norm.cdf(effect / float(np.std(stats_)) - sps.norm.isf(0.005)))


def real_false_alarms(runs: list[dict], length: int, n: int, tol: Tolerances, limit: int) -> tuple[int, int, dict]:
    """Good candidates from the real seeds: every way of picking n baselines and one candidate (up to limit)."""
    alarms, total, codes = 0, 0, {}
    for combo in itertools.islice(itertools.permutations(range(len(runs)), n + 1), limit):
        *b, c = combo
        base = [as_run(f"seed{i}", {k: np.array(runs[i][k]) for k in ("loss", "grad_norm", "lr")}, length) for i in b]
        cand = as_run(f"seed{c}", {k: np.array(runs[c][k]) for k in ("loss", "grad_norm", "lr")}, length)
        v = evaluate(base, cand, tol)
        total += 1
        if not v.passed:
            alarms += 1
            for code in v.failed_codes:
                codes[code] = codes.get(code, 0) + 1
    return alarms, total, codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench_gate"))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--real-steps", type=int, default=600)
    ap.add_argument("--global-batch", type=int, default=256,
                    help="sequences per step (256 x 32 tokens: per-step loss noise of a few percent, as LLM runs)")
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--fault-trials", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"real runs: {args.seeds} seeds x {args.real_steps} steps of {args.global_batch} sequences (tiny Llama, "
          f"FSDP2, 1 Gloo rank)", flush=True)
    runs = train_seeds(args.out, args.seeds, args.real_steps, args.global_batch)
    model = fit_noise(runs)
    print(f"noise model: loss AR(1) phi {model.loss.phi:.3f} sigma {model.loss.sigma:.3g} dof {model.loss.dof:.1f} "
          f"run offset sd {model.loss.offset_sd:.3g} wander sd {model.loss.wander_sd:.3g}; log grad norm phi "
          f"{model.log_gn.phi:.3f} sigma {model.log_gn.sigma:.3g} dof {model.log_gn.dof:.1f} offset sd "
          f"{model.log_gn.offset_sd:.3g} wander sd {model.log_gn.wander_sd:.3g}", flush=True)
    tol = Tolerances()
    rng = np.random.default_rng(20261201)
    results = {"model": model.__dict__ | {"loss": model.loss.__dict__, "log_gn": model.log_gn.__dict__},
               "false_alarms": {}, "detection": {}}
    header = "| steps | baselines | false alarms (model) | false alarms (real seeds) |"
    rows = [header, "|---|---|---|---|"]
    detect_rows = ["| steps | baselines | fault | size | detected | median delay (steps) | best possible |",
                   "|---|---|---|---|---|---|---|"]
    met: dict[str, list[str]] = {"false alarms <= 1 % per run": []}  # target -> cells that miss it
    for length in LENGTHS:
        for n in BASELINES:
            began = time.perf_counter()
            alarms = sum(not trial(model, rng, length, n, None, tol)[0] for _ in range(args.trials))
            real = ""
            if length <= args.real_steps and len(runs) > n:
                ra, rt, codes = real_false_alarms(runs, length, n, tol, args.trials)
                real = f"{ra}/{rt} ({ra / rt:.1%})" + (f" {codes}" if codes else "")
                if ra / rt > 0.01 + 1.96 * math.sqrt(0.01 * 0.99 / rt):
                    met["false alarms <= 1 % per run"].append(f"{length}x{n} real")
            rate = alarms / args.trials
            if rate > 0.01 + 1.96 * math.sqrt(0.01 * 0.99 / args.trials):
                met["false alarms <= 1 % per run"].append(f"{length}x{n}")
            rows.append(f"| {length} | {n} | {alarms}/{args.trials} ({rate:.1%}) | {real or 'n/a'} |")
            results["false_alarms"][f"{length}x{n}"] = {"model": rate, "real": real}
            for fault in FAULTS:
                got = [trial(model, rng, length, n, fault, tol) for _ in range(args.fault_trials)]
                detected = [d for passed, d, _ in got if not passed]
                rate_d = len(detected) / len(got)
                delay = statistics.median(detected) if detected else math.nan
                bound = shift_bound(model, rng, length, n, fault[1]) if fault[0] == "loss_shift" else math.nan
                if fault in TARGETS:
                    missed = met.setdefault(f"{fault[0]} {fault[1]:g} detected >= 99 %", [])
                    if rate_d < 0.99:
                        missed.append(f"{length}x{n} ({rate_d:.0%}" + (f", best possible {bound:.0%})"
                                                                      if math.isfinite(bound) else ")"))
                detect_rows.append(f"| {length} | {n} | {fault[0]} | {fault[1]:g} | {rate_d:.1%} | {delay:.0f} | "
                                   + (f"{bound:.1%} |" if math.isfinite(bound) else "|"))
                results["detection"][f"{length}x{n}:{fault[0]}:{fault[1]:g}"] = {"rate": rate_d, "delay": delay,
                                                                                 "best_possible": bound}
            print(f"  {length} steps, {n} baseline(s): {time.perf_counter() - began:.0f} s", flush=True)
    print("\n".join(rows))
    print()
    print("\n".join(detect_rows))
    print("\ntargets (cells steps x baselines that miss them):")
    for target, missed in met.items():
        print(f"  {target}: " + ("met" if not missed else "NOT met at " + ", ".join(missed)))
    print("best possible: the known-onset difference of means (after the onset minus before it; the level when the "
          "shift spans the run) at a 1 % false-alarm rate under the fitted model; no rule that must find the onset "
          "can do better")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
