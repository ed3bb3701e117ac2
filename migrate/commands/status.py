"""``migrate status JOB.yaml``: what each stage of a job last did, and whether it is current."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from migrate.commands._common import EXIT_OK, job_argument, load_or_exit


@click.command(help="Show each stage's last result for JOB_FILE and whether its inputs changed since.")
@job_argument
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def command(job_file: Path, as_json: bool) -> None:
    from migrate.pipeline.runner import input_hash, read_artifact
    from migrate.stages import STAGES, execution_order

    job = load_or_exit(job_file)
    rows: list[dict[str, Any]] = []
    for name in execution_order(tuple(job.stage_options)):
        art = read_artifact(job, STAGES[name].key(job.stage_options.get(name)))
        if art is None:
            rows.append({"stage": name, "status": "not run", "verdict": None, "finished_at": None, "current": False})
            continue
        upstream = {d: a for d in STAGES[name].upstream_in(tuple(job.stage_options), job.stage_options.get(name))
                    if (a := read_artifact(job, d)) is not None}
        digest, _ = input_hash(STAGES[name], job, upstream)
        rows.append({"stage": name, "status": art.status.value, "verdict": art.verdict,
                     "finished_at": art.finished_at, "current": digest == art.input_hash,
                     "reasons": list(art.reasons)})
    if as_json:
        click.echo(json.dumps({"job": job.name, "work_dir": str(job.work_dir), "stages": rows}, indent=2))
    else:
        click.echo(f"job {job.name} (work dir {job.work_dir})")
        for r in rows:
            stale = "" if r["status"] == "not run" else ("" if r["current"] else "  [inputs changed: will re-run]")
            verdict = f" verdict={r['verdict']}" if r["verdict"] else ""
            when = f" at {r['finished_at']}" if r["finished_at"] else ""
            click.echo(f"  {r['stage']:<12} {r['status']}{verdict}{when}{stale}")
    sys.exit(EXIT_OK)
