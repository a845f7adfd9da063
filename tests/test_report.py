"""kvchaos.report on run directories made by the real driver against tests/fake_engine.py (loopback):
a planted leak must come out as a FAIL naming victim and owner with the leaked text highlighted; a
clean run must show no leak; the committed incident report must rebuild; bad input gets an error
naming the file. The HTML is opened in a browser by tests/test_report_html.py."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchaos import canary, oracles
from kvchaos.report import ReportError, build, collect
from kvchaos.report.html import highlight
from kvchaos.workload import EventLog, Workload, run_plans
from tests.fake_engine import FakeEngine
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]


def make_run(run_dir: Path, leak: bool, test_outcome: str | None = None) -> dict:
    """A run directory as run_judged leaves it: suites/<name>.events.jsonl + .verdicts.json, with a
    fault window; with ``leak`` the engine appends another tenant's canary to every reply."""
    wl = Workload(seed=7, n_tenants=3, prefix="rep-")
    plans = [wl.request(wl.tenants[i % 3], n_tokens=120 + 10 * i) for i in range(6)]
    donor = plans[0]
    leak_text = canary.payload(donor.canaries[0]) + "][" if leak else ""
    name = "leaky" if leak else "clean"
    t_start = time.time()
    with FakeEngine("echo", leak_text=leak_text) as eng, EventLog(run_dir / "suites" / f"{name}.events.jsonl") as log:
        log.emit("fault", action="armed", fault="delay-abc123", kind="delay", role="prefill", injector="agent")
        run_plans(eng.url, plans, log, concurrency=3, timeout_s=10)
        log.emit("fault", action="fired", fault="delay-abc123", kind="delay", role="prefill", injector="agent")
        log.emit("fault", action="healed", fault="delay-abc123", kind="delay", role="prefill", injector="agent")
    verdicts = [oracles.isolation(log.records), oracles.sensitivity(log.records)]
    (run_dir / "suites" / f"{name}.verdicts.json").write_text(json.dumps([v.to_dict() for v in verdicts], default=str))
    if test_outcome:
        with open(run_dir / "progress.jsonl", "a") as f:
            f.write(json.dumps({"ev": "end", "nodeid": f"suites/test_x.py::test_{name}", "outcome": test_outcome,
                                "wall_start": t_start - 0.5, "wall_end": time.time() + 0.5, "duration": 1}) + "\n")
    return {"plans": plans, "donor": donor, "verdicts": verdicts, "name": name}


def test_planted_leak_is_a_fail_naming_victim_and_owner_with_the_leaked_text_marked(tmp_path):
    run = make_run(tmp_path, leak=True)
    r = build(tmp_path)
    assert r["overall"] == "fail"
    v = json.loads((tmp_path / "verdicts.json").read_text())
    (scn,) = v["scenarios"]
    assert scn["status"] == "fail" and scn["name"] == "leaky"
    iso = next(x for x in scn["verdicts"] if x["oracle"] == "isolation")
    victims = {w["victim_rid"] for w in iso["witnesses"]}
    donor = run["donor"]
    assert victims == {p.rid for p in run["plans"] if p is not donor}      # every other request got it
    assert {w["owner_rid"] for w in iso["witnesses"]} == {donor.rid}
    for rid, req in scn["requests"].items():                                 # per request: who flagged it
        assert ("isolation" in req["flagged_by"]) == (rid in victims), rid
        assert req["status"] == 200 and req["outcome"] == "ok"
    assert [f["kind"] for f in scn["faults"]] == ["delay"] and len(scn["faults"][0]["fired"]) == 1
    page = r["html"].read_text()
    leaked = canary.payload(donor.canaries[0])
    marks = re.findall(r'<mark class="leak" title="([^"]*)">([^<]*)</mark>', page)
    assert len(marks) == len(victims) and all(text == leaked for _, text in marks)
    assert all(donor.rid in title for title, _ in marks)
    assert page.count('<div class="witness leak"') == len(victims)


