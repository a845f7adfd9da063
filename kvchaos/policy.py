"""Verdict policy: what a run's verdicts mean for red or green, and the known engine findings.

Every checker says PASS, FAIL or UNKNOWN. A non-PASS verdict is **KNOWN** only when it matches an
entry of the findings registry (``kvchaos/findings.toml``: data, not code) for the engine and
version that ran, with every witness matching the entry's signature. Then:

* a run is red on any FAIL or UNKNOWN that is not KNOWN;
* KNOWN is red too unless accepted (``--kvchaos-accept-known`` or the profile's ``[policy]
  accept_known``: ``true`` or a list of finding ids); accepted KNOWN is its own outcome (terminal
  ``K``, JUnit ``skipped`` with the finding id, report.html) — never PASS;
* a finding is matched per verdict and per checker: a liveness finding cannot make an isolation,
  kv_lifecycle or differential FAIL or an isolation UNKNOWN anything but red;
* a leak-judging checker (isolation, kv_lifecycle, differential) that FAILs is red even when the
  test did not ask for it; isolation UNKNOWN is red too unless a blind model was declared;
* a self-test that did not catch its planted leak makes isolation UNKNOWN in every experiment of
  the session (red) unless a blind model was declared;
* a listed finding that a test exercising it did not reproduce is reported ("did not reproduce on
  0.5.23 — fixed?") and is a failure under ``--kvchaos-strict``.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict, agent_kind, kv_page_size, kv_pages_written, pages_for

KNOWN = "known"
FINDINGS_FILE = Path(__file__).resolve().parent / "findings.toml"
LEAK_CHECKERS = ("isolation", "kv_lifecycle", "differential", "cache_isolation", "timing_isolation")
STATUSES = (PASS, FAIL, UNKNOWN)


class PolicyError(ValueError):
    """A findings registry or policy setting that cannot be used as written."""


# --------------------------------------------------------------------------- context
@dataclass
class Context:
    """What a signature may look at besides the verdict: the experiment's event log (its header
    says which engine ran) and the known engine failures found in the servers' logs during it."""
    events: list = field(default_factory=list)
    engine: str = "sglang"
    version: str | None = None
    engine_errors: list = field(default_factory=list)

    @classmethod
    def of(cls, events: list[dict], engine_errors=()) -> "Context":
        head = next((e for e in events if e.get("ev") == "experiment"), {})
        eng = head.get("engine") or {}
        return cls(events, eng.get("name") or "sglang", eng.get("version"), list(engine_errors))

    def plans(self) -> dict[str, dict]:
        return {e["rid"]: e for e in self.events if e.get("ev") == "plan"}

    def fault_events(self, action: str | None = None) -> list[dict]:
        """Fault records of the experiment: the harness's ``fault`` events and the agents' own
        ``fault_fired`` (raw or copied into the log as ``agent``)."""
        out = []
        for e in self.events:
            if e.get("ev") == "fault" and (action is None or e.get("action") == action):
                out.append(e)
            elif agent_kind(e) == "fault_fired" and action in (None, "fired"):
                out.append({**e, "action": "fired"})
        return out


# --------------------------------------------------------------------------- signatures
def _rid_witnesses(v: Verdict) -> list[dict]:
    return [w for w in v.witnesses if w.get("rid") or w.get("victim_rid")]


def _targeted(ctx: Context, kind: str) -> set:
    return {e.get("rid") for e in ctx.fault_events("fired") if e.get("kind") == kind and e.get("rid")}


def _sig_victims_targeted_by_fault(v, ctx, kind):
    rids = _targeted(ctx, kind)
    bad = [w.get("victim_rid") for w in v.witnesses if w.get("victim_rid") not in rids]
    return bool(v.witnesses) and not bad, f"victims not targeted by a {kind!r} fault: {bad[:5]}"


