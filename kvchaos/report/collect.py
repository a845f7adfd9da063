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
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kvchaos import policy
from kvchaos.cluster.procs import log_tail
from kvchaos.history import History, HistoryError
from kvchaos.workload.events import load_events

ORACLE_RID_KEYS = ("victim_rid", "rid")
RUN_VERDICTS = "verdicts.json"          # the run-level file this package writes into a run directory
SCENARIO_DIR_RUN_VERDICTS = "run-verdicts.json"  # ... into a directory that is itself one scenario
EXPERIMENTS = "experiments.jsonl"
FINDINGS = "findings.json"
SELFTEST_TEST = "session: planted-leak self-test"
FAILED_TESTS = ("failed", "error")


def run_verdicts_name(run_dir: Path) -> str:
    """A committed incident directory keeps its own ``verdicts.json`` (the scenario's); the run-level
    file then goes beside it under another name."""
    return SCENARIO_DIR_RUN_VERDICTS if (Path(run_dir) / "events.jsonl").exists() else RUN_VERDICTS


class ReportError(ValueError):
    """A run directory kvchaos cannot build a report from (the message names the problem)."""




@dataclass
class Request:
    rid: str
    tenant: str | None
    kind: str | None
    n_tokens: int | None
    oversized: bool
    canaries: list
    send: float | None = None          # wall clock
    first_byte: float | None = None
    end: float | None = None
    outcome: str | None = None
    status: int | None = None
    latency_s: float | None = None
    text: str = ""
    error: str | None = None
    complete: bool | None = None       # the body event's "complete": False for a cut/aborted reply
    flagged_by: dict = field(default_factory=dict)   # oracle -> [witness index]

    def to_dict(self) -> dict:
        return {"tenant": self.tenant, "kind": self.kind, "n_tokens": self.n_tokens, "oversized": self.oversized,
                "status": self.status, "outcome": self.outcome, "complete": self.complete,
                "latency_s": None if self.latency_s is None else round(self.latency_s, 4),
                "flagged_by": self.flagged_by}


@dataclass
class FaultWindow:
    fault: str
    kind: str
    role: str | None
    start: float
    end: float | None           # None: no heal seen in the logs (drawn to the scenario's end)
    fired: list = field(default_factory=list)   # wall times the injector reported acting


