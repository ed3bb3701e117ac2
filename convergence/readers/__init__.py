"""Readers: a metric source on disk -> :class:`convergence.series.RunMetrics`.

``read_metrics(path)`` detects the format (JSONL, CSV or a DeepSpeed CSV-monitor
folder, TensorBoard event files, Megatron-LM or DeepSpeed text logs) and resolves
restarts with the given policy. W&B runs are read by ``migrate.gate.wandb_source``
(this library has no W&B), which builds the same RunMetrics with
:func:`convergence.series.run_from_points`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from convergence.readers import deepspeed_log, jsonl, megatron_log, tabular, tensorboard
from convergence.series import RestartPolicy, RunMetrics, SeriesError, run_from_points

Format = Literal["auto", "jsonl", "csv", "tensorboard", "megatron", "deepspeed"]
FORMATS: tuple[str, ...] = ("jsonl", "csv", "tensorboard", "megatron", "deepspeed")

_READERS = {
    "jsonl": jsonl.read_points,
    "csv": tabular.read_points,
    "tensorboard": tensorboard.read_points,
    "megatron": megatron_log.read_points,
    "deepspeed": deepspeed_log.read_points,
}


def detect_format(path: Path) -> str:
    """The format of ``path`` from its name, its folder contents or its first lines."""
    if not path.exists():
        raise SeriesError(f"{path}: no such file or directory")
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        if any("tfevents" in n for n in names):
            return "tensorboard"
        if any(n.endswith(".wandb") for n in names) or any(n.startswith(("run-", "offline-run-")) for n in names):
            raise SeriesError(f"{path}: looks like a W&B run directory; read it with migrate's W&B source")
        if any(n.endswith(".csv") for n in names):
            return "csv"
        raise SeriesError(
            f"{path}: directory holds no TensorBoard event file (events.out.tfevents.*) "
            f"and no CSV file; found {sorted(names)[:10]}"
        )
    name = path.name
    if "tfevents" in name:
        return "tensorboard"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".wandb"):
        raise SeriesError(f"{path}: a W&B transaction log; read it with migrate's W&B source")
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        head = [handle.readline() for _ in range(400)]
    text = "".join(head)
    if megatron_log.LINE.search(text):
        return "megatron"
    if deepspeed_log.PROGRESS.search(text) or deepspeed_log.PIPE.search(text):
        return "deepspeed"
    if text.lstrip().startswith("{"):
        return "jsonl"
    if re.match(r"^[\w./ -]+(,[\w./ -]+)+\s*$", head[0] or ""):
        return "csv"
    raise SeriesError(
        f"{path}: unknown metric format; expected JSONL, CSV, TensorBoard events, or a "
        f"Megatron-LM (' iteration N/ M | lm loss: ...') or DeepSpeed ('step=N, skipped=...' / "
        f"'steps: N loss: ...') text log"
    )


def read_metrics(path: str | Path, fmt: Format = "auto", *, policy: RestartPolicy = "last") -> RunMetrics:
    """Read every metric series from ``path``; raises SeriesError naming the file."""
    path = Path(path)
    kind = detect_format(path) if fmt == "auto" else fmt
    if kind not in _READERS:
        raise SeriesError(f"{path}: unknown format {kind!r}; choose one of {', '.join(FORMATS)}")
    if not path.exists():
        raise SeriesError(f"{path}: no such file or directory")
    try:
        points = _READERS[kind](path)
    except UnicodeDecodeError as exc:
        raise SeriesError(f"{path}: not UTF-8 text ({kind} expected): byte {exc.start} is {exc.object[exc.start]:#04x}"
                          ) from None
    except OSError as exc:
        raise SeriesError(f"{path}: unreadable ({exc.strerror or exc})") from None
    return run_from_points(str(path), points, policy=policy)
