"""The judgement: how a history's verdicts become red or green (:class:`Policy`: the gates — history
incomplete, self-test not caught — then each verdict against what is required of it, claimed or
not, KNOWN only by the findings registry), the serialized result (:class:`Judgement`, ``to_dict``),
and reading an already-serialized verdicts file back into a status (:func:`status_of`)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.history import History, render_witness, witness
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict
from kvchaos.oracles.base import Composite

from .context import Context
from .core import KNOWN, STATUSES, PolicyError, exit_code, is_leak_checker, status_from_rows, with_always
from .findings import Finding, Registry


@dataclass
class Policy:
    """How verdicts become red or green. ``accept_known``: True, False or a list of finding ids.
    ``blind_model``: the user declared a model that cannot echo canaries; isolation is then not
    claimed (UNKNOWN stays UNKNOWN, but is not red) — the report says so."""
    registry: Registry = None
    accept_known: bool | list = False
    strict: bool = False
    blind_model: bool = False
    selftest: dict | None = None  # the session's planted-leak self-test result

    def __post_init__(self):
        if self.registry is None:
            self.registry = Registry.load()
        if isinstance(self.accept_known, (list, tuple)):
            for fid in self.accept_known:
                self.registry.get(fid)  # names an unknown id at once

    def accepted(self, f: Finding) -> bool:
        return self.accept_known is True or (isinstance(self.accept_known, (list, tuple)) and f.id in self.accept_known)

    def selftest_blind(self) -> str | None:
        """Why the session cannot trust an isolation PASS, or None."""
        st = (self.selftest or {}).get("status")
        if self.selftest is None or st == "caught" or self.blind_model:
            return None
        if st == "engine_leak" and self.selftest.get("planted_caught"):
            return None  # the harness caught what it planted (and more: the engine's own leak, red on its own)
        return f"the session's planted-leak self-test was not a clean catch ({st}): isolation cannot be trusted"

    def accepted_engine_failures(self, engine_errors, ctx: "Context") -> list[str]:
        """The accepted findings that name one of these engine failures (an ``engine_error``
        signature) for the engine that ran."""
        sigs = {e.get("signature") for e in engine_errors or ()}
        return sorted({f.id for f in self.registry.findings if self.accepted(f) and f.applies_to(ctx.engine, ctx.version)
                       and any(m.signature.get("engine_error") in sigs for m in f.matches)})

    def blinded(self, j: "Judgement", engine_errors) -> list[str]:
        """Why an experiment may run once more: it is red only for want of power (no FAIL, a claimed
        isolation UNKNOWN) and an accepted engine failure struck during it — the findings naming that
        failure; [] otherwise. A second blinded attempt is red like any other."""
        if j.status != UNKNOWN or not engine_errors:
            return []
        blind = any(i.outcome == "red" and i.verdict.oracle == "isolation" and i.verdict.status == UNKNOWN
                    for i in j.items)
        return self.accepted_engine_failures(engine_errors, j.ctx) if blind else []

    def checks(self, checks) -> tuple[Composite, set[str]]:
        """The checkers a history is judged by: those asked for, and every always-run leak checker."""
        return with_always(checks)

    def gate(self, verdicts: list[Verdict], history: History | None = None) -> list[Verdict]:
        """Session- and history-level evidence applied to fresh verdicts: with a self-test that did not
        catch its planted leak no isolation verdict may PASS; an incomplete history (a record lost)
        cannot PASS anything."""
        why = self.selftest_blind()
        lost = "; ".join(history.problems) if history is not None and history.problems else None
        seen = _leaks_seen(history)
        out = []
        for v in verdicts:
            if v.status != FAIL and v.oracle in seen:
                # the runner's live judge saw this checker FAIL on replies the client had received; a log
                # that no longer shows it was rewritten or cut, never a reason for green
                w = seen[v.oracle]
                v = Verdict(v.oracle, FAIL, f"the runner saw a leak live ({len(w)} record(s): leak_seen) that this "
                            f"judgement of the log does not show; the checker alone said: {v.summary}",
                            w + list(v.witnesses), {**v.stats, "leak_seen": len(w)})
            if why and v.oracle == "isolation" and v.status == PASS:
                v = Verdict(v.oracle, UNKNOWN, f"{why}; the experiment alone said: {v.summary}", v.witnesses,
                            {**v.stats, "selftest": (self.selftest or {}).get("status")})
            if lost and v.status == PASS:
                v = Verdict(v.oracle, UNKNOWN, f"the history is incomplete ({lost}); the checker alone said: "
                            f"{v.summary}", v.witnesses, {**v.stats, "history_problems": history.problems})
            out.append(v)
        return out

    def judge(self, verdicts: list[Verdict], ctx: Context, required: dict | None = None,
              planted: str | None = None, claimed=None, every_fail_counts: bool = False) -> "Judgement":
        """Each verdict against what is required of it. ``required``: oracle -> wanted status, held
        exactly. ``claimed``: the checkers the test named (None: every verdict given); a leak checker
        not claimed ran because it always runs — its FAIL is red, its UNKNOWN only shown. ``planted``:
        the experiment carries a bug on purpose (a self-test's planted leak, a detection-matrix
        mutation) — then only ``required`` counts, and the record says what was planted.
        ``every_fail_counts``: with nobody to declare requirements (``kvchaos judge``), a FAIL of any
        checker is red, not only a leak checker's."""
        required = dict(required or {})
        by = {v.oracle: v for v in verdicts}
        missing = sorted(set(required) - set(by))
        if missing:
            raise PolicyError(f"required verdict(s) {missing} were not judged (have {sorted(by)})")
        claimed = set(by) if claimed is None else set(claimed) | set(required)
        items = []
        for v in verdicts:
            want = required.get(v.oracle)
            if want is not None and want not in STATUSES:
                raise PolicyError(f"require({v.oracle}={want!r}): one of {STATUSES}")
            leak, mine = is_leak_checker(v.oracle), v.oracle in claimed
            note = ""
            if want is not None:
                # a leak FAIL is red unless the experiment says it planted the bug: requiring FAIL alone
                # does not make a leak expected
                ok = v.status == want and not (leak and v.status == FAIL and not planted)
            elif planted:
                ok = True  # a planted experiment: only what it requires counts
            elif leak and v.status == FAIL:
                ok = False  # a leak is red whether or not the test asked for this checker
            elif leak and v.stats.get("crashed"):
                ok = False  # a leak checker that could not judge the history proves nothing: red
            elif leak and mine and v.oracle == "isolation" and v.status == UNKNOWN:
                ok = False  # claimed isolation without the power to see a leak: a blind run
            elif v.status == UNKNOWN and not mine:
                ok, note = True, "not claimed: this checker always runs, the test did not ask for it"
            else:
                ok = not (every_fail_counts and v.status == FAIL)
            if v.oracle == "isolation" and v.status == UNKNOWN and self.blind_model and want in (None, PASS) \
                    and not planted:
                ok, note = True, "blind model declared: isolation not claimed"
            finding, why_not = (None, "") if ok or (want is not None and want != PASS) else self.registry.classify(v, ctx)
            outcome = "ok" if ok else (KNOWN if finding else "red")
            items.append(Item(v, want, outcome, finding, finding is not None and self.accepted(finding), leak, mine,
                              note, why_not if outcome == "red" else ""))
        return Judgement(items, ctx, planted, list(ctx.history.problems) if ctx.history is not None else [])


