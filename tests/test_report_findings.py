"""The report leads with the run's status and the findings (kvchaos.report): overall FAIL / UNKNOWN /
KNOWN-only / PASS / no chaos verdict from the policy's status of each experiment; every leak of an
experiment that was not planted, every known finding with its witness, what did not reproduce; the
planted-leak self-test once, labelled; only tests that ran an experiment in the tests table, the
harness's own tests in one line; experiments linked to their tests by id, never by wall clock.

Run directories are written with the real driver against tests/fake_engine.py, judged by the real
policy (a test findings registry where a known finding is needed) and recorded by the experiment
runner's own record writer; findings.json by the pytest plugin's own summary function."""

import json
import re
import time
from pathlib import Path

import pytest

from kvchaos import oracles
from kvchaos.policy import Policy, Registry
from kvchaos.plugin.known import findings_summary
from kvchaos.report import build
from kvchaos.report.collect import SELFTEST_TEST
from kvchaos.workload import Workload, run_plans
from tests.fake_engine import FakeEngine
from tests.test_report import N_REQUESTS, make_run, write_experiment

HANG_TEST = "suites/test_known.py::test_hang_is_known"
REGISTRY = Registry.from_dict({"finding": [{
    "id": "test-hang", "title": "every request of the hang experiment times out", "engine": "sglang",
    "versions": ["0.5.23"], "upstream": ["https://github.com/sgl-project/sglang/issues/1"],
    "tests": ["suites/test_known.py::test_hang*"],
    "match": [{"checker": "liveness", "statuses": ["fail"], "signature": {"witnesses_are_timeouts": True}}]}]})


def known_run(run_dir: Path, accepted: bool = True, test_outcome: str | None = "known", hang: bool = True):
    """An experiment whose liveness FAIL (every request times out) matches the test registry's known
    finding; ``hang=False``: the same test where the finding does not show."""
    wl = Workload(seed=9, n_tenants=2, prefix="hang-")
    plans = [wl.request(wl.tenants[i % 2], n_tokens=50) for i in range(3)]

    def fill(log):
        with FakeEngine("hang" if hang else "echo") as eng:
            run_plans(eng.url, plans, log, concurrency=3, timeout_s=1)
        log.emit("probe", phase="after", role="router", ok=True, detail="HTTP 200")

    ex = write_experiment(run_dir, "hang", plans, fill, lambda rec: [oracles.liveness(rec, bound_s=5)],
                          test=HANG_TEST, policy=Policy(registry=REGISTRY, accept_known=accepted),
                          required={"liveness": "pass"})
    if test_outcome:
        with open(run_dir / "progress.jsonl", "a") as f:
            msg = f"KNOWN test-hang: experiment hang: {ex.judgement.status}" if test_outcome == "known" else ""
            f.write(json.dumps({"ev": "end", "nodeid": HANG_TEST, "outcome": test_outcome, "message": msg,
                                "duration": 1}) + "\n")
    return ex


def selftest_run(run_dir: Path, caught: bool = True):
    """The session's planted-leak self-test as kvchaos.selftest leaves it: selftest.events.jsonl,
    selftest.verdicts.json, a planted record in experiments.jsonl — and selftest.json."""
    run = make_run(run_dir, leak=caught, name="selftest", test=SELFTEST_TEST, path=run_dir / "selftest.events.jsonl",
                   planted="two leaks planted by faults.request.plant_leak", required={"isolation": "fail"})
    by = {v.oracle: v for v in run["verdicts"]}
    (run_dir / "selftest.json").write_text(json.dumps({
        "isolation": by["isolation"].to_dict(), "sensitivity": by["sensitivity"].to_dict(), "faults": [],
        "status": "caught" if caught else "missed", "experiment": run["experiment"].id}, default=str))
    return run