@dataclass
class Scenario:
    name: str
    source: str                 # path of the verdicts file, relative to the run dir
    verdicts: list
    events: list
    requests: dict
    t0: float | None
    t1: float | None
    faults: list = field(default_factory=list)
    summary: dict | None = None
    test: str | None = None             # the pytest node id that ran it (experiment record / header)
    test_outcome: str | None = None     # that test's outcome (progress.jsonl, else JUnit)
    id: str | None = None               # experiment id (experiments.jsonl); None in an old directory
    policy_status: str | None = None    # the policy's verdict: pass | fail | unknown | known
    planted: str | None = None          # what was planted on purpose (its required FAILs prove sight)
    known: list = field(default_factory=list)     # finding ids the policy matched
    accepted: list = field(default_factory=list)  # ... of which accepted
    engine: str | None = None
    version: str | None = None
    events_file: str | None = None
    note: str | None = None             # something the reader must know about this scenario's data
    rerun: str | None = None            # blinded by an accepted engine failure: its test ran again (why)
    attempt: int = 1

    @property
    def verdict_status(self) -> str:
        """What the verdicts alone say: fail > unknown > pass."""
        st = {v.get("status") for v in self.verdicts}
        return "fail" if "fail" in st else "unknown" if "unknown" in st or not st else "pass"

    @property
    def status(self) -> str:
        """The policy's status (for a planted experiment "pass" means: caught as required): the
        record's, else the policy's reading of the verdicts file (kvchaos.policy.status_of)."""
        if self.policy_status:
            return self.policy_status
        return policy.status_of(self.verdicts, self.events)

    @property
    def caught(self) -> bool | None:
        """For a planted experiment: was what was planted seen as required?"""
        return None if not self.planted else self.status == "pass"

    def unaccepted_known(self) -> list[dict]:
        return [v for v in self.verdicts if v.get("outcome") == "known" and not (v.get("known") or {}).get("accepted")]

    @property
    def run_status(self) -> str:
        """What this scenario means for the run (kvchaos.policy.scenario_status): a planted experiment
        is pass when caught as required, else unknown — its planted FAILs never redden the run."""
        return policy.scenario_status(self.status, self.planted, bool(self.rerun))

    def red_verdicts(self) -> list[dict]:
        """Verdicts that make this scenario count against the run (for the report's reason line), as
        the policy recorded them."""
        if self.planted:
            return [v for v in self.verdicts if v.get("required") and v.get("status") != v.get("required")]
        out = []
        for v in self.verdicts:
            k = v.get("known") or {}
            if v.get("outcome") == "known":
                if not k.get("accepted"):
                    out.append(v)
            elif v.get("outcome") == "red" or policy.leak_verdict(v):
                out.append(v)
            elif "outcome" not in v and v.get("status") in ("fail", "unknown"):
                out.append(v)
        return out

    @property
    def context(self) -> str:
        """How to read this scenario's status."""
        if self.rerun:
            return f"blinded, run again (the next attempt stands for it): {self.rerun}"
        if self.planted:
            what = f"planted on purpose: {self.planted}"
            if self.caught:
                return f"planted — caught as required ({what}; its FAIL verdicts prove the harness sees this bug)"
            return f"planted — MISSED ({what}; a required verdict did not come out: the harness did not show it sees this bug)"
        if self.known:
            acc = [k for k in self.known if k in self.accepted]
            return (f"KNOWN engine finding {', '.join(self.known)}"
                    + ("" if len(acc) == len(self.known) else " — NOT accepted (red; --kvchaos-accept-known)"))
        if self.test_outcome in FAILED_TESTS:
            return "its test failed"
        return ""

    @cached_property
    def run(self) -> History | None:
        """The checkers' index of this scenario's events: what the report shows of a reply is exactly
        what the checkers scanned (``History.response_text``), so witness offsets index it. None
        when the log cannot be indexed (the note says why)."""
        try:
            return History(self.events, source=self.events_file or self.name)
        except HistoryError as e:
            self.note = (self.note + "; " if self.note else "") + f"event log not readable as a history: {e}"
            return None

    def response_text(self, rid: str) -> str:
        return self.run.response_text(rid) if self.run is not None else ""


@dataclass
class TestCase:
    nodeid: str
    outcome: str                # passed | failed | error | skipped | xfailed | xpassed | known
    time_s: float
    message: str = ""


@dataclass
class RunModel:
    run_dir: Path
    run_id: str
    scenarios: list
    tests: list
    cluster: dict | None
    logs: list                  # [(relative path, size, tail)]
    extras: dict                # other JSON results (detection_matrix.json, run.json)
    findings: dict | None = None   # findings.json: {"known": [...], "not_reproduced": [...], "strict": bool}
    experiments: bool = False      # the directory has experiments.jsonl (statuses from the policy)

    @property
    def experiment_tests(self) -> set:
        return {s.test for s in self.scenarios if s.test}

    def is_chaos_test(self, nodeid: str) -> bool:
        """A test that ran an experiment: under suites/, or named by an experiment record."""
        return nodeid in self.experiment_tests or "suites" in Path(nodeid.split("::")[0]).parts

    @property
    def chaos_tests(self) -> list:
        return [t for t in self.tests if self.is_chaos_test(t.nodeid)]

    @property
    def harness_tests(self) -> list:
        return [t for t in self.tests if not self.is_chaos_test(t.nodeid)]


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


