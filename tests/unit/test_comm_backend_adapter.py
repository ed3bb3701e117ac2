"""A user moving a job between NCCL, HCCL and Gloo: which backend, which env, which options survive."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from migrate.comm.backends import (
    BackendProbe,
    BackendUnavailable,
    backend_environment,
    format_backend_string,
    map_comm_options,
    parse_backend_string,
    process_group_backend,
    select_backend,
)

EVERYTHING = BackendProbe(nccl=True, gloo=True, mpi=True, xccl=True, ucc=True, torch_npu=True)
CPU_ONLY = BackendProbe(nccl=False, gloo=True, mpi=False, xccl=False, ucc=False, torch_npu=False)


@pytest.mark.parametrize(("device", "backend", "pg"), [
    ("cuda", "nccl", "cpu:gloo,cuda:nccl"),
    ("gpu", "nccl", "cpu:gloo,cuda:nccl"),
    ("npu", "hccl", "cpu:gloo,npu:hccl"),
    ("Ascend", "hccl", "cpu:gloo,npu:hccl"),
    ("cpu", "gloo", "gloo"),
    ("xpu", "xccl", "cpu:gloo,xpu:xccl"),
])
def test_each_device_type_gets_its_vendor_backend(device: str, backend: str, pg: str) -> None:
    choice = select_backend(device, probe=EVERYTHING)
    assert (choice.backend, choice.process_group_backend) == (backend, pg)
    assert choice.import_module == ("torch_npu" if backend == "hccl" else None)


def test_multi_backend_string_is_what_torch_parses() -> None:
    text = process_group_backend("cuda", "nccl")
    assert BackendConfig(dist.Backend(text)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_string("cuda:nccl, cpu:gloo") == {"cuda": "nccl", "cpu": "gloo"}
    assert format_backend_string({"cuda": "nccl", "cpu": "gloo"}) == "cpu:gloo,cuda:nccl"
    choice = select_backend("cuda", "cpu:gloo,cuda:nccl", probe=EVERYTHING)
    assert choice.backend == "nccl" and choice.process_group_backend == "cpu:gloo,cuda:nccl"


def test_requested_mpi_where_pytorch_has_it_and_not_where_it_lacks_it() -> None:
    assert select_backend("cpu", "mpi", probe=EVERYTHING).backend == "mpi"
    with pytest.raises(BackendUnavailable, match=r"'mpi'.*is_mpi_available\(\) is False"):
        select_backend("cpu", "mpi", probe=CPU_ONLY)


def test_missing_backends_are_named_with_what_is_missing() -> None:
    with pytest.raises(BackendUnavailable, match="torch_npu is not installed"):
        select_backend("npu", probe=CPU_ONLY)
    with pytest.raises(BackendUnavailable, match="is_nccl_available"):
        select_backend("cuda", probe=CPU_ONLY)
    with pytest.raises(ValueError, match=r"cannot move 'npu' tensors"):
        select_backend("npu", "nccl", probe=EVERYTHING)
    with pytest.raises(ValueError, match="names device 'cpu' twice"):
        parse_backend_string("cpu:gloo,cpu:mpi")


def test_this_machine_has_gloo() -> None:
    assert select_backend("cpu").backend == "gloo"


def test_backend_environment_keeps_only_that_backends_variables() -> None:
    env = {"NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1", "HCCL_BUFFSIZE": "300", "PATH": "/bin",
           "GLOO_SOCKET_IFNAME": "eth0"}
    assert backend_environment("nccl", env) == {"NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert backend_environment("hccl", env) == {"HCCL_BUFFSIZE": "300"}
    assert backend_environment("gloo", env) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_nccl_job_options_mapped_to_hccl_with_units_and_gaps_reported() -> None:
    env = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128", "NCCL_BUFFSIZE": str(6 * 2**20 + 1),
           "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_TIMEOUT": "22", "NCCL_MAX_NCHANNELS": "16",
           "NCCL_SOMETHING_NEW": "1", "PATH": "/bin"}
    framework = {"timeout_s": 1800, "ddp_bucket_cap_mb": 512, "overlap_grad_reduce": True, "tp_comm_overlap": True}
    mapping = map_comm_options("nccl", "hccl", env, framework)
    by_key = {(o.key, o.target_key): o for o in mapping.options}
    assert mapping.target_env["HCCL_ALGO"] == "level0:NA;level1:ring"
    assert mapping.target_env["HCCL_BUFFSIZE"] == "7"  # bytes -> MiB, rounded up
    assert mapping.target_env["HCCL_SOCKET_IFNAME"] == "ib0"
    assert mapping.target_env["HCCL_RDMA_TIMEOUT"] == "20"  # clamped to HCCL's documented range
    assert mapping.target_env["HCCL_CONNECT_TIMEOUT"] == "1780"  # +20 s notification stays under the PG timeout
    assert mapping.target_env["HCCL_EXEC_TIMEOUT"] == str(1800 // 68 * 68)
    unmapped = {o.key for o in mapping.unmapped}
    assert unmapped == {"NCCL_PROTO", "NCCL_MAX_NCHANNELS", "NCCL_SOMETHING_NEW", "tp_comm_overlap"}
    assert by_key[("overlap_grad_reduce", "overlap_grad_reduce")].status == "carried"
    assert all(o.doc.startswith("https://") for o in mapping.options)
    assert "PATH" not in {o.key for o in mapping.options}


def test_nccl_tree_algorithm_has_no_hccl_equivalent() -> None:
    mapping = map_comm_options("nccl", "hccl", {"NCCL_ALGO": "Tree"})
    (option,) = mapping.options
    assert option.status == "unmapped" and "only 'Ring'" in option.note
    assert "HCCL_ALGO" not in mapping.target_env


def test_hccl_job_moving_to_nccl_and_to_gloo() -> None:
    env = {"HCCL_BUFFSIZE": "200", "HCCL_ALGO": "level0:NA;level1:H-D_R", "HCCL_DETERMINISTIC": "true",
           "HCCL_SOCKET_IFNAME": "eth1"}
    to_nccl = map_comm_options("hccl", "nccl", env)
    assert to_nccl.target_env == {"NCCL_BUFFSIZE": str(200 * 2**20), "NCCL_SOCKET_IFNAME": "eth1"}
    assert {o.key for o in to_nccl.unmapped} == {"HCCL_ALGO", "HCCL_DETERMINISTIC"}
    to_gloo = map_comm_options("hccl", "gloo", env)
    assert to_gloo.target_env == {"GLOO_SOCKET_IFNAME": "eth1"}
    assert len(to_gloo.unmapped) == 3


def test_same_backend_carries_everything_and_unknown_options_are_rejected() -> None:
    same = map_comm_options("nccl", "nccl", {"NCCL_ALGO": "Tree"})
    assert [o.status for o in same.options] == ["carried"] and same.target_env == {"NCCL_ALGO": "Tree"}
    with pytest.raises(ValueError, match=r"unknown communication options \['bucket_mb'\]"):
        map_comm_options("nccl", "hccl", {}, {"bucket_mb": 25})


def test_large_buckets_raise_hccl_buffer_size() -> None:
    mapping = map_comm_options("nccl", "hccl", {}, {"reduce_bucket_size": 500_000_000})
    assert mapping.target_env["HCCL_BUFFSIZE"] == str(-(-500_000_000 * 4 // 2**20))
