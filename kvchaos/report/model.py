"""The run model the report renders: a run directory's scenarios (experiments), tests, logs and
findings (:class:`RunModel`), and the file names a run directory holds. What a scenario's status
means is the policy's (:mod:`kvchaos.policy`); this module only carries it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kvchaos import policy
from kvchaos.history import History, HistoryError

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