# --------------------------------------------------------------------------- findings
def leaks(m: RunModel) -> list[dict]:
    """Every leak witness of every experiment that was not planted: isolation, kv_lifecycle and
    differential FAILs, whatever their test required and whether or not a known finding matched."""
    out = []
    for i, s in enumerate(m.scenarios):
        if s.planted:
            continue
        for v in s.verdicts:
            if not policy.leak_verdict(v):
                continue
            k = v.get("known") or {}
            for n, w in enumerate(v.get("witnesses") or []):
                out.append({"scenario": i, "experiment": s.name, "experiment_id": s.id, "test": s.test,
                            "oracle": v["oracle"], "outcome": v.get("outcome") or "red",
                            "known": k.get("id"), "accepted": bool(k.get("accepted")), "witness_index": n,
                            "witness": w if isinstance(w, dict) else {"value": w}})
    return out


def known_findings(m: RunModel) -> list[dict]:
    """Each verdict a known finding matched ({id, title, engine, version, test, experiment, oracle,
    status, accepted, upstream, witnesses, summary, scenario}); findings.json fills in what the
    verdict files lack."""
    out, seen = [], set()
    for i, s in enumerate(m.scenarios):
        for v in s.verdicts:
            k = v.get("known")
            if v.get("outcome") != "known" or not isinstance(k, dict):
                continue
            seen.add((k.get("id"), s.test, s.name, v.get("oracle")))
            out.append({"id": k.get("id"), "title": k.get("title"), "engine": s.engine, "version": s.version,
                        "test": s.test, "experiment": s.name, "oracle": v.get("oracle"), "status": v.get("status"),
                        "accepted": bool(k.get("accepted")), "upstream": list(k.get("upstream") or []),
                        "conditions": k.get("conditions"),
                        "versions": k.get("versions"), "witnesses": v.get("witnesses") or [],
                        "summary": v.get("summary"), "scenario": i})
    for k in (m.findings or {}).get("known") or []:
        if (k.get("id"), k.get("test"), k.get("experiment"), k.get("oracle")) not in seen:
            out.append({**k, "scenario": next((i for i, s in enumerate(m.scenarios)
                                                if s.name == k.get("experiment") and s.test == k.get("test")), None)})
    return out


# --------------------------------------------------------------------------- the run's status
def judge(m: RunModel) -> dict:
    """The run's status and why.

    ``chaos``: from the experiments — fail > unknown > known > pass over what each means for the run
    (``Scenario.run_status``: the policy's status; planted experiments count only when they missed
    what was planted, as unknown; a leak checker's FAIL is never hidden); "none" when no experiment
    that was not planted ran (a run of harness tests only has no chaos verdict).
    ``overall``: ``chaos``, but "fail" when any test failed or errored, or when ``--kvchaos-strict``
    was set and a listed finding did not reproduce."""
    real = [s for s in m.scenarios if not s.planted and not s.rerun]
    planted = [s for s in m.scenarios if s.planted]
    counted = real + [s for s in planted if not s.caught]
    chaos = policy.merge(s.run_status for s in counted) if real else (
        "unknown" if any(not s.caught for s in planted) else "none")
    red, known = [], []
    for s in sorted(counted, key=lambda s: -policy.RANK.get(s.run_status, 2)):
        if s.run_status == "pass":
            continue
        vs = s.red_verdicts()
        what = "; ".join(f"{v.get('oracle')} {str(v.get('status')).upper()}"
                         + (f" (required {str(v['required']).upper()})" if v.get("required") and s.planted else "")
                         for v in vs[:3]) or s.run_status.upper()
        if s.planted:
            red.append(f"{s.name}: planted bug MISSED — {what}")
        elif s.run_status == "known":
            known.append(f"{s.name}: KNOWN {', '.join(s.known) or '?'}")
        else:
            red.append(f"{s.name}: {what}" + (f" — {_first_summary(vs)}" if _first_summary(vs) else ""))
    failed = [t for t in m.tests if t.outcome in FAILED_TESTS]
    nr = (m.findings or {}).get("not_reproduced") or []
    strict = bool((m.findings or {}).get("strict"))
    overall, other = chaos, []
    if failed:
        overall = "fail"
        other.append(f"{len(failed)} test(s) failed: " + ", ".join(t.nodeid for t in failed[:5])
                     + (" …" if len(failed) > 5 else ""))
    if strict and nr:
        overall = "fail"
        other.append(f"--kvchaos-strict: {len(nr)} listed finding(s) did not reproduce")
    n_real, n_planted = len(real), len(planted)
    exps = f"{n_real} experiment(s)" + (f" + {n_planted} planted" if n_planted else "")
    if chaos == "none":
        head = ("no chaos verdict: " + (f"only planted experiments ran ({n_planted}, caught as required)"
                                         if n_planted else "no experiment ran")
                + (f" ({len(m.tests)} test(s), none judged an engine)" if m.tests and not n_planted else ""))
    elif chaos == "pass":
        head = f"{exps}: every verdict as required, no leak" + ("; planted bugs caught" if n_planted else "")
    elif chaos == "known":
        ids = sorted({k for s in real for k in s.known}
                     | {(v.get("known") or {}).get("id") for s in real for v in s.verdicts if v.get("known")})
        head = f"{exps}: nothing red but accepted known engine finding(s) {', '.join(ids)} — never PASS"
    else:
        head = f"{exps}: " + "; ".join(red[:3]) + (f" (+{len(red) - 3} more)" if len(red) > 3 else "")
        if known:
            head += f"; also {len(known)} known finding(s)"
    if other:
        head += (" — but " if chaos in ("pass", "known", "none") else "; ") + "; ".join(other)
    reasons = red + known + other
    return {"overall": overall, "chaos": chaos, "reason": head, "reasons": reasons}