def junit(run_dir: Path, n_harness: int, extra: str = "") -> None:
    cases = "".join(f'<testcase classname="tests.test_h{i % 7}" name="test_{i}" time="0.01"/>' for i in range(n_harness))
    (run_dir / "junit.xml").write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                                       f"{cases}{extra}</testsuite></testsuites>")


def sections(page: str) -> list[str]:
    """The page's leading elements in the order they appear."""
    keys = ['id="verdict"', 'id="reason"', 'id="leaks"', 'id="known"', 'id="not-reproduced"', 'class="scenario"',
            'id="tests"', 'id="harness-tests"']
    return [k for k in sorted(keys, key=lambda k: page.find(k)) if k in page]


def test_leak_and_known_finding_lead_the_report_and_harness_tests_are_one_line(tmp_path):
    selftest_run(tmp_path)
    leak = make_run(tmp_path, leak=True, name="transfer_delay", test="suites/test_transfer_delay.py::test_delay")
    known_run(tmp_path, test_outcome=None)
    junit(tmp_path, 50,
          '<testcase classname="suites.test_transfer_delay" name="test_delay" time="3">'
          '<failure message="VerdictsNotMet: isolation FAIL">isolation FAIL</failure></testcase>'
          '<testcase classname="suites.test_known" name="test_hang_is_known" time="2">'
          '<skipped type="pytest.xfail" message="KNOWN test-hang: experiment hang: KNOWN"/></testcase>')
    summ = findings_summary(tmp_path, REGISTRY, strict=False)
    (tmp_path / "findings.json").write_text(json.dumps(summ, default=str))
    r = build(tmp_path)
    v = json.loads(r["verdicts"].read_text())
    assert r["overall"] == "fail" and v["chaos"] == "fail"
    assert "transfer_delay: isolation FAIL" in v["reason"]
    # the self-test once, planted, caught; the others by id with their tests
    scs = {s["name"]: s for s in v["scenarios"]}
    assert sorted(scs) == ["hang", "selftest", "transfer_delay"]
    assert scs["selftest"]["planted"] and scs["selftest"]["caught"] and scs["selftest"]["status"] == "pass"
    assert scs["transfer_delay"]["test_outcome"] == "failed" and scs["hang"]["test_outcome"] == "known"
    assert scs["hang"]["status"] == "known" and scs["hang"]["known"] == ["test-hang"]
    # leaks: the victims of transfer_delay, none of the planted self-test
    victims = {p.rid for p in leak["plans"] if p is not leak["donor"]}
    assert {x["witness"]["victim_rid"] for x in v["leaks"]} == victims
    assert {x["experiment"] for x in v["leaks"]} == {"transfer_delay"}
    (k,) = v["known"]
    assert k["id"] == "test-hang" and k["accepted"] and k["test"] == HANG_TEST and k["version"] == "0.5.23"
    assert {w["outcome"] for w in k["witnesses"]} == {"timeout"} and len(k["witnesses"]) == 3
    assert v["by_oracle"]["isolation"] == {"pass": 0, "fail": 1, "unknown": 0}   # planted FAILs not counted
    assert v["tests"]["harness"] == {"passed": 50} and v["tests"]["chaos"] == {"failed": 1, "known": 1}
    page = r["html"].read_text()
    assert sections(page) == ['id="verdict"', 'id="reason"', 'id="leaks"', 'id="known"', 'class="scenario"',
                              'id="tests"', 'id="harness-tests"']
    leaks_html = page[page.index('id="leaks"'):page.index('id="known"')]
    assert leaks_html.count('<div class="witness leak"') == len(victims)
    assert all(f'data-victim="{rid}"' in leaks_html for rid in victims)
    known_html = page[page.index('id="known"'):page.index('class="scenario"')]
    assert 'data-finding="test-hang" data-accepted="1"' in known_html
    assert 'href="https://github.com/sgl-project/sglang/issues/1"' in known_html
    assert HANG_TEST in known_html and "0.5.23" in known_html and "timeout" in known_html
    tests_table = re.search(r'<table id="tests">(.*?)</table>', page).group(1)
    assert tests_table.count("<tr") == 3                                   # header + the two chaos tests
    assert 'class="badge known">KNOWN</span>' in tests_table
    assert "harness tests:</b> 50 passed, 0 failed" in page and "tests.test_h" not in page
    assert page.count('class="planted-label">planted — caught as required<') == 1
    assert page.count('class="witness planted-leak"') > 0


