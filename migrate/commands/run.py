"""``migrate run JOB.yaml``: every stage of the job in order, skipping what is unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from migrate.commands._common import EXIT_BAD_INPUT, job_argument, load_or_exit, run_stages


@click.command(help="Run the stages of JOB_FILE in dependency order. Exit 0 all passed, 1 a stage failed, 2 bad input.")
@job_argument
@click.option("--stages", "stages", default=None, help="comma-separated subset, e.g. preflight,convert")
@click.option("--force", is_flag=True, help="re-run stages even if their inputs are unchanged")
def command(job_file: Path, stages: str | None, force: bool) -> None:
    job = load_or_exit(job_file)
    selected = [s.strip() for s in stages.split(",") if s.strip()] if stages else None
    if selected is not None:
        missing = [s for s in selected if s not in job.stage_options]
        if missing:
            click.echo(f"{job.path}: --stages names {missing}, not listed in the job (it lists: "
                       f"{', '.join(job.stage_options) or 'none'})", err=True)
            sys.exit(EXIT_BAD_INPUT)
    sys.exit(run_stages(job, selected, force))
