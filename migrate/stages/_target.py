"""The target layout and micro batch a stage works at: the job's ``target`` section, else the search
stage's choice (its ``target_layout.yaml``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from checkpoint.layout import ParallelLayout


def target_layout(job: Any, upstream: Mapping[str, Any]) -> tuple[ParallelLayout, str]:
    """(layout, where it came from); raises ValueError when neither the job nor a search gives one."""
    if job.spec.target.layout is not None:
        return job.spec.target.layout.to_layout(), "target.layout"
    search = upstream.get("search")
    if search is not None and "target_layout" in search.outputs:
        path = Path(search.outputs["target_layout"])
        data = yaml.safe_load(path.read_text())
        return ParallelLayout.from_dict(data["target"]["layout"]), f"search stage ({path})"
    raise ValueError("no target layout: set target.layout in the job, or list the search stage before this one")


def target_micro_batch(job: Any, upstream: Mapping[str, Any]) -> tuple[int, str]:
    """(micro batch, where it came from): ``target.micro_batch_size``, else the search stage's choice when
    it chose the layout, else ``training.micro_batch_size``."""
    spec = job.spec
    if spec.target.micro_batch_size is not None:
        return spec.target.micro_batch_size, "target.micro_batch_size"
    search = upstream.get("search")
    if spec.target.layout is None and search is not None and "target_layout" in search.outputs:
        path = Path(search.outputs["target_layout"])
        chosen = (yaml.safe_load(path.read_text())["target"] or {}).get("micro_batch_size")
        if chosen is not None:
            return int(chosen), f"search stage ({path})"
    return spec.training.micro_batch_size, "training.micro_batch_size"