def test_known_only_run_is_known_never_pass(tmp_path):
    selftest_run(tmp_path)
    known_run(tmp_path)
    r = build(tmp_path)
    assert r["overall"] == "known" and r["label"] == "KNOWN-only"
    page = r["html"].read_text()
    assert 'data-overall="known"' in page and 'class="badge known big">KNOWN-only</span>' in page
    assert '<section id="leaks" data-count="0">' in page and 'data-finding="test-hang"' in page
    assert "PASS</span>" not in page.split('id="reason"')[0]
    assert any("KNOWN test-hang" in line for line in r["lines"])


def test_known_finding_not_accepted_is_red(tmp_path):
    known_run(tmp_path, accepted=False, test_outcome="failed")
    r = build(tmp_path)
    assert r["overall"] == "fail" and r["chaos"] == "fail"
    assert 'data-accepted="0"' in r["html"].read_text()


def test_planted_selftest_fail_and_clean_experiment_pass(tmp_path):
    selftest_run(tmp_path)
    make_run(tmp_path, leak=False, name="clean_control", test="suites/test_clean_control.py::test_clean",
             test_outcome="passed")
    r = build(tmp_path)
    assert r["overall"] == "pass", r["reason"]
    page = r["html"].read_text()
    assert 'class="witness leak"' not in page and '<section id="leaks" data-count="0">' in page
    assert page.count('data-planted="1"') == 1 and "planted — caught as required" in page
    assert len(r["model"].scenarios) == 2                  # selftest.json + selftest.verdicts.json: shown once


def test_planted_selftest_that_missed_makes_the_run_unknown(tmp_path):
    selftest_run(tmp_path, caught=False)                 # required isolation FAIL; nothing leaked
    make_run(tmp_path, leak=False, name="clean_control")
    r = build(tmp_path)
    assert r["overall"] == "unknown" and "selftest: planted bug MISSED" in r["reason"]
    assert "planted — MISSED" in r["html"].read_text()


def test_no_experiment_is_no_chaos_verdict(tmp_path):
    junit(tmp_path, 12)
    r = build(tmp_path)
    assert r["overall"] == "none" and r["label"] == "NO CHAOS VERDICT"
    page = r["html"].read_text()
    assert "NO CHAOS VERDICT" in page and "PASS" not in page and 'id="tests"' not in page
    assert "harness tests:</b> 12 passed, 0 failed" in page


def test_experiments_link_to_tests_by_id_even_when_wall_clocks_overlap(tmp_path):
    everything = (time.time() - 3600, time.time() + 3600)     # both tests' windows cover both experiments
    make_run(tmp_path, leak=False, name="a", test="suites/test_a.py::test_a", test_outcome="passed", window=everything)
    make_run(tmp_path, leak=False, name="b", test="suites/test_b.py::test_b", test_outcome="failed", window=everything)
    a, b = build(tmp_path)["model"].scenarios
    assert (a.name, a.test, a.test_outcome) == ("a", "suites/test_a.py::test_a", "passed")
    assert (b.name, b.test, b.test_outcome) == ("b", "suites/test_b.py::test_b", "failed")


