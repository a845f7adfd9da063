"""Mechanism signatures and power gating: how a non-PASS verdict is shown to be a registered engine
finding. Each predicate: (verdict, context, argument) -> (holds, why not). A finding's signature is a
table of them (``kvchaos/findings.toml``); every one must hold for the verdict to be KNOWN. The
stale-page findings are matched by their mechanism in the engines' own events
(:mod:`kvchaos.oracles.provenance`), never by who the victim was. A leak is KNOWN only where the run
had the power to see it (:func:`power_met`)."""

from __future__ import annotations

from kvchaos.oracles import Verdict, kv_page_size, kv_pages_written, pages_for, provenance
from kvchaos.oracles.isolation import power_line

from .context import Context
from .core import PolicyError


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


def _pool_held_by_hung(w: dict, timeouts: set) -> bool:
    """A ``decode KV pool did not return to its idle baseline`` witness that the hung requests' own
    pages explain: every token the pool kept past its baseline fits within what the requests that got
    no answer could still hold there (``held_by``, ``held_tokens_max``: :mod:`kvchaos.oracles.liveness`),
    and each of those is a timeout witness of the same verdict. A hang holds its pages while it hangs;
    a pool that kept more than that lost pages of its own, and stays a witness no hang explains. (A
    page loss no larger than what the hung requests could hold is not told apart from them.)"""
    held = w.get("held_by")
    return bool(held) and set(held) <= timeouts and pool_within_holders(w)


def pool_within_holders(w: dict) -> bool:
    """A pool witness kept no more past its baseline than its holders could hold (``held_tokens_max``)."""
    cap, before, after = w.get("held_tokens_max"), w.get("kv_used_before"), w.get("kv_used_after")
    return all(isinstance(x, int) for x in (cap, before, after)) and after - before <= cap


def _sig_witnesses_are_timeouts(v, ctx, want):
    timeouts = {w["rid"] for w in v.witnesses
                if w.get("rid") and (w.get("outcome") == "timeout" or "never ended" in (w.get("problem") or ""))}
    bad = [w for w in v.witnesses
           if not (w.get("rid") in timeouts or (not w.get("rid") and _pool_held_by_hung(w, timeouts)))]
    ok = bool(v.witnesses) and not bad
    return ok == bool(want), f"witnesses that are not a request's timeout: {[w.get('problem') for w in bad[:3]]}"


def _tagged(ctx: Context, tag: str) -> set:
    return {rid for rid, p in ctx.plans().items() if (p.get("extra") or {}).get("probe") == tag}


def _culprits(ctx: Context, what: str) -> set:
    """``what``: a plan tag, or "oversized" for the oversized requests."""
    if what == "oversized":
        return {rid for rid, p in ctx.plans().items() if p.get("oversized")}
    return _tagged(ctx, what)


def _queued(ctx: Context) -> dict:
    """rid -> when prefill last put it in its bootstrap queue (the agent's ``bootstrap_queued``, the
    engine's own clock): the order the engine took requests in. The last time, not the first: a request
    queued again (sglang-router re-sends one whose transfer failed, under a new bootstrap room) waits as
    that last attempt, and one queued again after a culprit waits behind it (a replay of a guided 0.5.23
    find, 2026-12-05: a request queued at 2.11 s, failed by a ``fail`` fault, queued again at 3.04 s
    behind a band prompt queued at 2.68 s, hung with it, and left the intake-reject hang NEW)."""
    out = {}
    for e in ctx.history.agent_events("bootstrap_queued"):
        rid, wall = e.get("rid"), e.get("wall")
        if rid and isinstance(wall, (int, float)):
            out[rid] = max(out.get(rid, float(wall)), float(wall))
    return out


def _first_queued(ctx: Context, rid: str) -> float:
    """When prefill first queued ``rid`` (a culprit wedges the engine from its first attempt on)."""
    return min(float(e["wall"]) for e in ctx.history.agent_events("bootstrap_queued")
               if e.get("rid") == rid and isinstance(e.get("wall"), (int, float)))


def _sig_hung_behind(v, ctx, what):
    """Every hung request is one of the culprits or came after the first of them (queued behind a
    request that hangs the engine) — never one that was in flight before the culprits came. "After" is
    the engine's order where prefill queued a culprit (its ``bootstrap_queued``): a request it queued
    later, or a ``/generate`` request it never queued at all (prefill queues what it receives in order,
    so one that reached it before the culprit would have been queued before it), is behind. The OpenAI
    routes reach the engines under ids of their own (not the client's rid), so for them, and where
    prefill queued no culprit, the client's send order decides. Requests sent in the same millisecond reach the engine in either
    order: guided searches on 0.5.23 saw a request the client sent 10 ms before a band prompt, which
    prefill never queued, hang behind it, and left the hang band NEW."""
    culprits = _culprits(ctx, what)
    sends = {rid: e.get("wall", 0) for rid, e in ctx.history.sends.items()}
    first = min((sends[r] for r in culprits if r in sends), default=None)
    queued = _queued(ctx)
    first_q = min((_first_queued(ctx, r) for r in culprits if r in queued), default=None)

    plans = ctx.plans()

    def behind(rid):
        if first_q is not None and rid in queued:
            return queued[rid] > first_q
        if first_q is not None and (plans.get(rid) or {}).get("endpoint", "generate") == "generate":
            return True  # never queued by prefill, which had queued the culprit
        return first is not None and sends.get(rid, 0) >= first
    bad = [w["rid"] for w in _rid_witnesses(v) if w["rid"] not in culprits and not behind(w["rid"])]
    return bool(culprits) and first is not None and not bad, \
        f"hung requests neither {what!r} nor sent (or, by prefill's own queue, queued) after the first of them: {bad[:5]}"