def test_clean_run_has_no_leak_and_passes(tmp_path):
    make_run(tmp_path, leak=False)
    r = build(tmp_path)
    assert r["overall"] == "pass"
    page = r["html"].read_text()
    assert 'class="leak"' not in page and "<h3>Leaks</h3>" not in page
    assert "<mark" not in page                      # replies are shown (and marked) only for witnesses
    assert len(set(re.findall(r'id="(req-rep-[^"]+)"', page))) == 6   # one timeline bar per request
    v = json.loads((tmp_path / "verdicts.json").read_text())
    assert all(not q["flagged_by"] for q in v["scenarios"][0]["requests"].values())


def test_scenario_is_linked_to_its_test_and_a_required_fail_does_not_redden_the_run(tmp_path):
    make_run(tmp_path, leak=True, test_outcome="passed")      # a detection test that asserted the FAIL
    r = build(tmp_path)
    (s,) = r["model"].scenarios
    assert s.test == "suites/test_x.py::test_leaky" and s.test_outcome == "passed"
    assert r["overall"] == "pass" and "detection the test required" in s.context
    (tmp_path / "progress.jsonl").unlink()
    make_run(tmp_path, leak=False, test_outcome="failed")
    assert build(tmp_path)["overall"] == "fail"


def test_committed_incident_report_rebuilds_with_the_victims_named(tmp_path):
    d = tmp_path / "glm53-replay"
    shutil.copytree(REPO / "reports" / "incidents" / "glm53-replay", d)
    for f in ("report.html", "run-verdicts.json"):
        (d / f).unlink(missing_ok=True)
    before = (d / "verdicts.json").read_text()
    r = build(d)
    assert (d / "verdicts.json").read_text() == before           # the scenario's own verdicts are kept
    assert r["verdicts"].name == "run-verdicts.json" and r["overall"] == "fail"
    (s,) = r["model"].scenarios
    iso = next(v for v in s.verdicts if v["oracle"] == "isolation")
    assert {w["victim_tenant"] for w in iso["witnesses"]} == {"t015"}
    assert all(w["owner_tenant"] != "t015" and w["status"] == 200 for w in iso["witnesses"])
    assert [w.kind for w in s.faults] == ["reject_admitted"]
    assert r["html"].read_text().count('<div class="witness leak"') == 4
    p = tmp_path / "glm53-prefix"
    shutil.copytree(REPO / "reports" / "incidents" / "glm53-prefix", p)
    audit = json.loads((p / "audit.json").read_text())
    page = build(p)["html"].read_text()                      # the audit of that deployment is shown too
    fails = sum(c["status"] == "fail" for c in audit["checks"])
    assert 'table class="audit"' in page and fails >= 7
    assert page.count('class="badge fail">FAIL</span></td><td><code>') == fails


def test_highlight_escapes_html_and_finds_moved_offsets():
    text = "<script>alert(1)</script> ABCDEFGHIJ ok KLMNOPQRST"
    out = highlight(text, [(0, 10, "r9 (t1)", "ABCDEFGHIJ")], ["KLMNOPQRST"])  # offsets wrong: located by search
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert '<mark class="leak" title="r9 (t1)">ABCDEFGHIJ</mark>' in out
    assert '<mark class="own" title="own canary">KLMNOPQRST</mark>' in out


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        collect(tmp_path / "nope")
    with pytest.raises(ReportError, match="nothing to report"):
        collect(tmp_path)
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "x.verdicts.json").write_text("{not json")
    with pytest.raises(ReportError, match=r"x\.verdicts\.json: not valid JSON"):
        collect(tmp_path)
    (tmp_path / "suites" / "x.verdicts.json").write_text('[{"no": "oracle"}]')
    with pytest.raises(ReportError, match="expected a list of verdicts"):
        collect(tmp_path)


