"""Verdict policy — the one place that decides what verdicts mean: which checkers always run, what is
a leak, how verdicts merge into an experiment's and a run's status, which exit code that is, and when
a verdict is a known engine finding.

Every checker says PASS, FAIL or UNKNOWN and declares (its class attribute ``leak``) whether its FAIL
is a leak. Here:

* **Always run.** Every leak checker that needs nothing but the history (``log_only``: isolation,
  kv_lifecycle, retraction) runs on every history, whatever a test or ``--checkers`` named
  (:func:`with_always`). One the test did not name is *not claimed*: its FAIL is red like any leak,
  its UNKNOWN is shown ("not claimed") but does not decide the status.
* **Claimed.** A checker a test named or required is claimed. A claimed leak checker must not FAIL;
  claimed isolation must PASS (UNKNOWN — no power — is red) unless a blind model was declared.
  ``required``: oracle -> wanted status, held exactly.
* **Incomplete history.** A history the loader found incomplete (a cut last line) cannot PASS: every
  PASS becomes UNKNOWN naming the lost record (:meth:`Policy.gate`).
* **Self-test.** A session whose planted-leak self-test did not catch its leak cannot PASS isolation.
* **Known findings.** A non-PASS verdict is KNOWN only when it matches an entry of the findings
  registry (``kvchaos/findings.toml``: data, not code) for the engine and version that ran, with
  every witness showing the entry's mechanism in the engines' own events. A leak can be KNOWN only
  where the run had the power to see it (isolation's per-class power met): a blind run is never
  covered. KNOWN is red unless accepted; accepted KNOWN is its own outcome, never PASS. A liveness
  finding cannot make an isolation, kv_lifecycle or differential FAIL anything but red: findings
  match per checker.
* **Merge and exit codes.** An experiment's status: fail > unknown > known > pass over its items;
  a run's: the worst of its experiments (:func:`merge`); :data:`EXIT` maps a status to an exit code.

Everything else — the CLI, the pytest plugin, the report, shrink — renders or consumes the serialized
:class:`Judgement` (``to_dict``); none of them decides.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos import oracles
from kvchaos.history import History, as_history, render_witness
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict, kv_page_size, kv_pages_written, pages_for, provenance
from kvchaos.oracles.base import Checker, Composite

KNOWN = "known"
STATUSES = (PASS, FAIL, UNKNOWN)
FINDINGS_FILE = Path(__file__).resolve().parent / "findings.toml"


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


# --------------------------------------------------------------------------- context
@dataclass
class Context:
    """What a signature may look at besides the verdict: the experiment's history (its header says
    which engine ran) and the known engine failures found in the servers' logs during it."""
    history: History = None
    engine: str = "sglang"
    version: str | None = None
    engine_errors: list = field(default_factory=list)
    registry: object = None  # the canary registry the checkers were handed (kvchaos.canary.Registry)

    def __post_init__(self):
        if self.history is not None and not isinstance(self.history, History):
            self.history = as_history(self.history)  # records given: indexed once, here

    @classmethod
    def of(cls, events, engine_errors=(), registry=None) -> "Context":
        h = as_history(events)
        eng = h.header.get("engine") or {}
        return cls(h, eng.get("name") or "sglang", eng.get("version"), list(engine_errors), registry)

    @property
    def events(self) -> list[dict]:
        return self.history.records if self.history is not None else []

    def plans(self) -> dict[str, dict]:
        return self.history.plans if self.history is not None else {}

    def fault_events(self, action: str | None = None) -> list[dict]:
        """Fault records of the experiment: the harness's ``fault`` events and the agents' own
        ``fault_fired`` (copied into the log as ``agent``), the latter as action ``fired``."""
        if self.history is None:
            return []
        out = [e for e in self.history.fault_records(action)]
        if action in (None, "fired"):
            out += [{**e, "action": "fired"} for e in self.history.agent_events("fault_fired")]
        return out


# --------------------------------------------------------------------------- signatures
# Each predicate: (verdict, context, argument) -> (holds, why not). A finding's signature is a table
# of them; every one must hold for the verdict to be KNOWN. The stale-page findings are matched by
# their mechanism in the engines' own events (kvchaos.oracles.provenance), never by who the victim was.
def _rid_witnesses(v: Verdict) -> list[dict]:
    return [w for w in v.witnesses if w.get("rid") or w.get("victim_rid")]


