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

from kvchaos.history import History, agent_kind, as_history

from .base import FAIL, PASS, STATUSES, UNKNOWN, Checker, Composite, Verdict, check_safe, compose
from .isolation import (CORRUPTING_FAULTS, DEFAULT_FLOOR, ECHO_RATE, Isolation, Sensitivity, SensitivityFloor,
                        binomial_lower_bound, isolation, power, scan, sensitivity)

Run = as_history  # the index every checker reads: kvchaos.history.History


# --------------------------------------------------------------------------- differential
def differential(events, reference: dict[str, dict]) -> Verdict:
    """``reference``: rid -> {"output_ids": [...], "text": ...} from a clean single server."""
    run = as_history(events)
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
def http_semantics(events) -> Verdict:
    run = as_history(events)
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
def liveness(events, bound_s: float, pool_tolerance_tokens: int = 0) -> Verdict:
    """Every request ended (and within ``bound_s``); the post-run probe answered; the KV pool is
    back at its idle baseline (``probe`` events with phase ``before``/``after`` and ``kv_used``)."""
    run = as_history(events)
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
def kv_pages_written(events) -> dict[str, int]:
    """Per rid, the KV pages prefill wrote to decode (the sum of the agent's ``write_end`` pages over
    every chunk of the request's transfer; a chunked prefill sends several). Pages of
    :func:`kv_page_size` tokens each."""
    out: dict[str, int] = defaultdict(int)
    for e in _records(events):
        if agent_kind(e) == "write_end" and e.get("rid") and isinstance(e.get("pages"), int):
            out[e["rid"]] += e["pages"]
    return dict(out)


def kv_page_size(events) -> int:
    """The KV page size the agent's transfer events report (1 when they do not say)."""
    for e in _records(events):
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


def kv_lifecycle(events, tolerance_s: float = 0.0) -> Verdict:
    """No KV write into decode's pages ends after decode released them (same bootstrap room). Each
    late write is paired with the release it followed — the room's last ``kv_released`` before the
    write ended — and with that release's own outcome (the ``deferred_release`` SGLang reported for
    that room at that release: ``drained`` or ``timeout``; none: released at once, no deferral)."""
    h = as_history(events)
    releases = defaultdict(list)  # room -> its kv_released events, in time order
    outcomes = defaultdict(list)  # room -> its deferred_release events, in time order
    starts: dict = {}  # room -> its first transfer_start (decode pages it was given, when prefill began)
    writes = defaultdict(list)
    n_writes = 0
    for e in h.agent:
        kind, room = agent_kind(e), e.get("room")
        if room is None or not isinstance(e.get("wall"), (int, float)):
            continue
        if kind == "transfer_start":
            starts.setdefault(room, e)
        elif kind == "kv_released":
            releases[room].append(e)
        elif kind == "deferred_release":
            outcomes[room].append(e)
        elif kind == "write_end":
            writes[room].append(e)
            n_writes += 1
    witnesses = []
    for room, rels in releases.items():
        rels.sort(key=lambda r: r["wall"])
        for w in writes.get(room, []):
            before = [r for r in rels if r["wall"] + tolerance_s < w["wall"]]
            if not before:
                continue
            rel = before[-1]  # the release this write landed after
            nxt = next((r["wall"] for r in rels if r["wall"] > rel["wall"]), float("inf"))
            # SGLang reports the outcome right after it released (same thread, same room)
            out = next((o for o in outcomes.get(room, ()) if rel["wall"] <= o["wall"] < nxt), None)
            witnesses.append({"room": room, "rid": w.get("rid") or rel.get("rid"), "pages": w.get("pages"),
                              "released_at": rel["wall"], "write_start": w.get("wall_start"), "write_end": w["wall"],
                              "after_release_ms": round(1000 * (w["wall"] - rel["wall"]), 1),
                              "deferred_release_enabled": rel.get("deferred_release_enabled"),
                              "release_outcome": out.get("outcome") if out else None,
                              "release_outcome_at": out.get("wall") if out else None,
                              "releases_of_room": len(rels),
                              "reused_by": _reused_by(room, rel["wall"], starts),
                              "problem": "KV write landed in decode pages after decode released them"})
    all_outcomes = [o.get("outcome") for os_ in outcomes.values() for o in os_]
    stats = {"writes": n_writes, "released_rooms": len(releases),
             "released_with_writes": sum(1 for r in releases if writes.get(r)),
             "release_outcomes": dict(Counter(all_outcomes))}
    if witnesses:
        w = witnesses[0]
        return Verdict("kv_lifecycle", FAIL, f"{len(witnesses)} KV write(s) landed after decode released the pages "
                       f"(first: room {w['room']} rid {w['rid']}: {w['pages']} pages, {w['after_release_ms']} ms "
                       f"after a release whose outcome was {w['release_outcome']})", witnesses, stats)
    if not n_writes:
        return Verdict("kv_lifecycle", UNKNOWN, "no engine-side write evidence (in-engine agent not loaded?)", [], stats)
    if not releases:
        return Verdict("kv_lifecycle", UNKNOWN, f"{n_writes} writes, but no failed/aborted transfer released pages: "
                       "nothing to judge", [], stats)
    return Verdict("kv_lifecycle", PASS, f"{len(releases)} released room(s), {stats['released_with_writes']} with "
                   f"writes: every write ended before its pages were released", [], stats)


