"""``liveness``: every request ends within the bound; the cluster answers afterwards; the KV pool
returns to its idle baseline (no pages lost)."""

from __future__ import annotations

from kvchaos.history import as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict


def liveness(events, bound_s: float, pool_tolerance_tokens: int = 0) -> Verdict:
    """Every request ended (and within ``bound_s`` times the pace the history's header records: a like:
    probe on CPU takes its layers over the probe's as long per token, ``ClusterSpec.pace``); the post-run
    probe answered; the KV pool is back at its idle baseline (``probe`` events with phase
    ``before``/``after`` and ``kv_used``)."""
    run = as_history(events)
    pace = run.pace
    bound_s = bound_s * pace
    within = f"{bound_s:.0f} s" + (f" ({bound_s / pace:.0f} s at pace {pace:g})" if pace != 1 else "")
    witnesses = []
    for rid, p in run.plans.items():
        end = run.ends.get(rid)
        if end is None:
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "problem": "never ended (no end event)"})
        elif end.get("outcome") == "timeout" or (end.get("latency_s") or 0) > bound_s:
            witnesses.append({"rid": rid, "tenant": p.get("tenant"), "problem": f"no answer within {within}",
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
                w = {"problem": f"{role} KV pool did not return to its idle baseline",
                     "kv_used_before": before_used[role], "kv_used_after": used}
                if role == "decode":
                    w.update(_held_by_hung(run, witnesses, e.get("wall")))
                witnesses.append(w)
    # plans a wedged run never sent (kvchaos.workload.driver's stall_s): no evidence either way
    not_sent = sum(e.get("outcome") == "not_sent" for e in run.ends.values())
    stats = {"requests": len(run.plans), "ended": len(run.ends), "not_sent": not_sent, "pool": pool,
             "after_probes": len(after), "bound_s": bound_s, "pace": pace}
    if witnesses:
        return Verdict("liveness", FAIL, f"{len(witnesses)} liveness problems (first: "
                       f"{witnesses[0].get('rid', '')} {witnesses[0]['problem']})", witnesses, stats)
    if not after:
        return Verdict("liveness", UNKNOWN, f"all {len(run.plans)} requests ended within {within}, "
                       "but no post-run probe of the cluster was recorded", [], stats)
    if not_sent:  # only a timeout stops a run sending, and that timeout is a witness: never here
        return Verdict("liveness", UNKNOWN, f"{not_sent} of {len(run.plans)} plans were never sent", [], stats)
    return Verdict("liveness", PASS, f"all {len(run.plans)} requests ended within {within}; cluster answers"
                   + ("; KV pool back to baseline" if pool else ""), [], stats)


def _held_by_hung(run, witnesses: list[dict], probe_wall) -> dict:
    """Which of the requests that never got an answer (``witnesses`` so far) decode could still be
    holding pages for when the post-run probe read its pool: ``held_by`` (client rids), and
    ``held_tokens_max`` the most those could hold — each one's pre-allocated pages (decode's
    ``kv_prealloc``, its last one) plus its ``max_new_tokens`` — counting only those decode had not
    given back (``kv_released`` of that room) before the probe. A request sent on an OpenAI route is
    known to decode by an id of its own, named back by its canaries (:meth:`History.engine_rids`). An
    upper bound: pages the pool kept beyond it are not the hung requests' (the policy's signatures read
    it; see ``witnesses_are_timeouts``)."""
    hung = {w["rid"] for w in witnesses if w.get("rid")}
    names = run.engine_rids()
    at = float(probe_wall) if isinstance(probe_wall, (int, float)) else float("inf")
    last: dict[str, dict] = {}
    for e in run.agent_events("kv_prealloc"):
        rid = names.get(e.get("rid"), e.get("rid"))
        if rid in hung and float(e.get("wall") or 0) <= at:
            last[rid] = e
    released = {e.get("room") for e in run.agent_events("kv_released") if float(e.get("wall") or 0) <= at}
    held, tokens = [], 0
    for rid, e in sorted(last.items()):
        if e.get("room") in released:
            continue
        pages = e.get("dst_pages_total")
        if not isinstance(pages, int):
            pages = len(e.get("dst_pages") or [])
        tokens += pages * int(e.get("page_size") or 1) + int((run.plans.get(rid) or {}).get("max_new_tokens") or 0)
        held.append(rid)
    return {"held_by": held, "held_tokens_max": tokens}


class Liveness(Checker):
    name = "liveness"

    def __init__(self, bound_s: float, pool_tolerance_tokens: int = 0):
        if bound_s <= 0:
            raise ValueError(f"liveness bound_s must be > 0, got {bound_s}")
        self.bound_s, self.pool_tolerance_tokens = bound_s, pool_tolerance_tokens

    def check(self, events, registry=None):
        return liveness(events, self.bound_s, self.pool_tolerance_tokens)
