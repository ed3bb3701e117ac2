"""Backend adapter: device type -> torch.distributed backend, backend env, option mapping.

Three pure pieces and one probe:

* :func:`select_backend` picks the backend for a device type (CUDA -> NCCL,
  Ascend NPU -> HCCL through torch_npu, CPU -> Gloo, Intel XPU -> XCCL, MPI by
  name where PyTorch was built with it) and checks, through :class:`BackendProbe`,
  that this PyTorch can actually create it.
* :func:`process_group_backend` builds the multi-backend string that
  ``torch.distributed.init_process_group`` accepts (``"cpu:gloo,cuda:nccl"``),
  so that CPU tensors (object collectives, checkpoint metadata) keep working
  next to device tensors.
* :func:`backend_environment` reads the backend-specific environment
  (``NCCL_*``, ``TORCH_NCCL_*``, ``HCCL_*``, ``GLOO_*``, ...).
* :func:`map_comm_options` maps the communication options a job sets on the
  source (bucket sizes, overlap, timeouts, algorithm hints, network selection)
  to the target backend's equivalents and reports those that have none.  Every
  rule names the documentation it was taken from.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal
from collections.abc import Callable, Mapping

import torch.distributed as dist

from migrate.runtime.backend import BACKEND_DEVICES, DEFAULT_BACKEND

NCCL_ENV_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
TORCH_NCCL_ENV_DOC = "https://pytorch.org/docs/stable/torch_nccl_environment_variables.html"
TORCH_DIST_DOC = "https://pytorch.org/docs/stable/distributed.html"
HCCL_ENV_DOC = "https://www.hiascend.com/document/detail/zh/canncommercial/latest/maintenref/envvar/envref_07_0001.html"
HCCL_BUFFSIZE_DOC = "https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/envvar/envref_07_0080.html"
HCCL_ALGO_DOC = "https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/envvar/envref_07_0079.html"
HCCL_RDMA_TIMEOUT_DOC = "https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/envvar/envref_07_0091.html"
HCCL_CONNECT_TIMEOUT_DOC = "https://www.hiascend.com/document/detail/zh/canncommercial/850/maintenref/envvar/envref_07_0149.html"
HCCL_EXEC_TIMEOUT_DOC = "https://www.hiascend.com/doc_center/source/zh/canncommercial/601/modeldev/tfmigr2/tfmigr2_000147.html"
TORCH_NPU_ASYNC_DOC = "https://hiascend.com/document/detail/zh/Pytorch/600/apiref/Envvariables/Envir_028.html"
ASCEND_LOG_DOC = "https://www.hiascend.com/document/detail/zh/canncommercial/latest/maintenref/envvar/envref_07_0121.html"
GLOO_ENV_DOC = "https://pytorch.org/docs/stable/distributed.html#common-environment-variables"
MEGATRON_ARGS_DOC = "https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/training/arguments.py"
DEEPSPEED_ZERO_DOC = "https://www.deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training"
TORCH_DDP_DOC = "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html"

DEVICE_ALIASES: Mapping[str, str] = {"gpu": "cuda", "ascend": "npu", "intel_gpu": "xpu"}
"""Other names users write for a device type."""

BACKEND_ENV_PREFIXES: Mapping[str, tuple[str, ...]] = {
    "nccl": ("NCCL_", "TORCH_NCCL_"),
    "hccl": ("HCCL_", "ASCEND_", "TORCH_HCCL_"),
    "gloo": ("GLOO_", "TORCH_GLOO_"),
    "xccl": ("CCL_", "TORCH_XCCL_", "FI_"),
    "mpi": ("OMPI_", "MPI_", "I_MPI_"),
    "ucc": ("UCC_", "UCX_", "TORCH_UCC_"),
}
"""Environment prefixes each backend (or its PyTorch binding) reads."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot be created by this PyTorch installation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendProbe:
    """What this PyTorch can create; injectable so selection is testable without hardware."""

    nccl: bool
    gloo: bool
    mpi: bool
    xccl: bool
    ucc: bool
    torch_npu: bool

    @classmethod
    def current(cls) -> BackendProbe:
        """Probe the running interpreter (``torch.distributed.is_*_available`` and torch_npu)."""
        return cls(
            nccl=dist.is_nccl_available(),
            gloo=dist.is_gloo_available(),
            mpi=dist.is_mpi_available(),
            xccl=dist.is_xccl_available(),
            ucc=dist.is_ucc_available(),
            torch_npu=importlib.util.find_spec("torch_npu") is not None,
        )

    def has(self, backend: str) -> bool:
        """True when ``backend`` can be created (HCCL needs torch_npu installed)."""
        if backend == "hccl":
            return self.torch_npu
        return bool(getattr(self, backend, False))


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendChoice:
    """The backend picked for a device type and how to initialise it."""

    device_type: str
    backend: str
    process_group_backend: str
    import_module: str | None
    reason: str


