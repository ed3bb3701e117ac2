"""``migrate stability JOB.yaml``: a long run of the target from the converted checkpoint, failures survived."""

from __future__ import annotations

from pathlib import Path

import click

from migrate.commands._common import job_argument, load_or_exit, run_stage_with_flags


def _kill(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[dict[str, int]] | None:
    """``RANK@STEP`` values as the job's ``faults`` entries."""
    faults = []
    for value in values:
        rank, sep, step = value.partition("@")
        if not sep or not rank.isdigit() or not step.isdigit() or int(step) < 1:
            raise click.BadParameter(f"{value!r}: expected RANK@STEP, e.g. 1@30 (rank 1 killed at the 30th step)")
        faults.append({"kill_rank": int(rank), "at_step": int(step)})
    return faults or None


@click.command(help="Train the target from the converted checkpoint for a long while, with periodic checkpoints: "
                    "memory growth per 1,000 steps, step-time tails and periodic slowdowns, loss health, and ranks "
                    "killed on purpose recovered from the newest checkpoint with the same losses as an uninterrupted "
                    "run. Needs the convert stage's result. Options override the job's stages.stability.")
@job_argument
@click.option("--steps", type=click.IntRange(min=1), default=None, help="steps after the converted checkpoint")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="train this long (with --steps: whichever ends first)")
@click.option("--save-every", type=click.IntRange(min=1), default=None, help="checkpoint every K steps")
@click.option("--kill", "faults", multiple=True, callback=_kill, metavar="RANK@STEP",
              help="kill RANK's process at the STEP-th step of this run (repeatable)")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None, help="recoveries allowed")
@click.option("--force", is_flag=True, help="run even if the inputs are unchanged")
def command(job_file: Path, steps: int | None, minutes: float | None, save_every: int | None,
            faults: list[dict[str, int]] | None, max_restarts: int | None, force: bool) -> None:
    run_stage_with_flags(load_or_exit(job_file), "stability",
                         {"steps": steps, "minutes": minutes, "save_every": save_every, "faults": faults,
                          "max_restarts": max_restarts}, force)
