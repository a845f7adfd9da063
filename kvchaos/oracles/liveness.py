"""``liveness``: every request ends within the bound; the cluster answers afterwards; the KV pool
returns to its idle baseline (no pages lost)."""

from __future__ import annotations

from kvchaos.history import as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict


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
    # plans a wedged run never sent (kvchaos.workload.driver's stall_s): no evidence either way
    not_sent = sum(e.get("outcome") == "not_sent" for e in run.ends.values())
    stats = {"requests": len(run.plans), "ended": len(run.ends), "not_sent": not_sent, "pool": pool,
             "after_probes": len(after)}
    if witnesses:
        return Verdict("liveness", FAIL, f"{len(witnesses)} liveness problems (first: "
                       f"{witnesses[0].get('rid', '')} {witnesses[0]['problem']})", witnesses, stats)
    if not after:
        return Verdict("liveness", UNKNOWN, f"all {len(run.plans)} requests ended within {bound_s:.0f} s, "
                       "but no post-run probe of the cluster was recorded", [], stats)
    if not_sent:  # only a timeout stops a run sending, and that timeout is a witness: never here
        return Verdict("liveness", UNKNOWN, f"{not_sent} of {len(run.plans)} plans were never sent", [], stats)
    return Verdict("liveness", PASS, f"all {len(run.plans)} requests ended within {bound_s:.0f} s; cluster answers"
                   + ("; KV pool back to baseline" if pool else ""), [], stats)


class Liveness(Checker):
    name = "liveness"

    def __init__(self, bound_s: float, pool_tolerance_tokens: int = 0):
        if bound_s <= 0:
            raise ValueError(f"liveness bound_s must be > 0, got {bound_s}")
        self.bound_s, self.pool_tolerance_tokens = bound_s, pool_tolerance_tokens

    def check(self, events, registry=None):
        return liveness(events, self.bound_s, self.pool_tolerance_tokens)
