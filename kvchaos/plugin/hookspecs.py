"""The hooks through which a conftest.py or plugin extends kvchaos (docs/reference/hooks.md).

Specifications only: ``kvchaos.plugin.pytest_addhooks`` adds them to the plugin manager. Their names
carry the ``pytest_`` prefix because pytest only collects implementations whose names do.
"""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_kvchaos_checkers(config):
    """Extra checkers for the session's verdict policy (the ``kvchaos_policy`` fixture).

    Return a list of :class:`kvchaos.oracles.base.Checker` instances (or one). Every experiment of
    the session is judged by them besides the checkers it names and the always-run leak checkers,
    unclaimed like the latter: a FAIL of a checker whose class declares ``leak = True`` is red, its
    UNKNOWN only shown; a non-leak checker's verdicts are recorded and shown. A checker whose name the
    experiment already has is not added twice. Called once, when ``kvchaos_policy`` is first used.
    """


@pytest.hookspec
def pytest_kvchaos_report_sections(config, run_dir):
    """Extra sections for the run's ``report.html``, built at the end of the session.

    ``run_dir``: the run directory (:class:`pathlib.Path`) the report is built from. Return a list of
    sections: ``{"title": str, "html": str}`` (HTML inserted as is), ``{"title": str, "text": str}``
    or ``(title, text)`` (text shown preformatted, escaped). They come after the report's own sections,
    before the engine logs, each as ``<section class="plugin-section">``.
    """


@pytest.hookspec
def pytest_kvchaos_fault_kinds(config):
    """Extra fault kinds for the ``faults`` fixture: ``faults.kinds[name](**params)``.

    Return a dict ``name -> factory``; ``factory(kit, **params)`` arms the fault (``kit``: the test's
    :class:`faults.FaultKit`: its ``cluster``, ``log``, ``agent``, ``net``, ``proc``) and returns its
    :class:`faults.base.Fault` handle. The ``faults`` fixture heals every fault so armed after the test
    and errors the test when a heal fails. Called once a session, when ``faults`` is first used.
    """
