"""The code is clean under ruff with the rules of `[tool.ruff]` in pyproject.toml (pyflakes, pycodestyle, bugbear,
pyupgrade, blind excepts, unused noqa), so the suite fails where a name is used undefined or an exception swallowed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
