"""The ``migrate`` command line: one subcommand per stage, plus validate, run and status."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import click

from migrate import __version__
from migrate.runtime.ray_cluster import RayConnectionError

# Commands with a module of their own (migrate/commands/<name>.py exposing ``command``).
_COMMAND_MODULES = ("validate", "run", "status", "inspect", "convert")


class _Group(click.Group):
    """The command group; a usage error (a bad option value, a missing argument) or a Ray cluster that cannot be
    reached is one line on stderr, naming the option or the address and what was expected, with exit code 2."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except click.UsageError as exc:
            where = f"migrate {exc.ctx.command_path.partition(' ')[2]}".strip() if exc.ctx else "migrate"
            click.echo(f"error: {where}: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        except RayConnectionError as exc:  # the address of the job (target.ray.address) or of --ray-address
            click.echo(f"error: {exc} (start the cluster, run from one of its nodes, or set the address: "
                       f"target.ray.address in the job, --ray-address on the command line)", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


def _build() -> click.Group:
    @click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
