"""Device profiles: shipped ones load with a source for every number; user YAML is validated."""
from __future__ import annotations

import pytest
import yaml

from parallel_search.profiles import ProfileError, dump_profile, load_profile, shipped_profiles


def test_every_common_accelerator_ships_a_sourced_profile():
    names = set(shipped_profiles())
    assert {"h100", "h200", "a100", "mi300x", "ascend-910b", "cpu"} <= names
    for name in names:
        profile = load_profile(name)
        assert profile.memory_bytes > 0 and profile.peak_flops("fp32") > 0
        assert all(text.strip() for text in profile.source.values())


def test_datasheet_numbers_of_h100_and_910b():
    h100, npu = load_profile("h100"), load_profile("ascend-910b")
    assert h100.peak_tflops["bf16"] == pytest.approx(989.4)
    assert h100.memory_gb == 80 and h100.memory_bandwidth_gbps == 3350
    assert npu.memory_gb == 64 and "bf16" in npu.supported_dtypes


def _user_profile(tmp_path, **changes):
    data = load_profile("h100").to_dict() | {"name": "mine"} | changes
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_user_profile_round_trips(tmp_path):
    path = _user_profile(tmp_path, memory_gb=96.0)
    profile = load_profile(path)
    assert profile.name == "mine" and profile.memory_gb == 96.0
    again = load_profile(dump_profile(profile, tmp_path / "again.yaml"))
    assert again == profile


def test_unknown_key_is_rejected_with_the_file_name(tmp_path):
    path = _user_profile(tmp_path, hbm_tb=3)
    with pytest.raises(ProfileError, match=r"mine\.yaml.*unknown keys \['hbm_tb'\]"):
        load_profile(path)


def test_number_without_source_is_rejected(tmp_path):
    data = load_profile("h100").to_dict()
    del data["source"]["memory_gb"]
    path = tmp_path / "nosource.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"source has no entry for \['memory_gb'\]"):
        load_profile(path)


def test_bad_values_name_the_field(tmp_path):
    with pytest.raises(ProfileError, match=r"memory_gb=-1"):
        load_profile(_user_profile(tmp_path, memory_gb=-1))
    with pytest.raises(ProfileError, match=r"unknown dtypes \['int4'\]"):
        load_profile(_user_profile(tmp_path, peak_tflops={"int4": 1.0}))
    with pytest.raises(ProfileError, match="no shipped device profile 'tpu-v9'"):
        load_profile("tpu-v9")


def test_measured_profile_replaces_numbers_and_cites_the_measurement():
    from migrate.search.measure import measured_profile

    base = load_profile("cpu")
    results = [{"rank": r, "node": "hostA", "tflops": {"fp32": 0.05 + r * 0.01}, "copy_gbps": 12.0 - r,
                "busbw_gbps": 2.0 + r, "latency_us": 50.0 + r} for r in range(2)]
    profile = measured_profile(base, results)
    assert profile.peak_tflops["fp32"] == pytest.approx(0.05)  # the slowest rank
    assert profile.memory_bandwidth_gbps == 11.0 and profile.intra_node_bandwidth_gbps == 2.0
    assert profile.collective_latency_us == 51.0
    assert profile.source["peak_tflops"].startswith("measured by migrate search --measure")
