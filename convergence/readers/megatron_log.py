"""Megatron-LM stdout logs: ``[date] iteration   10/  100 | consumed samples: 80 |
... | learning rate: 1.000000E-04 | global batch size: 8 | lm loss: 1.234567E+00 |
loss scale: 1.0 | grad norm: 0.123 | number of skipped iterations: 0 |
number of nan iterations: 0 |`` (``training_log`` in megatron/training/training.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from convergence.readers.jsonl import as_float

LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")


def parse_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(iteration, {field: value}) for one training_log line, else None."""
    match = LINE.search(line)
    if not match:
        return None
    fields: dict[str, float] = {}
    for part in match.group(3).split("|"):
        key, sep, raw = part.partition(":")
        if not sep:
            continue
        value = as_float(raw)
        if value is not None:
            fields[key.strip()] = value
    # Megatron prints a loss only when its interval average is > 0, so a NaN
    # iteration shows up as a missing loss and a nan-iteration count.
    if fields.get("number of nan iterations", 0) > 0 and not any("loss" in k and k != "loss scale" for k in fields):
        fields["lm loss"] = math.nan
    return int(match.group(1)), fields


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Raw points per field in file order (a resume shows up as repeated iterations)."""
    points: dict[str, list[tuple[int, float]]] = {}
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            parsed = parse_line(line)
            if parsed is None:
                continue
            step, fields = parsed
            for key, value in fields.items():
                points.setdefault(key, []).append((step, value))
    return points
