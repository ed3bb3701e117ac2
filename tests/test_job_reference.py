"""docs/job-reference.md is what the code that validates job files says: every key of the job, of every stage's
options and of the gate's tolerances, with its type, default and meaning (none left without one)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_reference_is_the_one_the_code_writes():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "job_reference.py"), "--check"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr


def test_every_key_has_a_meaning_and_every_stage_a_section():
    from migrate.stages import STAGES

    text = (REPO / "docs" / "job-reference.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 150
    assert [row for row in rows if row.rstrip().endswith("|  |")] == []
    for name, stage in STAGES.items():
        assert f"### `{name}`" in text
        for key in stage.options.model_fields:
            assert f"| `{key}` |" in text
    for key in ("source.checkpoint.step", "target.layout.tp", "training.optimizer.grad_clip", "rule.alpha",
                "loss.step_rel", "align.restart_policy"):
        assert f"| `{key}` |" in text