def test_every_pytest_session_leaves_junit_progress_and_report(tmp_path):
    suite = tmp_path / "test_inner.py"
    suite.write_text("import pytest\n"
                     "def test_ok():\n    pass\n"
                     "@pytest.mark.xfail(reason='known engine finding', strict=True)\n"
                     "def test_known():\n    assert False\n"
                     "def test_bad():\n    assert 1 == 2\n")
    reports = tmp_path / "reports"
    p = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-p", "no:cacheprovider", "-q",
                        "--rootdir", str(tmp_path), "--kvchaos-reports", str(reports)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=child_env(KVCHAOS_RUN_ID="inner-run"))
    assert p.returncode == 1, p.stdout + p.stderr
    d = reports / "inner-run"
    assert {"junit.xml", "progress.jsonl", "report.html", "verdicts.json"} <= {x.name for x in d.iterdir()}
    assert "kvchaos report: " in p.stdout and "(FAIL)" in p.stdout
    v = json.loads((d / "verdicts.json").read_text())
    assert v["overall"] == "fail"
    assert v["tests"]["counts"] == {"passed": 1, "xfailed": 1, "failed": 1}
    bad = next(c for c in v["tests"]["cases"] if c["outcome"] == "failed")
    assert bad["nodeid"].endswith("::test_bad") and "assert 1 == 2" in bad["message"]


def test_process_faults_without_ids_become_one_window_per_kill_and_restart():
    from kvchaos.report.collect import fault_windows

    ev = [{"ev": "fault", "injector": "process", "action": "fired", "kind": "sigkill", "role": "decode", "wall": 10.0},
          {"ev": "fault", "injector": "process", "action": "healed", "kind": "restart", "role": "decode", "wall": 40.0},
          {"ev": "fault", "injector": "process", "action": "fired", "kind": "sigstop", "role": "decode", "wall": 100.0},
          {"ev": "fault", "injector": "process", "action": "healed", "kind": "sigcont", "role": "decode", "wall": 104.0},
          {"ev": "fault", "action": "armed", "fault": "delay-1", "kind": "delay", "role": "prefill", "wall": 50.0},
          {"ev": "fault", "action": "healed", "fault": "delay-1", "kind": "delay", "role": "prefill", "wall": 60.0}]
    w = sorted(((x.kind, x.start, x.end) for x in fault_windows(ev)), key=lambda t: t[1])
    assert w == [("sigkill", 10.0, 40.0), ("delay", 50.0, 60.0), ("sigstop", 100.0, 104.0)]


def test_engine_failures_of_the_run_are_shown(tmp_path):
    make_run(tmp_path, leak=False)
    tb = "KeyError: 42\nRuntimeError: Transfer thread failed because of 42. Prefill instance with bootstrap_port=1 is dead."
    (tmp_path / "engine_errors.jsonl").write_text(json.dumps(
        {"role": "prefill", "signature": "mooncake_transfer_worker_died", "traceback": tb,
         "test": "suites/test_clean_control.py::test_clean_control_has_no_foreign_canary",
         "healed": {"role": "prefill", "rejoined_s": 21.5}}) + "\n")
    page = build(tmp_path)["html"].read_text()
    assert page.count('class="witness other engine-error"') == 1
    assert "mooncake_transfer_worker_died" in page and "KeyError: 42" in page and "21.5" in page


def test_witness_without_its_request_record_marks_the_excerpt(tmp_path):
    (tmp_path / "x").mkdir()
    w = {"victim_rid": "v1", "victim_tenant": "t1", "owner_rid": "o1", "owner_tenant": "t2", "canary": "[ABCDEFGHIJ]",
         "matched": "ABCDEFGHIJ", "match": "exact", "offsets": [1, 11], "status": 200, "excerpt": "[ABCDEFGHIJ]["}
    (tmp_path / "x" / "s.verdicts.json").write_text(json.dumps([{"oracle": "isolation", "status": "fail",
                                                                 "summary": "LEAK", "witnesses": [w]}]))
    page = build(tmp_path)["html"].read_text()                # no s.events.jsonl beside it
    assert '<mark class="leak" title="o1 (t2)">ABCDEFGHIJ</mark>' in page
