"""Helpers for writing suites on top of :mod:`kvchaos.experiment` (the one runner).

- :func:`abort_in_flight` — the abort choreography as an experiment's ``during`` action: each
  victim's KV write is held inside prefill's transfer, the request is aborted on both engines while
  held, then the write is released and lands late.
- :func:`server_field` — a value from a nested ``/server_info`` answer.
- :func:`own_cluster` — a cluster of a test's own (another release, another deployment), with its own
  planted-leak self-test gating the policy its experiments are judged by.
"""

from __future__ import annotations

import contextlib
import time

import httpx

from kvchaos.workload.probes import server_field  # noqa: F401 - suites import it from here


@contextlib.contextmanager
def own_cluster(spec, workdir, reaper, policy=None):
    """Start a cluster of ``spec`` in ``workdir``; with ``policy``, run its planted-leak self-test
    and yield ``(cluster, a copy of policy gated by that self-test)``, else ``(cluster, None)``.
    Always stopped; processes left behind fail the test."""
    import copy
    import json
    import os

    from kvchaos.cluster import Cluster
    from kvchaos.selftest import planted_leak_selftest

    if os.environ.get("KVCHAOS_DRY") == "1":  # a dry run (--kvchaos-dry) starts no engine
        from kvchaos.cluster.dry import DryCluster

        yield DryCluster(spec), (copy.copy(policy) if policy is not None else None)
        return

    c = Cluster(spec, workdir, reaper=reaper).start()
    (c.workdir / "cluster.json").write_text(json.dumps(c.describe(), indent=2, default=str))
    try:
        own = None
        if policy is not None:
            own = copy.copy(policy)  # the session's registry and flags; this cluster's own self-test
            own.selftest = None
            own.selftest = planted_leak_selftest(c, c.workdir, own)
        yield c, own
    finally:
        left = c.stop()
        assert not left, f"processes left after the {spec.name} cluster's teardown: {left}"


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
