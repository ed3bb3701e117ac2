"""The target layout and micro batch a stage works at: the job's ``target`` section, else the search
stage's choice (its ``target_layout.yaml``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml

from checkpoint.layout import ParallelLayout


def target_layout(job: Any, upstream: Mapping[str, Any]) -> tuple[ParallelLayout, str]:
    """(layout, where it came from); raises ValueError when neither the job nor a search gives one. The job's
    ``target.layout`` wins over the search's choice; where they differ, the second item says so."""
    chosen = search_choice(upstream)
    if job.spec.target.layout is not None:
        fixed = job.spec.target.layout.to_layout()
        override = layout_override(fixed, chosen[0]) if chosen else None
        return fixed, "target.layout" if override is None else f"target.layout ({override})"
    if chosen is not None:
        return chosen[0], f"search stage ({chosen[1]})"
    raise ValueError("no target layout: set target.layout in the job, or list the search stage before this one")


def search_choice(upstream: Mapping[str, Any]) -> tuple[ParallelLayout, Path] | None:
    """The layout the search stage chose and the file that records it; None without a search result."""
    search = upstream.get("search")
    if search is None or "target_layout" not in search.outputs:
        return None
    path = Path(search.outputs["target_layout"])
    return ParallelLayout.from_dict(yaml.safe_load(path.read_text())["target"]["layout"]), path


def layout_override(fixed: ParallelLayout, chosen: ParallelLayout) -> str | None:
    """What to warn of when the job fixes ``target.layout`` and the search chose another layout (pure);
    None when they agree."""
    if fixed.describe() == chosen.describe() and fixed.order == chosen.order:
        return None
    return (f"the job's target.layout {fixed.describe()} overrides the search's choice {chosen.describe()}: "
            f"remove target.layout from the job to use the searched layout")


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
