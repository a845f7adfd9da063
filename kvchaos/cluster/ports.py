"""Free-port allocation that is safe across concurrent processes (pytest-xdist workers, two CI
jobs on one host).

Binding to port 0 and closing is racy: two workers can be handed the same port before either
server binds it. Instead each port is *reserved* by creating a lock file ``<dir>/<port>`` holding
the owner's pid, and only then checked for bindability on 127.0.0.1. Reservations of dead owners
are reclaimed. Check, reclaim and create run under one ``flock`` on ``<dir>/.lock`` (released by
the kernel if the holder dies): without it a reader could see a just-created, still empty file,
take it for stale and reclaim a live reservation (seen once in CI: two processes, one port). Ports come from a range below the Linux
ephemeral range so the kernel never hands them to outgoing connections.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

DEFAULT_RANGE = (20000, 32000)


def _lock_dir() -> Path:
    d = Path(os.environ.get("KVCHAOS_PORT_DIR", Path(tempfile.gettempdir()) / "kvchaos-ports"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _try_reserve(port: int, owner: int) -> bool:
    path = _lock_dir() / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            try:
                holder = int(path.read_text().strip() or "0")
            except (OSError, ValueError):
                holder = 0
            if holder and pid_alive(holder):
                return False
            try:  # stale: reclaim once
                path.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(owner))
        if _bindable(port):
            return True
        path.unlink(missing_ok=True)
        return False
    return False


def reserve_ports(n: int, owner: int | None = None, port_range=DEFAULT_RANGE, attempts: int = 2000) -> list[int]:
    """Reserve ``n`` distinct free loopback ports for ``owner`` (default: this process)."""
    if n < 1:
        raise ValueError(f"reserve_ports: n must be >= 1, got {n}")
    owner = owner or os.getpid()
    lo, hi = port_range
    rng = random.Random(os.urandom(8))
    got: list[int] = []
    with open(_lock_dir() / ".lock", "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            for _ in range(attempts):
                if len(got) == n:
                    return got
                p = rng.randrange(lo, hi)
                if p not in got and _try_reserve(p, owner):
                    got.append(p)
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)
    release_ports(got)
    raise RuntimeError(f"could not reserve {n} free ports in {lo}-{hi} after {attempts} attempts")


def _sweep(keep) -> list[str]:
    """Under the allocation lock: delete the reservations ``keep(holder)`` refuses; their paths."""
    d = _lock_dir()
    gone = []
    with open(d / ".lock", "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            for f in d.iterdir():
                if not f.name.isdigit():
                    continue
                try:
                    holder = int(f.read_text().strip() or "0")
                except (OSError, ValueError):
                    holder = 0
                if not keep(holder):
                    f.unlink(missing_ok=True)
                    gone.append(str(f))
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)
    return gone


def _running(pid: int) -> bool:
    """Alive and not a zombie (a SIGKILLed owner its parent has not reaped yet is gone for us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return pid_alive(pid) if not Path("/proc/self").exists() else False


def release_owner(pid: int) -> list[str]:
    """Delete every reservation of ``pid`` once it is dead (its reaper's last act)."""
    if _running(pid):
        return []
    return _sweep(lambda holder: holder != pid)


def sweep_ports() -> list[str]:
    """Delete the reservations of dead owners (a session's start): what ``_try_reserve`` would reclaim
    one at a time."""
    return _sweep(lambda holder: bool(holder) and pid_alive(holder))


def release_ports(ports) -> None:
    d = _lock_dir()
    for p in ports:
        (d / str(p)).unlink(missing_ok=True)
