"""pytest-xdist: one machine. Under xdist every test holds the run's machine lock, shared —
``exclusive`` tests alone (:mod:`kvchaos.machine_lock`). The controller fixes the run's uid (its
workers' lock file) and removes the lock files at its end."""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from pathlib import Path

import pytest

MACHINE_LOCK = pytest.StashKey[object]()          # a worker's lock (None: not under xdist)
MACHINE_LOCK_CLEANUP = pytest.StashKey[object]()  # the controller's: removed at unconfigure


def lock_path(uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"kvchaos-xdist-{uid}.lock"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from kvchaos.machine_lock import MachineLock  # only here: the plugin loads in every pytest run

    if hasattr(config, "workerinput"):  # a real xdist worker (a child pytest may inherit a worker's env)
        uid = config.workerinput.get("testrunuid")
        config.stash[MACHINE_LOCK] = MachineLock(lock_path(uid)) if uid else None
    elif getattr(config.option, "numprocesses", None) and hasattr(config.option, "testrunuid"):
        if not config.option.testrunuid:
            config.option.testrunuid = uuid.uuid4().hex
        config.stash[MACHINE_LOCK_CLEANUP] = MachineLock(lock_path(config.option.testrunuid))


@contextlib.contextmanager
def holding(item):
    """The run's machine lock held for ``item`` (shared, or alone for an ``exclusive`` test); nothing
    outside xdist. A wait of a second or more is recorded as a user property."""
    lock = item.config.stash.get(MACHINE_LOCK, None)
    if lock is None:
        yield
        return
    with lock.hold(exclusive=item.get_closest_marker("exclusive") is not None) as waited:
        if waited >= 1.0:
            item.user_properties.append(("kvchaos_machine_lock_wait_s", round(waited, 1)))
        yield


def pytest_unconfigure(config):
    lock = config.stash.get(MACHINE_LOCK_CLEANUP, None)
    if lock is not None:
        lock.remove()
