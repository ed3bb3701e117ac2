"""Tolerances of the convergence gate: one frozen dataclass per check family,
loaded from YAML that maps 1:1 onto them (unknown keys are errors).

The statistical rule (`rule:`, :class:`convergence.decision.DecisionRule`) states the false-alarm
rate per run (1 % by default) whatever the run's length; with two or more baselines its scales
come from their spread. With one baseline there is no noise to measure and documented fixed
defaults from migration practice stand in: per-step loss noise 1.5 % and window-mean noise
0.15 % of the loss, first-step loss within 0.5 %, mean loss after warm-up within 1 %, grad
norm noise 15 % per step and mean within 10 % (vendor migration guides, Megatron-LM golden
values). The hard checks are never relaxed: NaN/Inf, coverage, learning rate.
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
    """Loss against the baseline (relative values divide by |baseline|)."""

    fixed_step_rel: float = 0.015
    """One baseline: the per-step noise scale as a fraction of |baseline loss| (the rule's per-step test)."""
    fixed_window_rel: float = 0.0015
    """One baseline: the noise scale of a window mean as a fraction of |baseline loss| (window tests)."""
    mean_rel: float = 0.01
    """One baseline: allowed |mean relative error| over all steps after warm-up (with two or more baselines
    the calibrated window tests judge sustained bias)."""
    warmup_steps: int = 0
    """Aligned steps skipped at the start by the mean-error check."""
    first_step_rel: float = 0.005
    """One baseline: allowed relative error of the candidate's first aligned step."""
    allowed_failures: int = 0
    """Per-step excursions tolerated beyond the rule (the rule already holds its false-alarm rate)."""

    def __post_init__(self) -> None:
        _positive("loss", fixed_step_rel=self.fixed_step_rel, fixed_window_rel=self.fixed_window_rel,
                  mean_rel=self.mean_rel, first_step_rel=self.first_step_rel,
                  warmup_steps=self.warmup_steps, allowed_failures=self.allowed_failures)


@dataclass(frozen=True, kw_only=True, slots=True)
class GradNormTolerance:
    """Gradient norm, judged as log ratios candidate / baseline."""

    fixed_step_rel: float = 0.15
    """One baseline: the per-step noise scale of log(grad norm) (0.15: about 15 %)."""
    fixed_window_rel: float = 0.03
    """One baseline: the noise scale of a window mean of log(grad norm)."""
    mean_rel: float = 0.10
    """One baseline: allowed |mean relative error| after warm-up."""
    warmup_steps: int = 0
    allowed_failures: int = 0

    def __post_init__(self) -> None:
        _positive("grad_norm", fixed_step_rel=self.fixed_step_rel, fixed_window_rel=self.fixed_window_rel,
                  mean_rel=self.mean_rel, warmup_steps=self.warmup_steps, allowed_failures=self.allowed_failures)


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
    restart_policy: Literal["last", "first", "error"] = "last"

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


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ToleranceError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ToleranceError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
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
