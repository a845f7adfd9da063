"""What a status is and how statuses combine: the checker set (what a leak checker is, which always
run), merging verdict outcomes into an experiment's and a run's status, exit codes, and what one
experiment means for its run. The one definition of each — the rest of :mod:`kvchaos.policy` and
everything that renders a judgement use these."""

from __future__ import annotations

from kvchaos import oracles
from kvchaos.oracles import FAIL, PASS, UNKNOWN
from kvchaos.oracles.base import Checker, Composite

KNOWN = "known"
STATUSES = (PASS, FAIL, UNKNOWN)


class PolicyError(ValueError):
    """A findings registry or policy setting that cannot be used as written."""


# --------------------------------------------------------------------------- what a checker is
def _checker_classes() -> list[type]:
    out, todo = [], list(Checker.__subclasses__())
    while todo:
        c = todo.pop()
        todo += c.__subclasses__()
        if c.name and c is not Composite:
            out.append(c)
    return out


def is_leak_checker(name: str) -> bool:
    """The one definition of a leak checker: a checker whose class declares ``leak`` (its FAIL is a
    leak, never hidden)."""
    return any(c.name == name and c.leak for c in _checker_classes())


def always_run() -> list[Checker]:
    """The leak checkers every history is judged by: kvchaos' own that need nothing but the history."""
    return [c() for c in sorted(_checker_classes(), key=lambda c: c.name)
            if c.leak and c.log_only and c.__module__.startswith("kvchaos.oracles")]


def with_always(checks) -> tuple[Composite, set[str]]:
    """``checks`` plus every always-run leak checker it lacks, and the names ``checks`` claimed."""
    comp = checks if isinstance(checks, Composite) else oracles.compose(*checks)
    claimed = set(comp.names)
    return oracles.compose(*comp.checkers, *(c for c in always_run() if c.name not in claimed)), claimed


# --------------------------------------------------------------------------- merge and exit codes
RANK = {PASS: 0, KNOWN: 1, UNKNOWN: 2, FAIL: 3}  # how bad a status is
EXIT = {PASS: 0, KNOWN: 0, FAIL: 1, UNKNOWN: 3}   # KNOWN: accepted only (a finding not accepted is red)
EXIT_BAD_INPUT = 2


def merge(statuses) -> str | None:
    """The worst of several statuses (fail > unknown > known > pass); None for none."""
    statuses = [s for s in statuses if s]
    return max(statuses, key=lambda s: RANK.get(s, RANK[UNKNOWN])) if statuses else None


def exit_code(status: str) -> int:
    return EXIT.get(status, EXIT[UNKNOWN])


def scenario_status(status: str, planted: str | None, rerun: bool = False) -> str | None:
    """What one experiment means for its run: a planted experiment (a bug put there on purpose) is
    PASS when it came out as required (caught), else UNKNOWN (the harness did not show it sees that
    bug) — its planted FAILs never count as findings about the engine. An attempt an accepted engine
    failure blinded, run once more (``rerun``): None — the next attempt stands for it (both are
    reported)."""
    if rerun:
        return None
    if planted:
        return PASS if status == PASS else UNKNOWN
    return status


def status_from_rows(rows) -> str:
    """An experiment's status from its items' (outcome, verdict status, accepted)."""
    rows = list(rows)
    red = [st for o, st, a in rows if o == "red" or (o == KNOWN and not a)]  # a finding not accepted is red
    if FAIL in red:
        return FAIL
    if red:
        return UNKNOWN
    if any(o == KNOWN for o, _st, _a in rows):
        return KNOWN
    return PASS


def leak_verdict(d: dict) -> bool:
    """A serialized verdict that is a leak: a leak checker's FAIL."""
    return d.get("status") == FAIL and bool(d.get("leak", is_leak_checker(d.get("oracle"))))

