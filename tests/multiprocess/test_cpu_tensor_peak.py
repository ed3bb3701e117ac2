"""The CPU measure of peak tensor memory that the accelerator check compares the memory model against: the torch
profiler's allocations, with the frees it misses (Gloo releasing a collective's buffers on its own thread)
bounded instead of counted live to the end."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from migrate.accelerator.tensor_peak import MemoryEvent, cpu_memory_events, tensor_peak


def _profiled(work) -> list[MemoryEvent]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    return list(cpu_memory_events(prof.profiler.kineto_results.experimental_event_tree()))


def test_the_peak_is_the_most_bytes_live_at_once():
    kept = []

    def work():
        a = torch.ones(1000)          # 4,000 bytes
        b = a.clone()                 # 8,000 live
        del a, b                      # 0
        kept.append(torch.ones(500))  # 2,000: still live at the end

    events = _profiled(work)
    measured = tensor_peak(events)
    assert (measured.peak_bytes, measured.events, measured.unrecorded_frees) == (8000, 5, 0)
    assert all(e.collective_end_ns is None for e in events)


@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*:FutureWarning")  # Megatron's call
def test_a_buffer_a_collective_allocates_is_known_by_the_collective_that_ends_it(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grads = torch.ones(4096)
        out = torch.empty(4096)
        events = _profiled(lambda: dist.reduce_scatter_tensor(out, grads, async_op=True).wait())
    finally:
        dist.destroy_process_group()
    inside = [e for e in events if e.collective_end_ns is not None and e.size > 0]
    assert inside and all(e.collective_end_ns >= e.time_ns for e in inside)


def _run(*events: tuple[int, int, int, int | None]) -> tuple[int, int]:
    measured = tensor_peak(MemoryEvent(t, size, address, end) for t, size, address, end in events)
    return measured.peak_bytes, measured.unrecorded_frees


def test_a_collective_buffer_whose_free_was_missed_dies_with_the_collective():
    grads = (0, 1000, 0xA, None)                    # the gradient buffer, live throughout
    clone = (10, 1000, 0xB, 20)                     # reduce-scatter's input clone, inside a collective ending at 20
    backward = [(30, 1500, 0xC, None), (40, -1500, 0xC, None)]  # the next step's peak
    recorded = _run(grads, clone, (21, -1000, 0xB, None), *backward)
    missed = _run(grads, clone, *backward)
    assert recorded == (2500, 0) and missed == (2500, 1)


def test_an_address_handed_out_again_proves_its_earlier_block_was_freed():
    assert _run((0, 800, 0xA, None), (10, 800, 0xA, None), (20, 100, 0xB, None)) == (900, 1)
    assert _run((0, 800, 0xA, None), (10, 800, 0xC, None)) == (1600, 0)  # different addresses: both live
