"""pytest plugin (entry point ``kvchaos``): a session-scoped real cluster for chaos suites.

Options
  --kvchaos-profile NAME|PATH   cluster profile (default: cpu)
  --kvchaos-attach  router=URL,prefill=URL,decode=URL   use running servers instead of launching
                    [,prefill_agent=tcp://H:P,decode_agent=tcp://H:P]  their agent gateways
                                (KVCHAOS_AGENT_TOKEN); process faults via KVCHAOS_K8S_* (faults/k8s.py)
  --kvchaos-agent-channel unix|tcp   how the harness reaches a launched cluster's agents
  --kvchaos-topology one-host|two-hosts   two-hosts: prefill and decode in network namespaces
  --kvchaos-reference URL       reference single server for differential checks in attach mode
  --kvchaos-model   tiny:SEED|DIR   override the profile's model
  --kvchaos-reports DIR         where run directories go (default: ./reports)
  --kvchaos-backends A,B        run the cluster tests once per KV transfer backend (mooncake_tcp,nixl)
  --kvchaos-layouts A,B         run the suites once per KV layout (kvchaos.cluster.layouts: mha-p1-fp32,
                                gqa-p64-bf16, mla-p64-bf16, ...), one session cluster each; without it the
                                profile's [suites] layouts apply to tests marked every_layout only
  --kvchaos-releases A,B        releases the release matrix runs the unmodified incident on (marker bisect)
  --kvchaos-trials N            trials per release (default 3; a fresh cluster each)
  --kvchaos-deployment D        incident | auto-truncate: how the release matrix deploys each release
  --kvchaos-accept-known        known engine findings matched for the running version are KNOWN, not red
                                (default: the profile's [policy] accept_known)
  --kvchaos-strict              fail the run when a listed finding did not reproduce ("fixed?")
  --kvchaos-blind-model         declare a model that cannot echo canaries (isolation not claimed)
  --kvchaos-findings PATH       known-findings registry [kvchaos/findings.toml]

Fixtures
  kvchaos_spec      the ClusterSpec in force
  cluster           session-scoped launched (or attached) prefill/decode/router cluster
  reference_server  session-scoped single (non-disaggregated) server of the same model
  kvchaos_run_dir   reports/<run-id>/ for this session
  faults            per-test FaultKit (agent / net / proc injectors) writing
                    reports/<run-id>/events/<test>.jsonl; healed after the test even on failure,
                    and the test errors if anything is still armed afterwards
  experiment        factory of kvchaos.experiment.Experiment bound to this test (id, run dir, policy,
                    cluster, faults); every experiment a test runs must be judged
  kvchaos_policy    the session's verdict policy (kvchaos.policy.Policy)

Outcomes: a test whose only departures from its required verdicts are accepted known findings is
KNOWN (terminal ``K``, JUnit skipped with the finding ids, progress ``known``), never passed; the
session writes findings.json (known findings seen, listed findings that did not reproduce).

The cluster fixture runs the planted-leak self-test (kvchaos.selftest) once per session: a
cluster on which a planted leak goes unseen errors every test that uses it; one on which the model
cannot show a leak (self-test ``unknown``) makes every isolation verdict UNKNOWN (red) unless a
blind model is declared.

Markers
  gpu   needs CUDA; skipped with the reason when no CUDA device is visible
  slow  long sweeps; deselected by the default ``make test`` (run with ``-m slow``)
  every_layout  runs on every layout of the profile's ``[suites] layouts`` in a default run (smoke,
        incident, detection matrix); ``every_layout(own=False)``: on the profile's other layouts only in
        a default run (CI time); other tests run on the profile's own layout unless
        ``--kvchaos-layouts`` names layouts (then every suite runs on each)
  layouts(*names)  the only layouts this test applies to
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kvchaos.cluster import AttachedCluster, Cluster, ClusterSpec, SingleServer
from kvchaos.cluster.launcher import Endpoints
from kvchaos.cluster.reaper import Reaper


def pytest_addoption(parser):
    g = parser.getgroup("kvchaos")
    g.addoption("--kvchaos-profile", default=os.environ.get("KVCHAOS_PROFILE", "cpu"),
                help="cluster profile name (kvchaos/profiles) or TOML path [cpu]")
    g.addoption("--kvchaos-agent-channel", default=os.environ.get("KVCHAOS_AGENT_CHANNEL"), choices=("unix", "tcp"),
                help="how the harness reaches the in-engine agents of a launched cluster: unix (their control "
                     "directory) or tcp (each server's gateway with a token; no engine-side file read) "
                     "[the profile's agent_channel]")
    g.addoption("--kvchaos-topology", default=os.environ.get("KVCHAOS_TOPOLOGY"), choices=("one-host", "two-hosts"),
                help="two-hosts: prefill and decode each in a network namespace of its own, the agents over "
                     "TCP, engine-side files out of the harness's view (kvchaos.cluster.netns) [the profile's]")
    g.addoption("--kvchaos-attach", default=os.environ.get("KVCHAOS_ATTACH"),
                help="attach to running servers: router=URL,prefill=URL,decode=URL")
    g.addoption("--kvchaos-reference", default=os.environ.get("KVCHAOS_REFERENCE"),
                help="URL of a single (non-disaggregated) reference server, for attach mode")
    g.addoption("--kvchaos-model", default=os.environ.get("KVCHAOS_MODEL"),
                help="model override: tiny:SEED or a model directory")
    g.addoption("--kvchaos-reports", default=os.environ.get("KVCHAOS_REPORTS", "reports"),
                help="directory for run reports [reports]")
    g.addoption("--kvchaos-accept-known", action="store_true",
                default=os.environ.get("KVCHAOS_ACCEPT_KNOWN", "") not in ("", "0"),
                help="a verdict matching a known engine finding (kvchaos/findings.toml) for the running engine "
                     "version is KNOWN, not red [the profile's [policy] accept_known]")
    g.addoption("--kvchaos-strict", action="store_true", default=os.environ.get("KVCHAOS_STRICT", "") not in ("", "0"),
                help="fail the run when a listed finding did not reproduce on the engine version it lists")
    g.addoption("--kvchaos-findings", default=os.environ.get("KVCHAOS_FINDINGS"),
                help="known-findings registry TOML [kvchaos/findings.toml]")
    g.addoption("--kvchaos-blind-model", action="store_true",
                default=os.environ.get("KVCHAOS_BLIND_MODEL", "") not in ("", "0"),
                help="declare a model that cannot echo canaries: isolation is not claimed (UNKNOWN, reported, not red)")
    g.addoption("--kvchaos-releases", default=os.environ.get("KVCHAOS_RELEASES", "0.5.19,0.5.20,0.5.21,0.5.22,0.5.23"),
                help="SGLang releases the release matrix (suites/incidents/test_release_matrix.py, marker "
                     "bisect) runs the unmodified incident on, each in its own environment")
    g.addoption("--kvchaos-deployment", default=os.environ.get("KVCHAOS_DEPLOYMENT", "incident"),
                help="how the release matrix deploys each release: incident (prefill pool < context) or "
                     "auto-truncate (the same with --allow-auto-truncate on both roles)")
    g.addoption("--kvchaos-trials", type=int, default=int(os.environ.get("KVCHAOS_TRIALS", "3")),
                help="trials per release in the release matrix (a fresh cluster each)")
    g.addoption("--kvchaos-layouts", default=os.environ.get("KVCHAOS_LAYOUTS"),
                help="comma-separated KV layouts to run the suites over, one cluster each (e.g. "
                     "mha-p1-fp32,gqa-p64-bf16,mla-p64-bf16) [the profile's [suites] layouts, for tests "
                     "marked every_layout]")
    g.addoption("--kvchaos-seed", default=os.environ.get("KVCHAOS_SEED"),
                help="the run's seed: every suite's workload and every fault's randomness derive from it "
                     "(kvchaos.workload.seed; 0 = the reviewed plans) [a fresh random one, printed and recorded]")
    g.addoption("--kvchaos-dry", action="store_true", default=False,
                help="record each test's first experiment's plans (digest, seed) in <run dir>/plans.jsonl and "
                     "send nothing: no cluster is started (kvchaos digests compares two dry runs)")
    g.addoption("--kvchaos-shrink", default=None, metavar="EXPERIMENT",
                help="once the experiment of this name is judged FAIL, shrink it to a minimal scenario that still "
                     "fails the same way (kvchaos.shrink): <run dir>/shrink/<name>/ (kvchaos shrink starts this)")
    g.addoption("--kvchaos-shrink-budget-s", type=float, default=1200.0, help="shrink: wall-clock bound [1200]")
    g.addoption("--kvchaos-shrink-steps", type=int, default=40, help="shrink: at most this many attempts [40]")
    g.addoption("--kvchaos-shrink-checker", default=None,
                help="shrink: the checker whose FAIL to keep [the first leak checker that failed]")
    g.addoption("--kvchaos-backends", default=os.environ.get("KVCHAOS_BACKENDS"),
                help="comma-separated KV transfer backends to run the suites over, one cluster each "
                     "(e.g. mooncake_tcp,nixl) [the profile's]")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with the reason when none is visible)")
    config.addinivalue_line("markers", "slow: long sweeps, deselected by default (-m slow)")
    config.addinivalue_line("markers", "cluster: uses the real cluster")
    config.addinivalue_line("markers", "bisect: the release matrix (kvchaos bisect): one cluster per release and trial")
    config.addinivalue_line("markers", "disruptive: leaves the engine busy on purpose; run at the end of the session")
    config.addinivalue_line("markers", "every_layout(own=True): runs on every layout of the profile's [suites] "
                            "layouts in a default run (without --kvchaos-layouts); own=False: on the others only")
    config.addinivalue_line("markers", "layouts(*names): the only KV layouts this test applies to")
    config.addinivalue_line("markers", "exclusive: measures time; under pytest-xdist no other worker runs a test "
                            "meanwhile (kvchaos.machine_lock)")
    config.addinivalue_line("markers", "backends(*names): the KV transfer backends this test applies to "
                            "(default: every backend for suites/, the first one for the harness's own tests)")
    # the cluster layer does not import the fault layer: the network fault proxy is wired in here
    from faults import install_network_proxy

    install_network_proxy()
    run_id = os.environ.get("KVCHAOS_RUN_ID") or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    _machine_lock(config)
    if worker:
        run_id += f"-{worker}"
    config._kvchaos_run_id = run_id
    from kvchaos.workload.seed import SeedError, parse

    try:
        config._kvchaos_seed = parse(config.getoption("--kvchaos-seed"))
    except SeedError as e:
        raise pytest.UsageError(str(e)) from None
    # xdist workers inherit the environment: one run, one seed, even when it was drawn here
    os.environ["KVCHAOS_SEED"] = str(config._kvchaos_seed)
    if config.getoption("--kvchaos-dry"):
        os.environ["KVCHAOS_DRY"] = "1"  # clusters of a test's own (kvchaos.suite.own_cluster) start nothing
    if getattr(config.option, "collectonly", False):
        return
    run_dir = Path(config.getoption("--kvchaos-reports")) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    if not worker:  # what ``kvchaos replay`` needs to run this again; the report shows the seed
        (run_dir / "run.json").write_text(json.dumps({
            "run_id": run_id, "seed": config._kvchaos_seed, "dry": config.getoption("--kvchaos-dry"),
            "args": list(config.invocation_params.args), "cwd": str(config.invocation_params.dir),
            "profile": config.getoption("--kvchaos-profile"), "layouts": config.getoption("--kvchaos-layouts"),
            "backends": config.getoption("--kvchaos-backends"), "model": config.getoption("--kvchaos-model"),
            "attach": config.getoption("--kvchaos-attach"), "started": time.time()}, indent=2))
    config._kvchaos_progress = Progress(run_dir / "progress.jsonl")
    config.pluginmanager.register(config._kvchaos_progress, "kvchaos-progress")
    # every run leaves JUnit XML in its run directory (unless the caller chose a path)
    if not worker and not getattr(config.option, "xmlpath", None):
        config.option.xmlpath = str(run_dir / "junit.xml")


class Progress:
    """``<run dir>/progress.jsonl``: what ``kvchaos run`` shows while the run goes, and how the report
    links each scenario to the test that ran it. Lines: ``collected`` (n), ``start`` (nodeid), ``end``
    (nodeid, outcome passed|failed|error|skipped|xfailed|xpassed, wall_start, wall_end, duration, message)."""

    def __init__(self, path: Path):
        self.path = path
        self.run_dir = path.parent
        self._f = None
        self._open: dict[str, dict] = {}

    def emit(self, ev: str, **fields):
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)
        self._f.write(json.dumps({"ev": ev, "wall": time.time(), **fields}, default=str) + "\n")

    # pytest hooks (this object is registered as a plugin of its session)
    def pytest_collection_finish(self, session):
        self.emit("collected", n=len(session.items))

    def pytest_runtest_logreport(self, report):
        if report.when == "setup":
            self.emit("start", nodeid=report.nodeid)
        self.report(report)

    def report(self, rep):
        st = self._open.setdefault(rep.nodeid, {"outcome": "passed", "message": "", "start": time.time()})
        if rep.when == "setup":
            st["start"] = time.time() - (rep.duration or 0)
        if getattr(rep, "wasxfail", "").startswith("KNOWN ") and rep.skipped:
            st["outcome"] = "known"
            st["message"] = rep.wasxfail
        elif hasattr(rep, "wasxfail"):
            st["outcome"] = "xfailed" if rep.skipped else "xpassed"
            st["message"] = rep.wasxfail
        elif rep.outcome == "rerun":  # blinded by an accepted engine failure: the test runs again
            st["outcome"] = "rerun"
            st["message"] = str(rep.longrepr)[-2000:]
        elif rep.failed:
            st["outcome"] = "failed" if rep.when == "call" else "error"
            st["message"] = str(rep.longrepr)[-2000:]
        elif rep.skipped and st["outcome"] == "passed":
            st["outcome"] = "skipped"
            lr = rep.longrepr
            st["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        if rep.when == "teardown":
            self._open.pop(rep.nodeid, None)
            end = time.time()
            self.emit("end", nodeid=rep.nodeid, outcome=st["outcome"], wall_start=st["start"], wall_end=end,
                      duration=round(end - st["start"], 3), message=st["message"])

    def close(self):
        if self._f:
            self._f.close()
            self._f = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """After JUnit is written: the run-level verdicts.json and report.html of this run directory."""
    pr = getattr(session.config, "_kvchaos_progress", None)
    if pr is None:
        return
    policy = getattr(session.config, "_kvchaos_policy", None)
    if policy is not None:
        try:
            summ = findings_summary(pr.run_dir, policy.registry, policy.strict)
            session.config._kvchaos_findings = summ
            (pr.run_dir / "findings.json").write_text(json.dumps(summ, indent=2, default=str))
            if policy.strict and summ["not_reproduced"] and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
                exitstatus = session.exitstatus
        except Exception as e:  # noqa: BLE001 - say it; a missing summary must not read as green
            (pr.run_dir / "findings-error.txt").write_text(repr(e))
            session.exitstatus = exitstatus = pytest.ExitCode.INTERNAL_ERROR
    pr.emit("finished", exitstatus=int(exitstatus))
    pr.close()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    try:
        from kvchaos.report import build

        r = build(pr.run_dir)
        msg = "\n".join(r["lines"] + [f"kvchaos report: {r['html']} ({r['label']})"])
    except Exception as e:  # noqa: BLE001 - the run's result stands; say loudly that its report is missing
        (pr.run_dir / "report-error.txt").write_text(repr(e))
        msg = f"kvchaos report: NOT BUILT for {pr.run_dir}: {e!r}"
    if tr is not None:
        tr.ensure_newline()
        for line in msg.splitlines():
            tr.write_line(line)


# --------------------------------------------------------------------------- xdist: one machine
def _machine_lock(config) -> None:
    """Under pytest-xdist every test holds the run's machine lock, shared — ``exclusive`` tests alone
    (:mod:`kvchaos.machine_lock`). The controller fixes the run's uid (its workers' lock file) and
    removes the lock files at its end."""
    from kvchaos.machine_lock import MachineLock

    def path(uid):
        return Path(tempfile.gettempdir()) / f"kvchaos-xdist-{uid}.lock"

    if hasattr(config, "workerinput"):  # a real xdist worker (a child pytest may inherit a worker's env)
        uid = config.workerinput.get("testrunuid")
        config._kvchaos_machine_lock = MachineLock(path(uid)) if uid else None
    elif getattr(config.option, "numprocesses", None) and hasattr(config.option, "testrunuid"):
        if not config.option.testrunuid:
            config.option.testrunuid = uuid.uuid4().hex
        config._kvchaos_machine_lock_cleanup = MachineLock(path(config.option.testrunuid))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a test (holding the run's machine lock under xdist); once more when its first attempt was
    blinded by an accepted engine failure.

    An experiment red only for want of power (claimed isolation UNKNOWN, no FAIL anywhere in the
    test) during which an engine failure an accepted finding names struck (Mooncake's transfer thread
    dying: the cluster fixture restarts prefill after the test) says nothing about the engine's
    isolation: the test runs once more on the restarted engine. The first attempt's report is
    ``rerun`` (terminal ``R``), its experiments stay in the run directory marked ``rerun``
    (kvchaos.policy.scenario_status: the next attempt stands for them); a second blinded attempt is
    red like any other."""
    if not isinstance(item, pytest.Function):
        return None
    lock = getattr(item.config, "_kvchaos_machine_lock", None)
    if lock is None:
        return _protocol(item, nextitem)
    with lock.hold(exclusive=item.get_closest_marker("exclusive") is not None) as waited:
        if waited >= 1.0:
            item.user_properties.append(("kvchaos_machine_lock_wait_s", round(waited, 1)))
        return _protocol(item, nextitem)


