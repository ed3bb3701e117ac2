"""The target layout a stage works at: the job's ``target.layout``, else the search stage's choice."""

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