def normalize_device_type(device_type: str) -> str:
    """Lower-case a device type and resolve aliases (``gpu`` -> ``cuda``, ``ascend`` -> ``npu``)."""
    name = device_type.strip().lower().split(":")[0]
    return DEVICE_ALIASES.get(name, name)


def select_backend(
    device_type: str, requested: str | None = None, probe: BackendProbe | None = None
) -> BackendChoice:
    """Pick the backend for ``device_type`` (or validate ``requested``) and check it exists.

    Raises :class:`BackendUnavailable` naming the device type, the backend and
    what is missing; ``ValueError`` for a backend that cannot move that device's tensors.
    """
    probe = probe if probe is not None else BackendProbe.current()
    device = normalize_device_type(device_type)
    if requested is None or requested.strip().lower() in ("", "auto"):
        if device not in DEFAULT_BACKEND:
            raise ValueError(
                f"device_type {device_type!r} has no default backend; known: {sorted(DEFAULT_BACKEND)}"
                " (set target.backend explicitly)"
            )
        backend = DEFAULT_BACKEND[device]
        reason = f"default backend for device_type {device!r}"
    else:
        backend = requested.strip().lower()
        if ":" in backend or "," in backend:
            parsed = parse_backend_string(backend)
            if device not in parsed:
                raise ValueError(f"backend string {requested!r} names no backend for device_type {device!r}")
            for dev, name in parsed.items():
                _check_available(dev, name, probe)
            return BackendChoice(
                device_type=device,
                backend=parsed[device],
                process_group_backend=format_backend_string(parsed),
                import_module="torch_npu" if "hccl" in parsed.values() else None,
                reason=f"multi-backend string {requested!r} from the job",
            )
        reason = f"backend {backend!r} requested by the job"
    if backend not in BACKEND_DEVICES:
        raise ValueError(f"backend {requested!r} is unknown; known: {sorted(BACKEND_DEVICES)}")
    if device not in BACKEND_DEVICES[backend]:
        raise ValueError(
            f"backend {backend!r} cannot move {device!r} tensors; it handles {list(BACKEND_DEVICES[backend])}"
        )
    _check_available(device, backend, probe)
    return BackendChoice(
        device_type=device,
        backend=backend,
        process_group_backend=process_group_backend(device, backend),
        import_module="torch_npu" if backend == "hccl" else None,
        reason=reason,
    )


def _check_available(device: str, backend: str, probe: BackendProbe) -> None:
    if probe.has(backend):
        return
    what = "torch_npu is not installed" if backend == "hccl" else f"torch.distributed.is_{backend}_available() is False"
    raise BackendUnavailable(f"backend {backend!r} for device_type {device!r} is unavailable here: {what}")


def parse_backend_string(text: str) -> dict[str, str]:
    """Parse ``"cpu:gloo,cuda:nccl"`` into ``{"cpu": "gloo", "cuda": "nccl"}``; a bare name maps no device."""
    result: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if ":" not in part:
            raise ValueError(f"backend string {text!r}: entry {part!r} is not 'device:backend'")
        device, backend = (s.strip().lower() for s in part.split(":", 1))
        device = DEVICE_ALIASES.get(device, device)
        if device in result:
            raise ValueError(f"backend string {text!r} names device {device!r} twice")
        result[device] = backend
    return result


def format_backend_string(mapping: Mapping[str, str]) -> str:
    """Inverse of :func:`parse_backend_string`, CPU first."""
    order = sorted(mapping, key=lambda d: (d != "cpu", d))
    return ",".join(f"{d}:{mapping[d]}" for d in order)


