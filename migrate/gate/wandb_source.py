"""W&B runs as :class:`convergence.series.RunMetrics`.

Offline: a ``run-*.wandb`` transaction log (or the run / wandb folder holding it) is
read with W&B's own reader, ``wandb leet inspect --json PATH``, which prints one JSON
record per line; ``history`` records carry the logged metrics and their step.
Online: ``wandb.Api().run("entity/project/run_id").scan_history()`` (needs an API key).
Keys starting with ``_`` (``_step``, ``_runtime``, ``_timestamp``) are bookkeeping, not metrics.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from convergence.readers.jsonl import as_float
from convergence.series import RestartPolicy, RunMetrics, SeriesError, run_from_points

ONLINE_PREFIX = "wandb:"


def _flatten(item: Mapping, prefix: str = "") -> Iterable[tuple[str, object]]:
    for key, value in item.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def points_from_history(rows: Iterable[tuple[int, Mapping]]) -> dict[str, list[tuple[int, float]]]:
    """(step, logged dict) rows in log order -> raw points per metric."""
    points: dict[str, list[tuple[int, float]]] = {}
    for step, item in rows:
        for key, raw in _flatten(item):
            if key.startswith("_"):
                continue
            value = as_float(raw)
            if value is not None:
                points.setdefault(key, []).append((step, value))
    return points


def _wandb_cli() -> str:
    sibling = Path(sys.executable).with_name("wandb")
    return str(sibling) if sibling.exists() else (shutil.which("wandb") or "wandb")


def is_wandb_path(path: Path) -> bool:
    """A .wandb log, an offline run folder, or a wandb folder with runs."""
    if path.is_file():
        return path.suffix == ".wandb"
    if path.is_dir():
        return any(path.glob("*.wandb")) or any(path.glob("*run-*/*.wandb"))
    return False


def read_offline(path: str | Path, *, policy: RestartPolicy = "last", timeout_s: float = 120.0) -> RunMetrics:
    """Metrics of an offline run through ``wandb leet inspect --json``."""
    path = Path(path)
    if not is_wandb_path(path):
        raise SeriesError(f"{path}: expected a W&B run (a run-*.wandb file or a folder holding one)")
    target = path
    if path.is_dir() and not any(path.glob("*.wandb")):
        runs = sorted(path.glob("*run-*/*.wandb"))
        if len(runs) != 1:
            raise SeriesError(f"{path}: holds {len(runs)} W&B runs ({[str(r.parent.name) for r in runs]}); "
                              f"name one run folder")
        target = runs[0]
    proc = subprocess.run([_wandb_cli(), "leet", "inspect", "--json", str(target)], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SeriesError(f"{target}: `wandb leet inspect --json` failed with exit {proc.returncode}: "
                          f"{proc.stderr.strip()[-500:]}")
    rows: list[tuple[int, Mapping]] = []
    for lineno, line in enumerate(proc.stdout.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SeriesError(f"{target}: record {lineno} from wandb leet is not JSON ({exc.msg})") from exc
        if record.get("type") != "history":
            continue
        history = record.get("history", {})
        item = history.get("item", {})
        step = history.get("step", {}).get("num", item.get("_step"))
        if step is None:
            raise SeriesError(f"{target}: history record {record.get('num')} has no step")
        rows.append((int(step), item))
    return run_from_points(str(path), points_from_history(rows), policy=policy)


def read_online(run_path: str, *, policy: RestartPolicy = "last") -> RunMetrics:
    """Metrics of ``entity/project/run_id`` through the public API (online, API key needed)."""
    import wandb

    try:
        run = wandb.Api().run(run_path)
        rows = [(int(r["_step"]), r) for r in run.scan_history() if r.get("_step") is not None]
    except Exception as exc:  # the API raises CommError, ValueError, auth errors ...
        raise SeriesError(f"wandb:{run_path}: cannot read the run through wandb.Api() ({type(exc).__name__}: {exc})") from exc
    return run_from_points(f"{ONLINE_PREFIX}{run_path}", points_from_history(rows), policy=policy)
