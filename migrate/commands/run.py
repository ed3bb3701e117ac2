"""``migrate run JOB.yaml``: every stage of the job in order, skipping what is unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from typing import Any

from migrate.commands._common import EXIT_BAD_INPUT, EXIT_OK, job_argument, load_or_exit, run_stages


@click.command(help="Run the stages of JOB_FILE in dependency order. Exit 0 all passed, 1 a stage failed, 2 bad input.")
@job_argument
@click.option("--stages", "stages", default=None, help="comma-separated subset, e.g. preflight,convert")
@click.option("--force", is_flag=True, help="re-run stages even if their inputs are unchanged")
@click.option("--dry-run", is_flag=True, help="print what would run, be skipped or be blocked, and why, and what the "
                                              "cluster lacks for it; run nothing")
def command(job_file: Path, stages: str | None, force: bool, dry_run: bool) -> None:
    job = load_or_exit(job_file)
    selected = [s.strip() for s in stages.split(",") if s.strip()] if stages else None
    if selected is not None:
        missing = [s for s in selected if s not in job.stage_options]
        if missing:
            click.echo(f"{job.path}: --stages names {missing}, not listed in the job (it lists: "
                       f"{', '.join(job.stage_options) or 'none'})", err=True)
            sys.exit(EXIT_BAD_INPUT)
    if dry_run:
        sys.exit(_dry_run(job, selected, force))
    sys.exit(run_stages(job, selected, force))


def _dry_run(job: Any, selected: list[str] | None, force: bool) -> int:
    from migrate.api import cluster_problems, plan_job
    from migrate.pipeline.preview import render
    from migrate.runtime.session import TargetRuntime

    try:
        previews = plan_job(job, stages=selected, force=force)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_BAD_INPUT
    click.echo(render(previews))
    with TargetRuntime(job.spec.target) as runtime:
        problems = cluster_problems(job, runtime, [p.stage for p in previews if p.action == "run"])
    if problems:
        click.echo(f"\nthe cluster cannot run them as it is ({len(problems)} shortfall(s)):")
        for problem in problems:
            click.echo(f"  - {problem}")
    else:
        click.echo("\nthe cluster can place every worker group of the stages that would run")
    return EXIT_OK
