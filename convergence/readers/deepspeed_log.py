"""DeepSpeed stdout logs: the engine's ``[Rank 0] step=10, skipped=0, lr=[0.0001],
mom=[(0.9, 0.999)]`` (``DeepSpeedEngine._report_progress``) and the pipeline engine's
``steps: 10 loss: 2.3456 iter time (s): 0.123 samples/sec: 64.5`` (``PipelineEngine
.train_batch``). Megatron-DeepSpeed prints Megatron's format: use that reader."""

from __future__ import annotations

import re
from pathlib import Path

from convergence.readers.jsonl import as_float

PROGRESS = re.compile(r"\bstep=(\d+), skipped=(\d+), lr=\[([^\]]*)\]")
PIPE = re.compile(r"\bsteps: (\d+) loss: (\S+)(.*)$")
_PIPE_EXTRA = re.compile(r"([A-Za-z_/ ()]+?): (\S+)")


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Raw points (loss, lr, skipped, iter time, samples/sec) in file order."""
    points: dict[str, list[tuple[int, float]]] = {}

    def add(key: str, step: int, value: float | None) -> None:
        if value is not None:
            points.setdefault(key, []).append((step, value))

    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            match = PROGRESS.search(line)
            if match:
                step = int(match.group(1))
                add("skipped", step, float(match.group(2)))
                lrs = [as_float(x) for x in match.group(3).split(",") if x.strip()]
                add("lr", step, lrs[0] if lrs else None)
                continue
            match = PIPE.search(line)
            if match:
                step = int(match.group(1))
                add("loss", step, as_float(match.group(2)))
                for key, raw in _PIPE_EXTRA.findall(match.group(3)):
                    add(key.strip(), step, as_float(raw))
    return points
