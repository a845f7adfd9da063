"""Triage: what a fuzz run's non-PASS verdicts are.

Each verdict that is not PASS is matched against the findings registry with the policy's own
signatures (:meth:`kvchaos.policy.findings.Registry.classify`), so it becomes **KNOWN** with the
finding's id, or **NEW**. Triage asks only whether the *mechanism* is one we know: a leak whose every
witness matches a finding's signature is KNOWN even where some other exposure class of the run was
under its power floor (``power_met`` False says so). The policy itself never accepts such a run (there
an underpowered leak stays FAIL); a search that called it NEW would send a known bug through
confirmation and shrinking as if nobody had seen it. An UNKNOWN without witnesses is a blind run (the
workload did not give the power to see a leak): counted, never a find. A FAIL of a checker that is not a
leak checker (liveness, http_semantics, abort_semantics) whose every witness is a request the scenario
broke on purpose — a fault fired on it, it was in flight while a role was killed or stopped or a toxic
sat on the wire, the client aborted or cut it — is **expected**: the fault did what it does. Where only
some witnesses are such requests, the registry is asked about the rest (a park held one request to its
timeout while the others hung behind a band prompt: KNOWN as the hang band). A leak checker's FAIL is
never expected, nor ever judged on part of its witnesses, whatever was injected. The registry only
triages; it never steers what is generated.

A NEW verdict is deduplicated by its *mechanism*, not by who the victim was: the checker, its status,
and what its witnesses say happened (the kind of problem, the HTTP status class, the canary's origin,
whether the victim's transfer was cut short, the faults that fired on the victim). Two runs with the
same mechanism are one find.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict
from kvchaos.policy.core import is_leak_checker
from kvchaos.policy.signatures import pool_within_holders, power_met
from kvchaos.workload.plan import CLIENT_CUTS


@dataclass
class Find:
    oracle: str
    status: str
    kind: str            # known | new | blind | expected
    finding: str | None  # the registry id when known
    signature: str       # the mechanism's id (dedup key)
    mechanism: dict = field(default_factory=dict)
    summary: str = ""
    why_not_known: str = ""
    power_met: bool | None = None  # a leak checker's verdict: did the run have the power (signatures.power_met)

    def to_dict(self) -> dict:
        return {"oracle": self.oracle, "status": self.status, "kind": self.kind, "finding": self.finding,
                "signature": self.signature, "mechanism": self.mechanism, "summary": self.summary[:400],
                "why_not_known": self.why_not_known[:600], "power_met": self.power_met}


def _fired_on(records, rid) -> list[str]:
    return sorted({f"{e.get('kind')}:{e.get('phase') or 'fired'}" for e in records
                   if e.get("ev") == "agent" and e.get("agent_ev") == "fault_fired" and e.get("rid") == rid})


def _handoff(records, rid) -> str:
    """What the engines' own events say decode got for ``rid``: ``short`` where prefill wrote fewer KV
    pages (its agent's ``write_end``) than decode reserved (``kv_prealloc``'s ``dst_pages_total``) —
    the GLM-5.3 mechanism, a rejected prompt's one-page placeholder under a whole prompt's reservation —
    ``whole``, ``reserved_only`` (nothing written), ``written_only``, or ``none`` (no transfer seen)."""
    reserved, written = None, 0
    for e in records:
        if e.get("ev") != "agent" or e.get("rid") != rid:
            continue
        a = e.get("agent_ev")
        if a == "kv_prealloc" and isinstance(e.get("dst_pages_total"), int):
            reserved = max(reserved or 0, e["dst_pages_total"])
        elif a == "write_end" and isinstance(e.get("pages"), int):
            written += e["pages"]
    if reserved is None:
        return "written_only" if written else "none"
    if not written:
        return "reserved_only"
    return "short" if written < reserved else "whole"


def mechanism(verdict, records) -> dict:
    """What the verdict's witnesses say happened, without the names of who it happened to."""
    kinds, statuses, origins, fired, handoff = set(), set(), set(), set(), set()
    for w in verdict.witnesses or []:
        if not isinstance(w, dict):
            continue
        rid = w.get("victim_rid") or w.get("rid")
        if w.get("problem"):
            kinds.add(str(w["problem"]).split(":")[0].split("(")[0].strip()[:60])
        if w.get("outcome"):
            kinds.add(f"outcome={w['outcome']}")
        if w.get("status") is not None:
            statuses.add(f"{int(w['status']) // 100}xx" if str(w["status"]).isdigit() else str(w["status"]))
        if "origin" in w:  # "this log", "session (experiment X)", "unknown": the kind, not which experiment
            origins.add(str(w["origin"]).split(" (")[0])
        elif w.get("owner_rid"):
            origins.add("owned")
        if rid:
            fired.update(_fired_on(records, rid))
            if w.get("victim_rid"):  # a leak's victim: what decode was handed for it
                handoff.add(_handoff(records, rid))
    return {"oracle": verdict.oracle, "status": verdict.status, "kinds": sorted(kinds), "http": sorted(statuses),
            "origins": sorted(origins), "faults_on_victims": sorted(fired), "victims_kv_handoff": sorted(handoff)}


def signature(mech: dict) -> str:
    return hashlib.sha256(json.dumps(mech, sort_keys=True).encode()).hexdigest()[:12]