def process_group_backend(device_type: str, backend: str) -> str:
    """Backend string for ``init_process_group``: accelerators get ``cpu:gloo`` next to their backend.

    CPU alone gives the bare backend name (``"gloo"``); an accelerator device
    gives e.g. ``"cpu:gloo,cuda:nccl"`` (the form torch documents for
    multi-backend process groups).
    """
    device = normalize_device_type(device_type)
    if device == "cpu":
        return backend
    return format_backend_string({"cpu": "gloo", device: backend})


def backend_environment(backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables in ``environ`` that ``backend`` (or its PyTorch binding) reads, sorted by name."""
    prefixes = BACKEND_ENV_PREFIXES.get(backend.lower(), ())
    return {k: environ[k] for k in sorted(environ) if k.startswith(prefixes)}


# --------------------------------------------------------------------------- option mapping

OptionKind = Literal["env", "framework"]
MappingStatus = Literal["mapped", "carried", "derived", "unmapped"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionRule:
    """One row of the mapping table: source option -> target option (or none), with its source."""

    source_backend: str
    target_backend: str
    key: str
    kind: OptionKind
    target_key: str | None
    convert: Callable[[str], str] | None = None
    note: str
    doc: str


@dataclass(frozen=True, kw_only=True, slots=True)
class MappedOption:
    """What became of one source option on the target."""

    key: str
    value: str
    status: MappingStatus
    target_key: str | None
    target_value: str | None
    note: str
    doc: str


@dataclass(frozen=True, kw_only=True, slots=True)
class OptionMapping:
    """Result of :func:`map_comm_options`: target env to set plus every option's fate."""

    source_backend: str
    target_backend: str
    options: tuple[MappedOption, ...]
    target_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def unmapped(self) -> tuple[MappedOption, ...]:
        """Options that have no equivalent on the target."""
        return tuple(o for o in self.options if o.status == "unmapped")


def _bytes_to_mib_ceil(value: str) -> str:
    return str(max(1, math.ceil(int(value) / 2**20)))


def _mib_to_bytes(value: str) -> str:
    return str(int(value) * 2**20)


def _nccl_algo_to_hccl(value: str) -> str:
    algos = [a.strip().lower() for a in value.split(",")]
    if algos == ["ring"]:
        return "level0:NA;level1:ring"
    raise ValueError(f"NCCL_ALGO={value!r}: only 'Ring' has an HCCL_ALGO equivalent (level1:ring)")


def _hccl_algo_to_nccl(value: str) -> str:
    level1 = [p.split(":", 1)[1] for p in value.split(";") if p.strip().startswith("level1:")]
    if level1 == ["ring"] and "=" not in value:
        return "Ring"
    raise ValueError(f"HCCL_ALGO={value!r}: only a global 'level1:ring' has an NCCL_ALGO equivalent (Ring)")


def _nccl_debug_to_ascend(value: str) -> str:
    levels = {"TRACE": "0", "INFO": "1", "WARN": "2", "VERSION": "2"}
    if value.upper() not in levels:
        raise ValueError(f"NCCL_DEBUG={value!r}: expected one of {sorted(levels)}")
    return levels[value.upper()]


def _identity(value: str) -> str:
    return value


def _ib_timeout_to_hccl(value: str) -> str:
    return str(min(20, max(5, int(value))))


def _rules_between(source: str, target: str) -> tuple[OptionRule, ...]:
    """The rules for one (source, target) backend pair, both directions derived from one table."""
    rules: list[OptionRule] = []
    nccl_hccl: tuple[tuple[str, str | None, Callable[[str], str] | None, Callable[[str], str] | None, str, str], ...] = (
        ("NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME", _identity, _identity,
         "network interface for the host/bootstrap sockets; same syntax for a single name", HCCL_ENV_DOC),
        ("NCCL_BUFFSIZE", "HCCL_BUFFSIZE", _bytes_to_mib_ceil, _mib_to_bytes,
         "NCCL: bytes per channel buffer (default 4 MiB); HCCL: MiB per communicator (default 200); "
         "rounded up to whole MiB", HCCL_BUFFSIZE_DOC),
        ("NCCL_ALGO", "HCCL_ALGO", _nccl_algo_to_hccl, _hccl_algo_to_nccl,
         "algorithm hint; only ring exists on both (NCCL Tree/CollNet/NVLS and HCCL H-D_R/NHR/NB/pipeline do not)",
         HCCL_ALGO_DOC),
        ("NCCL_IB_TIMEOUT", "HCCL_RDMA_TIMEOUT", _ib_timeout_to_hccl, _identity,
         "both are the exponent t of the RDMA retransmission timeout 4.096us * 2^t; clamped to HCCL's "
         "range [5,20] on Atlas A2/A3",
         HCCL_RDMA_TIMEOUT_DOC),
        ("NCCL_IB_TC", "HCCL_RDMA_TC", _identity, _identity, "RDMA traffic class", HCCL_ENV_DOC),
        ("NCCL_IB_SL", "HCCL_RDMA_SL", _identity, _identity, "RDMA service level", HCCL_ENV_DOC),
        ("NCCL_IB_RETRY_CNT", "HCCL_RDMA_RETRY_CNT", _identity, _identity, "RDMA retry count", HCCL_ENV_DOC),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING", _identity, _identity,
         "PyTorch binding's asynchronous error handling (torch_npu reads HCCL_ASYNC_ERROR_HANDLING)",
         TORCH_NPU_ASYNC_DOC),
        ("NCCL_DEBUG", "ASCEND_GLOBAL_LOG_LEVEL", _nccl_debug_to_ascend, None,
         "log verbosity: TRACE->0 (debug), INFO->1, WARN->2", ASCEND_LOG_DOC),
        ("NCCL_PROTO", None, None, None, "HCCL exposes no protocol choice (LL/LL128/Simple)", HCCL_ENV_DOC),
        ("NCCL_MIN_NCHANNELS", None, None, None, "HCCL exposes no channel count", HCCL_ENV_DOC),
        ("NCCL_MAX_NCHANNELS", None, None, None, "HCCL exposes no channel count", HCCL_ENV_DOC),
        ("NCCL_NTHREADS", None, None, None, "HCCL has no CUDA-thread setting", HCCL_ENV_DOC),
        ("NCCL_P2P_DISABLE", None, None, None,
         "no switch for peer-to-peer links; HCCL_INTRA_PCIE_ENABLE/HCCL_INTRA_ROCE_ENABLE choose intra-node links "
         "instead and are not equivalent", HCCL_ENV_DOC),
        ("NCCL_IB_DISABLE", None, None, None, "no switch that disables RDMA between servers", HCCL_ENV_DOC),
        ("NCCL_NET_GDR_LEVEL", None, None, None, "GPUDirect RDMA is CUDA-specific", NCCL_ENV_DOC),
        ("NCCL_CROSS_NIC", None, None, None, "no cross-NIC ring setting", HCCL_ENV_DOC),
        ("TORCH_NCCL_BLOCKING_WAIT", None, None, None,
         "torch_npu documents no blocking-wait switch; the process-group timeout applies", TORCH_NCCL_ENV_DOC),
        ("TORCH_NCCL_AVOID_RECORD_STREAMS", None, None, None, "CUDA caching-allocator specific", TORCH_NCCL_ENV_DOC),
        ("TORCH_NCCL_HIGH_PRIORITY", None, None, None, "CUDA stream priority specific", TORCH_NCCL_ENV_DOC),
    )
    hccl_only: tuple[tuple[str, str], ...] = (
        ("HCCL_DETERMINISTIC", "NCCL has no switch for deterministic reductions"),
        ("HCCL_CONNECT_TIMEOUT", "NCCL has no link-setup timeout; the process-group timeout covers it"),
        ("HCCL_EXEC_TIMEOUT", "NCCL has no device execution timeout; the process-group timeout (watchdog) covers it"),
        ("HCCL_EVENT_TIMEOUT", "no NCCL equivalent; the process-group timeout covers it"),
        ("HCCL_OP_EXPANSION_MODE", "NCCL has no op expansion mode (AI_CPU/AIV/HOST)"),
        ("HCCL_INTRA_ROCE_ENABLE", "NCCL chooses intra-node links itself"),
        ("HCCL_INTRA_PCIE_ENABLE", "NCCL chooses intra-node links itself"),
        ("HCCL_IF_IP", "NCCL selects by interface name (NCCL_SOCKET_IFNAME), not by IP"),
        ("HCCL_WHITELIST_DISABLE", "NCCL has no trust list"),
    )
    gloo_from: tuple[tuple[str, str | None, str], ...] = (
        ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "network interface for the TCP transport"),
        ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "network interface for the TCP transport"),
    )
    if source == "nccl" and target == "hccl":
        for key, tkey, fwd, _rev, note, doc in nccl_hccl:
            rules.append(OptionRule(source_backend=source, target_backend=target, key=key, kind="env",
                                    target_key=tkey, convert=fwd, note=note, doc=doc))
    elif source == "hccl" and target == "nccl":
        for key, tkey, _fwd, rev, note, doc in nccl_hccl:
            if tkey is None:
                continue
            rules.append(OptionRule(source_backend=source, target_backend=target, key=tkey, kind="env",
                                    target_key=key if rev is not None else None, convert=rev, note=note, doc=doc))
        for key, note in hccl_only:
            rules.append(OptionRule(source_backend=source, target_backend=target, key=key, kind="env",
                                    target_key=None, note=note, doc=HCCL_ENV_DOC))
    if target == "gloo":
        for key, tkey, note in gloo_from:
            if key.startswith(source.upper() + "_"):
                rules.append(OptionRule(source_backend=source, target_backend=target, key=key, kind="env",
                                        target_key=tkey, convert=_identity, note=note, doc=GLOO_ENV_DOC))
    if target == source:
        return ()
    return tuple(rules)


