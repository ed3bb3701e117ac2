"""JSONL metrics: one JSON object per line with a step key and numeric metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

from convergence.series import SeriesError

STEP_KEYS: tuple[str, ...] = ("step", "iteration", "global_step", "_step", "iter", "steps")
_SPECIAL = {"nan": math.nan, "inf": math.inf, "infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf}


def as_float(value: object) -> float | None:
    """A metric value as float (numbers, numeric strings, 'NaN'/'Infinity'); None if not a metric."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in _SPECIAL:
            return _SPECIAL[text.lower()]
        try:
            return float(text)
        except ValueError:
            return None
    return None


def step_of(record: dict, where: str) -> int:
    """The step of one record; raises naming ``where`` and the keys it has."""
    for key in STEP_KEYS:
        if key in record:
            value = as_float(record[key])
            if value is None or not math.isfinite(value) or value != int(value):
                raise SeriesError(f"{where}: step key {key!r} holds {record[key]!r}, expected an integer")
            return int(value)
    raise SeriesError(f"{where}: no step key (expected one of {', '.join(STEP_KEYS)}); keys are {sorted(record)}")


def check_cells(path: Path, points: dict[str, list[tuple[int, float]]], odd: dict[str, tuple[str, object]]) -> None:
    """A metric (a key or column with numbers) with a value that is no number is an error naming the file,
    the row and the column; a key that never holds a number (a name, a timestamp) is no metric and ignored."""
    for key, (where, raw) in odd.items():
        if key in points:
            raise SeriesError(f"{where}: {key!r} holds {raw!r}, not a number (its other rows are numbers); fix or "
                              f"drop the row, a silently dropped step would hide a gap")


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Raw points per metric in file order."""
    points: dict[str, list[tuple[int, float]]] = {}
    odd: dict[str, tuple[str, object]] = {}
    with path.open("r", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SeriesError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(record, dict):
                raise SeriesError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
            step = step_of(record, where)
            for key, raw in record.items():
                if key in STEP_KEYS:
                    continue
                value = as_float(raw)
                if value is not None:
                    points.setdefault(key, []).append((step, value))
                elif raw is not None and not isinstance(raw, (dict, list)):
                    odd.setdefault(key, (f"{where} (step {step})", raw))
    check_cells(path, points, odd)
    return points