# outcomes that say nothing about whether the engine would have answered: a plan a wedged run never sent
# (kvchaos.workload.driver's stall_s), or one its own client cut (abort, disconnect) before any answer
NO_EVIDENCE = ("not_sent", "aborted", "disconnected")


def _sig_all_tagged_hung(v, ctx, tag):
    """Every request tagged ``tag`` that could show it hung: those never sent or cut by their own client
    neither confirm nor contradict, but at least one tagged request must have hung."""
    tagged = {r for r in _tagged(ctx, tag) if ctx.history.outcome(r) not in NO_EVIDENCE}
    hung = {w["rid"] for w in _rid_witnesses(v)}
    miss = sorted(tagged - hung)
    return bool(tagged) and not miss, f"requests tagged {tag!r} that did not hang: {miss[:5]}"


def _sig_oversized_all_hung(v, ctx, want):
    """Every oversized request that reached the engine's reject path hung. Set aside: those never sent,
    and those refused with a 4xx (a prompt past decode's own input limit: decode answers it 400
    ``decode_bad_request``, and it never waits on prefill's reject path — a guided search on 0.5.23 with
    prefill's limit lowered to 256 saw a 2048-token prompt answered so beside 256-token ones that hung,
    and left the intake-reject hang NEW). At least one must have hung."""
    h = ctx.history
    big = {rid for rid, p in ctx.plans().items() if p.get("oversized") and h.outcome(rid) != "not_sent"
           and not (h.outcome(rid) == "http_error" and 400 <= (h.statuses.get(rid) or 0) < 500)}
    miss = sorted(r for r in big if h.outcome(r) not in (None, "timeout"))
    ok = bool(big) and not miss
    return ok == bool(want), f"oversized requests that did not hang: {miss[:5]}"


def _victims_written(v, ctx):
    """``(rid, plan, pages prefill's writes filled for it, page size)`` for each witness's victim (an
    isolation witness's ``victim_rid``, another checker's ``rid``), from prefill's own transfer events."""
    plans = ctx.plans()
    sent = kv_pages_written(ctx.history)
    ps = kv_page_size(ctx.history)
    for w in v.witnesses:
        rid = w.get("victim_rid") or w.get("rid")
        n = sent.get(rid)
        if n is None:  # an OpenAI route: prefill wrote it under an engine-side id, into the room decode named
            pages = [e.get("pages") for e in provenance.writes(ctx.history, rid)]
            n = sum(pages) if pages and all(isinstance(x, int) for x in pages) else None
        yield rid, plans.get(rid, {}), n, ps


def _sig_victims_truncated(v, ctx, want):
    """Every victim is an oversized request whose KV prefill wrote, by its own transfer events (the
    pages of every chunk), was short of the prompt but more than the one-page placeholder of the
    reject path (truncated on prefill by ``--allow-auto-truncate``, not rejected), while decode
    reserved pages for more than was written (its own ``kv_prealloc``)."""
    if not want:
        raise PolicyError("victims_truncated takes true")
    bad = []
    for rid, p, n, ps in _victims_written(v, ctx):
        sp = provenance.stale_pages(ctx.history, rid)
        if not (p.get("oversized") and isinstance(n, int) and 1 < n < pages_for(p.get("n_tokens") or 0, ps)):
            bad.append(f"{rid}: prefill's writes ({n} pages) are not a truncated prompt")
        elif sp is None or not sp["unwritten"]:
            bad.append(f"{rid}: decode's own evidence shows no page reserved beyond what prefill wrote")
    return bool(v.witnesses) and not bad, f"victims not decoded over a truncated prompt's unwritten pages: {bad[:3]}"


