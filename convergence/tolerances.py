"""Tolerances of the convergence gate: one frozen dataclass per check family,
loaded from YAML that maps 1:1 onto them (unknown keys are errors).

Defaults follow common practice: first-step loss within 0.5 %, mean loss after
warm-up within 1 %, grad-norm mean within 10 % (vendor migration guides); per-step
loss within 5 % with a count of allowed failing steps (Megatron-LM golden values);
no NaN/Inf. With two or more baselines the per-step bands come from their spread
(:mod:`convergence.calibration`) instead of the fixed per-step numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from checkpoint import bounded_yaml


class ToleranceError(ValueError):
    """A tolerance file or value that cannot be used (names the key and the value)."""


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ToleranceError(f"{owner}.{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossTolerance:
    """Loss against the baseline (relative errors divide by |baseline|)."""

    step_abs: float = 0.0
    """Per-step band floor in loss units (band = max(step_abs, step_rel * |baseline|))."""
    step_rel: float = 0.05
    """Per-step relative band when no calibration is available."""
    window: int = 10
    """Steps in the moving window of the windowed check."""
    window_rel: float = 0.02
    """Allowed |mean signed relative deviation| over any window (uncalibrated)."""
    mean_rel: float = 0.01
    """Allowed |mean relative error| over all steps after warm-up."""
    warmup_steps: int = 0
    """Aligned steps skipped at the start by the mean-error check."""
    first_step_rel: float = 0.005
    """Allowed relative error of the candidate's first aligned step (uncalibrated)."""
    allowed_failures: int = 0
    """Per-step failures tolerated before the per-step check fails."""

    def __post_init__(self) -> None:
        _positive("loss", step_abs=self.step_abs, step_rel=self.step_rel, window_rel=self.window_rel,
                  mean_rel=self.mean_rel, first_step_rel=self.first_step_rel,
                  warmup_steps=self.warmup_steps, allowed_failures=self.allowed_failures)
        if self.window < 1:
            raise ToleranceError(f"loss.window must be >= 1, got {self.window}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GradNormTolerance:
    """Gradient norm as a ratio candidate / baseline."""

    ratio_low: float = 0.5
    ratio_high: float = 2.0
    mean_rel: float = 0.10
    """Allowed |mean relative error| after warm-up."""
    warmup_steps: int = 0
    allowed_failures: int = 0

    def __post_init__(self) -> None:
        _positive("grad_norm", mean_rel=self.mean_rel, warmup_steps=self.warmup_steps,
                  allowed_failures=self.allowed_failures)
        if not 0 < self.ratio_low <= 1 <= self.ratio_high:
            raise ToleranceError(
                f"grad_norm needs 0 < ratio_low <= 1 <= ratio_high, got ratio_low={self.ratio_low} "
                f"ratio_high={self.ratio_high}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class NonFiniteTolerance:
    max_steps: int = 0
    """Candidate steps with NaN/Inf loss or grad norm tolerated beyond the baseline's count."""

    def __post_init__(self) -> None:
        _positive("nonfinite", max_steps=self.max_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpikeTolerance:
    """Spikes: robust z-score of a point against the rolling median of the previous ``window``."""

    window: int = 20
    z: float = 6.0
    max_excess_rate: float = 0.02
    """Candidate spike rate allowed above the highest baseline spike rate."""

    def __post_init__(self) -> None:
        _positive("spikes", z=self.z, max_excess_rate=self.max_excess_rate)
        if self.window < 3:
            raise ToleranceError(f"spikes.window must be >= 3, got {self.window}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoverageTolerance:
    min_steps: int = 10
    """Aligned steps the comparison needs at least."""
    key_steps: tuple[int, ...] = ()
    """Steps that must be present in the candidate and every baseline."""

    def __post_init__(self) -> None:
        _positive("coverage", min_steps=self.min_steps)


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
class CalibrationTolerance:
    """Per-step bands from two or more baselines: factor * rolling max spread, with floors."""

    factor: float = 4.0
    window: int = 5
    """Rolling-max window (steps, centred) applied to the baselines' spread."""
    min_abs: float = 1e-6
    min_rel: float = 1e-5
    """Floors, so bit-identical baselines do not demand a bit-identical candidate."""

    def __post_init__(self) -> None:
        _positive("calibration", factor=self.factor, min_abs=self.min_abs, min_rel=self.min_rel)
        if self.window < 1:
            raise ToleranceError(f"calibration.window must be >= 1, got {self.window}")


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
    calibration: CalibrationTolerance = field(default_factory=CalibrationTolerance)
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
        elif name == "key_steps":
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
                raise ToleranceError(f"{where}.key_steps: expected a list of integers, got {value!r}")
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
    except ToleranceError as exc:
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
