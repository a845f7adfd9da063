"""``kv_lifecycle``: from the engines' own evidence (the agent's ``write_end`` on prefill,
``kv_released`` / ``deferred_release`` on decode), no KV write lands in decode pages after decode
gave them back."""

from __future__ import annotations

from collections import Counter, defaultdict

from kvchaos.history import agent_kind, as_history

from .base import Checker, Verdict, ladder


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


# How far apart two hosts' clocks may be (prefill's write_end and decode's release are stamped by different
# processes, in a deployment on different hosts): a write that ended within it after a release decode says
# waited for the transfer (``drained``) cannot be ordered after it — UNKNOWN for that pair, never a FAIL,
# never a PASS. A release that did not wait (no outcome, ``timeout``) is judged as stamped.
CLOCK_SKEW_S = 0.05


def kv_lifecycle(events, tolerance_s: float = 0.0, skew_s: float = CLOCK_SKEW_S) -> Verdict:
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
    witnesses, unordered = [], []
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
            if out is not None and out.get("outcome") == "drained" and w["wall"] - rel["wall"] <= skew_s:
                unordered.append({"room": room, "rid": w.get("rid") or rel.get("rid"),
                                  "after_release_ms": round(1000 * (w["wall"] - rel["wall"]), 1)})
                continue
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
             "release_outcomes": dict(Counter(all_outcomes)), "within_clock_skew": unordered[:20],
             "clock_skew_s": skew_s}
    return ladder(
        "kv_lifecycle", stats, witnesses,
        fail=lambda ws: (f"{len(ws)} KV write(s) landed after decode released the pages (first: room "
                         f"{ws[0]['room']} rid {ws[0]['rid']}: {ws[0]['pages']} pages, {ws[0]['after_release_ms']} ms "
                         f"after a release whose outcome was {ws[0]['release_outcome']})"),
        unknown=[(not n_writes, "no engine-side write evidence (in-engine agent not loaded?)"),
                 (not releases, f"{n_writes} writes, but no failed/aborted transfer released pages: nothing to judge"),
                 (bool(unordered), f"{len(unordered)} write(s) ended within {1000 * skew_s:.0f} ms (two hosts' clocks "
                  f"may differ by that much) after a release decode reported as drained: they cannot be ordered "
                  f"(first: room {unordered[0]['room'] if unordered else None})")],
        passed=(f"{len(releases)} released room(s), {stats['released_with_writes']} with writes: every write ended "
                "before its pages were released"))


class KVLifecycle(Checker):
    name, leak, log_only = "kv_lifecycle", True, True

    def __init__(self, tolerance_s: float = 0.0, skew_s: float = CLOCK_SKEW_S):
        self.tolerance_s, self.skew_s = tolerance_s, skew_s

    def check(self, events, registry=None):
        return kv_lifecycle(events, self.tolerance_s, self.skew_s)