def _protocol(item, nextitem) -> bool:
    from _pytest.runner import call_and_report, runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    item._kvchaos_attempt = 1
    if not item._request:
        item._initrequest()
    setup = call_and_report(item, "setup", True)
    call = call_and_report(item, "call", False) if setup.passed else None
    why = _blinded(item, call)  # decided before teardown: a re-run keeps the session's fixtures
    if why:
        call.outcome = "rerun"
        call.longrepr = f"KVCHAOS RERUN: {why}\n{call.longrepr}"
    if call is not None:
        item.ihook.pytest_runtest_logreport(report=call)
    last = None if item.session.shouldfail or item.session.shouldstop else nextitem
    call_and_report(item, "teardown", True, nextitem=_Parent(item) if why else last)
    item._request, item.funcargs = False, None  # what runtestprotocol does after its teardown
    if why:
        _mark_rerun(item, why)
        item._kvchaos_attempt = 2
        runtestprotocol(item, nextitem=nextitem, log=True)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


class _Parent:
    """What a test's teardown tears down to when it runs again: its function-scope fixtures only."""

    def __init__(self, item):
        self._chain = item.listchain()[:-1]
        self.nodeid = item.nodeid

    def listchain(self):
        return self._chain


def _blinded(item, call) -> str | None:
    """Why the first attempt of ``item`` is to run again (None: it stands)."""
    policy = getattr(item.config, "_kvchaos_policy", None)
    exps = [ex for ex in getattr(item, "_kvchaos_experiments", ()) if ex.judgement is not None]
    if call is None or not call.failed or policy is None or not exps or hasattr(call, "wasxfail"):
        return None
    why = []
    for ex in exps:
        if ex.judgement.status == "fail":
            return None  # a leak, or any FAIL: it stands
        if ex.judgement.red:
            found = policy.blinded(ex.judgement, ex.engine_errors)
            if not found:
                return None  # red for a reason no accepted engine failure explains
            why.append(f"experiment {ex.name} ({ex.id}) had no power to see a leak after {', '.join(found)} "
                       f"({', '.join(e.get('signature', '?') for e in ex.engine_errors)})")
    return "; ".join(why) or None


