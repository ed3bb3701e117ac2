"""The CPU's measure of peak tensor memory: the torch profiler's record of every allocation and free.

The record misses some frees. Gloo's worker thread can hold the last reference to a collective's Work and
release it (and the buffers the collective allocated, such as the input clone of `reduce_scatter_tensor`) after
the work's thread-local profiler state is gone, so the free is never reported. Counting such a buffer live to
the end inflates the peak by whatever the collective copied (a whole gradient buffer), in some runs and not
others. Two facts bound when a buffer whose free was missed actually died: an allocation recorded later at the
same address, and, for a buffer a `c10d::` collective allocated, the end of that collective (its caller waits on
the work before using the result).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (`size` > 0) or free (`size` < 0) at `address`; `collective_end_ns` is the end of the
    `c10d::` collective it happened inside, or None."""

    time_ns: int
    size: int
    address: int
    collective_end_ns: int | None = None


@dataclass(frozen=True)
class TensorPeak:
    peak_bytes: int
    events: int
    unrecorded_frees: int  # buffers whose free the profiler missed, released at the bound above


def tensor_peak(events: Iterable[MemoryEvent]) -> TensorPeak:
    """The peak of live bytes over `events` (any order), counted from zero at the first event."""
    ordered = sorted(events, key=lambda e: e.time_ns)
    timeline: list[tuple[int, int]] = []
    live_at: dict[int, MemoryEvent] = {}
    unrecorded: list[tuple[int, int]] = []
    for event in ordered:
        timeline.append((event.time_ns, event.size))
        if event.size < 0:
            live_at.pop(event.address, None)
            continue
        earlier = live_at.get(event.address)
        if earlier is not None:  # the address was handed out again, so its earlier block was freed before now
            unrecorded.append((min(earlier.collective_end_ns or event.time_ns, event.time_ns), -earlier.size))
        live_at[event.address] = event
    unrecorded += [(e.collective_end_ns, -e.size) for e in live_at.values() if e.collective_end_ns is not None]
    live = peak = 0
    for _, size in sorted(timeline + unrecorded):  # at one instant, frees before allocations
        live += size
        peak = max(peak, live)
    return TensorPeak(peak_bytes=peak, events=len(ordered), unrecorded_frees=len(unrecorded))


def cpu_memory_events(event_tree: list[Any]) -> Iterator[MemoryEvent]:
    """The CPU allocations and frees of a torch profiler run (`kineto_results.experimental_event_tree()`)."""
    import torch

    allocation = torch._C._profiler._EventType.Allocation
    stack = [(node, None) for node in event_tree]
    while stack:
        node, collective_end = stack.pop()
        if node.tag == allocation:
            fields = node.typed[1]
            if fields.device.type == "cpu":
                yield MemoryEvent(time_ns=node.start_time_ns, size=fields.alloc_size, address=fields.ptr,
                                  collective_end_ns=collective_end)
            continue
        if collective_end is None and node.name.startswith("c10d::"):
            collective_end = node.end_time_ns
        stack.extend((child, collective_end) for child in node.children)
