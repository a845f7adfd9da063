"""The KNOWN outcome, the findings summary, and the rerun rule.

A test whose only departures from its required verdicts are accepted known engine findings is KNOWN
(terminal ``K``, JUnit skipped with the finding ids, progress ``known``), never passed; a test whose
first attempt was blinded by an accepted engine failure runs once more (its first report ``rerun``,
terminal ``R``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults.base import FaultDidNotFire
from kvchaos.plugin import xdist
from kvchaos.policy import not_reproduced

POLICY = pytest.StashKey[object]()     # config: the session's kvchaos.policy.Policy (the kvchaos_policy fixture)
FINDINGS = pytest.StashKey[dict]()     # config: findings_summary() of this run, once written
EXPERIMENTS = pytest.StashKey[list]()  # item: the experiments the experiment fixture made for it
ATTEMPT = pytest.StashKey[int]()       # item: 1, or 2 when it runs again (rerun rule)
CALL_FAILED = pytest.StashKey[bool]()  # item: its call phase failed (the "never judged" check needs it)


# --------------------------------------------------------------------------- rerun rule
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
    with xdist.holding(item):
        return _protocol(item, nextitem)


def _protocol(item, nextitem) -> bool:
    from _pytest.runner import call_and_report, runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    item.stash[ATTEMPT] = 1
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
        item.stash[ATTEMPT] = 2
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
    policy = item.config.stash.get(POLICY, None)
    exps = [ex for ex in item.stash.get(EXPERIMENTS, ()) if ex.judgement is not None]
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
    for ex in item.stash.get(EXPERIMENTS, ()):
        if ex.judgement is not None and ex.record:
            ex.rerun = why
            ex._record(ex.judgement)


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
        item.stash[CALL_FAILED] = rep.failed  # the experiment fixture's "never judged" check needs it
    from kvchaos.experiment import DryRun, KnownFinding  # not at plugin load: the plugin loads in every run

    if call.excinfo is None or rep.when == "teardown":
        return
    exc = call.excinfo.value
    if call.excinfo.errisinstance(DryRun):  # a dry run's stop (in the test or a fixture): skipped, saying why
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {exc}")
        return
    if rep.when != "call":
        return
    if call.excinfo.errisinstance(KnownFinding):
        _known(item, rep, exc.findings, str(exc))
        return

    if call.excinfo.errisinstance(FaultDidNotFire):
        _starved_by_known_breakage(item, rep, exc)


def _starved_by_known_breakage(item, rep, exc) -> None:
    """A fault that acted less than required is a blind run — unless the engine broke under it in a
    way a known, accepted finding explains (then KNOWN, with both messages). Every experiment of the
    test is judged first: a leak, or a breakage nothing explains, anywhere in it stays red."""
    from kvchaos.experiment import KNOWN  # on use: the runner is heavy (see fixtures.experiment)

    explained, red = [], False
    for ex in item.stash.get(EXPERIMENTS, ()):
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


def pytest_report_teststatus(report, config):
    if getattr(report, "wasxfail", "").startswith("KNOWN ") and report.skipped:
        return "known", "K", ("KNOWN", {"yellow": True})
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


# --------------------------------------------------------------------------- findings summary
def findings_summary(run_dir: Path, registry, strict: bool) -> dict:
    """Known findings seen in this run's experiments and listed findings that did not reproduce."""
    from kvchaos.report.collect import experiment_records  # on use: only a session's end reads the records

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


def write_findings(session, run_dir: Path, exitstatus):
    """``findings.json`` of a session that used the policy; returns the session's exit status (under
    ``--kvchaos-strict`` a listed finding that did not reproduce fails a green run)."""
    policy = session.config.stash.get(POLICY, None)
    if policy is None:
        return exitstatus
    try:
        summ = findings_summary(run_dir, policy.registry, policy.strict)
        session.config.stash[FINDINGS] = summ
        (run_dir / "findings.json").write_text(json.dumps(summ, indent=2, default=str))
        if policy.strict and summ["not_reproduced"] and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            exitstatus = session.exitstatus
    except Exception as e:  # noqa: BLE001 - say it; a missing summary must not read as green
        (run_dir / "findings-error.txt").write_text(repr(e))
        session.exitstatus = exitstatus = pytest.ExitCode.INTERNAL_ERROR
    return exitstatus


def findings_lines(tr, config) -> None:
    """The terminal's KNOWN findings section and each listed finding that did not reproduce."""
    summ = config.stash.get(FINDINGS, None)
    if not summ:
        return
    if summ["known"]:
        tr.section("kvchaos: KNOWN engine findings (accepted: not red, never PASS)", sep="-", yellow=True)
        for k in summ["known"]:
            tr.write_line(f"KNOWN {k['id']} on {k['engine']} {k['version']}: {k['title']} — {k['test']} "
                          f"[{k['oracle']} {k['status'].upper()}{'' if k['accepted'] else ', NOT accepted'}]")
    for n in summ["not_reproduced"]:
        tr.write_line(f"kvchaos: {n['message']}" + (" (--kvchaos-strict: run fails)" if summ["strict"] else ""),
                      yellow=True)
