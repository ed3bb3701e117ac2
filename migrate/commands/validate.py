"""``migrate validate JOB.yaml``: report every problem in a job file, run nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from migrate.commands._common import EXIT_BAD_INPUT, EXIT_OK, job_argument
from migrate.job.load import JobError, load_job


def notes(job) -> list[str]:
    """Things worth knowing that do not make the job invalid (paths not present here)."""
    found = list(job.deprecations)
    src = job.spec.source
    if src.checkpoint is not None and not job.resolve(src.checkpoint.path).exists():
        found.append(f"source.checkpoint.path: {job.resolve(src.checkpoint.path)} does not exist on this machine")
    for i, m in enumerate(src.metrics):
        if not job.resolve(m.path).exists():
            found.append(f"source.metrics[{i}].path: {job.resolve(m.path)} does not exist on this machine")
    return found


@click.command(help="Check JOB_FILE and print every problem; runs nothing. Exit 0 valid, 2 invalid.")
@job_argument
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def command(job_file: Path, as_json: bool) -> None:
    try:
        job = load_job(job_file)
    except JobError as exc:
        if as_json:
            click.echo(json.dumps({"valid": False, "file": str(exc.path), "problems": [
                {"field": p.field, "message": p.message} for p in exc.problems]}, indent=2))
        else:
            click.echo(str(exc), err=True)
        sys.exit(EXIT_BAD_INPUT)
    found = notes(job)
    if as_json:
        click.echo(json.dumps({"valid": True, "file": str(job.path), "name": job.name, "work_dir": str(job.work_dir),
                               "stages": list(job.stage_options), "notes": found}, indent=2))
    else:
        spec = job.spec
        click.echo(f"{job.path}: valid")
        click.echo(f"  job {spec.name}: {spec.source.cluster.device_count} x {spec.source.cluster.device_type} "
                   f"-> {spec.target.device_count} x {spec.target.device_type} ({spec.target.resolved_backend})")
        click.echo(f"  stages: {', '.join(job.stage_options) or 'none'}")
        click.echo(f"  work dir: {job.work_dir}")
        for note in found:
            click.echo(f"  note: {note}")
    sys.exit(EXIT_OK)
