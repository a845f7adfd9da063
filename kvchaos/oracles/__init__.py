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
* :func:`abort_semantics` — a request aborted at any stage comes back as aborted (an error, or 200
  with finish reason ``abort``), never as a 200 success while the abort provably reached it in time.
* :func:`retraction` — from decode's own evidence: every request decode retracted got its own KV
  back bit-exact when it resumed, and none was answered without being resumed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import math
import re

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

    def responses(self) -> list[str]:
        """Every request the client got any reply bytes for (a ``body`` event: complete or not)."""
        return list(self.bodies)

    def response_text(self, rid: str) -> str:
        """Everything the client saw of the reply: the parsed text, the error, then every raw byte
        received (streams cut, aborted or timed out included) — what isolation scans."""
        b = self.bodies.get(rid) or {}
        return "\n".join(x for x in (b.get("text") or "", b.get("error") or "", b.get("raw") or "") if x)


# --------------------------------------------------------------------------- isolation
def _automaton(plans: dict[str, dict], partial_len: int, registry=None):
    """Every canary this log's plans carry, plus every canary of ``registry`` (canaries minted
    elsewhere in the session: other tests, other waves, the self-test)."""
    a = ahocorasick.Automaton()
    owners: dict[str, list] = defaultdict(list)
    minted = [(rid, p.get("tenant"), c, None) for rid, p in plans.items() for c in p.get("canaries") or []]
    if registry is not None:  # by canary, not rid: another log may reuse a rid for other canaries
        own = {c for _r, _t, c, _s in minted}
        minted += [(m.rid, m.tenant, m.canary, m.source) for m in registry.entries() if m.canary not in own]
    for rid, tenant, c, source in minted:
        pay = canary.payload(c)
        owners[pay].append((rid, tenant, c, "exact", source))
        for i in range(len(pay) - partial_len + 1):
            owners[pay[i:i + partial_len]].append((rid, tenant, c, "partial", source))
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


def isolation(events: list[dict], partial_len: int = 8, echo_rate: float = ECHO_RATE, registry=None,
              floor: "SensitivityFloor | None" = None) -> Verdict:
    """A reply (any byte the client received: complete, streamed, cut, aborted, timed out, error
    bodies) holding a canary minted for another request — in this log or, with ``registry``,
    anywhere in the session — or a well-formed canary nobody minted is a LEAK."""
    run = Run(events)
    auto = _automaton(run.plans, partial_len, registry)
    witnesses, seen = [], set()
    for rid in run.responses():
        text = run.response_text(rid)
        victim = run.plans.get(rid, {})
        hits = scan(text, auto)
        exact_spans = [(s, e) for s, e, _k, own in hits if any(o[3] == "exact" for o in own)]
        common = {"victim_rid": rid, "victim_tenant": victim.get("tenant"),
                  # a cut or abandoned reply has its status only on the headers / its end
                  "status": run.statuses.get(rid) or (run.ends.get(rid) or {}).get("status"),
                  "outcome": (run.ends.get(rid) or {}).get("outcome"),
                  "complete": (run.bodies.get(rid) or {}).get("complete", True)}
        for s, e, key, owners in hits:
            # own: minted for this request in this log (a registry entry of the same rid is another request)
            foreign = [o for o in owners if not (o[0] == rid and o[4] is None)]
            if not foreign or len(foreign) < len(owners):
                continue  # own canary (or a window of one)
            kind = "exact" if any(o[3] == "exact" for o in foreign) else "partial"
            if kind == "partial" and any(a <= s and e <= b for a, b in exact_spans):
                continue  # window inside an exact hit already reported
            for owner_rid, owner_tenant, c, source in {(o[0], o[1], o[2], o[4]) for o in foreign}:
                if (rid, owner_rid, c, kind) in seen:
                    continue  # the same canary again (e.g. in the raw bytes after the parsed text)
                seen.add((rid, owner_rid, c, kind))
                witnesses.append({**common, "owner_rid": owner_rid, "owner_tenant": owner_tenant,
                                  "origin": "this log" if source is None else f"session ({source})",
                                  "canary": c, "matched": key, "match": kind, "offsets": [s, e],
                                  "same_tenant": owner_tenant == victim.get("tenant"),
                                  "excerpt": text[max(0, s - 40):e + 40]})
        # a well-formed canary that nobody in this session minted: foreign by definition (one that
        # overlaps a hit is a recital of a minted canary, already judged above)
        spans = [(s, e) for s, e, _k, _o in hits]
        for m in RECITED.finditer(text):
            pay = m.group(1)
            if any(a < m.end(1) and m.start(1) < b for a, b in spans) or (rid, None, pay, "unknown") in seen:
                continue
            seen.add((rid, None, pay, "unknown"))
            s, e = m.start(1), m.end(1)
            witnesses.append({**common, "owner_rid": None, "owner_tenant": None, "origin": "unknown",
                              "canary": f"[{pay}]", "matched": pay, "match": "unknown-origin", "offsets": [s, e],
                              "same_tenant": False, "excerpt": text[max(0, s - 40):e + 40],
                              "problem": "canary of unknown origin (minted by nobody in this session)"})
    sens = sensitivity(events, echo_rate, floor=floor)
    n = len(run.responses())
    if witnesses:
        victims = sorted({w["victim_rid"] for w in witnesses})
        w0 = witnesses[0]
        owner = (f"{w0['owner_rid']} ({w0['owner_tenant']})" if w0["owner_rid"] else "nobody: canary of unknown origin")
        return Verdict("isolation", FAIL,
                       f"LEAK: {len(victims)} of {n} responses hold canaries minted for other requests "
                       f"(first: {w0['victim_rid']} ({w0['victim_tenant']}) got {w0['matched']!r} of "
                       f"{owner}, HTTP {w0['status']}, {w0['outcome']})",
                       witnesses, {"responses": n, "victims": len(victims), "sensitivity": sens.stats})
    if sens.status != PASS:
        return Verdict("isolation", UNKNOWN, f"no foreign canary in {n} responses, but the model cannot show a "
                       f"leak: {sens.summary}", [], {"responses": n, "sensitivity": sens.stats})
    return Verdict("isolation", PASS, f"no foreign canary in {n} responses; {sens.summary}", [],
                   {"responses": n, "sensitivity": sens.stats})


