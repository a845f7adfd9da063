"""Oracles: functions of the event log returning ``pass`` / ``fail`` / ``unknown`` with witnesses.

* :func:`isolation` — a response holding a canary minted for another request is a LEAK; the
  witness names victim rid and tenant, owner rid and tenant, the matched text and its offsets.
  Exact payloads and partial matches (any ``partial_len``-character window of a payload) are
  found in one Aho-Corasick pass (pyahocorasick). If no leak is found but the responses do not
  echo their own canaries at the probe model's rate, the verdict is ``unknown``, never ``pass``.
* :func:`sensitivity` — own-canary echo rate over completed requests that should echo.
* :func:`differential` — greedy output vs the same prompt served alone on a clean single server.
* :func:`http_semantics` — a prompt the engine must reject (over the pool or the context) must get
  a 4xx with an error; HTTP 200 with content is a failure.
* :func:`liveness` — every request ends, within the bound; the cluster answers afterwards; the KV
  pool returns to its idle baseline (no pages lost).
* :func:`kv_lifecycle` — from the engines' own evidence (the in-engine agent's ``write_end`` on
  prefill, ``kv_released`` on decode): no KV write lands in decode pages after decode gave them back
  (an abort that frees pages while a write to them is in flight: late writes into recycled pages).
  Sees the bug even when no reply happens to show the foreign data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import ahocorasick

from kvchaos import canary

PASS, FAIL, UNKNOWN = "pass", "fail", "unknown"
ECHO_RATE = 0.99


@dataclass
class Verdict:
    oracle: str
    status: str
    summary: str
    witnesses: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        return f"{self.oracle}: {self.status.upper()} — {self.summary}"


class Run:
    """Index of an event log by request."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.plans: dict[str, dict] = {}
        self.bodies: dict[str, dict] = {}
        self.ends: dict[str, dict] = {}
        self.statuses: dict[str, int] = {}
        self.sends: dict[str, dict] = {}
        self.by_ev = defaultdict(list)
        for e in events:
            self.by_ev[e.get("ev")].append(e)
            rid = e.get("rid")
            ev = e.get("ev")
            if ev == "plan":
                self.plans[rid] = e
            elif ev == "body":
                self.bodies[rid] = e
            elif ev == "end":
                self.ends[rid] = e
            elif ev == "send":
                self.sends[rid] = e
            elif ev == "status" and not e.get("headers_only"):
                self.statuses[rid] = e.get("status")

    def response_text(self, rid: str) -> str:
        b = self.bodies.get(rid) or {}
        return (b.get("text") or "") + ("\n" + b["error"] if b.get("error") else "")


# --------------------------------------------------------------------------- isolation
def _automaton(plans: dict[str, dict], partial_len: int):
    a = ahocorasick.Automaton()
    owners: dict[str, list] = defaultdict(list)
    for rid, p in plans.items():
        for c in p.get("canaries") or []:
            pay = canary.payload(c)
            owners[pay].append((rid, p.get("tenant"), c, "exact"))
            for i in range(len(pay) - partial_len + 1):
                owners[pay[i:i + partial_len]].append((rid, p.get("tenant"), c, "partial"))
    for key, val in owners.items():
        a.add_word(key, (key, val))
    if len(a):
        a.make_automaton()
    return a


def scan(text: str, automaton) -> list[tuple[int, int, str, list]]:
    """(start, end, matched, owners) for every exact or partial canary hit in ``text``."""
    if not len(automaton):
        return []
    return [(end - len(key) + 1, end + 1, key, owners) for end, (key, owners) in automaton.iter(text)]