FRAMEWORK_OPTIONS: Mapping[str, tuple[str, str]] = {
    "ddp_bucket_cap_mb": ("PyTorch DDP bucket_cap_mb (backend-agnostic, carried)", TORCH_DDP_DOC),
    "ddp_bucket_size": ("Megatron --ddp-bucket-size in elements (backend-agnostic, carried)", MEGATRON_ARGS_DOC),
    "reduce_bucket_size": ("DeepSpeed zero_optimization.reduce_bucket_size in elements (carried)", DEEPSPEED_ZERO_DOC),
    "allgather_bucket_size": ("DeepSpeed zero_optimization.allgather_bucket_size in elements (carried)",
                              DEEPSPEED_ZERO_DOC),
    "overlap_comm": ("DeepSpeed zero_optimization.overlap_comm (carried)", DEEPSPEED_ZERO_DOC),
    "overlap_grad_reduce": ("Megatron --overlap-grad-reduce (carried)", MEGATRON_ARGS_DOC),
    "overlap_param_gather": ("Megatron --overlap-param-gather (carried)", MEGATRON_ARGS_DOC),
    "timeout_s": ("process-group timeout passed to init_process_group (carried)", TORCH_DIST_DOC),
    "tp_comm_overlap": ("Megatron --tp-comm-overlap (Transformer Engine userbuffers)", MEGATRON_ARGS_DOC),
}
"""Framework-level communication options this adapter understands, with their source."""