def _sig_owners_minted(v, ctx, want):
    bad = [w.get("matched") for w in v.witnesses if w.get("origin") == "unknown"]
    return (not bad) == bool(want), f"canaries of unknown origin: {bad[:5]}"


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
    sends = {e["rid"]: e["wall"] for e in ctx.events if e.get("ev") == "send" and e.get("rid")}
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
    run_ends = {e["rid"]: e.get("outcome") for e in ctx.events if e.get("ev") == "end"}
    miss = sorted(r for r in big if run_ends.get(r) not in (None, "timeout"))
    ok = bool(big) and not miss
    return ok == bool(want), f"oversized requests that did not hang: {miss[:5]}"


def _sig_victims_truncated(v, ctx, want):
    """Every victim is an oversized request whose KV prefill wrote, by its own transfer events (the
    pages of every chunk), was short of the prompt but more than the one-page placeholder of the
    reject path: the prompt was truncated on prefill (``--allow-auto-truncate``), not rejected. Pages
    of the layout's page size: fewer than the whole prompt needs."""
    plans = ctx.plans()
    sent = kv_pages_written(ctx.events)
    ps = kv_page_size(ctx.events)
    bad = [w.get("victim_rid") for w in v.witnesses
           if not (plans.get(w.get("victim_rid"), {}).get("oversized")
                   and isinstance(sent.get(w.get("victim_rid")), int)
                   and 1 < sent[w["victim_rid"]] < pages_for(plans[w["victim_rid"]].get("n_tokens") or 0, ps))]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"victims that are not oversized prompts prefill sent truncated: {bad[:5]}"


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
    """Every kv_lifecycle witness is a room decode let go because its deferred-release timeout passed
    (SGLang's own outcome, from the agent's ``deferred_release``), not because prefill acked the drain."""
    bad = [w.get("room") for w in v.witnesses if w.get("release_outcome") != "timeout"]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"late writes into rooms not released on timeout: {bad[:5]}"


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
    "victims_targeted_by_fault": _sig_victims_targeted_by_fault,
    "owners_minted": _sig_owners_minted,
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
            fails = []
            for name, arg in m.signature.items():
                ok, reason = SIGNATURES[name](v, ctx, arg)
                if not ok:
                    fails.append(f"{name}: {reason}")
            if not fails:
                return True, "signature matched"
            why = "; ".join(fails)
        return False, why

    def brief(self) -> dict:
        return {"id": self.id, "title": self.title, "upstream": self.upstream, "versions": self.versions}


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
        allowed = {"id", "title", "engine", "versions", "match", "upstream", "tests", "explanation"}
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
                               list(f.get("upstream", [])), list(f.get("tests", [])), f.get("explanation", "")))
        return cls(out, source)

    def get(self, fid: str) -> Finding:
        for f in self.findings:
            if f.id == fid:
                return f
        raise PolicyError(f"unknown finding id {fid!r}; known: {[f.id for f in self.findings]}")

    def classify(self, v: Verdict, ctx: Context) -> Finding | None:
        if v.status == PASS:
            return None
        for f in self.findings:
            if f.match(v, ctx)[0]:
                return f
        return None


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

    def gate(self, verdicts: list[Verdict]) -> list[Verdict]:
        """Apply session-level evidence to fresh verdicts: with a self-test that did not catch its
        planted leak, no isolation verdict may say PASS."""
        why = self.selftest_blind()
        out = []
        for v in verdicts:
            if why and v.oracle == "isolation" and v.status == PASS:
                v = Verdict(v.oracle, UNKNOWN, f"{why}; the experiment alone said: {v.summary}", v.witnesses,
                            {**v.stats, "selftest": (self.selftest or {}).get("status")})
            out.append(v)
        return out

    def judge(self, verdicts: list[Verdict], ctx: Context, required: dict | None = None,
              planted: str | None = None, every_fail_counts: bool = False) -> "Judgement":
        """Each verdict against what is required of it (``required``: oracle -> wanted status;
        leak checkers are always held to 'not FAIL', isolation to 'not UNKNOWN'). ``planted``: the
        experiment carries a bug on purpose (a self-test's planted leak, a detection-matrix
        mutation) — then only ``required`` counts, and the record says what was planted.
        ``every_fail_counts``: with nobody to declare requirements (``kvchaos judge``), a FAIL of any
        checker is red, not only a leak checker's."""
        required = dict(required or {})
        by = {v.oracle: v for v in verdicts}
        missing = sorted(set(required) - set(by))
        if missing:
            raise PolicyError(f"required verdict(s) {missing} were not judged (have {sorted(by)})")
        items = []
        for v in verdicts:
            want = required.get(v.oracle)
            if want is not None and want not in STATUSES:
                raise PolicyError(f"require({v.oracle}={want!r}): one of {STATUSES}")
            if want is not None:
                ok = v.status == want
            elif v.oracle in LEAK_CHECKERS and not planted:
                ok = v.status != FAIL and not (v.oracle == "isolation" and v.status == UNKNOWN)
            else:
                ok = not (every_fail_counts and v.status == FAIL)  # else informational: not asked for
            if v.oracle == "isolation" and v.status == UNKNOWN and self.blind_model and want in (None, PASS):
                ok = True  # declared blind: isolation is not claimed (the report says so)
            finding = None if ok or (want is not None and want != PASS) else self.registry.classify(v, ctx)
            outcome = "ok" if ok else (KNOWN if finding else "red")
            items.append(Item(v, want, outcome, finding, finding is not None and self.accepted(finding)))
        return Judgement(items, ctx, planted)


