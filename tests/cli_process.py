"""`migrate` as a process of its own, started in milliseconds instead of seconds.

The process is forked from multiprocessing's fork server, which imported torch, the frameworks and the CLI
once per test process (tests/conftest.py warms it), and then runs what the console `migrate` runs:
`migrate.cli.main` with its own argv, working directory, environment, stdout and stderr, its exit
handlers at the end, its exit code (or the signal that killed it) as the process's. Only the interpreter's
start and the imports are shared, so a test of what the command prints, exits with, writes or leaves
behind when killed holds for the console command. A test of which modules a command imports, or of the
installed entry point itself, starts a real interpreter (`subprocess`) instead.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ("migrate.cli",)  # what the fork server imports besides the frameworks


def _main(args: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """The child: the console script's work, then the interpreter's exit handlers; exits with the CLI's code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):  # file descriptors, so the command's own children write there too
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["migrate", *args]
    from migrate.cli import main

    try:
        main(args=args, prog_name="migrate")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


class MigrateProcess:
    """A started `migrate` command, with the parts of `subprocess.Popen` the tests use."""

    def __init__(self, args: Sequence[str], cwd: str | os.PathLike | None, env: Mapping[str, str] | None):
        self._folder = tempfile.TemporaryDirectory(prefix="migrate-cli-")
        self._out = Path(self._folder.name) / "stdout"
        self._err = Path(self._folder.name) / "stderr"
        context = multiprocessing.get_context("forkserver")
        self._process = context.Process(target=_main, args=(
            [str(a) for a in args], str(cwd or os.getcwd()), dict(os.environ if env is None else env),
            str(self._out), str(self._err)))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None
        self._output: tuple[bytes, bytes] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(["migrate"], timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Wait for the end; what it wrote to stdout and stderr."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        if self._output is None:
            self._output = self._out.read_bytes(), self._err.read_bytes()
            self._folder.cleanup()
        return self._output


def start_migrate(args: Sequence[str], *, cwd: str | os.PathLike | None = None,
                  env: Mapping[str, str] | None = None) -> MigrateProcess:
    """Start `migrate *args` (in `cwd`, with `env`, default this process's)."""
    return MigrateProcess(args, cwd, env)


def run_migrate(args: Sequence[str], *, cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                timeout: float | None = 600, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `migrate *args` to its end, as `subprocess.run(..., capture_output=True, text=True)` would."""
    process = start_migrate(args, cwd=cwd, env=env)
    out, err = process.communicate(timeout)
    done = subprocess.CompletedProcess(["migrate", *map(str, args)], process.returncode, out.decode(), err.decode())
    if check:
        done.check_returncode()
    return done
