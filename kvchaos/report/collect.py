"""Read a run directory into one model: scenarios (event log + verdicts), tests (JUnit), faults, logs.

A *scenario* is any ``<prefix>verdicts.json`` with its event log beside it — ``suites/<name>.verdicts.json``
+ ``suites/<name>.events.jsonl`` (suites using ``kvchaos.suite.run_judged``), ``incidents/<name>/verdicts.json``
+ ``events.jsonl`` (+ ``agent-events.jsonl``), a committed incident directory itself — and the session's
planted-leak self-test (``selftest.json`` + ``selftest.events.jsonl``). Fault windows come from every
event log of the run (``events/<test>.jsonl`` holds the harness side of each fault: armed, fired,
healed), matched to a scenario by wall-clock time.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.cluster.procs import log_tail
from kvchaos.workload.events import load_events

ORACLE_RID_KEYS = ("victim_rid", "rid")
RUN_VERDICTS = "verdicts.json"          # the run-level file this package writes into a run directory
SCENARIO_DIR_RUN_VERDICTS = "run-verdicts.json"  # ... into a directory that is itself one scenario


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
    flagged_by: dict = field(default_factory=dict)   # oracle -> [witness index]

    def to_dict(self) -> dict:
        return {"tenant": self.tenant, "kind": self.kind, "n_tokens": self.n_tokens, "oversized": self.oversized,
                "status": self.status, "outcome": self.outcome,
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
    test: str | None = None             # the pytest test that ran it (from progress.jsonl), and its outcome
    test_outcome: str | None = None

    @property
    def context(self) -> str:
        """How to read this scenario's status next to its test's outcome."""
        if self.source == "selftest.json":
            return "leaks planted on purpose: a FAIL here proves the harness can see a leak on this cluster"
        if self.status == "fail" and self.test_outcome == "passed":
            return ("its test passed: a detection the test required (an injected bug), or a verdict the test "
                    "does not apply to this scenario — see the test")
        if self.status == "fail" and self.test_outcome == "xfailed":
            return "known engine finding (xfail with witness)"
        if self.test_outcome in ("failed", "error"):
            return "its test failed"
        return ""

    @property
    def status(self) -> str:
        st = {v.get("status") for v in self.verdicts}
        return "fail" if "fail" in st else "unknown" if "unknown" in st or not st else "pass"


@dataclass
class TestCase:
    nodeid: str
    outcome: str                # passed | failed | error | skipped | xfailed
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


def _read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not valid JSON ({e})") from None


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
        elif ev == "end":
            r.end, r.outcome, r.latency_s = e.get("wall"), e.get("outcome"), e.get("latency_s")
    return out


def fault_windows(events: list[dict]) -> list[FaultWindow]:
    """Windows from harness ``fault`` events (action armed/fired/healed) and the agents' own
    ``armed``/``mutation_on``/``fault_fired``/``healed``; one window per fault id."""
    win: dict[str, FaultWindow] = {}
    open_by_role: dict = {}   # process faults carry no id: a kill/stop opens a window its restart/cont closes
    for e in sorted(events, key=lambda e: e.get("wall") or 0):
        wall = e.get("wall")
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


def _scenario(name: str, source: str, verdicts: list, events: list, summary: dict | None = None) -> Scenario:
    reqs = requests_of(events)
    _flag(reqs, verdicts)
    walls = [e["wall"] for e in events if isinstance(e.get("wall"), (int, float)) and e.get("ev") != "agent"]
    walls += [t for r in reqs.values() for t in (r.send, r.end) if t]
    t0, t1 = (min(walls), max(walls)) if walls else (None, None)
    return Scenario(name, source, verdicts, events, reqs, t0, t1, summary=summary)


def _verdict_file(vfile: Path) -> list:
    verdicts = _read_json(vfile)
    if isinstance(verdicts, dict):
        verdicts = [verdicts]
    if not isinstance(verdicts, list) or not all(isinstance(v, dict) and "oracle" in v for v in verdicts):
        raise ReportError(f"{vfile}: expected a list of verdicts (objects with 'oracle', 'status')")
    return verdicts


def scenarios(run_dir: Path) -> list[Scenario]:
    out = []
    for vfile in sorted(run_dir.rglob("*verdicts.json")):
        if vfile.parent == run_dir and vfile.name == run_verdicts_name(run_dir):
            continue  # the run-level file this package writes
        prefix = vfile.name[: -len("verdicts.json")]
        efiles = [vfile.with_name(prefix + "events.jsonl")]
        if not prefix:
            efiles.append(vfile.with_name("agent-events.jsonl"))
        sfile = vfile.with_name(prefix + "summary.json")
        summary = _read_json(sfile) if sfile.exists() else None
        rel = vfile.parent.relative_to(run_dir)
        name = prefix.rstrip(".") or (vfile.parent.name if rel.parts else run_dir.name)
        events = [e for f in efiles if f.exists() for e in load_events(f)]
        out.append(_scenario(name, str(vfile.relative_to(run_dir)), _verdict_file(vfile), events, summary))
    st = run_dir / "selftest.json"
    if st.exists():
        d = _read_json(st)
        ev = run_dir / "selftest.events.jsonl"
        out.insert(0, _scenario("planted-leak self-test (must FAIL: leaks planted on purpose)", "selftest.json",
                                [d[k] for k in ("isolation", "sensitivity") if isinstance(d.get(k), dict)],
                                load_events(ev) if ev.exists() else [],
                                {"selftest": d.get("status"), "planted": d.get("faults")}))
    return out


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
                if tag == "skipped" and (child.get("type") == "pytest.xfail" or msg.startswith("xfail")):
                    outcome = "xfailed"
                else:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        out.append(TestCase(nodeid, outcome, float(tc.get("time") or 0), msg))
    return out


def progress(run_dir: Path) -> list[TestCase]:
    """Tests as the kvchaos plugin recorded them (``progress.jsonl``: collected / start / end lines,
    each end with its outcome and wall-clock start and stop)."""
    p = run_dir / "progress.jsonl"
    if not p.exists():
        return []
    out = []
    for e in load_events(p):
        if e.get("ev") == "end":
            t = TestCase(e["nodeid"], e["outcome"], float(e.get("duration") or 0), e.get("message") or "")
            t.start, t.stop = e.get("wall_start"), e.get("wall_end")
            out.append(t)
    return out


def _link(scs: list[Scenario], tests: list[TestCase]) -> None:
    for s in scs:
        if s.t0 is None:
            continue
        for t in tests:
            a, b = getattr(t, "start", None), getattr(t, "stop", None)
            if a is not None and b is not None and a - 1 <= s.t0 and s.t1 <= b + 1:
                s.test, s.test_outcome = t.nodeid, t.outcome
                break


def collect(run_dir: str | Path) -> RunModel:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    scs = scenarios(run_dir)
    tests = progress(run_dir) or junit(run_dir)
    _link(scs, tests)
    if not scs and not tests:
        raise ReportError(f"{run_dir}: nothing to report — no *verdicts.json, selftest.json or junit.xml in it "
                          "(is this a kvchaos run directory, reports/<run-id>/?)")
    every = [e for s in scs for e in s.events]
    for f in sorted((run_dir / "events").glob("*.jsonl")) if (run_dir / "events").is_dir() else []:
        every += load_events(f)
    wins = fault_windows(every)
    for s in scs:
        if s.t0 is None:
            continue
        s.faults = [w for w in wins if w.start <= s.t1 and (w.end is None or w.end >= s.t0)
                    and (w.end is not None or w.start >= s.t0 - 60)]
    logs = []
    for p in sorted(run_dir.rglob("*.log")):
        logs.append((str(p.relative_to(run_dir)), p.stat().st_size, log_tail(p, 25)))
    extras = {}
    for name in ("detection_matrix.json", "run.json"):
        if (run_dir / name).exists():
            extras[name] = _read_json(run_dir / name)
    if (run_dir / "engine_errors.jsonl").exists():  # known silent engine failures, healed by a restart
        extras["engine_errors"] = load_events(run_dir / "engine_errors.jsonl")
    for a in sorted(run_dir.rglob("audit.json")):  # kvchaos audit results saved by a suite
        extras.setdefault("audits", {})[str(a.relative_to(run_dir))] = _read_json(a)
    cluster = _read_json(run_dir / "cluster.json") if (run_dir / "cluster.json").exists() else None
    return RunModel(run_dir, run_dir.name, scs, tests, cluster, logs, extras)


def run_verdicts(m: RunModel) -> dict:
    """The run-level ``verdicts.json``: per scenario, per oracle (with witnesses), per request."""
    by_oracle: dict = {}
    for s in m.scenarios:
        for v in s.verdicts:
            by_oracle.setdefault(v.get("oracle"), {"pass": 0, "fail": 0, "unknown": 0})
            by_oracle[v["oracle"]][v.get("status", "unknown")] = by_oracle[v["oracle"]].get(v.get("status"), 0) + 1
    counts: dict = {}
    for t in m.tests:
        counts[t.outcome] = counts.get(t.outcome, 0) + 1
    return {
        "run_id": m.run_id,
        "overall": overall(m),
        "tests": {"counts": counts, "cases": [t.__dict__ for t in m.tests]},
        "by_oracle": by_oracle,
        "scenarios": [{"name": s.name, "source": s.source, "status": s.status, "test": s.test,
                       "test_outcome": s.test_outcome, "context": s.context, "verdicts": s.verdicts,
                       "faults": [w.__dict__ for w in s.faults],
                       "requests": {rid: r.to_dict() for rid, r in s.requests.items()}} for s in m.scenarios],
    }


def overall(m: RunModel) -> str:
    """With tests (they encode what each scenario must show: a mutated scenario must FAIL, a known
    engine finding is an xfail): fail when a test failed or errored, else pass. Without tests (a
    directory of scenarios, e.g. a committed incident): fail > unknown > pass over the scenarios; the
    planted-leak self-test must FAIL by design and does not count."""
    if m.tests:
        return "fail" if any(t.outcome in ("failed", "error") for t in m.tests) else "pass"
    real = [s for s in m.scenarios if s.source != "selftest.json"]
    if any(s.status == "fail" for s in real):
        return "fail"
    if any(s.status == "unknown" for s in real) or not real:
        return "unknown"
    return "pass"
