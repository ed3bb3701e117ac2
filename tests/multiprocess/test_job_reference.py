"""docs/job-reference.md is what the code that validates job files says: every key of the job, of every stage's
options and of the gate's tolerances, with its type, default and meaning (none left without one)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def test_the_readmes_real_migration_job_is_a_valid_job(tmp_path):
    from migrate.job.load import load_job

    readme = (REPO / "README.md").read_text()
    assert readme.startswith("# migrate\n\n```bash\n./scripts/setup && .venv/bin/migrate run configs/demo_cpu.yaml\n"
                             "./scripts/setup && .venv/bin/python -m pytest\n```")
    start = readme.index("```yaml\nname: llama70b") + len("```yaml\n")
    path = tmp_path / "job.yaml"
    path.write_text(readme[start:readme.index("```", start)])
    job = load_job(path)
    assert list(job.stage_options) == ["preflight", "comm", "ops", "search", "convert", "resume", "stability", "gate"]
    assert job.spec.target.resolved_backend == "hccl"
