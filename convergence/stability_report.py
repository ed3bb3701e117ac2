"""Pictures of a stability run (matplotlib Agg, PNG): memory per rank with the fitted trend, step time with
its P50 and P99 lines, loss and grad norm with the reference run, and the failure timeline (the step
reached over wall-clock time, attempt by attempt). Inputs are plain arrays; each function writes one file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from convergence.stability import PER, Segment, Trend

_RESTART: dict[str, Any] = dict(color="tab:red", lw=0.8, ls="--", alpha=0.7)


def _mark_restarts(ax: plt.Axes, restarts: Sequence[int]) -> None:
    for i, step in enumerate(restarts):
        ax.axvline(step, **_RESTART, label="resumed from a checkpoint" if i == 0 else None)


def plot_memory(per_rank: Mapping[int, Sequence[Segment]], worst: int, trend: Trend | None, restarts: Sequence[int],
                path: Path, *, title: str, limit: float) -> None:
    """Every rank's memory (MiB) over steps, the worst rank in colour, its fitted common slope drawn through
    each of its segments, and the limit's slope for comparison."""
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    labelled: set[str] = set()
    for rank, segments in sorted(per_rank.items()):
        label = f"rank {rank} (largest growth)" if rank == worst else "other ranks"
        for seg in segments:
            ax.plot(seg.steps, seg.values, color="tab:blue" if rank == worst else "tab:gray",
                    lw=1.2 if rank == worst else 0.7, alpha=1.0 if rank == worst else 0.5,
                    label=None if label in labelled else label)
            labelled.add(label)
    if trend is not None:
        for j, seg in enumerate(per_rank.get(worst, ())):
            x = np.asarray(seg.steps, dtype=np.float64)
            y = np.asarray(seg.values, dtype=np.float64)
            if len(x) < 2:
                continue
            mid_x, mid_y = x.mean(), y.mean()
            ax.plot(x, mid_y + trend.slope / PER * (x - mid_x), color="black", lw=1.5,
                    label=f"fit: {trend.slope:+.3g} MiB / {PER} steps" if j == 0 else None)
            ax.plot(x, mid_y + limit / PER * (x - mid_x), color="tab:orange", lw=1.0, ls=":",
                    label=f"limit: {limit:g} MiB / {PER} steps" if j == 0 else None)
    _mark_restarts(ax, restarts)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_step_time(steps: Sequence[int], times: Sequence[float], p50: float, p99: float, restarts: Sequence[int],
                   path: Path, *, slow_period: tuple[int, int] | None = None) -> None:
    """Step time (ms) over steps with the P50 and P99 lines; the steps of a periodic slow phase marked."""
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    s = np.asarray(steps)
    t = np.asarray(times, dtype=np.float64) * 1e3
    ax.plot(s, t, ".", ms=3, color="tab:blue", label="step time")
    ax.axhline(p50 * 1e3, color="tab:green", lw=1.0, label=f"P50 {p50 * 1e3:.4g} ms")
    ax.axhline(p99 * 1e3, color="tab:red", lw=1.0, label=f"P99 {p99 * 1e3:.4g} ms")
    if slow_period is not None and len(s):
        period, phase = slow_period
        hit = s % period == phase
        ax.plot(s[hit], t[hit], "o", mfc="none", ms=6, color="tab:purple",
                label=f"step % {period} == {phase}")
    _mark_restarts(ax, restarts)
    ax.set_xlabel("step")
    ax.set_ylabel("ms (P50 and P99 after each warm-up)")
    if len(t) and np.nanmax(t) > 20 * p99 * 1e3:  # a few huge outliers: a log axis keeps the rest readable
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title("Step time")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss(steps: Sequence[int], loss: Sequence[float], grad_norm: Sequence[float], restarts: Sequence[int],
              path: Path, *, reference: tuple[Sequence[int], Sequence[float]] | None = None) -> None:
    """Loss (and grad norm on a second axis) over the run's steps; the reference run drawn wide beneath."""
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    if reference is not None and len(reference[0]):
        ax.plot(reference[0], reference[1], color="tab:gray", lw=4, alpha=0.5, label="uninterrupted reference")
    ax.plot(steps, loss, color="tab:blue", lw=1.0, label="loss")
    _mark_restarts(ax, restarts)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    other = ax.twinx()
    other.plot(steps, grad_norm, color="tab:orange", lw=0.8, alpha=0.8, label="grad norm")
    other.set_ylabel("grad norm")
    lines = ax.get_legend_handles_labels()
    more = other.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="best", fontsize=8)
    ax.set_title("Loss and gradient norm")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_timeline(attempts: Sequence[tuple[Sequence[float], Sequence[int]]], failures: Sequence[tuple[float, int, str]],
                  path: Path) -> None:
    """The step each attempt reached over wall-clock minutes since the run began; each failure marked
    where its attempt stopped, the next attempt starting lower (from its checkpoint)."""
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    origin = min((t[0] for t, _ in attempts if len(t)), default=0.0)
    end = max((t[-1] for t, _ in attempts if len(t)), default=origin)
    scale, unit = (60.0, "minutes") if end - origin > 120 else (1.0, "seconds")
    for i, (times, steps) in enumerate(attempts):
        if len(times):
            ax.plot((np.asarray(times) - origin) / scale, steps, lw=1.5, label=f"attempt {i + 1}")
    for j, (when, step, label) in enumerate(failures):
        ax.plot([(when - origin) / scale], [step], "x", color="tab:red", ms=9, mew=2,
                label="failure" if j == 0 else None)
        ax.annotate(label, ((when - origin) / scale, step), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set_xlabel(f"{unit} since the run began")
    ax.set_ylabel("step")
    ax.set_title("Failure timeline")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
