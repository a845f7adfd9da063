"""``differential``: greedy output against the same prompt served alone by a clean single server."""

from __future__ import annotations

from kvchaos.history import as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict
from .kvpages import _records


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


class Differential(Checker):
    """``reference``: rid -> {"output_ids", "text"}, or a callable of the event log returning that
    (e.g. the same prompts served alone by a clean single server after the run)."""
    name, leak = "differential", True

    def __init__(self, reference):
        self.reference = reference

    def check(self, events, registry=None):
        ref = self.reference(_records(events)) if callable(self.reference) else self.reference
        return differential(events, ref)
