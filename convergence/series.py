"""Metric series: one named scalar over training steps, restart resolution and alignment.

Vocabulary: a *series* is one metric (``loss``, ``grad_norm``, ``lr``) of one run;
a *run* (:class:`RunMetrics`) is every series read from one source; a *restart* is
the point where a log goes back to a step it already logged (a resume from an older
checkpoint), detected from the raw order of the points.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

RestartPolicy = Literal["last", "first", "error"]
"""What to keep when a step is logged twice: the resumed attempt (``last``), the
original one (``first``), or refuse the input (``error``)."""

ALIASES: Mapping[str, tuple[str, ...]] = {
    "loss": (
        "loss", "lm loss", "lm_loss", "train/loss", "train_loss", "train/lm_loss",
        "reduced_train_loss", "Train/Samples/train_loss", "training/loss",
    ),
    "grad_norm": (
        "grad_norm", "grad norm", "grad-norm", "train/grad_norm", "gradient_norm",
        "train/grad-norm", "global_grad_norm",
    ),
    "lr": (
        "lr", "learning rate", "learning-rate", "learning_rate", "train/lr",
        "train/learning_rate", "Train/Samples/lr",
    ),
    "tokens": ("tokens", "consumed_tokens", "consumed tokens", "train/tokens"),
    "samples": ("consumed samples", "consumed_samples", "samples", "consumed_train_samples"),
}
"""Canonical metric name -> names the frameworks log it under (first match wins)."""


class SeriesError(ValueError):
    """A metric source that cannot be turned into series (names the source)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Restart:
    """The log went back from ``from_step`` to ``to_step`` (``to_step <= from_step``)."""

    to_step: int
    from_step: int
    index: int
    """Position of the first repeated point in the raw point order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricSeries:
    """One metric of one run: strictly increasing steps and their values (NaN allowed)."""

    name: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    source: str = ""
    restarts: tuple[Restart, ...] = ()
    superseded: tuple[tuple[int, float], ...] = ()
    """(step, value) points dropped by the restart policy; kept for the continuity check."""

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.values):
            raise SeriesError(
                f"{self.source or '<memory>'}: series {self.name!r} has {len(self.steps)} steps "
                f"but {len(self.values)} values"
            )
        for a, b in zip(self.steps, self.steps[1:]):
            if b <= a:
                raise SeriesError(
                    f"{self.source or '<memory>'}: series {self.name!r} steps not strictly "
                    f"increasing ({a} then {b}); resolve restarts first"
                )

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def x(self) -> np.ndarray:
        return np.asarray(self.steps, dtype=np.int64)

    @property
    def y(self) -> np.ndarray:
        return np.asarray(self.values, dtype=np.float64)

    def value_at(self, step: int) -> float | None:
        """The value logged at ``step``, or None when that step is absent."""
        i = int(np.searchsorted(self.x, step))
        if i < len(self.steps) and self.steps[i] == step:
            return self.values[i]
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunMetrics:
    """Every series read from one source, keyed by the name the source used."""

    source: str
    series: Mapping[str, MetricSeries] = field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        return tuple(self.series)

    def find(self, canonical: str, override: str | None = None) -> MetricSeries | None:
        """The series for ``canonical`` (``loss``, ``grad_norm``, ...): ``override`` if
        given, else the first alias present, else a key whose last path part matches."""
        if override is not None:
            return self.series.get(override)
        for alias in ALIASES.get(canonical, (canonical,)):
            if alias in self.series:
                return self.series[alias]
        lowered = {k.lower(): k for k in self.series}
        for alias in ALIASES.get(canonical, (canonical,)):
            if alias.lower() in lowered:
                return self.series[lowered[alias.lower()]]
        for key in self.series:
            if key.rsplit("/", 1)[-1] in ALIASES.get(canonical, (canonical,)):
                return self.series[key]
        return None

    def require(self, canonical: str, override: str | None = None) -> MetricSeries:
        """Like :meth:`find` but raises :class:`SeriesError` naming what the source holds."""
        found = self.find(canonical, override)
        if found is None:
            wanted = override or " / ".join(ALIASES.get(canonical, (canonical,)))
            raise SeriesError(
                f"{self.source}: no {canonical} series (looked for {wanted}); "
                f"the source holds {sorted(self.series) or 'no series'}"
            )
        return found


def resolve_restarts(
    name: str,
    points: Iterable[tuple[int, float]],
    *,
    source: str = "",
    policy: RestartPolicy = "last",
) -> MetricSeries:
    """Turn raw (step, value) points in log order into a series, resolving restarts.

    A point whose step is not greater than the previous point's step starts a new
    attempt (the job resumed from an older checkpoint). With ``last`` the resumed
    attempt's values replace the old ones from that step on; with ``first`` the
    original values are kept; ``error`` raises. Every restart is recorded.
    """
    raw = [(int(s), float(v)) for s, v in points]
    restarts: list[Restart] = []
    for i in range(1, len(raw)):
        if raw[i][0] <= raw[i - 1][0]:
            restarts.append(Restart(to_step=raw[i][0], from_step=raw[i - 1][0], index=i))
    if restarts and policy == "error":
        r = restarts[0]
        raise SeriesError(
            f"{source or '<memory>'}: series {name!r} goes back from step {r.from_step} to "
            f"step {r.to_step} (point {r.index}); restart policy is 'error'"
        )
    kept: dict[int, float] = {}
    superseded: list[tuple[int, float]] = []
    previous: int | None = None
    for step, value in raw:
        if policy == "last" and previous is not None and step <= previous:
            # The resumed attempt replaces the old timeline from ``step`` on, including
            # steps it never reaches again.
            for s in sorted(k for k in kept if k >= step):
                superseded.append((s, kept.pop(s)))
        if step in kept:
            superseded.append((step, value))
        else:
            kept[step] = value
        previous = step
    steps = sorted(kept)
    return MetricSeries(
        name=name,
        steps=tuple(steps),
        values=tuple(kept[s] for s in steps),
        source=source,
        restarts=tuple(restarts),
        superseded=tuple(superseded),
    )


def run_from_points(
    source: str,
    points: Mapping[str, Sequence[tuple[int, float]]],
    *,
    policy: RestartPolicy = "last",
) -> RunMetrics:
    """Build a :class:`RunMetrics` from raw points per metric name (log order)."""
    series = {
        name: resolve_restarts(name, pts, source=source, policy=policy)
        for name, pts in points.items()
        if pts
    }
    if not series:
        raise SeriesError(f"{source}: no numeric metric points found")
    return RunMetrics(source=source, series=series)


def rekey_by(series: MetricSeries, position: MetricSeries, *, name: str | None = None) -> MetricSeries:
    """Re-index ``series`` by another series' values (e.g. consumed tokens) at the same steps.

    Steps missing from ``position`` are dropped; the result's steps are the positions.
    """
    pos = {s: v for s, v in zip(position.steps, position.values) if math.isfinite(v)}
    pairs = sorted((int(pos[s]), v) for s, v in zip(series.steps, series.values) if s in pos)
    if not pairs:
        raise SeriesError(
            f"{series.source}: series {series.name!r} shares no step with {position.name!r}"
        )
    return MetricSeries(
        name=name or series.name,
        steps=tuple(p for p, _ in pairs),
        values=tuple(v for _, v in pairs),
        source=series.source,
        restarts=series.restarts,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Aligned:
    """Baselines and candidate on the common steps (rows: runs, columns: steps)."""

    steps: np.ndarray
    baselines: np.ndarray
    candidate: np.ndarray
    interpolated: bool


def align(baselines: Sequence[MetricSeries], candidate: MetricSeries, *, interpolate: bool = False) -> Aligned:
    """Put series on common x positions.

    Exact mode keeps the candidate's steps that every baseline logged too. With
    ``interpolate`` (used when aligning by consumed tokens across batch sizes) the
    baselines are linearly interpolated onto the candidate's positions inside the
    range they all cover.
    """
    if not baselines:
        raise SeriesError("align: at least one baseline series is needed")
    cx = candidate.x
    if interpolate:
        lo = max(int(b.x[0]) for b in baselines)
        hi = min(int(b.x[-1]) for b in baselines)
        mask = (cx >= lo) & (cx <= hi)
        steps = cx[mask]
        rows = np.stack([np.interp(steps, b.x, b.y) for b in baselines]) if len(steps) else np.empty((len(baselines), 0))
        return Aligned(steps=steps, baselines=rows, candidate=candidate.y[mask], interpolated=True)
    common = set(candidate.steps)
    for b in baselines:
        common &= set(b.steps)
    steps = np.asarray(sorted(common), dtype=np.int64)
    rows = np.stack([b.y[np.searchsorted(b.x, steps)] for b in baselines]) if len(steps) else np.empty((len(baselines), 0))
    cand = candidate.y[np.searchsorted(cx, steps)] if len(steps) else np.empty(0)
    return Aligned(steps=steps, baselines=rows, candidate=cand, interpolated=False)
