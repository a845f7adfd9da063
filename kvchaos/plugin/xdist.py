"""pytest-xdist: one machine. Under xdist every test holds the run's machine lock, shared —
``exclusive`` tests alone (:mod:`kvchaos.machine_lock`). The controller fixes the run's uid (its
workers' lock file), writes its pid into the lock file, registers both files with a reaper of its own
(gone even when the controller is SIGKILLed) and removes them at its end.

Several runs on one machine (``make test`` runs the cluster-free tests beside the cluster session): where
``KVCHAOS_MACHINE_LOCK`` names a lock file, every test of the session holds *that* lock, serial sessions
included, so an ``exclusive`` test waits for the other run's tests in flight and stops new ones. Whoever
sets the variable owns the file (creates and removes it); the session takes the variable out of its
environment, so the pytest runs its tests start do not hold it too.

Every session except an xdist worker first sweeps what dead runs left in the temporary directory (agent
directories, lock files, mount directories, port reservations: :func:`kvchaos.cluster.tmpfiles.sweep`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from kvchaos.cluster import tmpfiles
from kvchaos.cluster.reaper import Reaper

SHARED_LOCK_ENV = "KVCHAOS_MACHINE_LOCK"  # a lock file shared with other runs on this machine (its setter owns it)
WORKER_KEY = "kvchaos_machine_lock"  # the shared lock's path, handed to xdist workers in their workerinput
MACHINE_LOCK = pytest.StashKey[object]()          # the lock this process's tests hold (None: none)
SHARED_LOCK = pytest.StashKey[str]()  # the controller's KVCHAOS_MACHINE_LOCK, for its workers
MACHINE_LOCK_CLEANUP = pytest.StashKey[object]()  # the controller's: removed at unconfigure
SWEPT = pytest.StashKey[list]()  # what this session's start removed
LOCK_REAPER = pytest.StashKey[object]()  # the controller's reaper: deletes the lock files if it is killed


def lock_path(uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"kvchaos-xdist-{uid}.lock"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from kvchaos.machine_lock import MachineLock  # only here: the plugin loads in every pytest run

    if hasattr(config, "workerinput"):  # a real xdist worker (a child pytest may inherit a worker's env)
        shared, uid = config.workerinput.get(WORKER_KEY), config.workerinput.get("testrunuid")
        config.stash[MACHINE_LOCK] = MachineLock(shared) if shared else MachineLock(lock_path(uid)) if uid else None
        return
    swept = tmpfiles.sweep()
    if swept:
        config.stash[SWEPT] = swept
    shared = os.environ.pop(SHARED_LOCK_ENV, "")  # this session's alone: the pytest runs its tests start go without
    if shared:
        config.stash[SHARED_LOCK] = shared  # its workers get it in their workerinput; a serial session holds it
        config.stash[MACHINE_LOCK] = MachineLock(shared)
        return
    if getattr(config.option, "numprocesses", None) and hasattr(config.option, "testrunuid"):
        if not config.option.testrunuid:
            config.option.testrunuid = uuid.uuid4().hex
        lock = MachineLock(lock_path(config.option.testrunuid))
        lock.path.write_text(f"{os.getpid()}\n")  # the owner: a later run's sweep leaves it alone while we live
        reaper = Reaper(f"kvc-xdist-{os.getpid()}")
        for p in (lock.path, lock.turnstile):
            reaper.register_cleanup("path", str(p))
        config.stash[MACHINE_LOCK_CLEANUP] = lock
        config.stash[LOCK_REAPER] = reaper


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, starting a worker: the shared lock goes with it (its environment no longer has it)."""
    shared = node.config.stash.get(SHARED_LOCK, None)
    if shared:
        node.workerinput[WORKER_KEY] = shared


def pytest_report_header(config):
    swept = config.stash.get(SWEPT, None)
    if swept:
        return f"kvchaos: removed {len(swept)} entries dead runs left in the temporary directory"


@contextlib.contextmanager
def holding(item):
    """The machine lock held for ``item`` (shared, or alone for an ``exclusive`` test): the xdist run's, or
    the one ``KVCHAOS_MACHINE_LOCK`` names; nothing for a serial session without it. A wait of a second or
    more is recorded as a user property."""
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
    reaper = config.stash.get(LOCK_REAPER, None)
    if reaper is not None:
        reaper.close()