_CUDA_ONLY_FRAMEWORK = {"tp_comm_overlap": "needs Transformer Engine userbuffers over CUDA IPC / NCCL"}


def map_comm_options(
    source_backend: str,
    target_backend: str,
    env: Mapping[str, str],
    framework: Mapping[str, object] | None = None,
) -> OptionMapping:
    """Map source communication options to the target backend.

    ``env`` is the source job's environment (only variables of the source
    backend are considered); ``framework`` holds framework-level options keyed
    as in :data:`FRAMEWORK_OPTIONS`.  Every input option appears exactly once in
    the result as ``mapped`` (renamed/converted), ``carried`` (same option works
    on the target), ``derived`` (a target-only setting computed from it) or
    ``unmapped`` (no equivalent, with the reason).  Unknown framework keys are a
    ``ValueError`` naming them.
    """
    source, target = source_backend.lower(), target_backend.lower()
    framework = dict(framework or {})
    unknown = sorted(set(framework) - set(FRAMEWORK_OPTIONS))
    if unknown:
        raise ValueError(f"unknown communication options {unknown}; known: {sorted(FRAMEWORK_OPTIONS)}")
    rules = {r.key: r for r in _rules_between(source, target)}
    results: list[MappedOption] = []
    target_env: dict[str, str] = {}
    for key, value in backend_environment(source, env).items():
        if source == target:
            results.append(MappedOption(key=key, value=value, status="carried", target_key=key, target_value=value,
                                        note="same backend on source and target", doc=_env_doc(source)))
            target_env[key] = value
            continue
        rule = rules.get(key)
        if rule is None:
            results.append(MappedOption(key=key, value=value, status="unmapped", target_key=None, target_value=None,
                                        note=f"no documented {target} equivalent of this {source} variable",
                                        doc=_env_doc(source)))
            continue
        if rule.target_key is None or rule.convert is None:
            results.append(MappedOption(key=key, value=value, status="unmapped", target_key=None, target_value=None,
                                        note=rule.note, doc=rule.doc))
            continue
        try:
            converted = rule.convert(value)
        except ValueError as exc:
            results.append(MappedOption(key=key, value=value, status="unmapped", target_key=rule.target_key,
                                        target_value=None, note=f"{exc}; {rule.note}", doc=rule.doc))
            continue
        target_env[rule.target_key] = converted
        results.append(MappedOption(key=key, value=value, status="mapped", target_key=rule.target_key,
                                    target_value=converted, note=rule.note, doc=rule.doc))
    for key in sorted(framework):
        value = str(framework[key])
        note, doc = FRAMEWORK_OPTIONS[key]
        if key in _CUDA_ONLY_FRAMEWORK and target != "nccl" and value.lower() not in ("false", "0", "none"):
            results.append(MappedOption(key=key, value=value, status="unmapped", target_key=None, target_value=None,
                                        note=f"{note}: {_CUDA_ONLY_FRAMEWORK[key]}; no {target} equivalent", doc=doc))
            continue
        results.append(MappedOption(key=key, value=value, status="carried", target_key=key, target_value=value,
                                    note=note, doc=doc))
    results.extend(_derived_target_settings(target, framework, target_env))
    for derived in results:
        if derived.status == "derived" and derived.target_key and derived.target_value is not None:
            target_env.setdefault(derived.target_key, derived.target_value)
    return OptionMapping(source_backend=source, target_backend=target, options=tuple(results), target_env=target_env)


