"""Triage: what a fuzz run's non-PASS verdicts are.

Each verdict that is not PASS is matched against the findings registry exactly as the policy matches
a suite's (same signatures, same power rule: :meth:`kvchaos.policy.findings.Registry.classify`), so it
becomes **KNOWN** with the finding's id, or **NEW**. An isolation UNKNOWN without witnesses is a blind
run (the workload did not give the power to see a leak), neither: counted, never a find. The registry
only triages; it never steers what is generated.

A NEW verdict is deduplicated by its *mechanism*, not by who the victim was: the checker, its status,
and what its witnesses say happened (the kind of problem, the HTTP status class, the canary's origin,
whether the victim's transfer was cut short, the faults that fired on the victim). Two runs with the
same mechanism are one find.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvchaos.oracles import FAIL, PASS, UNKNOWN
from kvchaos.policy.core import is_leak_checker


@dataclass
class Find:
    oracle: str
    status: str
    kind: str            # known | new | blind
    finding: str | None  # the registry id when known
    signature: str       # the mechanism's id (dedup key)
    mechanism: dict = field(default_factory=dict)
    summary: str = ""
    why_not_known: str = ""

    def to_dict(self) -> dict:
        return {"oracle": self.oracle, "status": self.status, "kind": self.kind, "finding": self.finding,
                "signature": self.signature, "mechanism": self.mechanism, "summary": self.summary[:400],
                "why_not_known": self.why_not_known[:600]}


def _fired_on(records, rid) -> list[str]:
    return sorted({f"{e.get('kind')}:{e.get('phase') or 'fired'}" for e in records
                   if e.get("ev") == "agent" and e.get("agent_ev") == "fault_fired" and e.get("rid") == rid})


def mechanism(verdict, records) -> dict:
    """What the verdict's witnesses say happened, without the names of who it happened to."""
    kinds, statuses, origins, fired = set(), set(), set(), set()
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
        if "origin" in w:
            origins.add(str(w["origin"]))
        elif w.get("owner_rid"):
            origins.add("owned")
        if rid:
            fired.update(_fired_on(records, rid))
    return {"oracle": verdict.oracle, "status": verdict.status, "kinds": sorted(kinds), "http": sorted(statuses),
            "origins": sorted(origins), "faults_on_victims": sorted(fired)}


def signature(mech: dict) -> str:
    return hashlib.sha256(json.dumps(mech, sort_keys=True).encode()).hexdigest()[:12]


def triage(verdicts, ctx, registry, records) -> list[Find]:
    """A :class:`Find` per verdict that is not PASS."""
    out = []
    for v in verdicts:
        if v.status == PASS:
            continue
        mech = mechanism(v, records)
        sig = signature(mech)
        if v.status == UNKNOWN and not v.witnesses:
            out.append(Find(v.oracle, v.status, "blind", None, sig, mech, v.summary))
            continue
        f, why = registry.classify(v, ctx)
        if f is not None:
            out.append(Find(v.oracle, v.status, "known", f.id, sig, mech, v.summary))
        else:
            out.append(Find(v.oracle, v.status, "new", None, sig, mech, v.summary, why))
    return out


def is_leak(find: Find) -> bool:
    return find.status == FAIL and is_leak_checker(find.oracle)
