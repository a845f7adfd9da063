"""kvchaos.report on run directories made by the real driver against tests/fake_engine.py (loopback),
judged by the real verdict policy and recorded by the real experiment runner's record writer
(``experiments.jsonl`` + the verdicts file + the event log opening with its header): a leak must come
out as a FAIL naming victim and owner with the leaked text highlighted; a clean run must show no
leak; the committed incident reports (an older layout) must rebuild; bad input gets an error naming
the file. The run's status and the findings sections are tested in tests/test_report_findings.py;
the HTML is opened in a browser by tests/test_report_html.py."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchaos import canary, oracles
from kvchaos.experiment import Experiment
from kvchaos.policy import Policy
from kvchaos.report import ReportError, build, collect
from kvchaos.report.html import highlight
from kvchaos.workload import EventLog, Workload, run_plans
from tests.fake_engine import FakeEngine
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]
ENGINE = {"name": "sglang", "version": "0.5.23", "roles": {"prefill": "0.5.23", "decode": "0.5.23"}}
N_REQUESTS = 40  # enough echoing replies for the sensitivity floor: isolation may PASS


def write_experiment(run_dir: Path, name: str, plans, log_fill, verdicts_of, *, test: str | None = None,
                     planted: str | None = None, required: dict | None = None, policy: Policy | None = None,
                     path: Path | None = None, engine: dict = ENGINE) -> Experiment:
    """One experiment as kvchaos.experiment leaves it: the event log opens with the ``experiment``
    header, ``log_fill(log)`` writes the method's events, ``verdicts_of(records)`` checks them, and the
    real policy's judgement is recorded (verdicts file + a line in experiments.jsonl)."""
    ex = Experiment(name, plans, [oracles.Isolation(), oracles.Sensitivity()], cluster=None, run_dir=run_dir,
                    test_id=test, policy=policy or Policy(), path=path)
    ex.log = EventLog(ex.path)
    ex.log.emit("experiment", id=ex.id, name=name, test=test, seed=7, n=len(plans), engine=engine,
                layout={"spec": {"name": "fake"}}, checkers=["Isolation()", "Sensitivity()"])
    try:
        log_fill(ex.log)
    finally:
        ex.log.close()
    ex.verdicts = verdicts_of(ex.log.records)
    ex.judge(planted=planted, **(required or {}))
    return ex


def make_run(run_dir: Path, leak: bool, test_outcome: str | None = None, *, name: str | None = None,
             test: str | None = None, n: int = N_REQUESTS, planted: str | None = None, required: dict | None = None,
             legacy: bool = False, path: Path | None = None, policy: Policy | None = None,
             window: tuple | None = None) -> dict:
    """A run directory with one experiment against the fake engine, with a fault window; with ``leak``
    the engine appends another tenant's canary to every reply. ``legacy``: as older runs left it (no
    header, a plain verdict list, no experiments.jsonl). ``test_outcome``: a progress.jsonl line for
    the experiment's test (wall window ``window``, default: around the experiment)."""
    wl = Workload(seed=7, n_tenants=3, prefix="rep-")
    plans = [wl.request(wl.tenants[i % 3], n_tokens=120 + 10 * i) for i in range(n)]
    donor = plans[0]
    leak_text = canary.payload(donor.canaries[0]) + "][" if leak else ""
    name = name or ("leaky" if leak else "clean")
    test = test or f"suites/test_x.py::test_{name}"
    t_start = time.time()

    def fill(log):
        with FakeEngine("echo", leak_text=leak_text) as eng:
            log.emit("fault", action="armed", fault="delay-abc123", kind="delay", role="prefill", injector="agent")
            log.emit("fault", action="fired", fault="delay-abc123", kind="delay", role="prefill", injector="agent")
            run_plans(eng.url, plans, log, concurrency=4, timeout_s=10)
            log.emit("fault", action="healed", fault="delay-abc123", kind="delay", role="prefill", injector="agent")

    def check(records):
        return [oracles.isolation(records), oracles.sensitivity(records)]

    if legacy:
        with EventLog(run_dir / "suites" / f"{name}.events.jsonl") as log:
            fill(log)
        verdicts = check(log.records)
        (run_dir / "suites" / f"{name}.verdicts.json").write_text(json.dumps([v.to_dict() for v in verdicts],
                                                                             default=str))
        ex = None
    else:
        ex = write_experiment(run_dir, name, plans, fill, check, test=test, planted=planted, required=required,
                              policy=policy, path=path)
        verdicts = ex.verdicts
    if test_outcome:
        a, b = window or (t_start - 0.5, time.time() + 0.5)
        with open(run_dir / "progress.jsonl", "a") as f:
            f.write(json.dumps({"ev": "end", "nodeid": test, "outcome": test_outcome, "wall_start": a,
                                "wall_end": b, "duration": 1}) + "\n")
    return {"plans": plans, "donor": donor, "verdicts": verdicts, "name": name, "test": test, "experiment": ex}