@dataclass
class Item:
    verdict: Verdict
    wanted: str | None
    outcome: str  # ok | known | red
    finding: Finding | None = None
    accepted: bool = False

    def to_dict(self) -> dict:
        d = self.verdict.to_dict()
        d["required"] = self.wanted
        d["outcome"] = self.outcome
        if self.finding:
            d["known"] = {**self.finding.brief(), "accepted": self.accepted}
        return d


@dataclass
class Judgement:
    items: list
    ctx: Context
    planted: str | None = None

    @property
    def red(self) -> list[Item]:
        return [i for i in self.items if i.outcome == "red" or (i.outcome == KNOWN and not i.accepted)]

    @property
    def known(self) -> list[Item]:
        return [i for i in self.items if i.outcome == KNOWN]

    @property
    def status(self) -> str:
        """fail | unknown | known | pass — what this experiment means for the run."""
        if any(i.outcome == "red" and i.verdict.status == FAIL for i in self.items):
            return FAIL
        if any(i.outcome == "red" for i in self.items):
            return UNKNOWN
        if self.known:
            return KNOWN
        return PASS

    def message(self) -> str:
        lines = []
        for i in self.items:
            if i.outcome == "ok":
                continue
            v = i.verdict
            head = f"{v.oracle}: {v.status.upper()}" + (f" (required {i.wanted.upper()})" if i.wanted else "")
            if i.finding:
                head += (f" — KNOWN {i.finding.id}{'' if i.accepted else ' (not accepted: --kvchaos-accept-known)'}"
                         f": {i.finding.title}")
            lines.append(f"{head} — {v.summary}")
            for w in v.witnesses[:3]:
                lines.append(f"    witness: {_short(w)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"status": self.status, "planted": self.planted, "verdicts": [i.to_dict() for i in self.items],
                "known": [{**i.finding.brief(), "oracle": i.verdict.oracle, "accepted": i.accepted} for i in self.known]}


def _short(w: dict) -> str:
    keep = ("victim_rid", "victim_tenant", "owner_rid", "owner_tenant", "origin", "matched", "status", "outcome",
            "rid", "problem", "room", "after_release_ms")
    return ", ".join(f"{k}={w[k]}" for k in keep if w.get(k) is not None)


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
