"""What a user sees while something runs: a phase that lasts is announced once it has run for a few seconds
and again every so often, with the seconds since the start, as plain lines on stderr (they read the same in
a terminal and in `ray job submit`'s log); quick phases print nothing, so a bad input stays one line.

`LiveStatus(label)` is such a status (the runner keeps one per stage, which a stage refines with
`ctx.status(text)` and silences with `ctx.status(None)` while it draws a bar of its own); a phase given
`files` shows a bar over them as they appear under `dest` at their final names (a conversion writes each to a
temporary name and renames it when complete, so counting them works for threads, processes and Ray tasks)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ANNOUNCE_AFTER_S = 2.0
REPEAT_EVERY_S = 10.0


class LiveStatus:
    """A `status(text, files=())` callback (see the module docstring); `status(None)` stops announcing until
    the next text. Also `checkpoint.api.convert`'s `phase` callback."""

    def __init__(self, label: str, *, dest: Path | str = ".", echo: Callable[[str], None] | None = None) -> None:
        self.dest, self.label, self.began = Path(dest), label, time.monotonic()
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self._current: tuple[str, float] | None = None
        self._announced = 0.0  # when the current phase was last announced (0: not yet)
        self._shown = False
        self._files: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def __call__(self, phase: str | None, files: Sequence[str] = ()) -> None:
        self._current, self._announced = (None if phase is None else (phase, time.monotonic())), 0.0
        self._files = tuple(files)

    def _say(self, text: str) -> None:
        self._shown = True
        self.echo(f"[{self.label}] {time.monotonic() - self.began:6.1f} s  {text}")

    def _loop(self) -> None:
        bar = None
        done: set[str] = set()
        while not self._stop.wait(0.5):
            if self._current is None:
                continue
            phase, since = self._current
            now = time.monotonic()
            if self._files and len(self._files) > 1:
                if bar is None and now - since >= ANNOUNCE_AFTER_S:
                    from tqdm import tqdm

                    self._shown = True
                    bar = tqdm(total=len(self._files), desc=f"[{self.label}] {phase}", unit="file", leave=False,
                               dynamic_ncols=True, mininterval=1.0)
                if bar is not None:
                    new = [f for f in self._files if f not in done and (self.dest / f).exists()]
                    done.update(new)
                    bar.update(len(new))
                continue
            if now - since >= ANNOUNCE_AFTER_S and (not self._announced or now - self._announced >= REPEAT_EVERY_S):
                self._say(phase if not self._announced else f"{phase} (still, {now - since:.0f} s)")
                self._announced = now
        if bar is not None:
            bar.close()

    def close(self, last: str = "done") -> None:
        """Stop; say `last` with the seconds it all took when anything was shown (once: a second close is a no-op)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._shown and last:
            self._say(last)
