"""The package as `pip install .` leaves it: built into a wheel and installed away from the source tree, it
carries its data files (the shipped device profiles) and its CLI validates a job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("migrate", "checkpoint", "parallel_search", "convergence")


@pytest.mark.slow
def test_the_installed_wheel_ships_its_profiles_and_validates_a_job(tmp_path):
    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(dist), str(source)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("*.whl")
    shipped = {p.name for p in (REPO / "parallel_search" / "profiles").glob("*.yaml")}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {Path(n).name for n in archive.namelist() if n.startswith("parallel_search/profiles/")}
    assert shipped and shipped <= in_wheel, f"profiles missing from {wheel.name}: {sorted(shipped - in_wheel)}"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the source tree (an editable install's path)
    probe = subprocess.run(
        [sys.executable, "-c", "import parallel_search.profiles as p; print(p.__file__); print(' '.join(p.shipped_profiles()));"
                               " print(p.load_profile('cpu').device_type)"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    where, names, device_type = probe.stdout.splitlines()
    assert where.startswith(str(site)), where
    assert set(names.split()) == {n.removesuffix(".yaml") for n in shipped}
    assert device_type == "cpu"

    job = tmp_path / "job.yaml"
    job.write_text((REPO / "configs" / "demo_cpu.yaml").read_text())
    validate = subprocess.run([sys.executable, "-m", "migrate", "validate", str(job)], cwd=tmp_path, env=env,
                              capture_output=True, text=True)
    assert validate.returncode == 0, validate.stdout + validate.stderr