def test_two_experiments_of_one_name_keep_their_own_files(tmp_path):
    """The same test once per transfer backend: neither experiment's log or verdicts overwrite the other's."""
    first = make_run(tmp_path, leak=False, name="same", test="suites/test_s.py::test_one", n=40)
    second = make_run(tmp_path, leak=True, name="same", test="suites/test_s.py::test_two", n=45)
    assert first["experiment"].path != second["experiment"].path
    one, two = build(tmp_path)["model"].scenarios
    assert (one.id, two.id) == (first["experiment"].id, second["experiment"].id)
    assert len(one.requests) == 40 and len(two.requests) == 45
    assert [e["id"] for e in one.events if e["ev"] == "experiment"] == [one.id]
    assert one.note is None and one.verdicts[0]["status"] == "pass"
    assert two.note is None and two.status == "fail"


@pytest.mark.parametrize("strict", [False, True])
def test_a_listed_finding_that_did_not_reproduce_is_reported(tmp_path, strict):
    known_run(tmp_path, hang=False, test_outcome="passed")
    (tmp_path / "findings.json").write_text(json.dumps(findings_summary(tmp_path, REGISTRY, strict=strict)))
    r = build(tmp_path)
    assert r["overall"] == ("fail" if strict else "pass")
    page = r["html"].read_text()
    assert '<section id="not-reproduced">' in page and "test-hang did not reproduce on sglang 0.5.23" in page


def test_an_accepted_known_isolation_fail_is_still_listed_as_a_leak(tmp_path):
    """A leak matching a listed finding is KNOWN (not red when accepted) — and still a leak on the page."""
    reg = Registry.from_dict({"finding": [{
        "id": "test-leak", "title": "a leak this engine version is known for", "engine": "sglang",
        "versions": ["0.5.23"], "match": [{"checker": "isolation", "statuses": ["fail"],
                                           "signature": {"owners_minted": True}}]}]})
    run = make_run(tmp_path, leak=True, policy=Policy(registry=reg, accept_known=True))
    r = build(tmp_path)
    assert r["overall"] == "known"
    v = json.loads(r["verdicts"].read_text())
    assert len(v["leaks"]) == N_REQUESTS - 1 and {x["known"] for x in v["leaks"]} == {"test-leak"}
    assert [k["id"] for k in v["known"]] == ["test-leak"]
    page = r["html"].read_text()
    leaks_html = page[page.index('id="leaks"'):page.index('id="known"')]
    assert leaks_html.count('<div class="witness leak"') == len(run["plans"]) - 1 and "KNOWN test-leak" in leaks_html


def test_only_the_planted_selftest_is_no_chaos_verdict(tmp_path):
    selftest_run(tmp_path)
    r = build(tmp_path)
    assert r["overall"] == "none" and "only planted experiments ran" in r["reason"]


def test_a_known_outcome_from_the_plugin_is_shown_as_known(tmp_path):
    """The plugin turns kvchaos.experiment.KnownFinding into its own outcome (progress "known", JUnit
    skipped with a "KNOWN ..." message); the report counts it as known, never passed or skipped."""
    import subprocess
    import sys

    from kvchaos.report.collect import junit as read_junit
    from tests.util import child_env

    suite = tmp_path / "test_inner_known.py"
    suite.write_text("from types import SimpleNamespace\n"
                     "from kvchaos.experiment import KnownFinding\n"
                     "def test_k():\n"
                     "    f = SimpleNamespace(finding=SimpleNamespace(id='test-hang'))\n"
                     "    raise KnownFinding(SimpleNamespace(known=[f]), 'liveness FAIL, known')\n"
                     "def test_ok():\n    pass\n")
    p = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-p", "no:cacheprovider", "-q", "--rootdir",
                        str(tmp_path), "--kvchaos-reports", str(tmp_path / "r")], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=child_env(KVCHAOS_RUN_ID="k"))
    d = tmp_path / "r" / "k"
    v = json.loads((d / "verdicts.json").read_text())
    assert v["tests"]["counts"] == {"known": 1, "passed": 1}, p.stdout + p.stderr
    assert {t.nodeid.split("::")[1]: t.outcome for t in read_junit(d)} == {"test_k": "known", "test_ok": "passed"}
    assert v["overall"] == "none"            # no experiment ran: no chaos verdict, and no failed test
