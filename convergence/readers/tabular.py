"""CSV metrics: a header row with a step column, or a DeepSpeed CSV-monitor folder
(one ``<tag>.csv`` per metric, each with the header ``step,<last tag part>``)."""

from __future__ import annotations

import csv
from pathlib import Path

from convergence.readers.jsonl import STEP_KEYS, as_float, check_cells
from convergence.series import SeriesError


def _read_file(path: Path, points: dict[str, list[tuple[int, float]]]) -> None:
    odd: dict[str, tuple[str, object]] = {}
    with path.open("r", encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle)
        header = next(rows, None)
        if not header:
            raise SeriesError(f"{path}: empty CSV file, expected a header row with a step column")
        header = [h.strip() for h in header]
        step_cols = [i for i, h in enumerate(header) if h in STEP_KEYS]
        if not step_cols:
            raise SeriesError(
                f"{path}: no step column in header {header} (expected one of {', '.join(STEP_KEYS)})"
            )
        sc = step_cols[0]
        for lineno, row in enumerate(rows, 2):
            if not row or (len(row) == len(header) and row == header):
                continue  # blank lines, and the header DeepSpeed repeats after a restart
            if len(row) != len(header):
                raise SeriesError(f"{path}:{lineno}: {len(row)} fields, header has {len(header)}")
            step = as_float(row[sc])
            if step is None or step != step or step != int(step):
                raise SeriesError(f"{path}:{lineno}: step {row[sc]!r} is not an integer")
            for i, cell in enumerate(row):
                if i == sc or not cell.strip():
                    continue
                value = as_float(cell)
                if value is not None:
                    points.setdefault(header[i], []).append((int(step), value))
                else:
                    odd.setdefault(header[i], (f"{path}:{lineno} (step {int(step)}, column {i + 1})", cell))
    check_cells(path, points, odd)


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Raw points per metric in file order (a folder: every ``*.csv`` in name order)."""
    points: dict[str, list[tuple[int, float]]] = {}
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files:
        raise SeriesError(f"{path}: no *.csv file in the folder")
    for f in files:
        _read_file(f, points)
    return points