def _mark_rerun(item, why: str) -> None:
    """The first attempt's experiments, recorded again as run once more (the last record stands)."""
    for ex in getattr(item, "_kvchaos_experiments", ()):
        if ex.judgement is not None and ex.record:
            ex.rerun = why
            ex._record(ex.judgement)


def pytest_unconfigure(config):
    lock = getattr(config, "_kvchaos_machine_lock_cleanup", None)
    if lock is not None:
        lock.remove()


# --------------------------------------------------------------------------- KNOWN outcome
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose only departures from its required verdicts are accepted known engine findings
    (``kvchaos.experiment.KnownFinding``) is KNOWN: its own outcome (terminal ``K``, JUnit skipped
    with the finding ids as message and a ``kvchaos_known`` property), never passed. So is a test whose
    fault did not fire as often as required (``FaultDidNotFire``) only because the engine broke under
    it, when that breakage is an accepted known finding and no leak was seen."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item._kvchaos_call_failed = rep.failed  # the experiment fixture's "never judged" check needs it
    from kvchaos.experiment import KNOWN, KnownFinding

    if call.excinfo is None or rep.when == "teardown":
        return
    exc = call.excinfo.value
    from kvchaos.experiment import DryRun

    if call.excinfo.errisinstance(DryRun):  # a dry run's stop (in the test or a fixture): skipped, saying why
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {exc}")
        return
    if rep.when != "call":
        return
    if call.excinfo.errisinstance(KnownFinding):
        _known(item, rep, exc.findings, str(exc))
        return
    from faults.base import FaultDidNotFire

    if call.excinfo.errisinstance(FaultDidNotFire):
        # a fault that acted less than required is a blind run — unless the engine broke under it in a
        # way a known, accepted finding explains (then KNOWN, with both messages). Every experiment of
        # the test is judged first: a leak, or a breakage nothing explains, anywhere in it stays red
        explained, red = [], False
        for ex in getattr(item, "_kvchaos_experiments", ()):
            if not ex.verdicts:
                continue
            j = ex.engine_broke()
            if j is None:
                red = red or bool(ex.judge().red)
            elif j.status == KNOWN and not j.red:
                explained.append((ex, j))
            else:
                red = True
        if explained and not red:
            findings = sorted({i.finding.id for _ex, j in explained for i in j.known})
            why = "\n".join(f"because the engine broke during experiment {ex.name} ({ex.id}):\n{j.message()}"
                            for ex, j in explained)
            _known(item, rep, findings, f"{exc}\n{why}")


