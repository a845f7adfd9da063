"""Every fixture of the kvchaos plugin: the cluster spec (profile, layout, backend), the session's
``cluster`` and ``reference_server``, the run directory, the verdict policy (with the checkers plugins
add: ``pytest_kvchaos_checkers``), the seeds, ``experiment`` and ``faults`` (with the fault kinds
plugins add: ``pytest_kvchaos_fault_kinds``)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from faults import FaultKit
from faults.client import AgentClient
from kvchaos import oracles
from kvchaos.cluster import AttachedCluster, Cluster, ClusterSpec, Endpoints, SingleServer
from kvchaos.cluster.dry import DryCluster, DryFaults
from kvchaos.cluster.layouts import LayoutError, apply, parse
from kvchaos.cluster.reaper import Reaper
from kvchaos.plugin import known, options, rundir
from kvchaos.policy import FINDINGS_FILE, Policy, PolicyError, Registry, load_policy_table
from kvchaos.workload.events import EventLog
from kvchaos.workload.seed import Seeds

SEEDS = pytest.StashKey[object]()       # item: its kvchaos.workload.seed.Seeds
FAULT_KINDS = pytest.StashKey[dict]()   # config: name -> factory, from pytest_kvchaos_fault_kinds


# --------------------------------------------------------------------------- what plugins add
def extra_checkers(config) -> list:
    """The checkers every ``pytest_kvchaos_checkers`` implementation returned."""
    from kvchaos.oracles.base import Checker  # not at plugin load: the plugin loads in every pytest run

    out = []
    for result in config.hook.pytest_kvchaos_checkers(config=config):
        for c in [result] if isinstance(result, Checker) else (result or ()):
            if not isinstance(c, Checker):
                raise pytest.UsageError(f"pytest_kvchaos_checkers returned {c!r}: not a checker "
                                        "(a kvchaos.oracles.base.Checker instance)")
            out.append(c)
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise pytest.UsageError(f"pytest_kvchaos_checkers: checker(s) {dup} added twice")
    return out


@dataclasses.dataclass
class PluginPolicy(Policy):
    """:class:`kvchaos.policy.Policy` that judges every history by the checkers plugins add as well,
    unclaimed like the always-run ones (a leak checker's FAIL is red; an UNKNOWN only shown)."""

    extra_checkers: tuple = ()

    def checks(self, checks):
        comp, claimed = super().checks(checks)
        have = set(comp.names)
        return oracles.compose(*comp.checkers, *(c for c in self.extra_checkers if c.name not in have)), claimed


def fault_kinds(config) -> dict:
    """name -> factory from every ``pytest_kvchaos_fault_kinds`` implementation (asked once a session)."""
    got = config.stash.get(FAULT_KINDS, None)
    if got is not None:
        return got
    got = {}
    for result in config.hook.pytest_kvchaos_fault_kinds(config=config):
        for name, factory in dict(result or {}).items():
            if not isinstance(name, str) or not name or not callable(factory):
                raise pytest.UsageError(f"pytest_kvchaos_fault_kinds: {name!r}: {factory!r} is not a name and a "
                                        "factory(kit, **params) -> faults.base.Fault")
            if name in got:
                raise pytest.UsageError(f"pytest_kvchaos_fault_kinds: fault kind {name!r} added twice")
            got[name] = factory
    config.stash[FAULT_KINDS] = got
    return got


class FaultKinds(Mapping):
    """``faults.kinds``: the fault kinds plugins add. ``faults.kinds[name](**params)`` arms one through
    its ``factory(kit, **params)`` and returns the :class:`faults.base.Fault` handle; the ``faults``
    fixture heals every one after the test (before the kit's own injectors), and errors the test when
    a heal fails or leaves one unhealed."""

    def __init__(self, kit, factories: dict):
        self.kit, self._factories, self.armed = kit, factories, []

    def __getitem__(self, name):
        if name not in self._factories:
            raise KeyError(f"fault kind {name!r}: not one a plugin adds ({', '.join(sorted(self._factories))})")

        def arm(**params):
            f = self._factories[name](self.kit, **params)
            self.armed.append((name, f))
            return f

        return arm

    def __iter__(self):
        return iter(self._factories)

    def __len__(self):
        return len(self._factories)

    def heal_all(self, wait_s: float = 60.0) -> list[str]:  # noqa: ARG002 - the kit's own signature
        problems = []
        for name, f in self.armed:
            try:
                f.heal()
            except Exception as e:  # noqa: BLE001 - heal the others, report all
                problems.append(f"{name}: heal failed: {e!r}")
                continue
            if getattr(f, "healed", True) is False:
                problems.append(f"{name}: still armed after heal: {getattr(f, 'id', f)!r}")
        return problems


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvchaos_run_dir(pytestconfig) -> Path:
    d = Path(pytestconfig.getoption("--kvchaos-reports")) / pytestconfig.stash[rundir.RUN_ID]
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def kvchaos_base_spec(pytestconfig) -> ClusterSpec:
    """The profile as loaded (what the single reference server uses: it has no transfer backend)."""
    spec = ClusterSpec.load(pytestconfig.getoption("--kvchaos-profile"), model=pytestconfig.getoption("--kvchaos-model"))
    over = {k: v for k, v in (("agent_channel", pytestconfig.getoption("--kvchaos-agent-channel")),
                              ("topology", pytestconfig.getoption("--kvchaos-topology"))) if v}
    if over:
        spec = ClusterSpec.from_dict({**spec.to_dict(), **over})
    return spec


@pytest.fixture(scope="session")
def kvchaos_layout(pytestconfig, kvchaos_base_spec) -> str:
    """The KV layout of this cluster (parametrized when several layouts apply)."""
    lays, _ = options.layouts(pytestconfig)
    return lays[0] if lays else kvchaos_base_spec.layout


@pytest.fixture(scope="session")
def kvchaos_layout_spec(kvchaos_base_spec, kvchaos_layout) -> ClusterSpec:
    """The profile with this session's layout applied (what the single reference server runs)."""
    if kvchaos_layout == kvchaos_base_spec.layout:
        return kvchaos_base_spec
    try:
        data = apply(kvchaos_base_spec.to_dict(), parse(kvchaos_layout))
    except LayoutError as e:
        raise pytest.UsageError(str(e)) from None
    return ClusterSpec.from_dict(data)


@pytest.fixture(scope="session")
def kvchaos_backend(pytestconfig, kvchaos_base_spec) -> str:
    """The KV transfer backend of this cluster (parametrized when --kvchaos-backends names several)."""
    names = options.backends(pytestconfig)
    return names[0] if names else kvchaos_base_spec.transfer_backend


@pytest.fixture(scope="session")
def kvchaos_spec(kvchaos_layout_spec, kvchaos_backend) -> ClusterSpec:
    if kvchaos_backend == kvchaos_layout_spec.transfer_backend:
        return kvchaos_layout_spec
    return ClusterSpec.from_dict({**kvchaos_layout_spec.to_dict(), "transfer_backend": kvchaos_backend,
                                  "name": f"{kvchaos_layout_spec.name}-{kvchaos_backend}"})


@pytest.fixture(scope="session")
def kvchaos_reaper():
    r = Reaper(f"kvc-session-{os.getpid()}")
    yield r
    r.close()


@pytest.fixture(scope="session")
def kvchaos_policy(pytestconfig):
    """The verdict policy of this session: the findings registry, what is accepted, strictness and a
    declared blind model (flags, or the profile's [policy] table), and — once the cluster is up — the
    planted-leak self-test's result."""
    path = options.profile_path(pytestconfig)
    extra = extra_checkers(pytestconfig)
    cls, kw = (PluginPolicy, {"extra_checkers": tuple(extra)}) if extra else (Policy, {})
    try:
        table = load_policy_table(path if path.exists() else None)
        p = cls(registry=Registry.load(pytestconfig.getoption("--kvchaos-findings") or FINDINGS_FILE),
                accept_known=pytestconfig.getoption("--kvchaos-accept-known") or table.get("accept_known", False),
                strict=pytestconfig.getoption("--kvchaos-strict") or table.get("strict", False),
                blind_model=pytestconfig.getoption("--kvchaos-blind-model") or table.get("blind_model", False), **kw)
    except PolicyError as e:
        raise pytest.UsageError(str(e)) from None
    pytestconfig.stash[known.POLICY] = p
    return p


@pytest.fixture(scope="session")
def kvchaos_seed(pytestconfig) -> int:
    """The run's seed (``--kvchaos-seed``)."""
    return pytestconfig.stash[rundir.SEED]


def _scope(item) -> str:
    """A test's id without its parameters' brackets: one test draws one set of seeds on every layout."""
    nid = item.nodeid
    return nid.split("[", 1)[0]


@pytest.fixture
def seeds(request, kvchaos_seed):
    """This test's seeds: ``Workload(seeds(101))`` — the workload stream 101 of this run's seed
    (:class:`kvchaos.workload.seed.Seeds`); faults armed through ``faults`` draw theirs from it."""
    s = request.node.stash.get(SEEDS, None)
    if s is None:
        s = request.node.stash[SEEDS] = Seeds(kvchaos_seed, _scope(request.node))
    return s


@pytest.fixture
def experiment(request, kvchaos_run_dir, kvchaos_policy, seeds):
    """Factory for :class:`kvchaos.experiment.Experiment` bound to this test (its id, the session's
    run directory and policy; ``cluster`` and ``faults`` from their fixtures unless given). Every
    experiment a test runs must be judged (``ex.require(...)`` or ``ex.judge(...)``)."""
    # on use: the runner pulls in the driver (aiohttp, ~0.4 s) and the shrinker, and this plugin loads in
    # every pytest run, most of which (the cluster-free tests) never make an experiment
    from kvchaos.experiment import Experiment

    made = []

    dry = request.config.getoption("--kvchaos-dry")

    def make(name, plans, checks, **kw):
        if "cluster" not in kw:
            kw["cluster"] = request.getfixturevalue("cluster")
        if "faults" not in kw:
            kw["faults"] = request.getfixturevalue("faults")
        kw.setdefault("run_seed", seeds.run)
        kw["dry"] = dry
        kw.setdefault("policy", kvchaos_policy)  # a cluster of its own brings its own self-test's policy
        kw.setdefault("attempt", request.node.stash.get(known.ATTEMPT, 1))
        ex = Experiment(name, plans, checks, run_dir=kvchaos_run_dir, test_id=request.node.nodeid, **kw)
        made.append(ex)
        return ex

    request.node.stash[known.EXPERIMENTS] = made  # the KNOWN outcome hook asks them why a fault did not fire

    yield make
    unjudged = [ex for ex in made if ex.verdicts and not ex.judged]
    if unjudged and not request.node.stash.get(known.CALL_FAILED, False):  # a failed test is red already
        raise RuntimeError("kvchaos: experiment(s) run but never judged (call ex.require(...)): "
                           + "; ".join(f"{ex.name}: {ex.judgement.status}" for ex in unjudged))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """``--kvchaos-shrink NAME``: once the test body has run (its experiments judged, its cluster and
    faults still up), the plugin shrinks the experiment of that name (:func:`kvchaos.shrink.shrink_after`:
    ``<run dir>/shrink/<name>/``). The experiment itself never starts a shrink."""
    yield
    name = item.config.getoption("--kvchaos-shrink")
    if not name:
        return
    from kvchaos.shrink import shrink_after  # on use: only a shrink run needs the shrinker

    for ex in item.stash.get(known.EXPERIMENTS, ()):
        if ex.name == name and ex.verdicts and ex.shrunk is None:
            ex.shrunk = shrink_after(ex, budget_s=item.config.getoption("--kvchaos-shrink-budget-s"),
                                     max_steps=item.config.getoption("--kvchaos-shrink-steps"),
                                     checker=item.config.getoption("--kvchaos-shrink-checker"))


@pytest.fixture(scope="session")
def cluster(pytestconfig, kvchaos_base_spec, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper, kvchaos_policy):
    attach = pytestconfig.getoption("--kvchaos-attach")
    if pytestconfig.getoption("--kvchaos-dry"):
        yield DryCluster(kvchaos_spec)
        return
    if attach:
        c = AttachedCluster.parse(attach, kvchaos_spec).start()
    else:
        workdir = kvchaos_run_dir if kvchaos_spec is kvchaos_base_spec else kvchaos_run_dir / kvchaos_spec.name
        c = Cluster(kvchaos_spec, workdir, reaper=kvchaos_reaper).start()
    (kvchaos_run_dir / "cluster.json").write_text(json.dumps(c.describe(), indent=2, default=str))
    if getattr(c, "workdir", kvchaos_run_dir) != kvchaos_run_dir:  # one per layout / backend besides
        (Path(c.workdir) / "cluster.json").write_text(json.dumps(c.describe(), indent=2, default=str))
    try:
        # every session proves the harness can see a leak on this cluster before trusting a PASS
        from kvchaos.selftest import planted_leak_selftest

        kvchaos_policy.selftest = None  # the self-test itself is not gated by an earlier one
        c.selftest = planted_leak_selftest(c, kvchaos_run_dir, kvchaos_policy)
        kvchaos_policy.selftest = c.selftest  # not a clean catch: every isolation verdict is UNKNOWN
        c.leak_sensitive = c.selftest["status"] == "caught" or (c.selftest["status"] == "engine_leak"
                                                                 and c.selftest.get("planted_caught"))
        yield c
    finally:
        armed = _still_armed(c)
        left = c.stop()
        if armed:
            raise RuntimeError(f"kvchaos: faults still armed at session end: {armed}")
        if left:
            raise RuntimeError(f"kvchaos: processes left after cluster teardown: {left}")


@pytest.fixture(scope="session")
def reference_server(pytestconfig, kvchaos_base_spec, kvchaos_layout_spec, kvchaos_run_dir, kvchaos_reaper):
    ref = pytestconfig.getoption("--kvchaos-reference")
    if pytestconfig.getoption("--kvchaos-dry"):
        yield DryCluster(kvchaos_base_spec)
        return
    if ref:
        s = AttachedCluster(Endpoints(router=ref, prefill=ref, decode=ref), kvchaos_layout_spec)
        yield s
        return
    if pytestconfig.getoption("--kvchaos-attach"):
        pytest.skip("attach mode without --kvchaos-reference: no reference server to compare against")
    workdir = kvchaos_run_dir if kvchaos_layout_spec is kvchaos_base_spec else kvchaos_run_dir / kvchaos_layout_spec.name
    s = SingleServer(kvchaos_layout_spec, workdir, reaper=kvchaos_reaper).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _kvchaos_cluster_still_alive(request):
    """After any test that used the cluster: fail loudly if an engine process died under it; restart a
    role that hit a known silent engine failure (alive, healthy-looking, no longer transferring KV —
    kvchaos.cluster.launcher.ENGINE_ERRORS) so the session's next tests get a working cluster; the
    failure is recorded in <run dir>/engine_errors.jsonl and as a warning."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        _heal_engine_failures(request, c)
        c.check_alive()


def _heal_engine_failures(request, c) -> None:
    """Restart each role with a known silent engine failure and record it (engine_errors.jsonl and a
    warning); idempotent. The faults fixture calls it before its own heal check, which needs a cluster
    that serves again (it is torn down before this autouse fixture)."""
    healed = c.heal_engine_errors() if hasattr(c, "heal_engine_errors") else []
    if healed:
        import warnings

        run_dir = request.getfixturevalue("kvchaos_run_dir")
        with open(run_dir / "engine_errors.jsonl", "a") as f:
            for e in healed:
                f.write(json.dumps({**e, "test": request.node.nodeid}, default=str) + "\n")
        warnings.warn(pytest.PytestWarning(
            f"kvchaos: known engine failure during {request.node.nodeid}: "
            + "; ".join(f"{e['role']} {e['signature']} ({e.get('cause')}), restarted in "
                        f"{e['healed']['rejoined_s']} s" for e in healed)))


def _still_armed(c) -> list:
    out = []
    if getattr(c, "agent_dir", None) or getattr(c, "agent_urls", None):
        try:
            out += AgentClient.for_cluster(c).armed()
        except Exception as e:  # noqa: BLE001
            out.append(f"agent query failed: {e!r}")
    if getattr(c, "proxy", None) is not None:
        out += c.proxy.armed()
    return out


@pytest.fixture
def faults(request, cluster, kvchaos_run_dir, seeds):
    if request.config.getoption("--kvchaos-dry"):
        yield DryFaults()  # nothing is armed in a dry run: the experiment stops on entering
        return
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in request.node.nodeid)[-150:]
    log = EventLog(kvchaos_run_dir / "events" / f"{name}.jsonl")
    kit = FaultKit(cluster, log, seeds=seeds)
    kit.kinds = FaultKinds(kit, fault_kinds(request.config))  # the kinds plugins add: healed here too
    try:
        yield kit
    finally:
        problems = []
        try:  # first: a dead transfer thread would fail the heal's serving check
            _heal_engine_failures(request, cluster)
        except Exception as e:  # noqa: BLE001 - still heal the faults, then report both
            problems.append(f"restart after a known engine failure failed: {e!r}")
        problems += kit.kinds.heal_all()
        problems += kit.heal_all()
        log.close()
        if problems:
            raise RuntimeError("kvchaos: fault heal check failed: " + "; ".join(problems))
