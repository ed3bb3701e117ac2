"""``migrate resume JOB.yaml [--steps K]``: train on from the converted checkpoint and compare with the baseline."""

from __future__ import annotations

from pathlib import Path

import click

from checkpoint.state.faults import FAULTS
from migrate.stages.resume import UNCHECKABLE
from migrate.commands._common import job_argument, load_or_exit, run_stage_with_flags


@click.command(help="Load the converted checkpoint at the target layout, run K steps, and compare losses, the "
                    "consumed sample order and the RNG states with the baseline's own continuation from the same "
                    "checkpoint. Needs the convert stage's result. Options override the job's stages.resume.")
@job_argument
@click.option("--steps", type=click.IntRange(min=1), default=None, help="K: steps after the checkpoint (default 3)")
@click.option("--fault", type=click.Choice(list(FAULTS)), default=None,
              help="test hook: break a copy of the converted checkpoint (see checkpoint.state.faults)")
@click.option("--accept-unchecked", "accept_unchecked", multiple=True, type=click.Choice(list(UNCHECKABLE)),
              help="let this state pass unchecked (repeatable; the report says so); by default nothing unchecked passes")
@click.option("--force", is_flag=True, help="run even if the inputs are unchanged")
def command(job_file: Path, steps: int | None, fault: str | None, accept_unchecked: tuple[str, ...], force: bool) -> None:
    run_stage_with_flags(load_or_exit(job_file), "resume",
                         {"steps": steps, "fault": fault, "accept_unchecked": list(accept_unchecked) or None}, force)
