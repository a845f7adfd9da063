"""``http_semantics``: a prompt the engine must reject (over the pool or the context) gets a 4xx
with an error; HTTP 200 with content is a failure.

A stream is answered 200 at its headers before the engine has looked at the prompt (SGLang's streaming
routes start the response first), so a stream's rejection is an error event in the stream: 200 with an
error and no content is a rejection; 200 headers followed by nothing at all (no content, no error, no
end) decide nothing here, and liveness judges the request that never ended."""

from __future__ import annotations

from kvchaos.history import as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict


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
        body = run.bodies.get(rid) or {}
        if p.get("kind") == "stream" and status == 200:
            if not (body.get("text") or "").strip() and run.outcome(rid) != "ok" and not body.get("error"):
                undecided.append(rid)  # headers only: the engine said nothing either way
                continue
            if body.get("error") and not (body.get("text") or "").strip():
                checked += 1  # rejected in the stream, the only way a stream can be
                continue
        checked += 1
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


class HttpSemantics(Checker):
    name = "http_semantics"

    def check(self, events, registry=None):
        return http_semantics(events)
