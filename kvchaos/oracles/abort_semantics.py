"""``abort_semantics``: a request aborted at any stage comes back as aborted (an error, or 200 with
finish reason ``abort``), never as a 200 success while the abort provably reached it in time."""

from __future__ import annotations

import math
from collections import defaultdict

from kvchaos.history import agent_kind, as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict


def _finish_type(body: dict):
    """A reply's finish reason: /generate's ``meta_info.finish_reason.type``, or an OpenAI choice's
    ``finish_reason`` string (the driver puts both in the body's meta)."""
    fr = (body.get("meta") or {}).get("finish_reason")
    return fr.get("type") if isinstance(fr, dict) else fr


def _in_time(run, aborts) -> dict | None:
    """rid -> whether the scheduler of the role that held the request (its first ``fault_fired``: the park
    or hold) acted on its abort (the agent's ``abort_ingested``) before the agent let it go (``fault_fired``
    phase ``released``, or the harness's own ``released`` fault record, whichever came first; when either
    came at all); any role's where nothing held it. None for a log without
    ``abort_ingested`` events (an agent before them): there, held at the send stands alone."""
    holder, ingested, released, seen = {}, {}, {}, False
    for e in run.records:
        k, rid = agent_kind(e), e.get("rid")
        if k == "abort_ingested":
            seen = True
            if rid in aborts:
                ingested.setdefault((rid, e.get("role")), float(e.get("wall") or 0.0))
        elif k == "fault_fired" and rid in aborts:
            holder.setdefault(rid, e.get("role"))
            if e.get("phase") == "released":
                released[rid] = min(released.get(rid, math.inf), float(e.get("wall") or 0.0))
        elif e.get("ev") == "fault" and e.get("action") == "released" and (t := (e.get("target") or {}).get("rid")) in aborts:
            # the harness let its hold or park go (a hold's release has no agent phase of its own)
            released[t] = min(released.get(t, math.inf), float(e.get("at") or e.get("wall") or 0.0))
    if not seen:
        return None
    out = {}
    for rid in aborts:
        walls = [w for (r, role), w in ingested.items() if r == rid and (rid not in holder or role == holder[rid])]
        out[rid] = bool(walls) and (rid not in released or min(walls) <= released[rid])
    return out


def abort_semantics(events) -> Verdict:
    """Every request the harness aborted (``fault`` records, action ``abort_request``) got the
    outcome of an abort: an error status with an error message, or HTTP 200 whose finish reason is
    ``abort``. A 200 that finished as a success (``length`` / ``stop``) is a FAIL when the abort was
    sent while the request was provably held at its stage and, where the agent logs it, an engine's
    scheduler acted on the abort before the request was let go (it could not have finished before: the
    abort was lost — the shape of SGLang #33507). ``/abort_request`` answering 200 only queues the abort:
    a request let go before a scheduler read it was not aborted in time, and like one nothing held (the
    abort may have come too late) its reply's content is judged by isolation / differential. Per stage,
    what came back is in the stats. UNKNOWN when no aborted request got an answer, or none in time."""
    run = as_history(events)
    aborts = {e["rid"]: e for e in run.records if e.get("ev") == "fault" and e.get("action") == "abort_request"
              and e.get("rid")}
    rooms = defaultdict(list)  # rid -> prefill's bootstrap rooms in order: one per attempt (a retry: a new one)
    for e in run.records:
        if agent_kind(e) == "bootstrap_queued" and e.get("rid") in aborts and e.get("room") not in rooms[e["rid"]]:
            rooms[e["rid"]].append(e.get("room"))
    in_time = _in_time(run, aborts)
    late = []  # held at the send, let go before the holding role's scheduler acted on the abort
    witnesses, outcomes, undecided = [], {}, []
    for rid, a in aborts.items():
        status, body = run.statuses.get(rid), run.bodies.get(rid) or {}
        ftype = _finish_type(body)
        outcomes[a.get("stage") or rid] = {"rid": rid, "status": status, "finish_reason": ftype, "held": a.get("held"),
                                           "ingested_in_time": None if in_time is None else in_time[rid],
                                           "attempts": len(rooms.get(rid, ())) or None,
                                           "text_chars": len(body.get("text") or ""),
                                           "error": (body.get("error") or "")[:160] or None}
        if status is None:
            undecided.append(rid)
            continue
        base = {"rid": rid, "tenant": run.plans.get(rid, {}).get("tenant"), "stage": a.get("stage"), "status": status,
                "finish_reason": ftype, "held": a.get("held"), "attempts": len(rooms.get(rid, ())) or None}
        if a.get("held") and in_time is not None and not in_time[rid]:
            late.append(rid)
            if status == 200 and ftype != "abort":
                continue  # not aborted in time: this 200 proves nothing lost; isolation judges its content
        if status == 200 and ftype != "abort" and a.get("held"):
            witnesses.append({**base, "problem": f"aborted while held at {a.get('stage')}, answered HTTP 200 finished "
                                                 f"as {ftype!r}: the abort was lost and the reply passed for complete"})
        elif status != 200 and not (400 <= status < 600 and body.get("error")):
            witnesses.append({**base, "problem": f"abort answered HTTP {status} without an error message"})
    stats = {"aborted": len(aborts), "no_status": len(undecided), "outcomes": outcomes, "not_in_time": late}
    if witnesses:
        w = witnesses[0]
        return Verdict("abort_semantics", FAIL, f"{len(witnesses)} of {len(aborts)} aborted requests did not come back "
                       f"as aborted (first: {w['rid']} at {w['stage']}: {w['problem']})", witnesses, stats)
    decided = len(aborts) - len(undecided)
    if not decided:
        return Verdict("abort_semantics", UNKNOWN, f"{len(aborts)} aborts sent, none answered"
                       + (" (see liveness)" if undecided else ""), [], stats)
    held = [rid for rid, a in aborts.items() if a.get("held") and rid not in undecided]
    if held and set(held) <= set(late):
        return Verdict("abort_semantics", UNKNOWN, f"{len(held)} aborts sent while their requests were held, none "
                       "acted on by a scheduler before the request was let go: nothing shows whether an abort in "
                       f"time comes back as one (first: {late[0]})", [], stats)
    return Verdict("abort_semantics", PASS, f"{decided} aborted requests answered as aborted: "
                   + ", ".join(f"{st} {o['status']}{'/' + str(o['finish_reason']) if o['status'] == 200 else ''}"
                               for st, o in outcomes.items() if o["status"] is not None), [], stats)


class AbortSemantics(Checker):
    name = "abort_semantics"

    def check(self, events, registry=None):
        return abort_semantics(events)