@dataclass
class Item:
    verdict: Verdict
    wanted: str | None
    outcome: str  # ok | known | red
    finding: Finding | None = None
    accepted: bool = False
    leak: bool = False
    claimed: bool = True
    note: str = ""       # why an UNKNOWN does not decide (not claimed, blind model)
    not_known: str = ""  # a red verdict: why no registered finding covers it

    def to_dict(self) -> dict:
        d = self.verdict.to_dict()
        d["required"] = self.wanted
        d["outcome"] = self.outcome
        d["leak"] = self.leak
        d["claimed"] = self.claimed
        if self.note:
            d["note"] = self.note
        if self.not_known:
            d["not_known"] = self.not_known
        if self.finding:
            d["known"] = {**self.finding.brief(), "accepted": self.accepted}
        return d


@dataclass
class Judgement:
    items: list
    ctx: Context
    planted: str | None = None
    problems: list = field(default_factory=list)

    @property
    def red(self) -> list[Item]:
        return [i for i in self.items if i.outcome == "red" or (i.outcome == KNOWN and not i.accepted)]

    @property
    def known(self) -> list[Item]:
        return [i for i in self.items if i.outcome == KNOWN]

    @property
    def status(self) -> str:
        """fail | unknown | known | pass — what this experiment means for the run (a planted one:
        pass means what was planted came out as required)."""
        return status_from_rows((i.outcome, i.verdict.status, i.accepted) for i in self.items)

    @property
    def exit_code(self) -> int:
        return exit_code(self.status)

    def message(self) -> str:
        lines = [f"history incomplete: {p}" for p in self.problems]
        for i in self.items:
            if i.outcome == "ok":
                continue
            v = i.verdict
            head = f"{v.oracle}: {v.status.upper()}" + (f" (required {i.wanted.upper()})" if i.wanted else "")
            if i.finding:
                head += (f" — KNOWN {i.finding.id}{'' if i.accepted else ' (not accepted: --kvchaos-accept-known)'}"
                         f": {i.finding.title}")
            lines.append(f"{head} — {v.summary}")
            if i.not_known:
                lines.append(f"    not a known finding: {i.not_known[:400]}")
            for w in v.witnesses[:3]:
                lines.append(f"    witness: {render_witness(w)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "red": bool(self.red), "planted": self.planted,
                "problems": self.problems, "verdicts": [i.to_dict() for i in self.items],
                "known": [{**i.finding.brief(), "oracle": i.verdict.oracle, "accepted": i.accepted} for i in self.known]}


