"""Tolerances of the convergence gate: one frozen dataclass per check family,
loaded from YAML that maps 1:1 onto them (unknown keys are errors).

The statistical rule (`rule:`, :class:`convergence.decision.DecisionRule`) states the false-alarm
rate per run (1 % by default) whatever the run's length. Per-step noise is always measured (from
the baselines' spread, or one baseline's own step-to-step noise); what one baseline cannot show,
how far a good run's level and wander stray, comes from documented priors: loss level 0.5 % and
wander 0.4 %, grad-norm level 5 % and wander 3 %, per-step (and first-step) loss noise at least 0.5 % (vendor migration
guides, Megatron-LM golden values, the seed-to-seed spread of the built-in workloads); two or more
baselines pool them with what they measure. The hard checks are never relaxed: NaN/Inf,
coverage, learning rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from checkpoint import bounded_yaml
from convergence.decision import DecisionRule


class ToleranceError(ValueError):
    """A tolerance file or value that cannot be used (names the key and the value)."""


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ToleranceError(f"{owner}.{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossTolerance:
    """Loss against the baselines (relative values are fractions of the baselines' mean loss)."""

    level_rel: float = 0.005
    """Prior: standard deviation of a good run's mean loss about the true centre (0.5 %: the seed-to-seed spread
    of small models; large LLM runs sit at 0.1-0.3 %). One baseline judges the level with it alone; two or more
    pool it with their measured spread."""
    window_rel: float = 0.004
    """Prior: standard deviation of a good run's slow wander about its own level (0.4 %; modelled with a time
    constant of 100 steps; seeds of the built-in tiny Llama wander by 0.25 % of the loss at 600 steps, and the
    noise model fitted to them by 0.38 % at 5,000)."""
    step_rel: float = 0.005
    """One baseline: the least per-step noise of the residual, as a fraction of the loss (0.5 %: the first-loss
    agreement of migration practice), where the baseline's own step-to-step noise is smaller (a steep start, a
    smoothed log). It bounds the first step's band too."""
    warmup_steps: int = 0
    """Aligned steps left out of the level and of the drift tests' reference at the start."""
    allowed_failures: int = 0
    """Per-step excursions tolerated beyond the rule (the rule already holds its false-alarm rate)."""

    def __post_init__(self) -> None:
        _positive("loss", level_rel=self.level_rel, window_rel=self.window_rel, step_rel=self.step_rel,
                  warmup_steps=self.warmup_steps, allowed_failures=self.allowed_failures)


@dataclass(frozen=True, kw_only=True, slots=True)
class GradNormTolerance:
    """Gradient norm, judged as log ratios candidate / baseline."""

    level_rel: float = 0.05
    """Prior: standard deviation of a good run's mean log grad norm about the true centre (about 5 %; migration
    guides accept 10 %)."""
    window_rel: float = 0.03
    """Prior: standard deviation of a good run's wander of log grad norm."""
    step_rel: float = 0.05
    """One baseline: the least per-step noise of the log grad-norm residual (5 %)."""
    warmup_steps: int = 0
    """Aligned steps left out of the level and of the drift tests' reference at the start."""
    allowed_failures: int = 0
    """Per-step excursions tolerated beyond the rule."""

    def __post_init__(self) -> None:
        _positive("grad_norm", level_rel=self.level_rel, window_rel=self.window_rel, step_rel=self.step_rel,
                  warmup_steps=self.warmup_steps, allowed_failures=self.allowed_failures)


@dataclass(frozen=True, kw_only=True, slots=True)
class NonFiniteTolerance:
    max_steps: int = 0
    """Candidate steps with NaN/Inf loss or grad norm tolerated (a baseline must have none)."""

    def __post_init__(self) -> None:
        _positive("nonfinite", max_steps=self.max_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpikeTolerance:
    """Spikes: robust z-score of a point against the rolling median of the previous ``window``."""

    window: int = 20
    z: float = 6.0
    """A spike: more than z robust standard deviations from the median of the previous window. The candidate's
    spike count is judged against the baselines' spike rate at the rule's `spike_share` of its level."""

    def __post_init__(self) -> None:
        _positive("spikes", z=self.z)
        if self.window < 3:
            raise ToleranceError(f"spikes.window must be >= 3, got {self.window}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoverageTolerance:
    min_steps: int = 10
    """Aligned steps the comparison needs at least."""
    key_steps: tuple[int, ...] = ()
    """Steps that must be present in the candidate and every baseline."""
    until: Literal["baseline", "candidate"] = "baseline"
    """The compared range ends where the baselines end (a candidate that stops early is incomplete
    evidence) or where the candidate ends (a deliberately shorter candidate)."""
    min_fraction: float = 0.95
    """Share of the baselines' steps in the compared range (from the candidate's first step) that the
    candidate must have logged too."""
    max_gap: int = 10
    """Most consecutive baseline steps of the compared range that the candidate may lack (a hole in its log)."""

    def __post_init__(self) -> None:
        _positive("coverage", min_steps=self.min_steps, min_fraction=self.min_fraction, max_gap=self.max_gap)
        if self.until not in ("baseline", "candidate"):
            raise ToleranceError(f"coverage.until must be 'baseline' or 'candidate', got {self.until!r}")
        if self.min_fraction > 1:
            raise ToleranceError(f"coverage.min_fraction must be <= 1, got {self.min_fraction}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartTolerance:
    """Continuity at a resume: the candidate's first steps, and repeated steps in one log."""

    window: int = 5
    """Steps after the candidate's first step (the resume) judged with no allowed failure."""
    repeat_rel: float = 1e-3
    """Allowed relative difference of a repeated step between the old and the resumed attempt."""
    jump_z: float = 8.0
    """Allowed robust z-score of the loss change across an in-log restart."""

    def __post_init__(self) -> None:
        _positive("restart", window=self.window, repeat_rel=self.repeat_rel, jump_z=self.jump_z)


@dataclass(frozen=True, kw_only=True, slots=True)
class LrTolerance:
    rel: float = 1e-4
    """Allowed relative difference of the learning rate at any aligned step."""

    def __post_init__(self) -> None:
        _positive("lr", rel=self.rel)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlignTolerance:
    by: Literal["step", "tokens"] = "step"
    """align the runs by optimizer step, or by consumed tokens (runs with different global batches)"""
    restart_policy: Literal["last", "first", "error"] = "last"
    """a step logged twice (a restart): keep the resumed attempt (last), the original one (first), or refuse the log
    (error)"""

    def __post_init__(self) -> None:
        if self.by not in ("step", "tokens"):
            raise ToleranceError(f"align.by must be 'step' or 'tokens', got {self.by!r}")
        if self.restart_policy not in ("last", "first", "error"):
            raise ToleranceError(
                f"align.restart_policy must be 'last', 'first' or 'error', got {self.restart_policy!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerances:
    loss: LossTolerance = field(default_factory=LossTolerance)
    grad_norm: GradNormTolerance = field(default_factory=GradNormTolerance)
    nonfinite: NonFiniteTolerance = field(default_factory=NonFiniteTolerance)
    spikes: SpikeTolerance = field(default_factory=SpikeTolerance)
    coverage: CoverageTolerance = field(default_factory=CoverageTolerance)
    restart: RestartTolerance = field(default_factory=RestartTolerance)
    lr: LrTolerance = field(default_factory=LrTolerance)
    rule: DecisionRule = field(default_factory=DecisionRule)
    align: AlignTolerance = field(default_factory=AlignTolerance)


RENAMED = {
    "fixed_step_rel": "step_rel (a floor: the per-step noise is measured, even from one baseline)",
    "fixed_window_rel": "window_rel (the prior sd of a window mean's wander)",
    "mean_rel": "level_rel (the prior sd of a good run's level, judged at the rule's level; not a limit)",
    "first_step_rel": "step_rel (the first step is judged inside its band)",
}
"""Keys of earlier tolerance files and what replaced them."""


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ToleranceError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        renamed = [f"{k} is now {RENAMED[k]}" for k in unknown if k in RENAMED]
        raise ToleranceError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}"
                             + (f" ({'; '.join(renamed)})" if renamed else ""))
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = fields[name].default_factory  # type: ignore[misc]
        if dataclasses.is_dataclass(sub):
            kwargs[name] = _build(sub, value or {}, f"{where}.{name}")
        elif isinstance(fields[name].default, tuple):  # key_steps, rule.windows
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in value):
                raise ToleranceError(f"{where}.{name}: expected a list of integers, got {value!r}")
            kwargs[name] = tuple(value)
        else:
            default = fields[name].default
            if isinstance(default, bool) or not isinstance(default, (int, float)):
                kwargs[name] = value
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ToleranceError(f"{where}.{name}: expected a number, got {value!r}")
            elif isinstance(default, int) and not isinstance(default, bool) and value != int(value):
                raise ToleranceError(f"{where}.{name}: expected an integer, got {value!r}")
            else:
                kwargs[name] = type(default)(value)
    try:
        return cls(**kwargs)
    except (ToleranceError, ValueError) as exc:
        raise ToleranceError(f"{where}: {exc}") from None


def tolerances_from_mapping(data: Mapping[str, Any] | None, where: str = "tolerances") -> Tolerances:
    """Tolerances from a plain mapping (a parsed YAML document or a job's stage options)."""
    return _build(Tolerances, data or {}, where)


def load_tolerances(path: str | Path) -> Tolerances:
    """Tolerances from a YAML file; errors name the file and the key."""
    path = Path(path)
    try:
        data = bounded_yaml.load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, bounded_yaml.YamlInputError) as exc:
        raise ToleranceError(f"{path}: cannot read tolerances ({exc})") from exc
    return tolerances_from_mapping(data, str(path))


def tolerances_to_mapping(tol: Tolerances) -> dict[str, Any]:
    """Plain nested dict (for the verdict JSON and the report)."""
    return dataclasses.asdict(tol)
