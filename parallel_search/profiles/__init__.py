"""Device capability profiles: shipped YAML for common accelerators, user YAML, validation.

A profile is one YAML mapping onto :class:`DeviceProfile`; unknown keys are errors and
every number carries a ``source`` entry (a datasheet, or "measured ..." for profiles that
``migrate search --measure`` writes). ``load_profile("h100")`` reads a shipped profile,
``load_profile("path/to/mine.yaml")`` a user's.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml

from checkpoint import bounded_yaml

PROFILE_DIR = Path(__file__).parent
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
_NUMBERS = ("peak_tflops", "memory_gb", "memory_bandwidth_gbps", "intra_node_bandwidth_gbps",
            "inter_node_bandwidth_gbps", "devices_per_node", "collective_latency_us", "layer_overhead_us",
            "memory_reserved_gb", "memory_fragmentation")


class ProfileError(ValueError):
    """A device profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """What one device (one rank) can do. Bandwidths are per device and per direction, in GB/s (1e9 B).

    ``layer_overhead_us``: fixed time per transformer layer and micro-batch (launch/dispatch);
    ``memory_reserved_gb``: per-rank memory the runtime takes besides tensors;
    ``memory_fragmentation``: allocator overhead as a fraction of tensor bytes.
    """

    name: str
    description: str = ""
    device_type: str
    peak_tflops: Mapping[str, float]
    memory_gb: float
    memory_bandwidth_gbps: float
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    devices_per_node: int = 8
    collective_latency_us: float = 10.0
    layer_overhead_us: float = 40.0
    memory_reserved_gb: float = 0.0
    memory_fragmentation: float = 0.1
    supported_dtypes: tuple[str, ...] = ()
    source: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        unknown = sorted(set(self.peak_tflops) - set(DTYPES))
        if unknown:
            raise ProfileError(f"{where}: peak_tflops has unknown dtypes {unknown}; known: {list(DTYPES)}")
        bad = {k: v for k, v in self.peak_tflops.items() if not isinstance(v, (int, float)) or v <= 0}
        if bad:
            raise ProfileError(f"{where}: peak_tflops must be > 0, got {bad}")
        for name in ("memory_gb", "memory_bandwidth_gbps", "intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ProfileError(f"{where}: {name}={value!r} must be a number > 0")
        for name in ("collective_latency_us", "layer_overhead_us", "memory_reserved_gb", "memory_fragmentation"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ProfileError(f"{where}: {name}={value!r} must be a number >= 0")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ProfileError(f"{where}: devices_per_node={self.devices_per_node!r} must be an integer >= 1")
        object.__setattr__(self, "supported_dtypes", tuple(self.supported_dtypes or self.peak_tflops))
        missing = sorted(set(self.peak_tflops) - set(self.supported_dtypes))
        if missing:
            raise ProfileError(f"{where}: dtypes {missing} have a peak rate but are not in supported_dtypes "
                               f"{list(self.supported_dtypes)}")
        unsourced = [n for n in _NUMBERS if n not in self.source]
        if unsourced:
            raise ProfileError(f"{where}: source has no entry for {unsourced}; every number needs its source "
                               "(a datasheet, or 'measured ...')")
        extra = sorted(set(self.source) - set(_NUMBERS))
        if extra:
            raise ProfileError(f"{where}: source names unknown fields {extra}; allowed: {list(_NUMBERS)}")

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in ``dtype``; raises when the device does not run it."""
        if dtype not in self.peak_tflops:
            raise ProfileError(f"profile {self.name!r} has no peak rate for {dtype!r}; it lists "
                               f"{sorted(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_tflops"] = dict(self.peak_tflops)
        data["supported_dtypes"] = list(self.supported_dtypes)
        data["source"] = dict(self.source)
        return data


def profile_from_dict(data: Mapping[str, Any], where: str = "profile") -> DeviceProfile:
    """A validated profile from a mapping; unknown keys and wrong types are errors naming ``where``."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(DeviceProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    missing = sorted(f.name for f in fields(DeviceProfile)
                     if f.name not in data and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise ProfileError(f"{where}: missing required keys {missing}")
    try:
        return DeviceProfile(**dict(data))
    except ProfileError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def shipped_profiles() -> tuple[str, ...]:
    """Names of the profiles shipped with the library."""
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A shipped profile by name (``h100``, ``ascend-910b``, ...) or a user's YAML file by path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ProfileError(f"no shipped device profile {str(name_or_path)!r}; shipped: {list(shipped_profiles())}, "
                               "or give the path of a YAML file")
    if not path.is_file():
        raise ProfileError(f"{path}: device profile file not found")
    try:
        data = bounded_yaml.load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, bounded_yaml.YamlInputError) as exc:
        raise ProfileError(f"{path}: cannot read the device profile ({exc})") from None
    return profile_from_dict(data, where=str(path))


def dump_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write ``profile`` as YAML that :func:`load_profile` reads back unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False), encoding="utf-8")
    return path