def _sig_owners_minted(v, ctx, want):
    bad = [w.get("matched") for w in v.witnesses if w.get("origin") == "unknown"]
    return (not bad) == bool(want), f"canaries of unknown origin: {bad[:5]}"


def _sig_stale_pages_of_owner(v, ctx, want):
    """Every witness is a victim that read decode pages its transfer never wrote, holding the bytes of
    a request that carried the canary — decode's ``kv_prealloc`` (who held each page before) and
    prefill's ``write_end`` (what each transfer wrote) say so."""
    if not want:
        raise PolicyError("stale_pages_of_owner takes true")
    bad = []
    for w in v.witnesses:
        ok, why, _sp = provenance.explains(ctx.history, w, ctx.registry)
        if not ok:
            bad.append(f"{w.get('victim_rid')} <- {w.get('owner_rid')}: {why}")
    return bool(v.witnesses) and not bad, "; ".join(bad[:3]) or "no witness"


def _sig_victims_shorted(v, ctx, want):
    """Every victim's transfer was cut by a ``short`` fault that sent fewer pages than were reserved."""
    if not want:
        raise PolicyError("victims_shorted takes true")
    bad = sorted({w.get("victim_rid") for w in v.witnesses if not provenance.shorted(ctx.history, w.get("victim_rid"))})
    return bool(v.witnesses) and not bad, f"victims whose transfer no short fault cut short: {bad[:5]}"


def _sig_witnesses_are_timeouts(v, ctx, want):
    bad = [w for w in v.witnesses
           if not w.get("rid") or not (w.get("outcome") == "timeout" or "never ended" in (w.get("problem") or ""))]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"witnesses that are not a request's timeout: {[w.get('problem') for w in bad[:3]]}"


def _tagged(ctx: Context, tag: str) -> set:
    return {rid for rid, p in ctx.plans().items() if (p.get("extra") or {}).get("probe") == tag}


def _culprits(ctx: Context, what: str) -> set:
    """``what``: a plan tag, or "oversized" for the oversized requests."""
    if what == "oversized":
        return {rid for rid, p in ctx.plans().items() if p.get("oversized")}
    return _tagged(ctx, what)


def _sig_hung_behind(v, ctx, what):
    """Every hung request is one of the culprits or was sent after the first of them (queued behind
    a request that hangs the engine) — never one that was in flight before the culprits came."""
    culprits = _culprits(ctx, what)
    sends = {rid: e.get("wall", 0) for rid, e in ctx.history.sends.items()}
    first = min((sends[r] for r in culprits if r in sends), default=None)
    bad = [w["rid"] for w in _rid_witnesses(v)
           if w["rid"] not in culprits and (first is None or sends.get(w["rid"], 0) < first)]
    return bool(culprits) and first is not None and not bad, \
        f"hung requests neither {what!r} nor sent after the first of them: {bad[:5]}"


def _sig_all_tagged_hung(v, ctx, tag):
    tagged = _tagged(ctx, tag)
    hung = {w["rid"] for w in _rid_witnesses(v)}
    miss = sorted(tagged - hung)
    return bool(tagged) and not miss, f"requests tagged {tag!r} that did not hang: {miss[:5]}"


def _sig_oversized_all_hung(v, ctx, want):
    big = {rid for rid, p in ctx.plans().items() if p.get("oversized")}
    miss = sorted(r for r in big if ctx.history.outcome(r) not in (None, "timeout"))
    ok = bool(big) and not miss
    return ok == bool(want), f"oversized requests that did not hang: {miss[:5]}"