def _known(item, rep, findings, message: str) -> None:
    rep.outcome = "skipped"
    rep.wasxfail = f"KNOWN {', '.join(findings)}: {message[:1500]}"
    item.user_properties.append(("kvchaos_known", ",".join(findings)))  # JUnit reads the teardown's


def pytest_report_header(config):
    s = getattr(config, "_kvchaos_seed", None)
    if s is not None:
        return f"kvchaos seed: {s} (again: --kvchaos-seed {s})"


def pytest_report_teststatus(report, config):
    if getattr(report, "wasxfail", "").startswith("KNOWN ") and report.skipped:
        return "known", "K", ("KNOWN", {"yellow": True})
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    run_dir = getattr(config, "_kvchaos_progress", None)
    summ = getattr(config, "_kvchaos_findings", None)
    tr = terminalreporter
    if run_dir is not None and getattr(config, "_kvchaos_seed", None) is not None:
        tr.write_line(f"kvchaos seed: {config._kvchaos_seed} — replay: kvchaos replay {run_dir.run_dir}")
    if run_dir is None or not summ:
        return
    if summ["known"]:
        tr.section("kvchaos: KNOWN engine findings (accepted: not red, never PASS)", sep="-", yellow=True)
        for k in summ["known"]:
            tr.write_line(f"KNOWN {k['id']} on {k['engine']} {k['version']}: {k['title']} — {k['test']} "
                          f"[{k['oracle']} {k['status'].upper()}{'' if k['accepted'] else ', NOT accepted'}]")
    for n in summ["not_reproduced"]:
        tr.write_line(f"kvchaos: {n['message']}" + (" (--kvchaos-strict: run fails)" if summ["strict"] else ""),
                      yellow=True)


