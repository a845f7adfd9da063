"""What a run tells the search: abstract engine states, taken from the engines' own events.

kvchaos fuzz is guided by what the *engines* did, not by which lines of kvchaos ran. The in-engine
agent logs each request's way through SGLang's PD path (``kv_prealloc`` on decode, ``transfer_start``
and ``write_end`` on prefill, ``kv_released`` / ``deferred_hold`` / ``deferred_release`` on decode,
``kv_retracted`` / ``kv_resumed``, ``prefix_match``, every fault's ``fault_fired``); the client logs
what came back. A request's *state* is a small tuple of those facts, each bucketed:

- what the client got (HTTP status class, outcome, finish reason);
- whether decode pre-allocated it, with a prefix from its own cache or not;
- how its KV moved (no transfer, whole, short: fewer pages sent than decode reserved, a failed write);
- how decode let its pages go (released at once, held for a late write, the hold's outcome);
- whether it was retracted and resumed (and restored equal);
- whether prefill's cache served it, and whether across salts;
- the faults that fired on it, and in which phase.

A feature is one such state (``req:...``), or a relation between requests the engines reveal (a write
that landed after decode released its pages: ``late_write``; occupancy bands of decode's pool and of
requests in flight). A scenario whose run shows a feature not seen before joins the corpus (AFL's rule
with engine states for edges). Why not branch coverage of SGLang's modules: ``sys.settrace`` in the
schedulers costs several times the engine's own time on these 2-core machines, and the states above are
the ones the isolation findings differ in (docs/reference/scenarios-and-fuzzing.md).
"""

from __future__ import annotations

import math
from collections import defaultdict


def _band(x: float) -> int:
    """log2 bucket: 0, 1, 2-3, 4-7, ..."""
    return 0 if x <= 0 else int(math.log2(x)) + 1


def _status_class(s) -> str:
    if s is None:
        return "none"
    return f"{int(s) // 100}xx"


def request_states(records) -> dict[str, tuple]:
    """rid -> its abstract state (a tuple of ``key=value`` strings, sorted)."""
    per: dict[str, dict] = defaultdict(dict)
    released_at: dict = {}
    for e in records:
        ev = e.get("ev")
        rid = e.get("rid")
        if ev == "end" and rid:
            per[rid]["status"] = _status_class(e.get("status"))
            per[rid]["outcome"] = e.get("outcome") or "?"
        elif ev == "body" and rid:
            fr = (e.get("meta") or {}).get("finish_reason")
            per[rid]["finish"] = (fr.get("type") if isinstance(fr, dict) else fr) or "none"
        elif ev == "agent" and rid:
            a = e.get("agent_ev")
            s = per[rid]
            if a == "kv_prealloc":
                s["prealloc"] = "prefix" if (e.get("total_prefix_len") or 0) > 0 else "fresh"
            elif a == "transfer_start":
                s.setdefault("xfer", "whole")
            elif a == "write_end":
                if e.get("ret") not in (0, None):
                    s["write"] = "failed"
                if e.get("room") in released_at and e.get("wall", 0) > released_at[e["room"]]:
                    s["late_write"] = "yes"
            elif a == "kv_released":
                released_at.setdefault(e.get("room"), e.get("wall", 0))
                s["release"] = "deferred" if e.get("deferred_release_enabled") else "immediate"
            elif a == "deferred_release":
                s["deferred"] = e.get("outcome") or "?"
            elif a == "kv_retracted":
                s["retracted"] = "yes"
            elif a == "kv_resumed":
                s["resumed"] = "equal" if e.get("restored_equal") else "differs"
            elif a == "prefix_match" and (e.get("cached_tokens") or 0) > 0:
                same = e.get("cache_salt") == e.get("lookup_salt")
                s["cache_hit"] = "same_salt" if same else "other_salt"
            elif a == "fault_fired":
                kind = e.get("kind")
                if kind == "short":
                    s["xfer"] = "short"
                s[f"fault_{kind}"] = e.get("phase") or "fired"
    return {rid: tuple(sorted(f"{k}={v}" for k, v in s.items())) for rid, s in per.items()}


def features(records) -> set[str]:
    """The run's features: each request's state, and the relations between requests (module doc)."""
    states = request_states(records)
    out = {"req:" + "|".join(st) for st in states.values() if st}
    in_flight = peak = 0
    max_page = 0
    late = 0
    for e in sorted(records, key=lambda e: e.get("wall", 0)):
        ev = e.get("ev")
        if ev == "send":
            in_flight += 1
            peak = max(peak, in_flight)
        elif ev == "end":
            in_flight -= 1
        elif ev == "agent" and e.get("agent_ev") == "kv_prealloc":
            pages = e.get("dst_pages") or []
            if pages:
                max_page = max(max_page, max(pages))
    for st in states.values():
        late += "late_write=yes" in st
    out.add(f"in_flight_band:{_band(peak)}")
    if max_page:
        out.add(f"decode_pool_band:{_band(max_page)}")
    if late:
        out.add(f"late_writes_band:{_band(late)}")
    return out
