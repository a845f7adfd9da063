"""``page_ownership``: at no instant does a KV page belong to two live requests, nor is one released
twice or given out while free — from the engines' own ledger (the in-engine agent's ``page_conflict``
events: ``faults/agent/ownership.py``).

The ledger runs in every engine process, whatever is armed: it sees what each allocator hands out and
takes back, and (decode) which request's page table each page was given to. A conflict is judged in the
experiment during which it happened — the moment a page is handed to a second holder, not when some later
reply shows it — so the witness names the page, both holders (by the client's rid where decode knew the
request by an id of its own) and when, in the engine's own order (the process's event sequence).

Conflicts (the ledger's words): ``double_assign`` — the allocator handed out a page it had not taken
back; ``two_holders`` — a page given to a request while another live request held it; ``double_free``
— a page released while no one held it; ``unallocated`` — a page given to a request while the
allocator held it as free (used after release).

UNKNOWN where the ledger left no evidence in this experiment (no decode pre-allocation carried its
figures: no agent, an agent too old, or nothing reached decode).
"""

from __future__ import annotations

from kvchaos.history import Witness, as_history

from .base import Checker, Verdict, ladder

PROBLEM = {
    "double_assign": "the allocator handed out a page it had not taken back (one page, two holders)",
    "two_holders": "a page was given to a request while another live request held it",
    "double_free": "a page was released while no one held it (released twice)",
    "unallocated": "a page was given to a request while the allocator held it as free (used after release)",
}


def page_ownership(events) -> Verdict:
    h = as_history(events)
    names = h.engine_rids()

    def client(rid):
        return names.get(rid, rid) if rid else rid

    witnesses = []
    for e in h.agent_events("page_conflict"):
        kind = e.get("conflict")
        witnesses.append(Witness({
            "problem": PROBLEM.get(kind, f"page conflict {kind!r}"), "conflict": kind, "page": e.get("page"),
            "page_size": e.get("page_size"), "role": e.get("role"), "holder": client(e.get("holder")),
            "to": client(e.get("to")), "rid": client(e.get("to")) or client(e.get("holder")),
            "pages": e.get("pages"), "n_pages": e.get("n_pages"), "where": e.get("where"),
            "allocator": e.get("allocator"), "wall": e.get("wall"), "seq": e.get("seq"), "pid": e.get("pid")}))
    ledgers, first = {}, {}
    for e in h.agent_events("kv_prealloc"):
        if isinstance(e.get("ledger"), dict):
            first.setdefault(e.get("pid"), e["ledger"])
            ledgers[e.get("pid")] = e["ledger"]
    for pid, led in ledgers.items():  # conflicts past the event cap: counted by the ledger, never lost
        grew = (led.get("suppressed") or 0) - (first[pid].get("suppressed") or 0)
        if grew > 0:
            witnesses.append(Witness({"problem": f"{grew} page conflict(s) past the ledger's event cap (counted, not "
                                                 "listed)", "conflict": "suppressed", "page": None, "role": "decode",
                                      "holder": None, "to": None, "rid": None, "where": None, "pid": pid}))
    stats = {"conflicts": len(witnesses), "ledgers": ledgers,
             "by_conflict": {k: sum(1 for w in witnesses if w["conflict"] == k) for k in PROBLEM}}
    t0 = h.header.get("wall") if isinstance(h.header.get("wall"), (int, float)) else None

    def fail(ws):
        w = ws[0]
        when = f" {w['wall'] - t0:.2f} s into the experiment" if t0 and isinstance(w.get("wall"), (int, float)) else ""
        pair = f"held by {w['holder']}" + (f", given to {w['to']}" if w.get("to") else "")
        n = f"{w['n_pages']} pages from page {w['page']}" if (w.get("n_pages") or 1) > 1 else f"page {w['page']}"
        return (f"{len(ws)} page conflict(s) in the engines' own ledger (first: {w['conflict']} of {n} on "
                f"{w['role']}, {pair}, in {w['where']}{when})")

    handed = sum(x.get("handed", 0) for x in ledgers.values())
    claimed = sum(x.get("claimed", 0) for x in ledgers.values())
    return ladder("page_ownership", stats, witnesses, fail,
                  unknown=[(not ledgers, "no ownership-ledger evidence from decode (in-engine agent not loaded, too "
                                         "old, or no request reached decode's pre-allocation)")],
                  passed=(f"no page held by two live requests, released twice or used while free (decode's ledger: "
                          f"{handed} pages handed out, {claimed} given to requests, since the process started)"))


class PageOwnership(Checker):
    name, leak, log_only = "page_ownership", True, True

    def check(self, events, registry=None):
        return page_ownership(events)