def findings_summary(run_dir: Path, registry, strict: bool) -> dict:
    """Known findings seen in this run's experiments and listed findings that did not reproduce."""
    from kvchaos.policy import not_reproduced
    from kvchaos.report.collect import experiment_records

    recs = experiment_records(run_dir)  # the last judgement of each experiment stands
    known = []
    for r in recs:
        for fid in sorted(set(r.get("known") or [])):
            f = registry.get(fid)
            vf = run_dir / r["verdicts_file"]
            items = json.loads(vf.read_text()) if vf.exists() else []
            for it in items:
                if (it.get("known") or {}).get("id") == fid:
                    known.append({"id": fid, "title": f.title, "engine": r["engine"], "version": r["version"],
                                  "test": r["test"], "experiment": r["name"], "oracle": it["oracle"],
                                  "status": it["status"], "accepted": it["known"]["accepted"],
                                  "upstream": f.upstream, "witnesses": it.get("witnesses", [])[:5],
                                  "summary": it.get("summary")})
    return {"known": known, "not_reproduced": not_reproduced(registry, recs), "strict": strict}


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


def _backends(config) -> list[str]:
    from kvchaos.cluster.spec import TRANSFER_BACKENDS

    raw = config.getoption("--kvchaos-backends")
    if not raw:
        return []
    names = list(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    bad = [n for n in names if n not in TRANSFER_BACKENDS]
    if bad or not names:
        raise pytest.UsageError(f"--kvchaos-backends {raw!r}: unknown backend(s) {bad}; one of {TRANSFER_BACKENDS}")
    return names


def _profile_path(config) -> Path:
    from kvchaos.cluster.spec import PROFILE_DIR

    prof = config.getoption("--kvchaos-profile")
    return Path(prof) if prof.endswith(".toml") else PROFILE_DIR / f"{prof}.toml"


def _layouts(config) -> tuple[list[str], bool]:
    """(layout names, named explicitly). The first is the one every test runs on; explicitly named
    layouts run every suite on each; the profile's ``[suites] layouts`` only the every_layout tests."""
    cached = getattr(config, "_kvchaos_layouts", None)
    if cached is not None:
        return cached
    import tomllib

    from kvchaos.cluster.layouts import LayoutError, parse_list

    raw = config.getoption("--kvchaos-layouts")
    explicit = bool(raw)
    if not raw:
        path = _profile_path(config)
        try:
            table = tomllib.loads(path.read_text()).get("suites", {}) if path.exists() else {}
        except tomllib.TOMLDecodeError as e:
            raise pytest.UsageError(f"profile {path}: invalid TOML: {e}") from None
        raw = ",".join(table.get("layouts", []))
        # a model of one's own, or an attached cluster, has the layout it has
        if config.getoption("--kvchaos-model") or config.getoption("--kvchaos-attach"):
            raw = ""
    elif config.getoption("--kvchaos-model") or config.getoption("--kvchaos-attach"):
        raise pytest.UsageError("--kvchaos-layouts picks each layout's probe model and launches a cluster for it: "
                                "it cannot be combined with --kvchaos-model or --kvchaos-attach")
    try:
        names = [x.name for x in parse_list(raw)] if raw else []
    except LayoutError as e:
        raise pytest.UsageError(f"--kvchaos-layouts: {e}") from None
    config._kvchaos_layouts = (names, explicit)
    return names, explicit


def pytest_generate_tests(metafunc):
    # with several backends / layouts every cluster test runs once per backend and layout (a session
    # cluster each; pytest finishes one cluster's tests and stops it before starting the next)
    names = _backends(metafunc.config)
    if len(names) > 1 and "kvchaos_backend" in metafunc.fixturenames:
        metafunc.parametrize("kvchaos_backend", names, scope="session")
    layouts, _ = _layouts(metafunc.config)
    if len(layouts) > 1 and "kvchaos_layout" in metafunc.fixturenames:
        metafunc.parametrize("kvchaos_layout", layouts, scope="session")


def _backend_of(item):
    cs = getattr(item, "callspec", None)
    return cs.params.get("kvchaos_backend") if cs else None


def _layout_of(item):
    cs = getattr(item, "callspec", None)
    return cs.params.get("kvchaos_layout") if cs else None


def _in_suites(item) -> bool:
    return "suites" in Path(str(item.fspath)).parts


def pytest_collection_modifyitems(config, items):
    names = _backends(config)
    layouts, explicit = _layouts(config)
    keep, drop = [], []
    for it in items:
        fx = getattr(it, "fixturenames", ())
        ok = True
        if names and "kvchaos_backend" in fx:
            b = _backend_of(it) or names[0]
            m = it.get_closest_marker("backends")
            allowed = set(m.args) if m else set(names) if _in_suites(it) else {names[0]}
            ok = b in allowed
        if ok and layouts and "kvchaos_layout" in fx:
            lay = _layout_of(it) or layouts[0]
            m = it.get_closest_marker("layouts")
            if m:
                allowed = set(m.args)
            elif explicit:
                allowed = set(layouts) if _in_suites(it) else {layouts[0]}
            else:
                every = it.get_closest_marker("every_layout")
                if every is None:
                    allowed = {layouts[0]}
                elif every.kwargs.get("own", True) or len(layouts) == 1:
                    allowed = set(layouts)
                else:  # CI time: on the profile's other layouts only (the own one under --kvchaos-layouts)
                    allowed = set(layouts[1:])
            ok = lay in allowed
        (keep if ok else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # tests that leave the engine busy on purpose (hung requests the router keeps retrying) run last,
    # so no other test's exact counters or pool baselines see their stray work; with several layouts
    # or backends, one cluster's tests (disruptive last) before the next cluster's
    lorder = {n: i for i, n in enumerate(layouts)}
    order = {n: i for i, n in enumerate(names)}
    items.sort(key=lambda it: (lorder.get(_layout_of(it), 0), order.get(_backend_of(it), 0),
                               it.get_closest_marker("disruptive") is not None))
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, why = cuda_available()
    if not ok:
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason=why))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvchaos_run_dir(pytestconfig) -> Path:
    d = Path(pytestconfig.getoption("--kvchaos-reports")) / pytestconfig._kvchaos_run_id
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
    layouts, _ = _layouts(pytestconfig)
    return layouts[0] if layouts else kvchaos_base_spec.layout


