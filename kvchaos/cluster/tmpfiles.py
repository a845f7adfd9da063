"""What kvchaos leaves in the temporary directory while it runs, and how it goes away even after a
SIGKILL.

Four kinds of entry, each named so its owner can be told from its name or its content:

* ``kvc-ag-<pid>-*``: a cluster's agent directory (the engines' Unix sockets); ``<pid>`` launched it;
* ``kvchaos-xdist-<uid>.lock`` and ``.turnstile``: an xdist run's machine lock; the controller writes
  its pid into the ``.lock`` file;
* ``kvchaos-ports/<port>``: a port reservation holding its owner's pid; :mod:`kvchaos.cluster.ports`
  creates and deletes those under its own lock (:func:`~kvchaos.cluster.ports.release_owner`);
* ``kvc<k><role>-*``: a two-host cluster's engine-side directory, a tmpfs inside namespace
  ``kvc<k><role>`` (:mod:`kvchaos.cluster.netns`).

The owner registers each entry with its reaper (:mod:`kvchaos.cluster.reaper`), which deletes it after
the processes when the owner goes away, however it goes (and releases the owner's ports). :func:`sweep` removes those of owners that
died without a reaper's help (a reaper SIGKILLed too, a crash of the machine), and runs when a pytest
session starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from kvchaos.cluster.ports import pid_alive, sweep_ports

_AGENT = re.compile(r"^kvc-ag-(\d+)-[A-Za-z0-9_]+$")
_XDIST = re.compile(r"^kvchaos-xdist-[0-9a-f]+\.lock(\.turnstile)?$")
UNOWNED_LOCK_AGE_S = 24 * 3600.0
_MOUNT = re.compile(r"^(kvc\d+[pd])-[A-Za-z0-9_]+$")


def tmp() -> Path:
    return Path(tempfile.gettempdir())


def _dirs() -> set[Path]:
    """Where the entries live: the temporary directory, and /tmp (an agent directory stays there
    whatever TMPDIR says: a Unix socket's path must stay under 108 bytes)."""
    return {tmp(), Path("/tmp")}


def is_ours(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an agent directory, an xdist lock file or a mount directory, directly in
    the temporary directory: the only paths a reaper agrees to delete."""
    p = Path(path)
    if not p.is_absolute() or ".." in p.parts or p.parent not in _dirs():
        return False
    return bool(_AGENT.match(p.name) or _XDIST.match(p.name) or _MOUNT.match(p.name))


def remove(path: str | os.PathLike) -> bool:
    """Delete ``path`` (a file, or a directory with its contents) if it is ours; True when it is gone."""
    p = Path(path)
    if not is_ours(p):
        raise ValueError(f"{p} is not a kvchaos temporary entry (kvc-ag-*, kvchaos-xdist-*.lock, kvc<k><r>-*)")
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return not p.exists()


def _pid_in(path: Path) -> int:
    try:
        return int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return 0


def owner(path: Path) -> int | None:
    """The pid that owns ``path`` (0: the entry names none, e.g. a lock file of an older kvchaos);
    None for a mount directory (owned by a namespace, not a pid)."""
    m = _AGENT.match(path.name)
    if m:
        return int(m.group(1))
    if _XDIST.match(path.name):
        return _pid_in(path.with_name(path.name.removesuffix(".turnstile")))
    return None


def stale(path: Path) -> bool:
    """Nobody can still be using ``path``: its owner pid is dead, or (a mount directory) its
    namespace is gone."""
    m = _MOUNT.match(path.name)
    if m:
        return not Path("/run/netns", m.group(1)).exists()
    if path.name.endswith(".turnstile") and not path.with_name(path.name.removesuffix(".turnstile")).exists():
        return True  # its lock file is gone (swept a moment ago, or removed by its run): nobody uses it
    pid = owner(path)
    if not pid and _XDIST.match(path.name):
        # a lock file of an older kvchaos names no owner: stale only once nobody could still be using it
        try:
            return time.time() - path.stat().st_mtime > UNOWNED_LOCK_AGE_S
        except FileNotFoundError:
            return False
    return not pid_alive(pid)


def entries() -> list[Path]:
    """Every agent directory, xdist lock file and mount directory now in the temporary directory."""
    return sorted(p for d in _dirs() if d.is_dir() for p in d.iterdir() if is_ours(p))


def sweep() -> list[str]:
    """Delete the stale entries and port reservations; returns what was deleted. A live owner's entry
    is never touched, and an entry deleted under us (another sweeper) is fine."""
    gone = []
    for p in entries():
        try:
            if stale(p) and remove(p):
                gone.append(str(p))
        except OSError:
            continue
    return gone + sweep_ports()
