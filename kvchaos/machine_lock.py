"""One machine, several pytest-xdist workers: tests that measure time get the machine to themselves.

Every test of an xdist run holds the run's lock *shared* from its setup to its teardown (so a cluster
starting up counts too); a test marked ``exclusive`` holds it *exclusively*: it waits until no other
worker is inside a test, and no other worker starts one until it is done. A worker's cluster between
tests is idle (``--sleep-on-idle``), so the exclusive test's timings are its own — what a timing
side-channel test needs: on 2 cores another worker's cluster turned a clear same-salt cache hit into
"no power" (UNKNOWN).

``fcntl.flock`` on two files: a turnstile every locker passes (an exclusive locker holds it while it
waits, so shared lockers arriving later queue behind it instead of starving it) and the lock itself.
Waits are bounded: past ``timeout_s`` a :class:`MachineLockTimeout` names the lock file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


class MachineLockTimeout(TimeoutError):
    pass


def _acquire(fd: int, mode: int, deadline: float, path: Path, what: str) -> float:
    t0 = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return time.monotonic() - t0
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise MachineLockTimeout(f"waited {time.monotonic() - t0:.0f} s for the {what} lock on {path}: "
                                         "another xdist worker's test has held it all that time") from None
            time.sleep(0.1)


class MachineLock:
    def __init__(self, path: str | os.PathLike, timeout_s: float = 3600.0):
        self.path = Path(path)
        self.turnstile = self.path.with_name(self.path.name + ".turnstile")
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def hold(self, exclusive: bool = False):
        """Hold the lock (shared, or ``exclusive``) for the block; yields the seconds waited."""
        deadline = time.monotonic() + self.timeout_s
        lock = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        gate = os.open(self.turnstile, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = _acquire(gate, fcntl.LOCK_EX, deadline, self.turnstile, "turnstile")
            try:
                waited += _acquire(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline, self.path,
                                   "exclusive" if exclusive else "shared")
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield waited
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        finally:
            os.close(gate)
            os.close(lock)

    def remove(self) -> None:
        for p in (self.path, self.turnstile):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
