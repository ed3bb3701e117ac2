"""The ``migrate`` command line: one subcommand per stage, plus validate, run and status."""

from __future__ import annotations

import importlib
import importlib.util
import os

import click

from migrate import __version__

# Commands with a module of their own (migrate/commands/<name>.py exposing ``command``).
_COMMAND_MODULES = ("validate", "run", "status", "inspect", "convert")


def _build() -> click.Group:
    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, prog_name="migrate")
    def group() -> None:
        """Move a distributed training job to another cluster and prove nothing changed."""
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from migrate.commands._common import stage_command
    from migrate.stages import STAGES

    names = list(_COMMAND_MODULES)
    for name in names:
        group.add_command(importlib.import_module(f"migrate.commands.{name}").command, name=name)
    for name, stage in STAGES.items():
        if importlib.util.find_spec(f"migrate.commands.{name}") is not None and name not in names:
            group.add_command(importlib.import_module(f"migrate.commands.{name}").command, name=name)
        elif name not in names:
            group.add_command(stage_command(name, stage.description), name=name)
    return group


main = _build()


if __name__ == "__main__":
    main()
