"""The CPU device adapter: what it patches, that it restores everything, which megatron-core it is verified with."""
import numpy as np
import pytest
import torch

from migrate.workload.megatron import cpu_adapter
from migrate.workload.megatron.cpu_adapter import (VERIFIED_MEGATRON_CORE, check_megatron_version, cpu_device_adapter,
                                                  is_cuda_device)


def test_verified_version_is_the_installed_megatron_core():
    from megatron.core.package_info import __version__

    assert VERIFIED_MEGATRON_CORE == "0.16.1" == __version__
    assert check_megatron_version() == "0.16.1"


def test_other_megatron_versions_are_refused(monkeypatch):
    import megatron.core.package_info as info

    monkeypatch.setattr(info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="verified with megatron-core 0.16.1, found 0.99.0"):
        check_megatron_version()
    assert check_megatron_version(allow_other_versions=True) == "0.99.0"


@pytest.mark.parametrize("device,expected", [("cuda", True), ("cuda:1", True), (0, True), (torch.device("cuda"), True),
                                             ("cpu", False), (torch.device("cpu"), False), (None, False), (True, False)])
def test_cuda_devices_are_recognised(device, expected):
    assert is_cuda_device(device) is expected


def test_cuda_calls_run_on_the_cpu_inside_the_adapter():
    with cpu_device_adapter() as patches:
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()
        x = torch.zeros(3, device="cuda")
        y = torch.empty(2, device=torch.cuda.current_device())
        z = x.new_empty((4,), device=torch.cuda.current_device())
        assert x.device.type == y.device.type == z.device.type == "cpu"
        assert x.to("cuda").device.type == "cpu" and x.cuda().device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor" and x.double().type() == "torch.cuda.DoubleTensor"
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.record_event().synchronize()
        torch.cuda.manual_seed(5)
        state = torch.cuda.get_rng_state()
        a = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(4))
        targets = {p.target for p in patches}
    assert {"torch.cuda.current_device", "torch.Tensor.type", "torch.zeros", "torch.distributed.all_to_all_single",
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            "megatron.core.transformer.moe.moe_utils.te_general_gemm"} <= targets


def test_everything_is_restored_on_exit_even_after_an_error():
    before = {p.target: getattr(p.owner, p.name, "absent") for p in cpu_adapter.planned_patches()}
    with pytest.raises(ZeroDivisionError):
        with cpu_device_adapter():
            assert torch.zeros is not before["torch.zeros"]
            1 / 0  # noqa: B018 - raises inside the adapter
    after = {p.target: getattr(p.owner, p.name, "absent") for p in cpu_adapter.planned_patches()}
    assert after == before
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_the_adapter_is_not_reentrant():
    with cpu_device_adapter():
        with pytest.raises(RuntimeError, match="already active"):
            with cpu_device_adapter():
                pass
    with cpu_device_adapter():
        pass


def test_numpy_split_sizes_reach_gloo_as_ints():
    seen = {}

    def fake(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        seen.update(out=output_split_sizes, inp=input_split_sizes)

    wrapped = cpu_adapter._split_sizes_as_ints(fake)
    wrapped(torch.empty(3), torch.empty(3), np.array([1, 2]), torch.tensor([2, 1]))
    assert seen == {"out": [1, 2], "inp": [2, 1]} and all(type(v) is int for v in seen["out"] + seen["inp"])


def test_uneven_gloo_gathers_and_scatters_are_padded_then_sliced():
    """Two simulated ranks holding 3 and 1 rows: the original collective sees only even (3-row)
    pieces, and the caller gets its uneven pieces back."""
    rank_rows = [torch.arange(6.0).view(3, 2), torch.tensor([[7.0, 8.0]])]
    seen = []

    def fake_all_gather(tensor_list, tensor, group=None, async_op=False):
        seen.append([tuple(t.shape) for t in [*tensor_list, tensor]])
        for out, rows in zip(tensor_list, rank_rows):
            out.copy_(cpu_adapter._padded(rows, out.shape[0]))

    outputs = [torch.empty(3, 2), torch.empty(1, 2)]
    cpu_adapter._uneven_all_gather(fake_all_gather)(outputs, rank_rows[1])
    assert seen == [[(3, 2), (3, 2), (3, 2)]]
    assert torch.equal(outputs[0], rank_rows[0]) and torch.equal(outputs[1], rank_rows[1])

    def fake_reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        seen.append([tuple(t.shape) for t in [output, *input_list]])
        output.copy_(input_list[1] * 2)  # this rank's piece, summed over two identical ranks

    out = torch.empty(1, 2)
    cpu_adapter._uneven_reduce_scatter(fake_reduce_scatter)(out, [torch.ones(3, 2), torch.full((1, 2), 5.0)])
    assert seen[-1] == [(3, 2), (3, 2), (3, 2)] and torch.equal(out, torch.full((1, 2), 10.0))

    even = []
    cpu_adapter._uneven_all_gather(lambda tl, t, group=None, async_op=False: even.append(len(tl)))(
        [torch.empty(2), torch.empty(2)], torch.ones(2))
    assert even == [2]  # even pieces reach the original untouched
