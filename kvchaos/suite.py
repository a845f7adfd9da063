"""Helpers for writing suites on top of :mod:`kvchaos.experiment` (the one runner).

- :func:`abort_in_flight` — the abort choreography as an experiment's ``during`` action: each
  victim's KV write is held inside prefill's transfer, the request is aborted on both engines while
  held, then the write is released and lands late.
- :func:`server_field` — a value from a nested ``/server_info`` answer.
"""

from __future__ import annotations

import time

import httpx

from kvchaos.workload.probes import server_field  # noqa: F401 - suites import it from here


def abort_in_flight(cluster, faults, victims, hold_s=0.3):
    """Arm a hold on each victim's KV write (call inside the experiment's ``with`` block, so the
    holds are part of its method) and return the action for ``ex.during(...)``: for each victim in
    turn, wait until the write is parked in prefill, abort the request on both engines, wait
    ``hold_s`` and release the write (it lands late). The action returns what happened per victim."""
    holds = [(v, faults.agent.arm("prefill", "hold", target={"rid": v.rid}, params={"max_hold_s": 30}))
             for v in victims]

    def choreograph() -> list[dict]:
        out = []
        for v, h in holds:
            try:
                held = faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=90)
            except TimeoutError as e:
                out.append({"rid": v.rid, "error": str(e)})
                continue
            t_abort = time.time()
            st = {}
            for role in ("prefill", "decode"):
                url = getattr(cluster.endpoints, role)
                try:
                    st[role] = httpx.post(f"{url}/abort_request", json={"rid": v.rid}, timeout=10).status_code
                except httpx.HTTPError as e:
                    st[role] = repr(e)
            time.sleep(hold_s)
            h.release()
            late = faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="late_write", timeout=30)
            out.append({"rid": v.rid, "room": held.get("room"), "aborted_at": t_abort, "abort_status": st,
                        "late_write_at": late["wall"], "room_status_at_write": late.get("room_status_at_write")})
        return out

    choreograph.holds = holds
    return choreograph