def _first_summary(vs: list[dict]) -> str:
    for v in vs:
        if v.get("summary"):
            s = str(v["summary"])
            return s if len(s) <= 200 else s[:200] + "…"
    return ""


def overall(m: RunModel) -> str:
    return judge(m)["overall"]


def test_counts(tests: list) -> dict:
    counts: dict = {}
    for t in tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    return counts


def run_verdicts(m: RunModel) -> dict:
    """The run-level ``verdicts.json``: the run's status and why, leaks, known findings, findings
    that did not reproduce, tests (all, and split chaos / harness), per-oracle counts (experiments
    that were not planted), and per scenario its status, verdicts (with witnesses), faults, requests."""
    by_oracle: dict = {}
    for s in m.scenarios:
        if s.planted:
            continue
        for v in s.verdicts:
            by_oracle.setdefault(v.get("oracle"), {"pass": 0, "fail": 0, "unknown": 0})
            by_oracle[v["oracle"]][v.get("status", "unknown")] = by_oracle[v["oracle"]].get(v.get("status"), 0) + 1
    j = judge(m)
    return {
        "run_id": m.run_id,
        "seed": ((m.extras or {}).get("run.json") or {}).get("seed"),
        "overall": j["overall"],
        "chaos": j["chaos"],
        "reason": j["reason"],
        "reasons": j["reasons"],
        "leaks": [{k: v for k, v in x.items()} for x in leaks(m)],
        "known": known_findings(m),
        "not_reproduced": (m.findings or {}).get("not_reproduced") or [],
        "strict": bool((m.findings or {}).get("strict")),
        "tests": {"counts": test_counts(m.tests), "chaos": test_counts(m.chaos_tests),
                  "harness": test_counts(m.harness_tests), "cases": [t.__dict__ for t in m.tests]},
        "by_oracle": by_oracle,
        "scenarios": [{"name": s.name, "id": s.id, "source": s.source, "events": s.events_file,
                       "status": s.status, "run_status": s.run_status, "verdict_status": s.verdict_status,
                       "planted": s.planted, "caught": s.caught, "known": s.known, "accepted": s.accepted,
                       "engine": s.engine, "version": s.version, "test": s.test, "test_outcome": s.test_outcome,
                       "context": s.context, "note": s.note, "verdicts": s.verdicts,
                       "faults": [w.__dict__ for w in s.faults],
                       "requests": {rid: r.to_dict() for rid, r in s.requests.items()}} for s in m.scenarios],
    }
