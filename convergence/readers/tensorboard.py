"""TensorBoard event files (Megatron, NeMo, torch SummaryWriter) via TensorBoard's
own EventAccumulator. Orphan purging is off so that a restart's repeated steps reach
our explicit restart policy instead of being dropped silently."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

from convergence.series import SeriesError


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Raw scalar points per tag, in the order the event files hold them."""
    if path.is_dir() and not any("tfevents" in p.name for p in path.iterdir()):
        raise SeriesError(f"{path}: no events.out.tfevents.* file in this folder")
    acc = event_accumulator.EventAccumulator(
        str(path),
        size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
        purge_orphaned_data=False,
    )
    try:
        acc.Reload()
    except Exception as exc:  # tensorboard raises DataLossError and friends
        raise SeriesError(f"{path}: not a readable TensorBoard event file ({type(exc).__name__}: {exc})") from exc
    tags = acc.Tags()
    points: dict[str, list[tuple[int, float]]] = {}
    for tag in tags.get("scalars", []):
        points[tag] = [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
    for tag in tags.get("tensors", []):
        events = acc.Tensors(tag)
        values = []
        for e in events:
            array = tensor_util.make_ndarray(e.tensor_proto)
            if array.size != 1 or array.dtype.kind not in "fiu":
                break
            values.append((int(e.step), float(array.reshape(()))))
        else:
            if values:
                points[tag] = values
    if not points:
        raise SeriesError(f"{path}: TensorBoard events hold no scalar series (tags: {tags})")
    return points
