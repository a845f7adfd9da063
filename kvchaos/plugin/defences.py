"""The defence arm (issue 30): ``--kvchaos-defences`` (or ``KVCHAOS_DEFENCES=1``) runs the session with
SGLang's own KV defences on both roles and judges every experiment by them as well.

* the profile's ``[defences]`` table (``kvchaos/profiles/gpu.toml``: ``--disaggregation-enable-kv-checksum``
  and ``--kv-canary log`` on prefill and decode) is applied by the profile loader
  (:func:`kvchaos.cluster.spec.with_defences`) wherever this session loads the profile: the option sets
  ``KVCHAOS_DEFENCES=1`` in this process, which every ``ClusterSpec.load`` honours;
* on a CPU profile (or one without the table) the arm is refused by name before anything starts: a
  usage error naming why (:data:`kvchaos.cluster.spec.DEFENCES_NEED_CUDA`);
* when each experiment opens, what the defences are set to on each role (``/server_info``) and where
  each engine log stands are recorded in its log (an ``observed`` record:
  :func:`kvchaos.oracles.defences.observe`);
* every experiment is judged by ``kv_checksum`` and ``kv_canary`` too (``pytest_kvchaos_checkers``),
  unclaimed: their FAIL is red (leak checkers), their UNKNOWN shown;
* ``report.html`` gets the table fault class x (kvchaos oracle, checksum, kv-canary)
  (``pytest_kvchaos_report_sections``, :mod:`kvchaos.report.defences`).

Registered with the plugin's other modules (``kvchaos.plugin.pytest_plugins``), or by hand with
``-p kvchaos.plugin.defences``.
"""

from __future__ import annotations

import os

import pytest

from kvchaos.cluster.spec import DEFENCES_ENV, ClusterSpec, SpecError, defences_requested

ON = pytest.StashKey[bool]()
OBSERVER = pytest.StashKey[object]()
ENV_BEFORE = pytest.StashKey[object]()  # KVCHAOS_DEFENCES as it was before this session set it


def pytest_addoption(parser):
    g = parser.getgroup("kvchaos")
    g.addoption("--kvchaos-defences", action="store_true", default=defences_requested(),
                help="the defence arm: SGLang's own KV defences (--disaggregation-enable-kv-checksum, --kv-canary "
                     "log) on both roles from the profile's [defences] table, and every experiment judged by the "
                     "kv_checksum and kv_canary checkers too; CUDA only (refused on a cpu profile) "
                     f"[{DEFENCES_ENV}=1]")


def pytest_configure(config):
    on = bool(config.getoption("--kvchaos-defences", default=False))
    config.stash[ON] = on
    if not on:
        return
    profile = config.getoption("--kvchaos-profile", default="cpu")
    try:  # refused here, by name, before any cluster starts
        ClusterSpec.load(profile, model=config.getoption("--kvchaos-model", default=None), defences=True)
    except SpecError as e:
        raise pytest.UsageError(f"--kvchaos-defences: {e}") from None
    config.stash[ENV_BEFORE] = os.environ.get(DEFENCES_ENV)
    os.environ[DEFENCES_ENV] = "1"  # every ClusterSpec.load of this session (and its workers) applies the arm
    from kvchaos import experiment  # only with the arm on: the runner is not loaded by every pytest run

    experiment.OBSERVERS.append(_observe)
    config.stash[OBSERVER] = _observe


def pytest_unconfigure(config):
    fn = config.stash.get(OBSERVER, None)
    if fn is None:
        return
    before = config.stash.get(ENV_BEFORE, None)
    if before is None:
        os.environ.pop(DEFENCES_ENV, None)
    else:
        os.environ[DEFENCES_ENV] = before
    from kvchaos import experiment  # loaded by pytest_configure already

    if fn in experiment.OBSERVERS:
        experiment.OBSERVERS.remove(fn)


def _observe(event, ex, **info):
    """``kvchaos.experiment.OBSERVERS``: when an experiment opens, the defences' settings and the logs'
    positions go into its log (what the checkers judge it by)."""
    if event != "open" or getattr(ex, "log", None) is None:
        return
    from kvchaos.oracles.defences import observe  # the checkers' own record of what they read

    ex.log.emit("observed", defences=observe(ex.cluster))


def pytest_kvchaos_checkers(config):
    if not config.stash.get(ON, False):
        return []
    from kvchaos.oracles.defences import arm_checkers  # not at plugin load: the arm is opt-in

    return arm_checkers()


def pytest_kvchaos_report_sections(config, run_dir):
    if not config.stash.get(ON, False):
        return []
    from kvchaos.report.defences import section  # not at plugin load: the arm is opt-in

    s = section(run_dir)
    return [s] if s else []
