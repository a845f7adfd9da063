"""``retraction``: from decode's own evidence, every request decode retracted got its own KV back
bit-exact when it resumed, and none was answered without being resumed."""

from __future__ import annotations

from collections import defaultdict

from kvchaos.history import agent_kind, as_history

from .base import Checker, Verdict, ladder


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
    return ladder(
        "retraction", stats, witnesses,
        fail=lambda ws: (f"{len(ws)} retracted request(s) did not get their own KV back (first: {ws[0]['rid']}: "
                         f"{ws[0]['problem']})"),
        unknown=[(hook_errors, lambda: f"the agent's retraction evidence failed {len(hook_errors)} time(s) (first: "
                  f"{hook_errors[0].get('error')}): not judged"),
                 (n < min_retractions, f"{n} of this log's requests were retracted (need >= {min_retractions}): the "
                  "retraction path was not exercised")],
        passed=(f"{n} retraction(s) of {len(retracted)} request(s): every one resumed with its KV restored "
                "bit-exact, none answered without its KV"))


class Retraction(Checker):
    name, leak, log_only = "retraction", True, True

    def __init__(self, min_retractions: int = 1):
        if min_retractions < 1:
            raise ValueError(f"min_retractions must be >= 1 (a run that retracted nothing proves nothing), "
                             f"got {min_retractions}")
        self.min_retractions = min_retractions

    def check(self, events, registry=None):
        return retraction(events, self.min_retractions)
