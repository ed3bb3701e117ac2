"""What a user sees while a conversion runs: each phase with its elapsed seconds, and a bar over the target
files as they appear at their final names (each is written to a temporary name and renamed when complete,
so counting them works for threads, local processes and Ray tasks alike)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class Phases:
    """A `phase` callback for `checkpoint.api.convert` that prints each phase with the seconds since start,
    and, once writing begins, follows the files under `dest` (`files`: the plan's relative paths)."""

    def __init__(self, dest: Path, *, label: str = "convert", echo: Callable[[str], None] | None = None) -> None:
        self.dest, self.label, self.began = Path(dest), label, time.monotonic()
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.files: Sequence[str] = ()

    def __call__(self, phase: str, files: Sequence[str] = ()) -> None:
        self.echo(f"[{self.label}] {time.monotonic() - self.began:6.1f} s  {phase}")
        if files:
            self.follow(files)

    def follow(self, files: Sequence[str]) -> None:
        """Show a bar over `files` until `close` (a no-op for fewer than two files)."""
        self.files = tuple(files)
        if len(self.files) < 2 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from tqdm import tqdm

        with tqdm(total=len(self.files), desc=f"[{self.label}] files", unit="file", leave=False,
                  dynamic_ncols=True, mininterval=1.0) as bar:
            done: set[str] = set()
            while not self._stop.wait(0.5):
                new = [f for f in self.files if f not in done and (self.dest / f).exists()]
                done.update(new)
                bar.update(len(new))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self("done")