def isolation(events: list[dict], partial_len: int = 8, echo_rate: float = ECHO_RATE) -> Verdict:
    run = Run(events)
    auto = _automaton(run.plans, partial_len)
    witnesses = []
    for rid in run.bodies:
        text = run.response_text(rid)
        victim = run.plans.get(rid, {})
        hits = scan(text, auto)
        exact_spans = [(s, e) for s, e, _k, own in hits if any(o[3] == "exact" for o in own)]
        for s, e, key, owners in hits:
            foreign = [o for o in owners if o[0] != rid]
            if not foreign or any(o[0] == rid for o in owners):
                continue  # own canary (or a window of one)
            kind = "exact" if any(o[3] == "exact" for o in foreign) else "partial"
            if kind == "partial" and any(a <= s and e <= b for a, b in exact_spans):
                continue  # window inside an exact hit already reported
            for owner_rid, owner_tenant, c, _ in {(o[0], o[1], o[2], kind) for o in foreign}:
                witnesses.append({
                    "victim_rid": rid, "victim_tenant": victim.get("tenant"),
                    "owner_rid": owner_rid, "owner_tenant": owner_tenant,
                    "canary": c, "matched": key, "match": kind, "offsets": [s, e],
                    "same_tenant": owner_tenant == victim.get("tenant"),
                    "status": run.statuses.get(rid),
                    "excerpt": text[max(0, s - 40):e + 40],
                })
    sens = sensitivity(events, echo_rate)
    n = len(run.bodies)
    if witnesses:
        victims = sorted({w["victim_rid"] for w in witnesses})
        w0 = witnesses[0]
        return Verdict("isolation", FAIL,
                       f"LEAK: {len(victims)} of {n} responses hold canaries minted for other requests "
                       f"(first: {w0['victim_rid']} ({w0['victim_tenant']}) got {w0['matched']!r} of "
                       f"{w0['owner_rid']} ({w0['owner_tenant']}), HTTP {w0['status']})",
                       witnesses, {"responses": n, "victims": len(victims), "sensitivity": sens.stats})
    if sens.status != PASS:
        return Verdict("isolation", UNKNOWN, f"no foreign canary in {n} responses, but the model cannot show a "
                       f"leak: {sens.summary}", [], {"responses": n, "sensitivity": sens.stats})
    return Verdict("isolation", PASS, f"no foreign canary in {n} responses; {sens.summary}", [],
                   {"responses": n, "sensitivity": sens.stats})


def sensitivity(events: list[dict], echo_rate: float = ECHO_RATE, min_samples: int = 1) -> Verdict:
    """Own-canary echo over requests that completed normally and were built to echo."""
    run = Run(events)
    eligible, echoed, misses = 0, 0, []
    for rid, p in run.plans.items():
        end = run.ends.get(rid, {})
        if not p.get("expect_echo") or p.get("oversized") or end.get("outcome") != "ok" or run.statuses.get(rid) != 200:
            continue
        meta = (run.bodies.get(rid) or {}).get("meta") or {}
        fr = (meta.get("finish_reason") or {}).get("type") if isinstance(meta.get("finish_reason"), dict) else None
        if fr == "abort":
            continue
        eligible += 1
        text = run.response_text(rid)
        missing = [c for c in p.get("canaries") or [] if canary.payload(c) not in text]
        if missing:
            if len(misses) < 10:
                misses.append({"rid": rid, "missing": missing, "reply": text[:120]})
        else:
            echoed += 1
    rate = echoed / eligible if eligible else 0.0
    stats = {"eligible": eligible, "echoed": echoed, "rate": rate, "threshold": echo_rate}
    if eligible < min_samples:
        return Verdict("sensitivity", UNKNOWN, "no completed request that should echo its canaries", [], stats)
    if rate < echo_rate:
        return Verdict("sensitivity", UNKNOWN, f"own-canary echo {echoed}/{eligible} = {100 * rate:.1f} % "
                       f"< {100 * echo_rate:.0f} %: this model/prompt mix cannot reveal a leak", misses, stats)
    return Verdict("sensitivity", PASS, f"own-canary echo {echoed}/{eligible} = {100 * rate:.1f} %", misses, stats)


