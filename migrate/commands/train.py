"""``migrate train JOB.yaml --side baseline|target``: real training steps on the job's runtime."""

from __future__ import annotations

from pathlib import Path

import click

from migrate.commands._common import job_argument, load_or_exit, run_stage_with_flags


@click.command(help="Train the job's model for real on its runtime: --side baseline at the source layout, "
                    "--side target at the target layout. Options override the job's stages.train.")
@job_argument
@click.option("--side", type=click.Choice(["baseline", "target"]), default=None, help="default: the job's, else baseline")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="optimizer steps (default: training.train_steps)")
@click.option("--load", "load", type=click.Path(exists=True, path_type=Path), default=None, help="checkpoint to resume from")
@click.option("--save-every", type=click.IntRange(min=0), default=None, help="checkpoint every K steps")
@click.option("--engine", type=click.Choice(["deepspeed", "megatron", "fsdp"]), default=None)
@click.option("--force", is_flag=True, help="run even if the inputs are unchanged")
def command(job_file: Path, side: str | None, steps: int | None, load: Path | None, save_every: int | None,
            engine: str | None, force: bool) -> None:
    flags = {"side": side, "steps": steps, "save_every": save_every, "engine": engine,
             "load": str(load.resolve()) if load else None}
    run_stage_with_flags(load_or_exit(job_file), "train", flags, force)
