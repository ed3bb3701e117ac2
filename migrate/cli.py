"""The ``migrate`` command line: one subcommand per stage, plus validate, run and status."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any

import click

from migrate import __version__
from migrate.runtime.ray_cluster import RayConnectionError

# Commands with a module of their own: migrate/commands/<name>.py exposing ``command``; every other stage of
# migrate.stages.STAGES is a plain stage command.
_COMMANDS_PACKAGE = "migrate.commands"


def _command_modules() -> set[str]:
    """The names of the commands with a module of their own (the package's public modules)."""
    package = importlib.import_module(_COMMANDS_PACKAGE)
    return {m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")}


class _Group(click.Group):
    """The command group; a usage error (a bad option value, a missing argument) or a Ray cluster that cannot be
    reached is one line on stderr, naming the option or the address and what was expected, with exit code 2.
    A command's module is imported when that command runs (``migrate convert`` does not import every stage)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from migrate.stages import STAGES

        return sorted(_command_modules() | set(STAGES) | set(self.commands))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        if name in _command_modules():
            command: click.Command = importlib.import_module(f"{_COMMANDS_PACKAGE}.{name}").command
        else:
            from migrate.commands._common import stage_command
            from migrate.stages import STAGES

            if name not in STAGES:
                return None
            command = stage_command(name, STAGES[name].description)
        self.add_command(command, name=name)
        return command

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

    return group


main = _build()


if __name__ == "__main__":
    main()