@pytest.fixture(scope="session")
def kvchaos_layout_spec(kvchaos_base_spec, kvchaos_layout) -> ClusterSpec:
    """The profile with this session's layout applied (what the single reference server runs)."""
    from kvchaos.cluster.layouts import LayoutError, apply, parse

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
    names = _backends(pytestconfig)
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
    from kvchaos.policy import FINDINGS_FILE, Policy, PolicyError, Registry, load_policy_table

    path = _profile_path(pytestconfig)
    try:
        table = load_policy_table(path if path.exists() else None)
        p = Policy(registry=Registry.load(pytestconfig.getoption("--kvchaos-findings") or FINDINGS_FILE),
                   accept_known=pytestconfig.getoption("--kvchaos-accept-known") or table.get("accept_known", False),
                   strict=pytestconfig.getoption("--kvchaos-strict") or table.get("strict", False),
                   blind_model=pytestconfig.getoption("--kvchaos-blind-model") or table.get("blind_model", False))
    except PolicyError as e:
        raise pytest.UsageError(str(e)) from None
    pytestconfig._kvchaos_policy = p
    return p


@pytest.fixture(scope="session")
def kvchaos_seed(pytestconfig) -> int:
    """The run's seed (``--kvchaos-seed``)."""
    return pytestconfig._kvchaos_seed