def _sig_victims_rejected_placeholder(v, ctx, want):
    """Every victim (an isolation witness's victim, an http_semantics witness's request) is a prompt
    prefill's input limit refused (its plan is oversized) of which prefill's own transfer events show
    exactly one page written (the reject path's one-token placeholder: the prompt swapped for it, the
    error parked in ``to_finish``, the request still sent on to transfer), while decode's own
    ``kv_prealloc`` reserved pages for the whole prompt — the GLM-5.3 incident's mechanism. An
    answered 200 with the prompt's own KV (written whole) or truncated (more than one page) is not it."""
    if not want:
        raise PolicyError("victims_rejected_placeholder takes true")
    bad = []
    for rid, p, n, ps in _victims_written(v, ctx):
        if not (p.get("oversized") and n == 1 and pages_for(p.get("n_tokens") or 0, ps) > 1):
            bad.append(f"{rid}: prefill's writes ({n} pages) are not the reject path's one-page placeholder of an "
                       "oversized prompt")
            continue
        pre = provenance.prealloc(ctx.history, rid)
        total = (pre or {}).get("dst_pages_total")
        if not isinstance(total, int) or total <= 1:
            bad.append(f"{rid}: decode's own evidence shows no reservation beyond the placeholder ({total} pages)")
    return bool(v.witnesses) and not bad, f"victims not answered over the reject path's placeholder: {bad[:3]}"


def _sig_read_unwritten_pages(v, ctx, want):
    """Every witness's request was decoded over pages decode reserved for it and its transfer never wrote
    (decode's ``kv_prealloc`` against prefill's ``write_end``: :func:`kvchaos.oracles.provenance.stale_pages`)
    — what a reply that is not what its prompt must give shows of the stale-page findings, whether or
    not the stale bytes held a canary."""
    if not want:
        raise PolicyError("read_unwritten_pages takes true")
    bad = []
    for w in v.witnesses:
        rid = w.get("victim_rid") or w.get("rid")
        sp = provenance.stale_pages(ctx.history, rid, ctx.registry) if rid else None
        if sp is None:
            bad.append(f"{rid}: no decode page evidence (kv_prealloc / write_end with page lists)")
        elif not sp["unwritten"]:
            bad.append(f"{rid}: every one of the {sp['reserved']} pages decode gave it was written by its transfer")
    return bool(v.witnesses) and not bad, "; ".join(bad[:3]) or "no witness"


def _sig_prealloc_never_written(v, ctx, want):
    """The intake reject from the engines' own events, without a fault that lowered a limit: every oversized
    request that hung was pre-allocated by decode beyond one page (``kv_prealloc``) and prefill wrote none
    of its KV (no ``write_end`` under its rid or into its room) — decode waited on a transfer prefill never
    started. Needs the in-engine agent's events: without them it does not match."""
    if not want:
        raise PolicyError("prealloc_never_written takes true")
    h = ctx.history
    hung = [rid for rid, p in ctx.plans().items() if p.get("oversized") and h.outcome(rid) == "timeout"]
    bad = []
    for rid in hung:
        pre = provenance.prealloc(h, rid)
        total = (pre or {}).get("dst_pages_total")
        if not isinstance(total, int) or total <= 1:
            bad.append(f"{rid}: no pre-allocation by decode beyond one page ({total})")
        elif provenance.writes(h, rid):
            bad.append(f"{rid}: prefill wrote {len(provenance.writes(h, rid))} transfer(s) of its KV")
    return bool(hung) and not bad, f"hung oversized requests not waiting on a transfer prefill never began: {bad[:3] or 'none hung'}"


def _sig_fault_armed(v, ctx, kind):
    ok = any(e.get("kind") == kind for e in ctx.fault_events("armed"))
    return ok, f"no {kind!r} fault armed in this experiment"


KILL_TIMING_SLACK_S = 1.0  # a request that ended this long before the kill was not in flight at it


def _sig_process_fault_fired(v, ctx, what):
    """A process fault of that kind (and role) fired in this experiment, and every request the verdict names
    was still in flight when it first fired (or came after): a hang that ended before the kill is not the
    kill's."""
    kind, _, role = str(what).partition(":")
    at = [float(e.get("at", e.get("wall"))) for e in ctx.fault_events("fired")
          if e.get("injector") == "process" and e.get("kind") == kind and (not role or e.get("role") == role)
          and isinstance(e.get("at", e.get("wall")), (int, float))]
    if not at:
        return False, f"no {kind} of {role or 'any role'} fired in this experiment"
    first, before = min(at), []
    for w in _rid_witnesses(v):
        rid = w.get("rid") or w.get("victim_rid")
        win = ctx.history.window(rid) if ctx.history is not None else None
        if win is not None and win[1] < first - KILL_TIMING_SLACK_S:
            before.append(f"{rid} (ended {first - win[1]:.1f} s before the {kind})")
    return not before, f"requests that had ended before the {kind} of {role or 'any role'} fired: {before[:3]}"


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
    "prealloc_never_written": _sig_prealloc_never_written,
    "read_unwritten_pages": _sig_read_unwritten_pages,
    "victims_truncated": _sig_victims_truncated,
    "victims_rejected_placeholder": _sig_victims_rejected_placeholder,
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
        if isinstance(pw, dict) and "classes" not in pw:  # a checker's own coverage figure (integrity: replies judged)
            return False, f"power not met: {pw.get('why') or 'not enough judged'}"
        try:
            return False, f"power not met: {power_line(pw)}"
        except Exception:  # noqa: BLE001 - malformed figures are not power
            return False, "power not met"
    return True, ""