def status_of(items: list[dict], events=None) -> str:
    """The status of an experiment from its serialized items (a verdicts file): their outcomes when
    this policy recorded them; a file judged before (no outcomes, or no ``leak`` flags: written before
    the policy alone decided) is judged by the policy now (its ``required`` and the findings its run
    accepted kept, nothing planted)."""
    if items and all(isinstance(d, dict) and "outcome" in d and "leak" in d for d in items):
        return status_from_rows((d["outcome"], d.get("status"), bool((d.get("known") or {}).get("accepted")))
                                for d in items)
    verdicts = [Verdict.from_dict(d) for d in items if isinstance(d, dict)]
    if not verdicts:
        return UNKNOWN
    try:
        ctx = Context.of(events or [])
    except Exception:  # noqa: BLE001 - an unreadable log: judged without its context
        ctx = Context(None)
    required = {d["oracle"]: d["required"] for d in items if isinstance(d, dict) and d.get("required") in STATUSES}
    reg = Registry.load()
    ids = {f.id for f in reg.findings}
    accepted = sorted({(d.get("known") or {}).get("id") for d in items if isinstance(d, dict)
                       and (d.get("known") or {}).get("accepted")} & ids)  # what the run's user had accepted
    return Policy(registry=reg, accept_known=accepted).judge(verdicts, ctx, required=required).status



def load_policy_table(profile_path: str | Path | None) -> dict:
    """The ``[policy]`` table of a profile TOML (``accept_known``, ``strict``, ``blind_model``)."""
    if not profile_path:
        return {}
    data = tomllib.loads(Path(profile_path).read_text())
    table = data.get("policy", {})
    unknown = sorted(set(table) - {"accept_known", "strict", "blind_model"})
    if unknown:
        raise PolicyError(f"{profile_path}: [policy] unknown key(s) {unknown}; allowed: accept_known, strict, blind_model")
    ak = table.get("accept_known", False)
    if not isinstance(ak, (bool, list)):
        raise PolicyError(f"{profile_path}: [policy] accept_known must be true/false or a list of finding ids")
    return table


def _leaks_seen(history) -> dict[str, list]:
    """checker -> witnesses, from the runner's own ``leak_seen`` records (its live judge's FAILs)."""
    out: dict[str, list] = {}
    for e in (history.by_ev.get("leak_seen", ()) if history is not None else ()):
        oracle = e.get("oracle") if isinstance(e.get("oracle"), str) else "isolation"
        victims = e.get("victims") if isinstance(e.get("victims"), list) else []
        owners = e.get("owners") if isinstance(e.get("owners"), list) else []
        out.setdefault(oracle, []).append(witness(problem="the runner's live judge saw a leak during the experiment",
                                                  victims=victims[:20], owners=owners[:20],
                                                  after_s=e.get("after_s"), record="leak_seen"))
    return out
