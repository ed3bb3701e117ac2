"""The gate's hard checks, which no calibration relaxes: the inputs a gate must never pass.

Each case is a metric file a user could bring (JSONL or CSV as the frameworks' loggers write them) run
through `migrate gate` as a user runs it: a candidate with NaN where the baseline had one elsewhere, a
candidate that stopped after a quarter of the baseline's steps, a hole in the middle of its log, a loss
column holding text, a baseline with NaN.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from click.testing import CliRunner

from migrate.cli import main as cli

STEPS = 40


def _rows(seed: int, steps: range = range(1, STEPS + 1), nan_at: int | None = None) -> list[dict]:
    out = []
    for s in steps:
        loss = 2.0 + 2.0 * math.exp(-s / 15) + 0.001 * math.sin(7 * s + seed)
        out.append({"step": s, "loss": math.nan if s == nan_at else loss, "grad_norm": 1.0 + 0.01 * math.cos(s + seed),
                    "lr": 1e-3})
    return out


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    return str(path)


def _gate(*args: str):
    return CliRunner().invoke(cli, ["gate", *args, "--json"])


def test_candidate_nan_is_never_excused_by_a_baseline_nan(tmp_path):
    base = _jsonl(tmp_path / "b.jsonl", _rows(0, nan_at=12))
    cand = _jsonl(tmp_path / "c.jsonl", _rows(1, nan_at=30))
    refused = _gate("--baseline", base, "--candidate", cand)
    assert refused.exit_code == 2 and "b.jsonl" in refused.stderr and "step(s) 12" in refused.stderr
    assert "healthy" in refused.stderr
    clean = _jsonl(tmp_path / "b2.jsonl", _rows(0))
    failed = _gate("--baseline", clean, "--candidate", cand)
    assert failed.exit_code == 1, failed.output
    verdict = json.loads(failed.stdout)
    assert "nonfinite" in verdict["failed"] and any("step(s) 30" in r for r in verdict["reasons"])


def test_coverage_is_measured_against_the_baselines_steps(tmp_path):
    base = _jsonl(tmp_path / "b.jsonl", _rows(0))
    short = _jsonl(tmp_path / "c.jsonl", _rows(1, range(1, 12)))
    result = _gate("--baseline", base, "--candidate", short)
    assert result.exit_code == 1
    verdict = json.loads(result.stdout)
    assert verdict["failed"][0] == "coverage"
    assert any("covers 11 of the baselines' 40 steps" in r for r in verdict["reasons"]), verdict["reasons"]


def test_a_hole_in_the_candidates_log_fails(tmp_path):
    base = _jsonl(tmp_path / "b.jsonl", _rows(0, range(1, 101)))
    holed = _jsonl(tmp_path / "c.jsonl", _rows(1, [s for s in range(1, 101) if not 40 <= s < 55]))
    result = _gate("--baseline", base, "--candidate", holed)
    assert result.exit_code == 1
    verdict = json.loads(result.stdout)
    assert any("hole of 15 baseline steps from step 40" in r for r in verdict["reasons"]), verdict["reasons"]


def test_text_in_a_metric_column_is_an_error_naming_file_row_and_column(tmp_path):
    base = _jsonl(tmp_path / "b.jsonl", _rows(0))
    csv = tmp_path / "c.csv"
    lines = ["step,loss,grad_norm,lr,run"] + [f"{r['step']},{r['loss']},{r['grad_norm']},{r['lr']},cand"
                                               for r in _rows(1)]
    lines[21] = "21,oops,1.0,0.001,cand"
    csv.write_text("\n".join(lines) + "\n")
    result = _gate("--baseline", base, "--candidate", str(csv))
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "c.csv:22" in line and "column 2" in line and "'loss' holds 'oops'" in line, line
    jsonl = tmp_path / "c.jsonl"
    rows = _rows(1)
    rows[5]["loss"] = "n/a"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _gate("--baseline", base, "--candidate", str(jsonl))
    assert result.exit_code == 2 and "c.jsonl:6" in result.stderr and "'n/a'" in result.stderr