def _scope(item) -> str:
    """A test's id without its parameters' brackets: one test draws one set of seeds on every layout."""
    nid = item.nodeid
    return nid.split("[", 1)[0]


@pytest.fixture
def seeds(request, kvchaos_seed):
    """This test's seeds: ``Workload(seeds(101))`` — the workload stream 101 of this run's seed
    (:class:`kvchaos.workload.seed.Seeds`); faults armed through ``faults`` draw theirs from it."""
    from kvchaos.workload.seed import Seeds

    s = getattr(request.node, "_kvchaos_seeds", None)
    if s is None:
        s = request.node._kvchaos_seeds = Seeds(kvchaos_seed, _scope(request.node))
    return s


@pytest.fixture
def experiment(request, kvchaos_run_dir, kvchaos_policy, seeds):
    """Factory for :class:`kvchaos.experiment.Experiment` bound to this test (its id, the session's
    run directory and policy; ``cluster`` and ``faults`` from their fixtures unless given). Every
    experiment a test runs must be judged (``ex.require(...)`` or ``ex.judge(...)``)."""
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
        if request.config.getoption("--kvchaos-shrink") == name:
            kw["shrink"] = {"budget_s": request.config.getoption("--kvchaos-shrink-budget-s"),
                            "max_steps": request.config.getoption("--kvchaos-shrink-steps"),
                            "checker": request.config.getoption("--kvchaos-shrink-checker")}
        kw.setdefault("policy", kvchaos_policy)  # a cluster of its own brings its own self-test's policy
        kw.setdefault("attempt", getattr(request.node, "_kvchaos_attempt", 1))
        ex = Experiment(name, plans, checks, run_dir=kvchaos_run_dir, test_id=request.node.nodeid, **kw)
        made.append(ex)
        return ex

    request.node._kvchaos_experiments = made  # the KNOWN outcome hook asks them why a fault did not fire

    yield make
    unjudged = [ex for ex in made if ex.verdicts and not ex.judged]
    if unjudged and not getattr(request.node, "_kvchaos_call_failed", False):  # a failed test is red already
        raise RuntimeError("kvchaos: experiment(s) run but never judged (call ex.require(...)): "
                           + "; ".join(f"{ex.name}: {ex.judgement.status}" for ex in unjudged))