# --------------------------------------------------------------------------- differential
def differential(events: list[dict], reference: dict[str, dict]) -> Verdict:
    """``reference``: rid -> {"output_ids": [...], "text": ...} from a clean single server."""
    run = Run(events)
    compared, witnesses = 0, []
    for rid, ref in reference.items():
        body = run.bodies.get(rid)
        if body is None or run.statuses.get(rid) != 200:
            continue
        compared += 1
        got, want = body.get("output_ids"), ref.get("output_ids")
        if got is None or want is None:
            got, want = body.get("text"), ref.get("text")
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            witnesses.append({"rid": rid, "tenant": run.plans.get(rid, {}).get("tenant"), "first_diff": i,
                              "cluster": body.get("text", "")[:160], "reference": ref.get("text", "")[:160]})
    if not compared:
        return Verdict("differential", UNKNOWN, "no request had both a cluster and a reference answer")
    if witnesses:
        return Verdict("differential", FAIL, f"{len(witnesses)}/{compared} outputs differ from the single server "
                       f"(first: {witnesses[0]['rid']} at token {witnesses[0]['first_diff']})", witnesses,
                       {"compared": compared})
    return Verdict("differential", PASS, f"{compared} outputs token-identical to the single server", [],
                   {"compared": compared})


# --------------------------------------------------------------------------- HTTP semantics
def http_semantics(events: list[dict]) -> Verdict:
    run = Run(events)
    checked, witnesses, undecided = 0, [], []
    for rid, p in run.plans.items():
        if not p.get("oversized"):
            continue
        status = run.statuses.get(rid)
        if status is None:
            undecided.append(rid)
            continue
        checked += 1
        body = run.bodies.get(rid) or {}
        if status == 200:
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "status": 200, "n_tokens": p.get("n_tokens"),
                              "problem": "rejected-size prompt answered HTTP 200", "text": (body.get("text") or "")[:200]})
        elif not (400 <= status < 500 and body.get("error")):
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "status": status, "n_tokens": p.get("n_tokens"),
                              "problem": "rejection is not a 4xx with an error message", "error": body.get("error")})
    stats = {"checked": checked, "no_status": len(undecided)}
    if witnesses:
        return Verdict("http_semantics", FAIL, f"{len(witnesses)}/{checked} oversized prompts not rejected with "
                       f"4xx+error (first: {witnesses[0]['rid']}: {witnesses[0]['problem']}, HTTP {witnesses[0]['status']})",
                       witnesses, stats)
    if not checked:
        return Verdict("http_semantics", UNKNOWN, "no oversized request got an HTTP status"
                       + (f" ({len(undecided)} never answered: see liveness)" if undecided else ""), [], stats)
    return Verdict("http_semantics", PASS, f"{checked} oversized prompts rejected with 4xx and an error", [], stats)