def test_leak_is_a_fail_naming_victim_and_owner_with_the_leaked_text_marked(tmp_path):
    run = make_run(tmp_path, leak=True)
    r = build(tmp_path)
    assert r["overall"] == "fail" and r["chaos"] == "fail"
    v = json.loads((tmp_path / "verdicts.json").read_text())
    (scn,) = v["scenarios"]
    assert scn["status"] == "fail" and scn["name"] == "leaky" and scn["id"] == run["experiment"].id
    assert scn["test"] == "suites/test_x.py::test_leaky" and scn["planted"] is None
    iso = next(x for x in scn["verdicts"] if x["oracle"] == "isolation")
    assert iso["outcome"] == "red"
    victims = {w["victim_rid"] for w in iso["witnesses"]}
    donor = run["donor"]
    assert victims == {p.rid for p in run["plans"] if p is not donor}      # every other request got it
    assert {w["owner_rid"] for w in iso["witnesses"]} == {donor.rid}
    assert {x["witness"]["victim_rid"] for x in v["leaks"]} == victims     # the run's leak list names them
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
    # the leaks come first: before the experiments and the tests
    assert page.index('id="leaks"') < page.index('class="scenario"')
    assert 'id="verdict"><span class="badge fail big">FAIL</span>' in page


def test_reply_shown_is_the_text_the_checker_scanned(tmp_path):
    """The page builds each reply with oracles.Run.response_text (text, error, raw bytes), so the
    witness offsets index it: a leak only in the raw bytes of a cut stream is marked where it is."""
    wl = Workload(seed=3, n_tenants=2, prefix="cut-")
    plans = [wl.request(wl.tenants[i % 2], kind="stream", n_tokens=100) for i in range(4)]
    donor_pay = canary.payload(plans[0].canaries[0])

    def fill(log):
        with FakeEngine("cut", leak_text=donor_pay + "][" + "x" * 40) as eng:
            run_plans(eng.url, plans, log, concurrency=2, timeout_s=10)

    write_experiment(tmp_path, "cut", plans, fill, lambda rec: [oracles.isolation(rec)],
                     test="suites/test_x.py::test_cut")
    r = build(tmp_path)
    (s,) = r["model"].scenarios
    iso = s.verdicts[0]
    assert iso["status"] == "fail" and iso["witnesses"]
    run = oracles.Run(s.events)
    for w in iso["witnesses"]:
        a, b = w["offsets"]
        text = s.response_text(w["victim_rid"])
        assert text == run.response_text(w["victim_rid"]) and text[a:b] == w["matched"]
    page = r["html"].read_text()
    cut = [w for w in iso["witnesses"] if w.get("complete") is False]
    assert cut and "cut (partial reply)" in page


