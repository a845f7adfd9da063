"""Read a run directory into one model: experiments (event log + verdicts + the policy's status),
tests (progress / JUnit), known findings, faults, logs.

A *scenario* is one experiment. In a run directory written by :mod:`kvchaos.experiment` they come
from ``experiments.jsonl`` (the last line per experiment id stands): each names its verdicts file, its
event log (which opens with an ``experiment`` header carrying the same id), the test that ran it (by
pytest node id), the policy's status (pass | fail | unknown | known) and what was planted on purpose
(the planted-leak self-test, the detection matrix's mutated arms: their required FAILs are the
harness proving it can see a bug, never a finding about the engine). Scenarios link to tests and to
fault records by id — never by wall-clock overlap: a scenario's fault windows are the fault records
in its own event log.

Older directories without ``experiments.jsonl`` (the committed incident directories) are read as
before: any ``<prefix>verdicts.json`` with its event log beside it, plus the session's self-test from
``selftest.json``; their status is derived from the verdicts (fail > unknown > pass).

The run model's classes live in :mod:`kvchaos.report.model`; the run's status, leaks and known
findings (the run-level ``verdicts.json``) in :mod:`kvchaos.report.verdicts`.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from kvchaos.cluster.procs import log_tail
from kvchaos.workload.events import load_events

# the run model and the run's status, importable from here as before (kvchaos.plugin, kvchaos.replay,
# tests import them from kvchaos.report.collect)
from .model import (EXPERIMENTS, FAILED_TESTS, FINDINGS, RUN_VERDICTS, SCENARIO_DIR_RUN_VERDICTS,  # noqa: F401
                    SELFTEST_TEST, FaultWindow, ReportError, Request, RunModel, Scenario, TestCase,
                    run_verdicts_name)
from .verdicts import known_findings, leaks, overall, run_status, run_verdicts, test_counts  # noqa: F401

ORACLE_RID_KEYS = ("victim_rid", "rid")


def _jsonl(p: Path) -> list[dict]:
    """A JSON-lines file that is not an event log (one object per line, no ``ev``)."""
    out = []
    for i, line in enumerate(p.read_text().splitlines()):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ReportError(f"{p}:{i + 1}: not JSON ({e})") from None
    return out


def _read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not valid JSON ({e})") from None


def _when(e: dict):
    """A record's wall time; a fault record copied into an experiment's log keeps its own in ``at``."""
    w = e.get("at") if e.get("ev") == "fault" and isinstance(e.get("at"), (int, float)) else e.get("wall")
    return w if isinstance(w, (int, float)) else None


def requests_of(events: list[dict]) -> dict[str, Request]:
    out: dict[str, Request] = {}
    for e in events:
        ev, rid = e.get("ev"), e.get("rid")
        if ev == "plan":
            out[rid] = Request(rid, e.get("tenant"), e.get("kind"), e.get("n_tokens"), bool(e.get("oversized")),
                               list(e.get("canaries") or []))
            continue
        r = out.get(rid)
        if r is None:
            continue
        if ev == "send" and r.send is None:
            r.send = e.get("wall")
        elif ev == "first_byte" and r.first_byte is None:
            r.first_byte = e.get("wall")
        elif ev == "status" and not e.get("headers_only"):
            r.status = e.get("status")
        elif ev == "status" and r.status is None:
            r.status = e.get("status")
        elif ev == "body":
            r.text = e.get("text") or ""
            r.error = e.get("error")
            r.complete = e.get("complete")
        elif ev == "end":
            r.end, r.outcome, r.latency_s = e.get("wall"), e.get("outcome"), e.get("latency_s")
    return out


def fault_windows(events: list[dict]) -> list[FaultWindow]:
    """Windows from harness ``fault`` events (action armed/fired/healed) and the agents' own
    ``armed``/``mutation_on``/``fault_fired``/``healed``; one window per fault id."""
    win: dict[str, FaultWindow] = {}
    open_by_role: dict = {}   # process faults carry no id: a kill/stop opens a window its restart/cont closes
    for e in sorted(events, key=lambda e: _when(e) or 0):
        wall = _when(e)
        if wall is None:
            continue
        if e.get("ev") == "fault" and not e.get("fault"):
            role, action = e.get("role"), e.get("action")

            def new_window():
                fid = f"{e.get('injector', 'fault')}-{e.get('kind')}-{role}-{len(win)}"
                win[fid] = FaultWindow(fid, str(e.get("kind")), role, wall, None)
                return win[fid]

            if action == "fired":
                w = open_by_role[role] = new_window()
                w.fired.append(wall)
            elif action == "healed":
                w = open_by_role.pop(role, None) or new_window()
                w.end = wall
            continue
        if e.get("ev") == "fault":
            fid, action = e.get("fault"), e.get("action")
        elif e.get("ev") == "agent" and e.get("agent_ev") in ("armed", "mutation_on", "fault_fired", "healed"):
            fid = e.get("fault")
            action = {"armed": "armed", "mutation_on": "armed", "fault_fired": "fired", "healed": "healed"}[e["agent_ev"]]
        else:
            continue
        if not fid:
            continue
        fid = str(fid)
        w = win.get(fid)
        if w is None:
            w = win[fid] = FaultWindow(fid, str(e.get("kind") or fid.rsplit("-", 1)[0]), e.get("role"), wall, None)
        if action == "fired":
            w.fired.append(wall)
            w.start = min(w.start, wall)
        elif action in ("healed", "heal"):
            w.end = wall if w.end is None else max(w.end, wall)
        elif action in ("armed", "arm"):
            w.start = min(w.start, wall)
    return list(win.values())


def _flag(requests: dict[str, Request], verdicts: list[dict]) -> None:
    for v in verdicts:
        for i, w in enumerate(v.get("witnesses") or []):
            if not isinstance(w, dict):
                continue
            rid = next((w[k] for k in ORACLE_RID_KEYS if w.get(k) in requests), None)
            if rid is not None:
                requests[rid].flagged_by.setdefault(v.get("oracle"), []).append(i)


def _scenario(name: str, source: str, verdicts: list, events: list, summary: dict | None = None, **kw) -> Scenario:
    reqs = requests_of(events)
    _flag(reqs, verdicts)
    walls = [_when(e) for e in events if e.get("ev") not in ("agent", "fault", "engine_error")]
    walls = [w for w in walls if w is not None]
    walls += [t for r in reqs.values() for t in (r.send, r.end) if t]
    t0, t1 = (min(walls), max(walls)) if walls else (None, None)
    head = next((e for e in events if e.get("ev") == "experiment"), None)
    if head and not kw.get("version"):  # no experiments.jsonl (a committed incident dir): the log's header
        eng = head.get("engine") or {}
        kw = {**kw, "engine": kw.get("engine") or eng.get("name"), "version": eng.get("version"),
              "test": kw.get("test") or head.get("test"), "id": kw.get("id") or head.get("id")}
    s = Scenario(name, source, verdicts, events, reqs, t0, t1, summary=summary, **kw)
    # fault windows: the fault records of this scenario's own log, never other logs by wall clock
    s.faults = fault_windows(events)
    if s.t0 is None:
        fw = [w.start for w in s.faults] + [w.end for w in s.faults if w.end]
        s.t0, s.t1 = (min(fw), max(fw)) if fw else (None, None)
    return s


def _verdict_file(vfile: Path) -> list:
    verdicts = _read_json(vfile)
    if isinstance(verdicts, dict):
        verdicts = [verdicts]
    if not isinstance(verdicts, list) or not all(isinstance(v, dict) and "oracle" in v for v in verdicts):
        raise ReportError(f"{vfile}: expected a list of verdicts (objects with 'oracle', 'status')")
    return verdicts


# --------------------------------------------------------------------------- experiments.jsonl
def experiment_records(run_dir: Path) -> list[dict]:
    """``experiments.jsonl``: the last record per experiment id stands (in first-seen order)."""
    p = run_dir / EXPERIMENTS
    if not p.exists():
        return []
    recs: dict[str, dict] = {}
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{p}:{i + 1}: not JSON ({e})") from None
        for k in ("id", "verdicts_file", "events"):
            if not r.get(k):
                raise ReportError(f"{p}:{i + 1}: experiment record without {k!r}")
        recs[r["id"]] = r
    return list(recs.values())


def _experiment_scenarios(run_dir: Path, recs: list[dict]) -> list[Scenario]:
    out = []
    selftest = _read_json(run_dir / "selftest.json") if (run_dir / "selftest.json").exists() else None
    for r in recs:  # each experiment has its own log and verdicts file (kvchaos.experiment._fresh)
        vfile, efile = run_dir / r["verdicts_file"], run_dir / r["events"]
        if not vfile.exists():
            raise ReportError(f"{run_dir / EXPERIMENTS}: experiment {r['id']} names {r['verdicts_file']}, "
                              "which is not in the run directory")
        verdicts = _verdict_file(vfile)
        events = load_events(efile) if efile.exists() else []
        head = next((e for e in events if e.get("ev") == "experiment"), {})
        note = None if events else f"event log {r['events']} is missing or empty"
        summary = None
        if selftest is not None and (r.get("test") == SELFTEST_TEST or selftest.get("experiment") == r["id"]):
            summary = {"selftest": selftest.get("status"), "why": selftest.get("why"),
                       "unplanted_witnesses": selftest.get("unplanted_witnesses") or None}
        name = r.get("name") or head.get("name") or r["id"]
        out.append(_scenario(name, r["verdicts_file"], verdicts, events, summary,
                             test=r.get("test") or head.get("test"), id=r["id"], policy_status=r.get("status"),
                             planted=r.get("planted"), known=list(r.get("known") or []),
                             accepted=list(r.get("accepted") or []), engine=r.get("engine"),
                             version=r.get("version"), events_file=r["events"], note=note, rerun=r.get("rerun"),
                             attempt=r.get("attempt") or 1))
    return out


# --------------------------------------------------------------------------- old directories
def _legacy_scenarios(run_dir: Path) -> list[Scenario]:
    out = []
    has_selftest_json = (run_dir / "selftest.json").exists()
    for vfile in sorted(run_dir.rglob("*verdicts.json")):
        if vfile.parent == run_dir and vfile.name == run_verdicts_name(run_dir):
            continue  # the run-level file this package writes
        prefix = vfile.name[: -len("verdicts.json")]
        if vfile.parent == run_dir and prefix == "selftest." and has_selftest_json:
            continue  # the self-test, read once below
        efiles = [vfile.with_name(prefix + "events.jsonl")]
        if not prefix:
            efiles.append(vfile.with_name("agent-events.jsonl"))
        sfile = vfile.with_name(prefix + "summary.json")
        summary = _read_json(sfile) if sfile.exists() else None
        rel = vfile.parent.relative_to(run_dir)
        name = prefix.rstrip(".") or (vfile.parent.name if rel.parts else run_dir.name)
        events = [e for f in efiles if f.exists() for e in load_events(f)]
        head = next((e for e in events if e.get("ev") == "experiment"), {})
        out.append(_scenario(name, str(vfile.relative_to(run_dir)), _verdict_file(vfile), events, summary,
                             test=head.get("test"), id=head.get("id"), events_file=str(efiles[0].relative_to(run_dir))))
    if has_selftest_json:
        d = _read_json(run_dir / "selftest.json")
        ev = run_dir / "selftest.events.jsonl"
        vs = [d[k] for k in ("isolation", "sensitivity") if isinstance(d.get(k), dict)]
        st = d.get("status") or ("caught" if any(v.get("oracle") == "isolation" and v.get("status") == "fail"
                                                 for v in vs) else "unknown")
        for v in vs:  # the planted leak is required to FAIL isolation
            if v.get("oracle") == "isolation":
                v.setdefault("required", "fail")
        out.insert(0, _scenario("planted-leak self-test", "selftest.json", vs,
                                load_events(ev) if ev.exists() else [],
                                {"selftest": st, "planted": d.get("faults"), "why": d.get("why")},
                                test=SELFTEST_TEST, policy_status="pass" if st == "caught" else "unknown",
                                planted="leaks planted on purpose by the session's self-test",
                                events_file="selftest.events.jsonl" if ev.exists() else None))
    return out


def scenarios(run_dir: Path) -> list[Scenario]:
    recs = experiment_records(run_dir)
    return _experiment_scenarios(run_dir, recs) if recs else _legacy_scenarios(run_dir)


# --------------------------------------------------------------------------- tests
def junit(run_dir: Path) -> list[TestCase]:
    p = run_dir / "junit.xml"
    if not p.exists():
        return []
    try:
        root = ET.parse(p).getroot()
    except ET.ParseError as e:
        raise ReportError(f"{p}: not valid JUnit XML ({e})") from None
    out = []
    for tc in root.iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        nodeid = f"{cls.replace('.', '/')}.py::{name}" if cls else name
        outcome, msg = "passed", ""
        for child in tc:
            tag = child.tag
            if tag in ("failure", "error", "skipped"):
                msg = (child.get("message") or child.text or "").strip()
                if tag == "skipped" and msg.startswith("KNOWN "):
                    outcome = "known"       # kvchaos' KNOWN outcome (an accepted known engine finding)
                elif tag == "skipped" and (child.get("type") == "pytest.xfail" or msg.startswith("xfail")):
                    outcome = "xfailed"
                else:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        out.append(TestCase(nodeid, outcome, float(tc.get("time") or 0), msg))
    return out


def progress(run_dir: Path) -> list[TestCase]:
    """Tests as the kvchaos plugin recorded them (``progress.jsonl``: collected / start / end lines,
    each end with its outcome — passed, failed, error, skipped, xfailed, xpassed, known)."""
    p = run_dir / "progress.jsonl"
    if not p.exists():
        return []
    out = []
    for e in load_events(p):
        if e.get("ev") == "end":
            out.append(TestCase(e["nodeid"], e["outcome"], float(e.get("duration") or 0), e.get("message") or ""))
    return out


def collect(run_dir: str | Path) -> RunModel:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    scs = scenarios(run_dir)
    tests = progress(run_dir) or junit(run_dir)
    by_id = {t.nodeid: t for t in tests}
    for s in scs:  # by test id, never by wall clock
        t = by_id.get(s.test) if s.test else None
        s.test_outcome = t.outcome if t else None
    findings = _read_json(run_dir / FINDINGS) if (run_dir / FINDINGS).exists() else None
    if not scs and not tests:
        raise ReportError(f"{run_dir}: nothing to report — no experiments.jsonl, *verdicts.json, selftest.json or "
                          "junit.xml in it (is this a kvchaos run directory, reports/<run-id>/?)")
    logs = []
    for p in sorted(run_dir.rglob("*.log")):
        logs.append((str(p.relative_to(run_dir)), p.stat().st_size, log_tail(p, 25)))
    extras = {}
    for name in ("detection_matrix.json", "run.json"):
        if (run_dir / name).exists():
            extras[name] = _read_json(run_dir / name)
    if (run_dir / "engine_errors.jsonl").exists():  # known silent engine failures, healed by a restart
        extras["engine_errors"] = _jsonl(run_dir / "engine_errors.jsonl")
    for a in sorted(run_dir.rglob("audit.json")):  # kvchaos audit results saved by a suite
        extras.setdefault("audits", {})[str(a.relative_to(run_dir))] = _read_json(a)
    cluster = _read_json(run_dir / "cluster.json") if (run_dir / "cluster.json").exists() else None
    return RunModel(run_dir, run_dir.name, scs, tests, cluster, logs, extras, findings,
                    experiments=(run_dir / EXPERIMENTS).exists())