def broken_on_purpose(records) -> tuple[set, bool]:
    """The requests the scenario itself broke (module doc), and whether a role was killed or stopped."""
    rids, windows, node = set(), [], False
    sends, ends = {}, {}
    open_at: dict = {}
    for e in records:
        ev = e.get("ev")
        if ev == "plan" and (e.get("kind") in CLIENT_CUTS or e.get("abort_after_ms") is not None):
            rids.add(e["rid"])
        elif ev == "send":
            sends[e["rid"]] = e.get("wall", 0)
        elif ev == "end":
            ends[e["rid"]] = e.get("wall", 0)
        elif ev == "agent" and e.get("agent_ev") == "fault_fired" and e.get("rid"):
            rids.add(e["rid"])
        elif ev == "fault":
            at = e.get("at", e.get("wall", 0))
            if e.get("action") == "abort_request" and e.get("rid"):
                rids.add(e["rid"])
            elif e.get("injector") == "process" and e.get("action") == "fired":
                node = True
                open_at[("process", e.get("role"))] = at
            elif e.get("injector") == "process" and e.get("action") == "healed":
                start = open_at.pop(("process", e.get("role")), None)
                if start is not None:
                    windows.append((start, at))
            elif e.get("injector") == "proxy" and e.get("action") == "armed":
                open_at[("proxy", e.get("fault"))] = at
            elif e.get("injector") == "proxy" and e.get("action") == "healed":
                start = open_at.pop(("proxy", e.get("fault")), None)
                if start is not None:
                    windows.append((start, at))
    windows += [(start, float("inf")) for start in open_at.values()]  # never healed in the log: to the end
    for rid, t0 in sends.items():
        t1 = ends.get(rid, float("inf"))
        if any(t0 <= b and a <= t1 for a, b in windows):
            rids.add(rid)
    return rids, node


def _unbroken(v, broken: set):
    """``v`` with only the witnesses the scenario did not break on purpose (a liveness FAIL where a park
    held some requests to their timeout and the rest hung behind a band prompt: the rest is what the
    registry is asked about), or None where that is all of them or none. A pool witness whose holders
    (``held_by``) the scenario all broke is theirs; otherwise it keeps the holders it did not break.
    Never for a leak checker: a leak is a leak whatever was injected."""
    if is_leak_checker(v.oracle):
        return None
    keep = []
    for w in v.witnesses:
        rid = w.get("rid") or w.get("victim_rid") if isinstance(w, dict) else None
        if rid is not None:
            if rid not in broken:
                keep.append(w)
        elif isinstance(w, dict) and w.get("held_by"):
            held = [r for r in w["held_by"] if r not in broken]
            within = pool_within_holders(w)
            if held or not within:  # more than its holders could hold: never the scenario's
                keep.append({**w, "held_by": held} if within else w)
        else:
            keep.append(w)
    if not keep or len(keep) == len(v.witnesses) and keep == list(v.witnesses):
        return None
    return Verdict(v.oracle, v.status, v.summary, keep, v.stats)


def _expected(v, broken: set, node: bool) -> bool:
    """``broken``, ``node``: :func:`broken_on_purpose` of the run."""
    if is_leak_checker(v.oracle) or v.status != FAIL or not v.witnesses:
        return False
    for w in v.witnesses:
        rid = w.get("rid") or w.get("victim_rid") if isinstance(w, dict) else None
        if rid is None:
            if not node:  # a cluster-wide problem (no answer after the run, pool not back) needs a node fault
                return False
        elif rid not in broken:
            return False
    return True


def triage(verdicts, ctx, registry, records) -> list[Find]:
    """A :class:`Find` per verdict that is not PASS."""
    out = []
    on_purpose = None  # broken_on_purpose(records), read once and only when a verdict needs it
    for v in verdicts:
        if v.status == PASS:
            continue
        mech = mechanism(v, records)
        sig = signature(mech)
        if v.status == UNKNOWN and not v.witnesses:
            out.append(Find(v.oracle, v.status, "blind", None, sig, mech, v.summary))
            continue
        f, why = registry.classify(v, ctx, require_power=False)
        if f is not None:
            out.append(Find(v.oracle, v.status, "known", f.id, sig, mech, v.summary,
                            power_met=power_met(v)[0] if is_leak_checker(v.oracle) else None))
            continue
        if on_purpose is None and not is_leak_checker(v.oracle):
            on_purpose = broken_on_purpose(records)
        if on_purpose is not None and _expected(v, *on_purpose):
            out.append(Find(v.oracle, v.status, "expected", None, sig, mech, v.summary))
            continue
        rest = _unbroken(v, on_purpose[0]) if on_purpose is not None else None
        g, why_rest = registry.classify(rest, ctx, require_power=False) if rest is not None else (None, "")
        if g is not None:
            n = len(v.witnesses) - len(rest.witnesses)
            out.append(Find(v.oracle, v.status, "known", g.id, sig, mech,
                            f"{v.summary} [{n} witness(es) the scenario broke on purpose; the rest: {g.id}]"))
        else:
            rest_why = f" | without the witnesses the scenario broke on purpose: {why_rest}" if rest else ""
            out.append(Find(v.oracle, v.status, "new", None, sig, mech, v.summary, why + rest_why))
    return out


def is_leak(find: Find) -> bool:
    return find.status == FAIL and is_leak_checker(find.oracle)