def test_clean_run_has_no_leak_and_passes(tmp_path):
    make_run(tmp_path, leak=False)
    r = build(tmp_path)
    assert r["overall"] == "pass"
    page = r["html"].read_text()
    assert 'class="witness leak"' not in page and "<mark class=\"leak\"" not in page
    assert '<section id="leaks" data-count="0">' in page and "No leak" in page
    assert "<mark" not in page                      # replies are shown (and marked) only for witnesses
    assert len(set(re.findall(r'id="(req-rep-[^"]+)"', page))) == N_REQUESTS   # one timeline bar per request
    v = json.loads((tmp_path / "verdicts.json").read_text())
    assert all(not q["flagged_by"] for q in v["scenarios"][0]["requests"].values())
    assert v["leaks"] == [] and v["known"] == []


def test_a_required_fail_of_an_experiment_not_planted_still_reddens_the_run(tmp_path):
    """A test may require isolation=FAIL, but unless the bug was planted on purpose that FAIL is a
    leak of the engine: the run is red and the leak is listed, whatever the test asserted."""
    make_run(tmp_path, leak=True, test_outcome="passed", required={"isolation": "fail"})
    r = build(tmp_path)
    (s,) = r["model"].scenarios
    assert s.status == "fail" and s.run_status == "fail"           # the policy decides it, and records it
    assert r["overall"] == "fail" and len(json.loads(r["verdicts"].read_text())["leaks"]) == N_REQUESTS - 1


def test_old_layout_without_experiment_records_is_judged_by_its_verdicts(tmp_path):
    make_run(tmp_path, leak=True, legacy=True, test_outcome="passed")
    r = build(tmp_path)
    (s,) = r["model"].scenarios
    assert s.id is None and s.test is None        # no id to link by: never linked by wall clock
    assert r["overall"] == "fail" and s.status == "fail"
    clean = tmp_path / "clean"
    clean.mkdir()
    make_run(clean, leak=False, legacy=True)
    assert build(clean)["overall"] == "pass"


@pytest.mark.parametrize("name", ["glm53-replay", "glm53-prefix", "glm53-fixed"])
def test_committed_incident_dirs_rebuild(tmp_path, name):
    d = tmp_path / name
    shutil.copytree(REPO / "reports" / "incidents" / name, d)
    for f in ("report.html", "run-verdicts.json"):
        (d / f).unlink(missing_ok=True)
    before = (d / "verdicts.json").read_text()
    r = build(d)
    assert (d / "verdicts.json").read_text() == before           # the scenario's own verdicts are kept
    # the reproductions show the leak; the fixed engine only its accepted known hang, never PASS
    want = {"glm53-replay": "fail", "glm53-prefix": "fail", "glm53-fixed": "known"}[name]
    assert r["verdicts"].name == "run-verdicts.json" and r["overall"] == want
    (s,) = r["model"].scenarios
    v = json.loads(r["verdicts"].read_text())
    iso = next(x for x in s.verdicts if x["oracle"] == "isolation")
    page = r["html"].read_text()
    if iso["status"] == "fail":
        victims = {w["victim_rid"] for w in iso["witnesses"]}
        assert page.count('<div class="witness leak"') == len(victims)
        assert {x["witness"]["victim_rid"] for x in v["leaks"]} == victims
    else:
        assert v["leaks"] == [] and 'class="witness leak"' not in page