# a recited canary in a reply: the probe's trigger supplies the opening bracket, so a payload may
# start a reply, follow "[", or follow a JSON quote in the raw bytes; every one ends with "]"
RECITED = re.compile(r"(?<![A-Z2-7])([A-Z2-7]{%d})\]" % canary.PAYLOAD_LEN)


@dataclass(frozen=True)
class SensitivityFloor:
    """Isolation may PASS only on evidence that the model would have shown a leak: at least
    ``min_samples`` echo-eligible completed requests, and a one-sided ``confidence`` lower bound
    (exact, Clopper-Pearson) of at least ``min_rate`` on the echo rate of their canaries. The
    trial is the canary: a leak is a foreign canary in a request's context, and what must be
    likely is that the model recites a canary in its context (a request carries 1-3)."""
    min_samples: int = 20
    min_rate: float = 0.95
    confidence: float = 0.95

    def lower_bound(self, k: int, n: int) -> float:
        return binomial_lower_bound(k, n, self.confidence)


DEFAULT_FLOOR = SensitivityFloor()


def binomial_lower_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) lower confidence bound of a rate seen as k of n: the p at
    which P(X >= k | n, p) = 1 - confidence. 0 for k == 0."""
    if n <= 0 or k <= 0:
        return 0.0
    alpha = 1.0 - confidence

    def tail(p):  # P(X >= k), term by term in log space (no overflow for large n)
        lp, lq = math.log(p), math.log1p(-p)
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                   for i in range(k, n + 1))

    if k == n:
        return alpha ** (1.0 / n)
    lo, hi = 1e-12, k / n
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


CORRUPTING_FAULTS = ("short", "fail", "reject_admitted")


def corrupted_rids(events: list[dict]) -> set:
    """Requests a fault deliberately broke (the agent's ``fault_fired`` names them): their replies
    say nothing about whether the model would show a leak, so they are not echo evidence."""
    out = set()
    for e in events:
        if agent_kind(e) == "fault_fired" and e.get("kind") in CORRUPTING_FAULTS and e.get("rid"):
            out.add(e["rid"])
    return out


def sensitivity(events: list[dict], echo_rate: float = ECHO_RATE, floor: SensitivityFloor | None = None) -> Verdict:
    """Own-canary echo over requests that completed normally and were built to echo. PASS needs
    the ``floor`` (default: >= 20 such requests, 95 % lower bound >= 0.95 on their canaries' echo
    rate) and the point rate >= ``echo_rate``; anything less is UNKNOWN with the numbers."""
    floor = floor or DEFAULT_FLOOR
    run = Run(events)
    broken = corrupted_rids(events)
    eligible, echoed, n_can, n_echo, misses = 0, 0, 0, 0, []
    for rid, p in run.plans.items():
        end = run.ends.get(rid, {})
        if rid in broken or not p.get("expect_echo") or p.get("oversized") or end.get("outcome") != "ok" \
                or run.statuses.get(rid) != 200:
            continue
        if _finish_type(run.bodies.get(rid) or {}) == "abort":  # /generate's {"type": ...} or OpenAI's string
            continue
        eligible += 1
        text = (run.bodies.get(rid) or {}).get("text") or ""
        cs = p.get("canaries") or []
        missing = [c for c in cs if canary.payload(c) not in text]
        n_can += len(cs)
        n_echo += len(cs) - len(missing)
        if missing:
            if len(misses) < 10:
                misses.append({"rid": rid, "missing": missing, "reply": text[:120]})
        else:
            echoed += 1
    rate = n_echo / n_can if n_can else 0.0
    lb = floor.lower_bound(n_echo, n_can)
    stats = {"eligible": eligible, "echoed": echoed, "canaries": n_can, "canaries_echoed": n_echo, "rate": rate,
             "threshold": echo_rate, "lower_bound": round(lb, 4), "confidence": floor.confidence,
             "min_rate": floor.min_rate, "min_samples": floor.min_samples}
    what = (f"own-canary echo {echoed}/{eligible} requests, {n_echo}/{n_can} canaries = {100 * rate:.1f} % "
            f"({100 * floor.confidence:.0f} % lower bound {lb:.3f})")
    if eligible < floor.min_samples:
        return Verdict("sensitivity", UNKNOWN, f"{what}: fewer than {floor.min_samples} completed requests that "
                       "should echo their canaries — too little evidence that a leak would show", misses, stats)
    if rate < echo_rate or lb < floor.min_rate:
        return Verdict("sensitivity", UNKNOWN, f"{what}: needs a lower bound >= {floor.min_rate:.2f} and a rate >= "
                       f"{100 * echo_rate:.0f} % — this run cannot show that a leak would be seen", misses, stats)
    return Verdict("sensitivity", PASS, what, misses, stats)


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
def agent_kind(e: dict) -> str | None:
    """Agent events appear raw (``ev``) or copied into a test log (``ev == "agent"``, ``agent_ev``)."""
    if e.get("ev") == "agent":
        return e.get("agent_ev")
    return e.get("ev") if e.get("source") == "agent" else None


def kv_pages_written(events: list[dict]) -> dict[str, int]:
    """Per rid, the KV pages prefill wrote to decode (the sum of the agent's ``write_end`` pages over
    every chunk of the request's transfer; a chunked prefill sends several). Pages of
    :func:`kv_page_size` tokens each."""
    out: dict[str, int] = defaultdict(int)
    for e in events:
        if agent_kind(e) == "write_end" and e.get("rid") and isinstance(e.get("pages"), int):
            out[e["rid"]] += e["pages"]
    return dict(out)


def kv_page_size(events: list[dict]) -> int:
    """The KV page size the agent's transfer events report (1 when they do not say)."""
    for e in events:
        if agent_kind(e) in ("transfer_start", "write_end") and isinstance(e.get("page_size"), int):
            return e["page_size"]
    return 1


def pages_for(n_tokens: int, page_size: int) -> int:
    """KV pages that hold ``n_tokens`` (the last one may be partly filled)."""
    return -(-int(n_tokens) // max(1, int(page_size)))


def _reused_by(room, released_at: float, starts: dict, limit: int = 5) -> list[dict]:
    """Requests whose transfers, begun after ``room``'s pages were released, were given some of those
    decode pages (``transfer_start`` ``dst_pages``): who owned the pages a late write landed in."""
    mine = set((starts.get(room) or {}).get("dst_pages") or ())
    out = []
    if not mine:
        return out
    for r, s in starts.items():
        if r == room or s["wall"] <= released_at:
            continue
        shared = mine.intersection(s.get("dst_pages") or ())
        if shared:
            out.append({"rid": s.get("rid"), "room": r, "pages": len(shared),
                        "transfer_start_after_release_ms": round(1000 * (s["wall"] - released_at), 1)})
    out.sort(key=lambda x: x["transfer_start_after_release_ms"])
    return out[:limit]


def kv_lifecycle(events: list[dict], tolerance_s: float = 0.0) -> Verdict:
    """No KV write into decode's pages ends after decode released them (same bootstrap room)."""
    released: dict = {}
    outcome: dict = {}  # room -> SGLang's deferred-release outcome (drained | timeout), agent evidence
    starts: dict = {}  # room -> its first transfer_start (decode pages it was given, when prefill began)
    writes = defaultdict(list)
    n_writes = 0
    for e in events:
        kind = agent_kind(e)
        room = e.get("room")
        if room is None:
            continue
        if kind == "transfer_start":
            starts.setdefault(room, e)
        elif kind == "kv_released":
            if room not in released or e["wall"] < released[room]["wall"]:
                released[room] = e
        elif kind == "deferred_release":
            outcome.setdefault(room, e.get("outcome"))
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
                                  "release_outcome": outcome.get(room),
                                  "reused_by": _reused_by(room, rel["wall"], starts),
                                  "problem": "KV write landed in decode pages after decode released them"})
    stats = {"writes": n_writes, "released_rooms": len(released),
             "released_with_writes": sum(1 for r in released if writes.get(r)),
             "release_outcomes": dict(Counter(outcome.values()))}
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


def _finish_type(body: dict):
    """A reply's finish reason: /generate's ``meta_info.finish_reason.type``, or an OpenAI choice's
    ``finish_reason`` string (the driver puts both in the body's meta)."""
    fr = (body.get("meta") or {}).get("finish_reason")
    return fr.get("type") if isinstance(fr, dict) else fr


def abort_semantics(events: list[dict]) -> Verdict:
    """Every request the harness aborted (``fault`` records, action ``abort_request``) got the
    outcome of an abort: an error status with an error message, or HTTP 200 whose finish reason is
    ``abort``. A 200 that finished as a success (``length`` / ``stop``) is a FAIL when the abort was
    sent while the request was provably held at its stage (it could not have finished before: the
    abort was lost — the shape of SGLang #33507); when nothing held it the abort may have come too
    late, and that reply's content is judged by isolation / differential. Per stage, what came back
    is in the stats. UNKNOWN when no aborted request got an answer."""
    run = Run(events)
    aborts = {e["rid"]: e for e in events if e.get("ev") == "fault" and e.get("action") == "abort_request"
              and e.get("rid")}
    rooms = defaultdict(list)  # rid -> prefill's bootstrap rooms in order: one per attempt (a retry: a new one)
    for e in events:
        if agent_kind(e) == "bootstrap_queued" and e.get("rid") in aborts and e.get("room") not in rooms[e["rid"]]:
            rooms[e["rid"]].append(e.get("room"))
    witnesses, outcomes, undecided = [], {}, []
    for rid, a in aborts.items():
        status, body = run.statuses.get(rid), run.bodies.get(rid) or {}
        ftype = _finish_type(body)
        outcomes[a.get("stage") or rid] = {"rid": rid, "status": status, "finish_reason": ftype, "held": a.get("held"),
                                           "attempts": len(rooms.get(rid, ())) or None,
                                           "text_chars": len(body.get("text") or ""),
                                           "error": (body.get("error") or "")[:160] or None}
        if status is None:
            undecided.append(rid)
            continue
        base = {"rid": rid, "tenant": run.plans.get(rid, {}).get("tenant"), "stage": a.get("stage"), "status": status,
                "finish_reason": ftype, "held": a.get("held"), "attempts": len(rooms.get(rid, ())) or None}
        if status == 200 and ftype != "abort" and a.get("held"):
            witnesses.append({**base, "problem": f"aborted while held at {a.get('stage')}, answered HTTP 200 finished "
                                                 f"as {ftype!r}: the abort was lost and the reply passed for complete"})
        elif status != 200 and not (400 <= status < 600 and body.get("error")):
            witnesses.append({**base, "problem": f"abort answered HTTP {status} without an error message"})
    stats = {"aborted": len(aborts), "no_status": len(undecided), "outcomes": outcomes}
    if witnesses:
        w = witnesses[0]
        return Verdict("abort_semantics", FAIL, f"{len(witnesses)} of {len(aborts)} aborted requests did not come back "
                       f"as aborted (first: {w['rid']} at {w['stage']}: {w['problem']})", witnesses, stats)
    decided = len(aborts) - len(undecided)
    if not decided:
        return Verdict("abort_semantics", UNKNOWN, f"{len(aborts)} aborts sent, none answered"
                       + (" (see liveness)" if undecided else ""), [], stats)
    return Verdict("abort_semantics", PASS, f"{decided} aborted requests answered as aborted: "
                   + ", ".join(f"{st} {o['status']}{'/' + str(o['finish_reason']) if o['status'] == 200 else ''}"
                               for st, o in outcomes.items() if o["status"] is not None), [], stats)


def retraction(events: list[dict], min_retractions: int = 1) -> Verdict:
    """Every request decode retracted (the agent's ``kv_retracted``) came back with its own KV: the
    pool read back at its new slots equals the host copy taken at retraction (``kv_resumed``
    ``restored_equal``, and the two digests agree), and no request was answered 200 with a
    retraction that was never resumed (decoded without its KV restored). UNKNOWN when fewer than
    ``min_retractions`` of this log's requests were retracted: the path was not exercised."""
    run = Run(events)
    retracted, resumed, hook_errors = defaultdict(list), defaultdict(list), []
    for e in events:
        kind, rid = agent_kind(e), e.get("rid")
        if kind == "kv_retracted" and rid in run.plans:
            retracted[rid].append(e)
        elif kind == "kv_resumed" and rid in run.plans:
            resumed[rid].append(e)
        elif kind == "hook_error" and e.get("hook") in ("offload_kv_cache", "load_kv_cache"):
            hook_errors.append(e)
    witnesses = []
    for rid, rs in resumed.items():
        for i, r in enumerate(rs):
            before = retracted[rid][i] if i < len(retracted[rid]) else {}
            if r.get("restored_equal") is False or (before.get("digest") and r.get("digest")
                                                    and before["digest"] != r["digest"]):
                witnesses.append({"rid": rid, "tenant": run.plans[rid].get("tenant"), "resume": i + 1,
                                  "kept_tokens": before.get("kept_tokens"), "restored_tokens": r.get("restored_tokens"),
                                  "digest_at_retraction": before.get("digest"), "digest_at_resume": r.get("digest"),
                                  "problem": "KV restored after retraction differs from the copy taken at retraction"})
    if not any(e.get("hook") == "load_kv_cache" for e in hook_errors):
        for rid, rs in retracted.items():
            if run.statuses.get(rid) == 200 and len(resumed.get(rid, ())) < len(rs):
                witnesses.append({"rid": rid, "tenant": run.plans[rid].get("tenant"), "retracted": len(rs),
                                  "resumed": len(resumed.get(rid, ())), "status": 200,
                                  "problem": "answered HTTP 200 although a retraction was never resumed "
                                             "(decoded without its KV restored)"})
    n = sum(len(v) for v in retracted.values())
    told = sum(int(((run.bodies.get(r) or {}).get("meta") or {}).get("num_retractions") or 0) for r in run.plans)
    stats = {"retractions": n, "requests_retracted": len(retracted), "resumes": sum(len(v) for v in resumed.values()),
             "reply_num_retractions": told, "hook_errors": len(hook_errors)}
    if witnesses:
        w = witnesses[0]
        return Verdict("retraction", FAIL, f"{len(witnesses)} retracted request(s) did not get their own KV back "
                       f"(first: {w['rid']}: {w['problem']})", witnesses, stats)
    if hook_errors:
        return Verdict("retraction", UNKNOWN, f"the agent's retraction evidence failed {len(hook_errors)} time(s) "
                       f"(first: {hook_errors[0].get('error')}): not judged", [], stats)
    if n < min_retractions:
        return Verdict("retraction", UNKNOWN, f"{n} of this log's requests were retracted (need >= {min_retractions}): "
                       "the retraction path was not exercised", [], stats)
    return Verdict("retraction", PASS, f"{n} retraction(s) of {len(retracted)} request(s): every one resumed with its "
                   f"KV restored bit-exact, none answered without its KV", [], stats)


ALL = ("isolation", "sensitivity", "http_semantics", "liveness", "kv_lifecycle")


# --------------------------------------------------------------------------- checkers
class Checker:
    """An oracle with its options bound at construction: ``checker(events) -> Verdict``.

    Build them once (``Liveness(bound_s=60)``), pass them to an experiment, and :func:`compose`
    several into one. ``name`` is the verdict's oracle name."""

    name = ""
    leak = False  # a FAIL of this checker is a leak (or its evidence): never hidden by any finding

    def __call__(self, events: list[dict]) -> Verdict:
        return self.check(events)

    def check(self, events: list[dict]) -> Verdict:
        raise NotImplementedError

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({opts})"


class Isolation(Checker):
    name, leak = "isolation", True

    def __init__(self, partial_len: int = 8, echo_rate: float = ECHO_RATE, registry="session",
                 floor: SensitivityFloor = DEFAULT_FLOOR):
        if partial_len < 4 or partial_len > canary.PAYLOAD_LEN:
            raise ValueError(f"partial_len must be 4..{canary.PAYLOAD_LEN}, got {partial_len}")
        self.partial_len, self.echo_rate, self.floor = partial_len, echo_rate, floor
        self.registry = canary.SESSION if registry == "session" else registry

    def check(self, events):
        return isolation(events, self.partial_len, self.echo_rate, self.registry, self.floor)


class Sensitivity(Checker):
    name = "sensitivity"

    def __init__(self, echo_rate: float = ECHO_RATE, floor: SensitivityFloor = DEFAULT_FLOOR):
        self.echo_rate, self.floor = echo_rate, floor

    def check(self, events):
        return sensitivity(events, self.echo_rate, self.floor)


class Differential(Checker):
    """``reference``: rid -> {"output_ids", "text"}, or a callable of the event log returning that
    (e.g. the same prompts served alone by a clean single server after the run)."""
    name, leak = "differential", True

    def __init__(self, reference):
        self.reference = reference

    def check(self, events):
        ref = self.reference(events) if callable(self.reference) else self.reference
        return differential(events, ref)


class HttpSemantics(Checker):
    name = "http_semantics"

    def check(self, events):
        return http_semantics(events)


class Liveness(Checker):
    name = "liveness"

    def __init__(self, bound_s: float, pool_tolerance_tokens: int = 0):
        if bound_s <= 0:
            raise ValueError(f"liveness bound_s must be > 0, got {bound_s}")
        self.bound_s, self.pool_tolerance_tokens = bound_s, pool_tolerance_tokens

    def check(self, events):
        return liveness(events, self.bound_s, self.pool_tolerance_tokens)


class KVLifecycle(Checker):
    name, leak = "kv_lifecycle", True

    def __init__(self, tolerance_s: float = 0.0):
        self.tolerance_s = tolerance_s

    def check(self, events):
        return kv_lifecycle(events, self.tolerance_s)


class AbortSemantics(Checker):
    name = "abort_semantics"

    def check(self, events):
        return abort_semantics(events)


class Retraction(Checker):
    name, leak = "retraction", True

    def __init__(self, min_retractions: int = 1):
        if min_retractions < 1:
            raise ValueError(f"min_retractions must be >= 1 (a run that retracted nothing proves nothing), "
                             f"got {min_retractions}")
        self.min_retractions = min_retractions

    def check(self, events):
        return retraction(events, self.min_retractions)


class Composite(Checker):
    """Several checkers as one: ``check`` returns one verdict per checker, in order."""

    def __init__(self, checkers):
        flat = []
        for c in checkers:
            flat += c.checkers if isinstance(c, Composite) else [c]
        for c in flat:
            if not isinstance(c, Checker):
                raise TypeError(f"not a checker: {c!r} (build one, e.g. oracles.Liveness(bound_s=60))")
        names = [c.name for c in flat]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"checker(s) {dup} given twice: each oracle judges a history once")
        self.checkers = flat

    def check(self, events) -> list[Verdict]:
        return [c.check(events) for c in self.checkers]


def compose(*checkers) -> Composite:
    return Composite(checkers)


def default_checkers(bound_s: float = 60.0) -> Composite:
    """What ``kvchaos judge`` applies to a log: every oracle that needs nothing but the log."""
    return compose(Isolation(), Sensitivity(), HttpSemantics(), Liveness(bound_s=bound_s), KVLifecycle())


from .cache import CacheIsolation, TimingIsolation, cache_isolation, timing_isolation  # noqa: E402