def _sig_victims_truncated(v, ctx, want):
    """Every victim is an oversized request whose KV prefill wrote, by its own transfer events (the
    pages of every chunk), was short of the prompt but more than the one-page placeholder of the
    reject path (truncated on prefill by ``--allow-auto-truncate``, not rejected), while decode
    reserved pages for more than was written (its own ``kv_prealloc``)."""
    if not want:
        raise PolicyError("victims_truncated takes true")
    plans = ctx.plans()
    sent = kv_pages_written(ctx.history)
    ps = kv_page_size(ctx.history)
    bad = []
    for w in v.witnesses:
        rid = w.get("victim_rid")
        p = plans.get(rid, {})
        n = sent.get(rid)
        sp = provenance.stale_pages(ctx.history, rid)
        if not (p.get("oversized") and isinstance(n, int) and 1 < n < pages_for(p.get("n_tokens") or 0, ps)):
            bad.append(f"{rid}: prefill's writes ({n} pages) are not a truncated prompt")
        elif sp is None or not sp["unwritten"]:
            bad.append(f"{rid}: decode's own evidence shows no page reserved beyond what prefill wrote")
    return bool(v.witnesses) and not bad, f"victims not decoded over a truncated prompt's unwritten pages: {bad[:3]}"


def _sig_fault_armed(v, ctx, kind):
    ok = any(e.get("kind") == kind for e in ctx.fault_events("armed"))
    return ok, f"no {kind!r} fault armed in this experiment"


def _sig_process_fault_fired(v, ctx, what):
    kind, _, role = str(what).partition(":")
    ok = any(e.get("injector") == "process" and e.get("kind") == kind and (not role or e.get("role") == role)
             for e in ctx.fault_events("fired"))
    return ok, f"no {kind} of {role or 'any role'} fired in this experiment"


def _sig_salts_lost_before_engine(v, ctx, want):
    """Every witness is a request whose cache_salt the engine never received (the agent's
    ``prefix_match``): cache_isolation witnesses carry ``engine_salt``; timing_isolation counts the
    timed requests whose salt was lost (``salts_lost`` of ``salted``)."""
    if v.oracle == "timing_isolation":
        lost, salted = v.stats.get("salts_lost"), v.stats.get("salted")
        ok = bool(salted) and lost == salted
        return ok == bool(want), f"{lost} of {salted} timed salted requests reached the engine without their salt"
    bad = [w.get("victim_rid") for w in v.witnesses
           if not (w.get("victim_salt") and "engine_salt" in w and w["engine_salt"] is None)]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"witnesses whose salt the engine did receive (or no agent evidence): {bad[:5]}"


def _sig_released_on_timeout(v, ctx, want):
    """Every kv_lifecycle witness is a write that landed after a release SGLang itself made because
    its deferred-release timeout passed (the outcome of *that* release, paired with the write by
    ``kv_lifecycle``), not after an early release or a drain ack."""
    bad = [w.get("room") for w in v.witnesses if w.get("release_outcome") != "timeout"]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"late writes that followed a release not made on timeout: {bad[:5]}"


def _sig_retried_after_abort(v, ctx, want):
    """Every abort_semantics witness is an aborted request answered 200 as a success that prefill saw
    again under a new bootstrap room after its abort (``attempts`` >= 2: a load balancer re-sent it)."""
    bad = [w.get("rid") for w in v.witnesses
           if not (w.get("status") == 200 and w.get("finish_reason") != "abort" and (w.get("attempts") or 0) >= 2)]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"aborted requests not answered by a second attempt: {bad[:5]}"


def _sig_engine_error(v, ctx, sig):
    ok = any(e.get("signature") == sig for e in ctx.engine_errors)
    return ok, f"no {sig!r} engine error in the servers' logs during this experiment"


SIGNATURES = {
    "owners_minted": _sig_owners_minted,
    "stale_pages_of_owner": _sig_stale_pages_of_owner,
    "victims_shorted": _sig_victims_shorted,
    "witnesses_are_timeouts": _sig_witnesses_are_timeouts,
    "hung_behind": _sig_hung_behind,
    "all_tagged_hung": _sig_all_tagged_hung,
    "oversized_all_hung": _sig_oversized_all_hung,
    "fault_armed": _sig_fault_armed,
    "victims_truncated": _sig_victims_truncated,
    "process_fault_fired": _sig_process_fault_fired,
    "engine_error": _sig_engine_error,
    "salts_lost_before_engine": _sig_salts_lost_before_engine,
    "released_on_timeout": _sig_released_on_timeout,
    "retried_after_abort": _sig_retried_after_abort,
}


