"""Shared pieces of the CLI commands: loading a job, running stages, exit codes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, NoReturn
from collections.abc import Mapping, Sequence

import click

from migrate.job.load import Job, JobError, load_job

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

job_argument = click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))


def load_or_exit(job_file: Path) -> Job:
    """The validated job, or the problems on stderr and exit code 2."""
    try:
        job = load_job(job_file)
    except JobError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_BAD_INPUT)
    for note in job.deprecations:
        click.echo(f"{job.path}: note: {note}", err=True)
    return job


def run_stages(job: Job, stages: Sequence[str] | None, force: bool) -> int:
    """Run stages of ``job`` with tracking and the target runtime (`migrate.api.run_job`); return the exit code.
    Before anything runs, the stages that would run are checked against the cluster: every shortfall at once,
    exit code 2."""
    from migrate.api import ClusterShortfall, run_job
    from migrate.tracking.report import verdict_line

    try:
        result = run_job(job, stages=stages, force=force, echo=lambda line: click.echo(line, err=True))
    except ClusterShortfall as exc:
        click.echo(f"{exc.headline}:", err=True)
        for problem in exc.problems:
            click.echo(f"  - {problem}", err=True)
        return EXIT_BAD_INPUT
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_BAD_INPUT
    click.echo(f"summary: {result.summary_path}")
    click.echo(f"metrics: {result.metrics_path}")
    if result.wandb_dir:
        click.echo(f"wandb:   {result.wandb_dir}")
    click.echo(verdict_line(job, result.records, result.summary_path))
    return EXIT_OK if result.ok else EXIT_FAILED


def stage_command(name: str, description: str) -> click.Command:
    """``migrate <stage> JOB.yaml [--force]``: run one stage of a job (with its artifact and skip rule)."""

    @click.command(name=name, help=f"Run the {name} stage of JOB_FILE: {description}.")
    @job_argument
    @click.option("--force", is_flag=True, help="run even if its inputs are unchanged")
    def command(job_file: Path, force: bool) -> None:
        job = load_or_exit(job_file)
        if name not in job.stage_options:
            click.echo(f"{job.path}: the job does not list stage {name!r} under 'stages:'", err=True)
            sys.exit(EXIT_BAD_INPUT)
        sys.exit(run_stages(job, [name], force))

    return command


def run_stage_with_flags(job: Job, stage: str, flags: Mapping[str, Any], force: bool) -> NoReturn:
    """Run one stage of ``job`` with the command's flags (None: not given) over the job's options; exit."""
    from pydantic import ValidationError

    from migrate.stages import STAGES

    options_type = STAGES[stage].options
    current = job.stage_options.get(stage) or options_type()
    updates = {k: v for k, v in flags.items() if v is not None}
    try:
        options = options_type.model_validate({**current.model_dump(), **updates})
    except ValidationError as exc:
        click.echo(f"invalid {stage} options: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    job = dataclasses.replace(job, stage_options={**job.stage_options, stage: options})
    sys.exit(run_stages(job, [stage], force))
