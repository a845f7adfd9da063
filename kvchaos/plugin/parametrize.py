"""Which tests run where: one session cluster per KV transfer backend and KV layout
(``--kvchaos-backends``, ``--kvchaos-layouts``, the profile's ``[suites] layouts``), the markers that
narrow that (``backends``, ``layouts``, ``every_layout``), ``disruptive`` tests last (``exclusive`` ones
just before them), and ``gpu`` tests skipped where no CUDA device is visible."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvchaos.plugin.options import backends, layouts


def cuda_available() -> tuple[bool, str]:
    if shutil.which("nvidia-smi") is None:
        return False, "no CUDA: nvidia-smi not found on this machine"
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"no CUDA: nvidia-smi failed ({e})"
    if r.returncode != 0 or "GPU" not in r.stdout:
        return False, f"no CUDA: nvidia-smi -L listed no GPU ({r.stdout.strip() or r.stderr.strip()})"
    return True, r.stdout.strip()


def pytest_generate_tests(metafunc):
    # with several backends / layouts every cluster test runs once per backend and layout (a session
    # cluster each; pytest finishes one cluster's tests and stops it before starting the next)
    names = backends(metafunc.config)
    if len(names) > 1 and "kvchaos_backend" in metafunc.fixturenames:
        metafunc.parametrize("kvchaos_backend", names, scope="session")
    lays, _ = layouts(metafunc.config)
    if len(lays) > 1 and "kvchaos_layout" in metafunc.fixturenames:
        metafunc.parametrize("kvchaos_layout", lays, scope="session")


def _backend_of(item):
    cs = getattr(item, "callspec", None)
    return cs.params.get("kvchaos_backend") if cs else None


def _layout_of(item):
    cs = getattr(item, "callspec", None)
    return cs.params.get("kvchaos_layout") if cs else None


def _in_suites(item) -> bool:
    return "suites" in Path(str(item.fspath)).parts


def _allowed_layouts(item, lays: list[str], explicit: bool) -> set[str]:
    m = item.get_closest_marker("layouts")
    if m:
        return set(m.args)
    if explicit:
        return set(lays) if _in_suites(item) else {lays[0]}
    every = item.get_closest_marker("every_layout")
    if every is None:
        return {lays[0]}
    if every.kwargs.get("own", True) or len(lays) == 1:
        return set(lays)
    return set(lays[1:])  # CI time: on the profile's other layouts only (the own one under --kvchaos-layouts)


def _applies(item, names: list[str], lays: list[str], explicit: bool) -> bool:
    """Whether ``item`` runs on its backend and layout."""
    fx = getattr(item, "fixturenames", ())
    if names and "kvchaos_backend" in fx:
        b = _backend_of(item) or names[0]
        m = item.get_closest_marker("backends")
        allowed = set(m.args) if m else set(names) if _in_suites(item) else {names[0]}
        if b not in allowed:
            return False
    if lays and "kvchaos_layout" in fx:
        return (_layout_of(item) or lays[0]) in _allowed_layouts(item, lays, explicit)
    return True


def pytest_collection_modifyitems(config, items):
    names = backends(config)
    lays, explicit = layouts(config)
    keep, drop = [], []
    for it in items:
        (keep if _applies(it, names, lays, explicit) else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # tests that leave the engine busy on purpose (hung requests the router keeps retrying) run last,
    # so no other test's exact counters or pool baselines see their stray work; with several layouts
    # or backends, one cluster's tests (disruptive last) before the next cluster's. Just before them, the
    # tests that hold the machine alone (``exclusive``): waiting for the lock, a session idles until every
    # other session's running test ends, and near its end fewer are running (make test's other sessions
    # have ended or are ending; CI, 2026-12-07: the timing test waited 50 s for them mid-run)
    lorder = {n: i for i, n in enumerate(lays)}
    order = {n: i for i, n in enumerate(names)}
    items.sort(key=lambda it: (lorder.get(_layout_of(it), 0), order.get(_backend_of(it), 0),
                               it.get_closest_marker("disruptive") is not None,
                               it.get_closest_marker("exclusive") is not None))
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, why = cuda_available()
    if not ok:
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason=why))