def power_met(v: Verdict) -> tuple[bool, str]:
    """Whether a verdict was reached with the power to see what it judges: a leak checker's verdict
    that reports power must have it met, and an isolation verdict must report it."""
    pw = v.stats.get("power") if isinstance(v.stats, dict) else None
    if pw is None:
        return v.oracle != "isolation", "the verdict reports no power figures"
    if not isinstance(pw, dict) or not pw.get("met"):
        from kvchaos.oracles.isolation import power_line

        try:
            return False, f"power not met: {power_line(pw)}"
        except Exception:  # noqa: BLE001 - malformed figures are not power
            return False, "power not met"
    return True, ""


# --------------------------------------------------------------------------- registry
def _vtuple(s: str) -> tuple:
    parts = re.findall(r"\d+", s)
    if not parts:
        raise PolicyError(f"not a version: {s!r}")
    return tuple(int(x) for x in parts)


def version_matches(version: str | None, specs: list[str]) -> bool:
    """``specs``: exact versions ("0.5.23") or comma-joined ranges (">=0.5.20,<0.5.24")."""
    if not version:
        return False
    v = _vtuple(version)
    for spec in specs:
        ok = True
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(>=|<=|==|>|<)?\s*([\w.+-]+)\s*", part)
            if not m:
                raise PolicyError(f"bad version spec {spec!r}")
            op, want = m.group(1) or "==", _vtuple(m.group(2))
            ok &= {"==": v == want, ">=": v >= want, "<=": v <= want, ">": v > want, "<": v < want}[op]
        if ok:
            return True
    return False


@dataclass
class Match:
    checker: str
    statuses: list
    signature: dict


@dataclass
class Finding:
    id: str
    title: str
    engine: str
    versions: list
    matches: list
    upstream: list = field(default_factory=list)
    tests: list = field(default_factory=list)
    explanation: str = ""
    conditions: str = ""       # what it was measured under: deployment shape, injected timing
    reproduction: str = ""     # how to see it without the agent, where that exists

    def applies_to(self, engine: str, version: str | None) -> bool:
        return engine == self.engine and version_matches(version, self.versions)

    def exercised_by(self, nodeid: str) -> bool:
        return any(fnmatch.fnmatch(nodeid, pat) for pat in self.tests)

    def match(self, v: Verdict, ctx: Context) -> tuple[bool, str]:
        """Does verdict ``v`` (with its witnesses) match this finding on this engine?"""
        if not self.applies_to(ctx.engine, ctx.version):
            return False, f"not for {ctx.engine} {ctx.version} (listed: {self.versions})"
        why = "no entry for this checker/status"
        for m in self.matches:
            if m.checker != v.oracle or v.status not in m.statuses:
                continue
            if is_leak_checker(v.oracle):
                ok, reason = power_met(v)
                if not ok:  # a leak seen by a run that could not have seen one reliably is never KNOWN
                    return False, f"KNOWN needs the power to see the leak: {reason}"
            fails = []
            for name, arg in m.signature.items():
                try:
                    ok, reason = SIGNATURES[name](v, ctx, arg)
                except PolicyError:
                    raise
                except Exception as e:  # noqa: BLE001 - a signature that cannot be checked does not match
                    ok, reason = False, f"cannot be checked: {type(e).__name__}: {e}"
                if not ok:
                    fails.append(f"{name}: {reason}")
            if not fails:
                return True, "signature matched"
            why = "; ".join(fails)
        return False, why

    def brief(self) -> dict:
        return {"id": self.id, "title": self.title, "upstream": self.upstream, "versions": self.versions,
                "conditions": self.conditions}


