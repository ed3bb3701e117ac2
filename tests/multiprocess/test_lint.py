"""The code is clean under ruff and mypy with the settings in pyproject.toml (`[tool.ruff]`: pyflakes, pycodestyle,
bugbear, pyupgrade, blind excepts, unused noqa; `[tool.mypy]`: the product's packages), so the suite fails where a
name is used undefined, an exception swallowed or a value used as a type it may not be."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    run = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.slow
def test_mypy_finds_nothing_in_the_product(tmp_path):
    run = _run("mypy", "--cache-dir", str(tmp_path / "cache"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "no issues found in" in run.stdout