def _records(events) -> list[dict]:
    return events.records if isinstance(events, History) else events


def _finish_type(body: dict):
    """A reply's finish reason: /generate's ``meta_info.finish_reason.type``, or an OpenAI choice's
    ``finish_reason`` string (the driver puts both in the body's meta)."""
    fr = (body.get("meta") or {}).get("finish_reason")
    return fr.get("type") if isinstance(fr, dict) else fr


def abort_semantics(events) -> Verdict:
    """Every request the harness aborted (``fault`` records, action ``abort_request``) got the
    outcome of an abort: an error status with an error message, or HTTP 200 whose finish reason is
    ``abort``. A 200 that finished as a success (``length`` / ``stop``) is a FAIL when the abort was
    sent while the request was provably held at its stage (it could not have finished before: the
    abort was lost — the shape of SGLang #33507); when nothing held it the abort may have come too
    late, and that reply's content is judged by isolation / differential. Per stage, what came back
    is in the stats. UNKNOWN when no aborted request got an answer."""
    run = as_history(events)
    aborts = {e["rid"]: e for e in run.records if e.get("ev") == "fault" and e.get("action") == "abort_request"
              and e.get("rid")}
    rooms = defaultdict(list)  # rid -> prefill's bootstrap rooms in order: one per attempt (a retry: a new one)
    for e in run.records:
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


def retraction(events, min_retractions: int = 1) -> Verdict:
    """Every request decode retracted (the agent's ``kv_retracted``) came back with its own KV: the
    pool read back at its new slots equals the host copy taken at retraction (``kv_resumed``
    ``restored_equal``, and the two digests agree), and no request was answered 200 with a
    retraction that was never resumed (decoded without its KV restored). UNKNOWN when fewer than
    ``min_retractions`` of this log's requests were retracted: the path was not exercised."""
    run = as_history(events)
    retracted, resumed, hook_errors = defaultdict(list), defaultdict(list), []
    for e in run.records:
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


# --------------------------------------------------------------------------- checkers
class Differential(Checker):
    """``reference``: rid -> {"output_ids", "text"}, or a callable of the event log returning that
    (e.g. the same prompts served alone by a clean single server after the run)."""
    name, leak = "differential", True

    def __init__(self, reference):
        self.reference = reference

    def check(self, events, registry=None):
        ref = self.reference(_records(events)) if callable(self.reference) else self.reference
        return differential(events, ref)


class HttpSemantics(Checker):
    name = "http_semantics"

    def check(self, events, registry=None):
        return http_semantics(events)


class Liveness(Checker):
    name = "liveness"

    def __init__(self, bound_s: float, pool_tolerance_tokens: int = 0):
        if bound_s <= 0:
            raise ValueError(f"liveness bound_s must be > 0, got {bound_s}")
        self.bound_s, self.pool_tolerance_tokens = bound_s, pool_tolerance_tokens

    def check(self, events, registry=None):
        return liveness(events, self.bound_s, self.pool_tolerance_tokens)


class KVLifecycle(Checker):
    name, leak, log_only = "kv_lifecycle", True, True

    def __init__(self, tolerance_s: float = 0.0):
        self.tolerance_s = tolerance_s

    def check(self, events, registry=None):
        return kv_lifecycle(events, self.tolerance_s)


class AbortSemantics(Checker):
    name = "abort_semantics"

    def check(self, events, registry=None):
        return abort_semantics(events)


class Retraction(Checker):
    name, leak, log_only = "retraction", True, True

    def __init__(self, min_retractions: int = 1):
        if min_retractions < 1:
            raise ValueError(f"min_retractions must be >= 1 (a run that retracted nothing proves nothing), "
                             f"got {min_retractions}")
        self.min_retractions = min_retractions

    def check(self, events, registry=None):
        return retraction(events, self.min_retractions)


def default_checkers(bound_s: float = 60.0) -> Composite:
    """What ``kvchaos judge`` applies to a log: every oracle that needs nothing but the log (the
    policy adds the leak checkers that always run, :func:`kvchaos.policy.with_always`)."""
    return compose(Isolation(), Sensitivity(), HttpSemantics(), Liveness(bound_s=bound_s), KVLifecycle())


from .cache import CacheIsolation, TimingIsolation, cache_isolation, timing_isolation  # noqa: E402