# --------------------------------------------------------------------------- liveness
def liveness(events: list[dict], bound_s: float, pool_tolerance_tokens: int = 0) -> Verdict:
    """Every request ended (and within ``bound_s``); the post-run probe answered; the KV pool is
    back at its idle baseline (``probe`` events with phase ``before``/``after`` and ``kv_used``)."""
    run = Run(events)
    witnesses = []
    for rid, p in run.plans.items():
        end = run.ends.get(rid)
        if end is None:
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "problem": "never ended (no end event)"})
        elif end.get("outcome") == "timeout" or (end.get("latency_s") or 0) > bound_s:
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "problem": f"no answer within {bound_s:.0f} s",
                              "outcome": end.get("outcome"), "latency_s": end.get("latency_s"),
                              "n_tokens": p.get("n_tokens"), "kind": p.get("kind")})
    probes = run.by_ev.get("probe", [])
    after = [e for e in probes if e.get("phase") == "after"]
    for e in after:
        if not e.get("ok"):
            witnesses.append({"problem": "cluster did not answer after the run", "probe": e.get("detail")})
    before_used = {e.get("role"): e.get("kv_used") for e in probes if e.get("phase") == "before" and e.get("kv_used") is not None}
    pool = {}
    for e in after:
        role, used = e.get("role"), e.get("kv_used")
        if role in before_used and used is not None:
            pool[role] = (before_used[role], used)
            if used > before_used[role] + pool_tolerance_tokens:
                witnesses.append({"problem": f"{role} KV pool did not return to its idle baseline",
                                  "kv_used_before": before_used[role], "kv_used_after": used})
    stats = {"requests": len(run.plans), "ended": len(run.ends), "pool": pool, "after_probes": len(after)}
    if witnesses:
        return Verdict("liveness", FAIL, f"{len(witnesses)} liveness problems (first: "
                       f"{witnesses[0].get('rid', '')} {witnesses[0]['problem']})", witnesses, stats)
    if not after:
        return Verdict("liveness", UNKNOWN, f"all {len(run.plans)} requests ended within {bound_s:.0f} s, "
                       "but no post-run probe of the cluster was recorded", [], stats)
    return Verdict("liveness", PASS, f"all {len(run.plans)} requests ended within {bound_s:.0f} s; cluster answers"
                   + ("; KV pool back to baseline" if pool else ""), [], stats)


# --------------------------------------------------------------------------- kv lifecycle
def _agent_kind(e: dict) -> str | None:
    """Agent events appear raw (``ev``) or copied into a test log (``ev == "agent"``, ``agent_ev``)."""
    if e.get("ev") == "agent":
        return e.get("agent_ev")
    return e.get("ev") if e.get("source") == "agent" else None


def kv_lifecycle(events: list[dict], tolerance_s: float = 0.0) -> Verdict:
    """No KV write into decode's pages ends after decode released them (same bootstrap room)."""
    released: dict = {}
    writes = defaultdict(list)
    n_writes = 0
    for e in events:
        kind = _agent_kind(e)
        room = e.get("room")
        if room is None:
            continue
        if kind == "kv_released":
            if room not in released or e["wall"] < released[room]["wall"]:
                released[room] = e
        elif kind == "write_end":
            writes[room].append(e)
            n_writes += 1
    witnesses = []
    for room, rel in released.items():
        for w in writes.get(room, []):
            if w["wall"] > rel["wall"] + tolerance_s:
                witnesses.append({"room": room, "rid": w.get("rid") or rel.get("rid"), "pages": w.get("pages"),
                                  "released_at": rel["wall"], "write_start": w.get("wall_start"), "write_end": w["wall"],
                                  "after_release_ms": round(1000 * (w["wall"] - rel["wall"]), 1),
                                  "deferred_release_enabled": rel.get("deferred_release_enabled"),
                                  "problem": "KV write landed in decode pages after decode released them"})
    stats = {"writes": n_writes, "released_rooms": len(released),
             "released_with_writes": sum(1 for r in released if writes.get(r))}
    if witnesses:
        w = witnesses[0]
        return Verdict("kv_lifecycle", FAIL, f"{len(witnesses)} KV write(s) landed after decode released the pages "
                       f"(first: room {w['room']} rid {w['rid']}: {w['pages']} pages, {w['after_release_ms']} ms "
                       "after release)", witnesses, stats)
    if not n_writes:
        return Verdict("kv_lifecycle", UNKNOWN, "no engine-side write evidence (in-engine agent not loaded?)", [], stats)
    if not released:
        return Verdict("kv_lifecycle", UNKNOWN, f"{n_writes} writes, but no failed/aborted transfer released pages: "
                       "nothing to judge", [], stats)
    return Verdict("kv_lifecycle", PASS, f"{len(released)} released room(s), {stats['released_with_writes']} with "
                   f"writes: every write ended before its pages were released", [], stats)


ALL = ("isolation", "sensitivity", "http_semantics", "liveness", "kv_lifecycle")
