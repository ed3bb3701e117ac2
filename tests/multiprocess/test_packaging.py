"""The package as `pip install` leaves it: the wheel built from the tree, installed into a fresh virtual
environment away from the sources, carries its data files (the shipped device profiles), its `migrate` command
validates a job and plans it analytically, and its dependency ranges admit the tested set and the torch builds
CUDA and torch_npu users have."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("migrate", "checkpoint", "parallel_search", "convergence")


def _metadata() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_dependency_ranges_admit_the_tested_set_and_other_torch_builds():
    """Every dependency is a range (no exact pin) that the constraints file's tested version satisfies, and
    torch's range takes CUDA builds and the torch a torch_npu release is built for."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = _metadata()
    assert project["name"] == "migrate-training"
    pins = {}
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name.split("[")[0])] = Version(version.strip())
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(spec)
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{spec}: an exact pin, expected a range"
        tested = pins[canonicalize_name(req.name)]
        assert req.specifier.contains(tested, prereleases=True), f"{spec} excludes the tested {req.name} {tested}"
    torch = next(Requirement(s) for s in project["dependencies"] if s.startswith("torch"))
    for build in ("2.13.0+cu128", "2.6.0", "2.7.1", "2.8.0+cpu"):  # CUDA wheels; torch_npu 2.6.0 / 2.7.1 / 2.8.0
        assert torch.specifier.contains(build), build


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_validates_and_plans_a_job(tmp_path):
    source = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(dist), str(source)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("migrate_training-*.whl")
    shipped = {p.name for p in (REPO / "parallel_search" / "profiles").glob("*.yaml")}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {Path(n).name for n in archive.namelist() if n.startswith("parallel_search/profiles/")}
    assert shipped and shipped <= in_wheel, f"profiles missing from {wheel.name}: {sorted(shipped - in_wheel)}"

    # A fresh venv; its dependencies are the tested set, reached through a path entry to this environment's
    # site-packages (a plain path: the editable install's own .pth there is not processed).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (site / "tested_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python, migrate = venv / "bin" / "python", venv / "bin" / "migrate"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--quiet", str(wheel)],
                   check=True, capture_output=True, text=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [str(python), "-c", "import parallel_search.profiles as p; print(p.__file__); print(' '.join(p.shipped_profiles()));"
                            " print(p.load_profile('cpu').device_type)"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    where, names, device_type = probe.stdout.splitlines()
    assert where.startswith(str(site)), where
    assert set(names.split()) == {n.removesuffix(".yaml") for n in shipped}
    assert device_type == "cpu"
    check = subprocess.run([str(python), "-m", "pip", "check"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    job = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    job["work_dir"] = str(tmp_path / "runs")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    validate = subprocess.run([str(migrate), "validate", "job.yaml"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    search = subprocess.run([str(migrate), "search", "--no-profile", "job.yaml"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert search.returncode == 0, search.stdout + search.stderr
    chosen = tmp_path / "runs" / "search" / "chosen"
    layout = yaml.safe_load((chosen / "target_layout.yaml").read_text())["target"]["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] * layout.get("cp", 1) == job["target"]["device_count"], layout
    assert (chosen / "deepspeed.json").is_file()
    assert "preflight" not in search.stdout + search.stderr.replace("no preflight", "")