@pytest.fixture(scope="session")
def cluster(pytestconfig, kvchaos_base_spec, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper, kvchaos_policy):
    attach = pytestconfig.getoption("--kvchaos-attach")
    if pytestconfig.getoption("--kvchaos-dry"):
        from kvchaos.cluster.dry import DryCluster

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
        c.leak_sensitive = c.selftest["status"] == "caught"
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
        from kvchaos.cluster.dry import DryCluster

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
        from faults.engine import AgentClient

        try:
            out += AgentClient.for_cluster(c).armed()
        except Exception as e:  # noqa: BLE001
            out.append(f"agent query failed: {e!r}")
    if getattr(c, "proxy", None) is not None:
        out += c.proxy.armed()
    return out


@pytest.fixture
def faults(request, cluster, kvchaos_run_dir, seeds):
    from faults import FaultKit
    from kvchaos.workload.events import EventLog

    if request.config.getoption("--kvchaos-dry"):
        from kvchaos.cluster.dry import DryFaults

        yield DryFaults()  # nothing is armed in a dry run: the experiment stops on entering
        return
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in request.node.nodeid)[-150:]
    log = EventLog(kvchaos_run_dir / "events" / f"{name}.jsonl")
    kit = FaultKit(cluster, log, seeds=seeds)
    try:
        yield kit
    finally:
        problems = []
        try:  # first: a dead transfer thread would fail the heal's serving check
            _heal_engine_failures(request, cluster)
        except Exception as e:  # noqa: BLE001 - still heal the faults, then report both
            problems.append(f"restart after a known engine failure failed: {e!r}")
        problems += kit.heal_all()
        log.close()
        if problems:
            raise RuntimeError("kvchaos: fault heal check failed: " + "; ".join(problems))