def _env_doc(backend: str) -> str:
    return {"nccl": NCCL_ENV_DOC, "hccl": HCCL_ENV_DOC, "gloo": GLOO_ENV_DOC}.get(backend, TORCH_DIST_DOC)


def _derived_target_settings(
    target: str, framework: Mapping[str, object], target_env: Mapping[str, str]
) -> list[MappedOption]:
    """Target-only settings that follow from framework options (HCCL timeouts and buffer size)."""
    out: list[MappedOption] = []
    if target != "hccl":
        return out
    if "timeout_s" in framework and "HCCL_CONNECT_TIMEOUT" not in target_env:
        timeout = int(float(str(framework["timeout_s"])))
        connect = min(7200, max(120, timeout - 20))
        out.append(MappedOption(
            key="timeout_s", value=str(framework["timeout_s"]), status="derived", target_key="HCCL_CONNECT_TIMEOUT",
            target_value=str(connect),
            note="torch_npu recommends a process-group timeout above HCCL_CONNECT_TIMEOUT (+20 s notification); "
                 "clamped to the documented range [120, 7200]", doc=HCCL_CONNECT_TIMEOUT_DOC))
        if timeout >= 68 and "HCCL_EXEC_TIMEOUT" not in target_env:
            exec_timeout = min(17340, timeout // 68 * 68)
            out.append(MappedOption(
                key="timeout_s", value=str(framework["timeout_s"]), status="derived", target_key="HCCL_EXEC_TIMEOUT",
                target_value=str(exec_timeout),
                note="HCCL rounds the execution timeout down to a multiple of 68 s, range [68, 17340]",
                doc=HCCL_EXEC_TIMEOUT_DOC))
    bucket_mib = _largest_bucket_mib(framework)
    if bucket_mib is not None and "HCCL_BUFFSIZE" not in target_env and bucket_mib > 200:
        out.append(MappedOption(
            key="bucket", value=f"{bucket_mib} MiB", status="derived", target_key="HCCL_BUFFSIZE",
            target_value=str(bucket_mib),
            note="HCCL documents slower collectives when a message exceeds HCCL_BUFFSIZE (default 200 MiB)",
            doc=HCCL_BUFFSIZE_DOC))
    return out


def _largest_bucket_mib(framework: Mapping[str, object]) -> int | None:
    """Largest communication bucket in MiB; element counts are taken as fp32 (4 bytes), a stated upper bound."""
    sizes: list[float] = []
    if "ddp_bucket_cap_mb" in framework:
        sizes.append(float(str(framework["ddp_bucket_cap_mb"])))
    for key in ("ddp_bucket_size", "reduce_bucket_size", "allgather_bucket_size"):
        if key in framework:
            sizes.append(float(str(framework[key])) * 4 / 2**20)
    return math.ceil(max(sizes)) if sizes else None
