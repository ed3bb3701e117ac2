"""The reaper of an embedded Ray cluster: its processes end with the process that started them.

`ray.init()` starts the GCS, the raylet and their agents as children of the driver. When the driver
is killed (kill -9, an OOM kill), nothing in it runs, and Ray's agents outlive it for a minute or
more, listening on their ports, while they retry a GCS that is gone. `start(driver_pid)` launches
this module as a small process in a session of its own; it keeps a list of the driver's Ray
descendants (polled every half second while new ones appear, every few seconds once they stop), and
when the driver closes the pipe (`Reaper.release`, after `ray.shutdown()`) or dies, it kills those
still running (and their own children) within about a second. Only
processes it saw as descendants of the driver that are Ray's (`ray::*` workers, `ray/` programs)
are touched, each matched by pid and start time.

Run as `python -m migrate.runtime.reaper DRIVER_PID` with the driver holding its stdin's write end.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

POLL_S = 0.5  # while the driver's Ray processes still appear (its start, new workers)
POLL_MAX_S = 4.0  # once none appeared for a while: each poll walks the process table, and what starts later
# (workers, agents) is a child of the raylet or the GCS, killed with them
GRACE_S = 1.0  # after the driver let go: time for a clean ray.shutdown() to finish on its own


def _is_ray(cmdline: list[str], name: str) -> bool:
    text = " ".join(cmdline)
    return name.startswith("ray::") or text.startswith("ray::") or "/ray/" in text or "/site-packages/ray" in text


def _ray_descendants(driver: int, me: int) -> dict[int, float]:
    """{pid: create time} of the driver's descendants that are Ray's processes (not this one)."""
    import psutil

    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in children:
        try:
            if p.pid != me and _is_ray(p.cmdline(), p.name()):
                out[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return out


def _kill(seen: dict[int, float]) -> int:
    """SIGKILL every recorded process still running (same pid and start time) and its descendants."""
    import psutil

    victims = []
    for pid, created in seen.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:
                victims += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=5)
    return len(victims)


def watch(driver: int, stdin_fd: int = 0) -> int:
    """Record the driver's Ray processes until stdin reaches EOF (the driver let go or died), then kill the
    ones left; returns how many were killed."""
    me = os.getpid()
    seen: dict[int, float] = {}
    interval = POLL_S
    while True:
        found = _ray_descendants(driver, me)
        interval = POLL_S if found.keys() - seen.keys() else min(2 * interval, POLL_MAX_S)
        seen.update(found)
        ready, _, _ = select.select([stdin_fd], [], [], interval)
        if ready and not os.read(stdin_fd, 4096):
            break
    alive = True
    try:
        os.kill(driver, 0)
    except OSError:
        alive = False
    if alive:  # a clean shutdown: let Ray's own stop finish first
        time.sleep(GRACE_S)
    return _kill(seen)


@dataclass
class Reaper:
    """The driver's handle: `release()` (or the driver's death) lets the reaper clean up and exit."""

    process: subprocess.Popen

    def release(self, wait_s: float = 10.0) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start(driver_pid: int | None = None) -> Reaper:
    """Launch the reaper for `driver_pid` (default: this process)."""
    proc = subprocess.Popen([sys.executable, "-m", "migrate.runtime.reaper", str(driver_pid or os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    return Reaper(process=proc)


if __name__ == "__main__":
    sys.exit(0 if watch(int(sys.argv[1])) >= 0 else 1)