def test_committed_incident_report_rebuilds_with_the_victims_named(tmp_path):
    d = tmp_path / "glm53-replay"
    shutil.copytree(REPO / "reports" / "incidents" / "glm53-replay", d)
    r = build(d)
    (s,) = r["model"].scenarios
    iso = next(v for v in s.verdicts if v["oracle"] == "isolation")
    assert {w["victim_tenant"] for w in iso["witnesses"]} == {"t015"}
    assert all(w["owner_tenant"] != "t015" and w["status"] == 200 for w in iso["witnesses"])
    assert [w.kind for w in s.faults] == ["reject_admitted"]
    victims = {w["victim_rid"] for w in iso["witnesses"]}  # one witness block per victim's reply
    assert r["html"].read_text().count('<div class="witness leak"') == len(victims) >= 3
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
    (tmp_path / "experiments.jsonl").write_text(json.dumps({"id": "e1", "verdicts_file": "suites/gone.verdicts.json",
                                                            "events": "suites/gone.events.jsonl"}) + "\n")
    with pytest.raises(ReportError, match=r"e1 names suites/gone\.verdicts\.json"):
        collect(tmp_path)
    (tmp_path / "experiments.jsonl").write_text("{half\n")
    with pytest.raises(ReportError, match=r"experiments\.jsonl:1: not JSON"):
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
    assert v["overall"] == "fail" and v["chaos"] == "none"      # a failed test; no experiment ran
    assert v["tests"]["counts"] == {"passed": 1, "xfailed": 1, "failed": 1}
    assert v["tests"]["harness"] == v["tests"]["counts"] and v["tests"]["chaos"] == {}
    bad = next(c for c in v["tests"]["cases"] if c["outcome"] == "failed")
    assert bad["nodeid"].endswith("::test_bad") and "assert 1 == 2" in bad["message"]
    page = (d / "report.html").read_text()
    assert 'id="tests"' not in page and "harness tests:</b> 1 passed, 1 failed, 1 xfailed" in page
    assert "test_inner.py::test_bad" in page.split('id="harness-failures"')[1]


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
    # fault records copied into an experiment's log keep their own time in "at"
    copied = [{**e, "at": e["wall"], "wall": 999.0} for e in ev]
    assert sorted(((x.kind, x.start, x.end) for x in fault_windows(copied)), key=lambda t: t[1]) == w


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


def test_plots_are_well_formed_svg_with_every_bar_fault_and_leak_mark(tmp_path):
    """The plots are written as SVG text (kvchaos/report/plots.py): each must parse as XML, hold one
    ``req-`` group per request with a bar of positive width, the fault window's group, and a LEAK mark
    naming the owner tenant on each victim's bar; the latency plot circles each victim."""
    import xml.etree.ElementTree as ET

    from kvchaos.report import plots

    run = make_run(tmp_path, leak=True)
    (scn,) = collect(tmp_path).scenarios
    ns = "{http://www.w3.org/2000/svg}"
    tl, lat = ET.fromstring(plots.timeline(scn)), ET.fromstring(plots.latency(scn))
    groups = {g.get("id"): g for g in tl.iter(f"{ns}g") if g.get("id")}
    bars = {k[4:]: g for k, g in groups.items() if k.startswith("req-")}
    assert set(bars) == {p.rid for p in run["plans"]}
    assert all(float(g.find(f"{ns}rect").get("width")) > 0 for g in bars.values())
    assert "fault-delay-abc123" in groups
    owner = run["donor"].tenant
    leaked = {rid for rid, g in bars.items() if any((t.text or "").startswith("LEAK ← ") for t in g.iter(f"{ns}text"))}
    assert leaked == {p.rid for p in run["plans"] if p is not run["donor"]}
    assert all(owner in "".join(t.text or "" for t in bars[rid].iter(f"{ns}text")) for rid in leaked)
    rings = [c for c in lat.iter(f"{ns}circle") if c.get("fill") == "none" and c.get("stroke") == "#d62728"]
    assert len(rings) == len(leaked) + 1  # each victim, and the legend's ring
    assert float(tl.get("width")) > 600 and float(tl.get("height")) > 150


@pytest.mark.parametrize("hi,want", [(0.0, [0.0]), (1.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]), (7.3, [0, 1, 2, 3, 4, 5, 6, 7]),
                                     (130, [0, 20, 40, 60, 80, 100, 120])])
def test_plot_ticks_are_round_and_cover_the_range(hi, want):
    from kvchaos.report.plots import ticks

    assert ticks(hi) == pytest.approx(want)
