"""The plugin's KNOWN outcome, acceptance, strictness and judged-experiment check, end to end: a child
pytest runs experiments through the real runner and policy against tests/fake_engine.py."""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]
INNER = REPO / "tests" / "data" / "known_suite" / "test_known_inner.py"
SHORT = "sglang-short-transfer-unchecked"


def inner(tmp_path, *args, k=None):
    cmd = [sys.executable, "-m", "pytest", str(INNER), "-p", "no:cacheprovider", "-o", "testpaths=", "-q",
           "--kvchaos-reports", str(tmp_path / "reports"), *args] + (["-k", k] if k else [])
    r = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    (run_dir,) = (tmp_path / "reports").iterdir()
    return r, run_dir


def test_accepted_known_finding_is_its_own_outcome_never_passed(tmp_path):
    r, run_dir = inner(tmp_path, "--kvchaos-accept-known", k="shorted or clean")
    assert r.returncode == 0, r.stdout[-3000:]
    assert re.search(r"1 passed, .*1 known", r.stdout), r.stdout[-1500:]
    assert f"KNOWN {SHORT}" in r.stdout  # the terminal lists it with its id
    case = next(c for c in ET.parse(run_dir / "junit.xml").iter("testcase") if c.get("name") == "test_shorted_leak")
    sk = case.find("skipped")
    assert sk is not None and sk.get("message").startswith(f"KNOWN {SHORT}")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props.get("kvchaos_known") == SHORT
    ends = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines() if '"end"' in x]
    assert {e["nodeid"].split("::")[1]: e["outcome"] for e in ends if e["ev"] == "end"} == \
        {"test_shorted_leak": "known", "test_clean": "passed"}
    summ = json.loads((run_dir / "findings.json").read_text())
    assert [k["id"] for k in summ["known"]] == [SHORT] and summ["known"][0]["accepted"] is True


def test_known_finding_not_accepted_is_red(tmp_path):
    r, _ = inner(tmp_path, "--kvchaos-profile", "gpu", k="shorted")  # the gpu profile accepts nothing
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-1500:]
    assert "not accepted" in r.stdout


def test_a_leak_no_finding_explains_is_red_whatever_is_accepted(tmp_path):
    r, _ = inner(tmp_path, "--kvchaos-accept-known", k="unexplained")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-1500:]
    assert "isolation: FAIL (required PASS)" in r.stdout


def test_an_experiment_never_judged_errors(tmp_path):
    r, _ = inner(tmp_path, k="never_judged")
    assert r.returncode == 1 and "never judged" in r.stdout, r.stdout[-1500:]


def test_finding_that_did_not_reproduce_is_reported_and_fails_under_strict(tmp_path):
    reg = tmp_path / "findings.toml"
    reg.write_text((REPO / "kvchaos" / "findings.toml").read_text().replace(
        'tests = ["suites/test_transfer_delay.py::test_short_transfer_is_not_served_as_a_clean_reply*"]',
        'tests = ["*test_known_inner.py::test_clean"]'))
    r, run_dir = inner(tmp_path, "--kvchaos-findings", str(reg), k="clean")
    assert r.returncode == 0 and "did not reproduce on sglang 0.5.23" in r.stdout, r.stdout[-1500:]
    r, _ = inner(tmp_path / "strict", "--kvchaos-findings", str(reg), "--kvchaos-strict", k="clean")
    assert r.returncode == 1 and "did not reproduce" in r.stdout, r.stdout[-1500:]


def test_a_fault_starved_by_a_known_engine_failure_is_known_not_blind(tmp_path):
    """A fault that acted fewer times than required is a failure (a blind run) — except when the engine
    broke under it in a way an accepted finding explains: then KNOWN with that finding, both messages."""
    r, run_dir = inner(tmp_path, "--kvchaos-accept-known", k="starved_by_broken")
    assert r.returncode == 0 and re.search(r"\b1 known\b", r.stdout), r.stdout[-2000:]
    case = next(c for c in ET.parse(run_dir / "junit.xml").iter("testcase"))
    msg = case.find("skipped").get("message")
    assert msg.startswith("KNOWN sglang-mooncake-transfer-worker-dies"), msg
    assert "expected >= 8" in msg and "because the engine broke" in msg


def test_a_fault_starved_on_a_healthy_engine_fails(tmp_path):
    r, _ = inner(tmp_path, "--kvchaos-accept-known", k="starved_healthy")
    assert r.returncode == 1 and "1 failed" in r.stdout and "FaultDidNotFire" in r.stdout, r.stdout[-1500:]


def test_a_leak_beside_a_broken_engine_stays_red(tmp_path):
    r, _ = inner(tmp_path, "--kvchaos-accept-known", k="broken_engine_leak and not elsewhere")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-1500:]
    r, _ = inner(tmp_path / "2", "--kvchaos-accept-known", k="broken_engine_leak_elsewhere")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-1500:]


def test_a_broken_engine_whose_finding_is_not_accepted_stays_red(tmp_path):
    r, _ = inner(tmp_path, "--kvchaos-profile", "gpu", k="starved_by_broken")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-1500:]


def test_a_run_blinded_by_an_accepted_engine_failure_runs_once_more(tmp_path):
    """Mooncake's transfer thread dying (an accepted finding) left the first attempt without power:
    the test runs again on the restarted engine, both attempts are recorded, the second stands. Blinded
    twice is red; blind without an engine failure, or a leak beside one, is red at once."""
    r, run_dir = inner(tmp_path, "--kvchaos-accept-known",
                       k="blinded_once or blinded_twice or blind_without or leak_with_engine")
    ends = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines() if '"end"' in x]
    got = [(e["nodeid"].split("::")[1], e["outcome"]) for e in ends if e["ev"] == "end"]
    assert got == [("test_blinded_once", "rerun"), ("test_blinded_once", "passed"),
                   ("test_blinded_twice", "rerun"), ("test_blinded_twice", "failed"),
                   ("test_blind_without_engine_failure", "failed"),
                   ("test_leak_with_engine_failure", "failed")], got
    assert r.returncode == 1 and "3 failed, 1 passed" in r.stdout and "2 rerun" in r.stdout, r.stdout[-1500:]
    recs = [json.loads(x) for x in (run_dir / "experiments.jsonl").read_text().splitlines()]
    last = {}
    for rec in recs:
        last[rec["id"]] = rec
    once = [x for x in last.values() if x["name"].startswith("blinded")]
    assert sorted((x["attempt"], bool(x["rerun"]), x["status"]) for x in once) == [(1, True, "unknown"),
                                                                                    (2, False, "pass")]
    assert "mooncake" in next(x for x in once if x["rerun"])["rerun"]
    from kvchaos.report.collect import collect, run_status

    m = collect(run_dir)
    blinded = [s for s in m.scenarios if s.name.startswith("blinded")]
    assert {s.run_status for s in blinded} == {None, "pass"}  # the second attempt stands for the first
    assert run_status(m)["overall"] == "fail"  # the other tests are red