class Registry:
    def __init__(self, findings: list[Finding], source: str = "<list>"):
        ids = [f.id for f in findings]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise PolicyError(f"{source}: finding id(s) {dup} listed twice")
        self.findings, self.source = findings, source

    @classmethod
    def load(cls, path: str | Path = FINDINGS_FILE) -> "Registry":
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise PolicyError(f"findings registry {path}: {e}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Registry":
        out = []
        allowed = {"id", "title", "engine", "versions", "match", "upstream", "tests", "explanation", "conditions",
                   "reproduction"}
        for i, f in enumerate(data.get("finding", [])):
            where = f"{source}: finding {f.get('id', i)!r}"
            unknown = sorted(set(f) - allowed)
            if unknown:
                raise PolicyError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
            for k in ("id", "title", "engine", "versions", "match"):
                if not f.get(k):
                    raise PolicyError(f"{where}: missing {k!r}")
            for spec in f["versions"]:
                version_matches("0", [spec])  # a bad spec is named here, not at match time
            matches = []
            for m in f["match"]:
                bad = sorted(set(m.get("signature", {})) - set(SIGNATURES))
                if bad:
                    raise PolicyError(f"{where}: unknown signature predicate(s) {bad}; known: {sorted(SIGNATURES)}")
                if not m.get("signature"):
                    raise PolicyError(f"{where}: a match needs a witness signature")
                sts = m.get("statuses") or [FAIL]
                if set(sts) - {FAIL, UNKNOWN}:
                    raise PolicyError(f"{where}: statuses {sts}: only 'fail' and 'unknown' can be known")
                matches.append(Match(m["checker"], list(sts), dict(m["signature"])))
            out.append(Finding(f["id"], f["title"], f["engine"], list(f["versions"]), matches,
                               list(f.get("upstream", [])), list(f.get("tests", [])), f.get("explanation", ""),
                               f.get("conditions", ""), f.get("reproduction", "")))
        return cls(out, source)

    def get(self, fid: str) -> Finding:
        for f in self.findings:
            if f.id == fid:
                return f
        raise PolicyError(f"unknown finding id {fid!r}; known: {[f.id for f in self.findings]}")

    def classify(self, v: Verdict, ctx: Context) -> tuple[Finding | None, str]:
        """The finding ``v`` matches (None if none), and why the closest one did not."""
        if v.status == PASS:
            return None, ""
        why = []
        for f in self.findings:
            ok, reason = f.match(v, ctx)
            if ok:
                return f, reason
            if f.applies_to(ctx.engine, ctx.version) and any(m.checker == v.oracle and v.status in m.statuses
                                                             for m in f.matches):
                why.append(f"{f.id}: {reason}")
        return None, "; ".join(why)


# --------------------------------------------------------------------------- policy
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
        out = []
        for v in verdicts:
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
        return _status((i.outcome, i.verdict.status, i.accepted) for i in self.items)

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


def _status(rows) -> str:
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


def status_of(items: list[dict], events=None) -> str:
    """The status of an experiment from its serialized items (a verdicts file): their outcomes when
    this policy recorded them; a file judged before (no outcomes, or no ``leak`` flags: written before
    the policy alone decided) is judged by the policy now (its ``required`` and the findings its run
    accepted kept, nothing planted)."""
    if items and all(isinstance(d, dict) and "outcome" in d and "leak" in d for d in items):
        return _status((d["outcome"], d.get("status"), bool((d.get("known") or {}).get("accepted"))) for d in items)
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


def leak_verdict(d: dict) -> bool:
    """A serialized verdict that is a leak: a leak checker's FAIL."""
    return d.get("status") == FAIL and bool(d.get("leak", is_leak_checker(d.get("oracle"))))


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


def not_reproduced(registry: Registry, ran: list[dict]) -> list[dict]:
    """Findings for the engine versions that ran whose exercising tests ran without showing them.
    ``ran``: per experiment {"test": nodeid, "engine": name, "version": v, "known": [finding ids]}."""
    out = []
    for f in registry.findings:
        runs = [r for r in ran if r.get("test") and f.exercised_by(r["test"]) and f.applies_to(r.get("engine"), r.get("version"))]
        if not runs:
            continue
        tests = sorted({r["test"] for r in runs})
        seen = {r["test"] for r in runs if f.id in (r.get("known") or [])}
        for t in tests:
            if t not in seen:
                ver = next(r["version"] for r in runs if r["test"] == t)
                out.append({"id": f.id, "title": f.title, "test": t, "version": ver,
                            "message": f"{f.id} did not reproduce on {f.engine} {ver} — fixed? ({t})"})
    return out
