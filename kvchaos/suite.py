"""Helpers for writing suites on top of :mod:`kvchaos.experiment` (the one runner).

- :func:`mix_with` — plain requests with one kind among them (one in four).
- :func:`delay_tenants_of_kind` — delay the transfers of the tenants sending one kind of request.
- :func:`abort_in_flight` — the abort choreography as an experiment's ``during`` action: each
  victim's KV write is held inside prefill's transfer, the request is aborted on both engines while
  held, then the write is released and lands late.
- :func:`abort_at_stages` — one victim per PD stage (held in decode's pre-allocation, prefill's
  waiting queue, the KV transfer, decode's waiting queue, or decoding), each aborted on both engines
  while it is there; the aborts are recorded for :class:`kvchaos.oracles.AbortSemantics`.
- :func:`server_field` — a value from a nested ``/server_info`` answer.
- :func:`single_server_reference` — the same prompts served alone by a clean single server (greedy),
  for :class:`kvchaos.oracles.Differential`.
- :func:`own_cluster` — a cluster of a test's own (another release, another deployment), with its own
  planted-leak self-test gating the policy its experiments are judged by.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time

import httpx

from kvchaos.cluster import Cluster
from kvchaos.schedule import abort_on_both, single_server_reference  # noqa: F401 - suites import them from here
from kvchaos.selftest import planted_leak_selftest
from kvchaos.workload import Workload
from kvchaos.workload.scenario import Op
from kvchaos.workload.snapshots import server_field  # noqa: F401 - suites import it from here


@contextlib.contextmanager
def own_cluster(spec, workdir, reaper, policy=None):
    """Start a cluster of ``spec`` in ``workdir``; with ``policy``, run its planted-leak self-test
    and yield ``(cluster, a copy of policy gated by that self-test)``, else ``(cluster, None)``.
    Always stopped; processes left behind fail the test."""
    import copy
    import json
    import os

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


def mix_with(seed: int, prefix: str, n: int, kind: str, n_tenants: int = 8, lengths=(150, 500)):
    """``(workload, plans)``: ``n`` requests of ``n_tenants`` tenants, one in four of ``kind`` among plain
    ones (the shape of a fault family that acts on one kind of request)."""
    wl = Workload(seed, n_tenants=n_tenants, prefix=prefix)
    return wl, wl.mix(n, weights={"plain": 3, kind: 1}, lengths=lengths)


def delay_tenants_of_kind(faults, plans, kind: str, ms: float) -> list:
    """Delay every KV transfer of the tenants that send requests of ``kind`` (prefill's agent), so what
    that kind does to a request (a disconnect, an abort) lands while its KV is still moving. Call inside
    the experiment's ``with`` block; returns the armed faults (``fired_events()`` proves each acted)."""
    tenants = sorted({p.tenant for p in plans if p.kind == kind})
    return [faults.agent.arm("prefill", "delay", target={"tenant": t}, params={"ms": ms}) for t in tenants]


def abort_in_flight(cluster, faults, victims, hold_s=0.3, wait_s=90.0):
    """Arm a hold on each victim's KV write (call inside the experiment's ``with`` block, so the
    holds are part of its method) and return the action for ``ex.during(...)``: for each victim in
    the order their writes are parked in prefill (a parked write can keep the next one from
    starting, so not in the plans' order), abort the request on both engines, wait ``hold_s`` and
    release the write (it lands late). The action returns what happened per victim, in that order."""
    holds = [(v, faults.agent.arm("prefill", "hold", target={"rid": v.rid}, params={"max_hold_s": 30}))
             for v in victims]

    def next_held(pending) -> tuple:
        """The pending (victim, hold) whose write was parked first, with its ``held`` event; None
        for the event when none was parked within ``wait_s``."""
        deadline, ids = time.monotonic() + wait_s, {h.id: (v, h) for v, h in pending}
        while True:
            held = [e for e in faults.agent.events("prefill")
                    if e["ev"] == "fault_fired" and e.get("phase") == "held" and e.get("fault") in ids]
            if held:
                e = min(held, key=lambda e: e.get("wall", 0))
                return ids[e["fault"]], e
            if time.monotonic() > deadline:
                return pending[0], None
            time.sleep(0.02)

    def choreograph() -> list[dict]:
        out, pending = [], list(holds)
        while pending:
            (v, h), held = next_held(pending)
            pending.remove((v, h))
            if held is None:
                out.append({"rid": v.rid, "error": f"no fault_fired held for {h.id} from prefill within {wait_s}s"})
                continue
            t_abort = time.time()
            st = abort_on_both(cluster, v.rid)
            time.sleep(hold_s)
            h.release()
            late = faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="late_write", timeout=30)
            out.append({"rid": v.rid, "room": held.get("room"), "aborted_at": t_abort, "abort_status": st,
                        "late_write_at": late["wall"], "room_status_at_write": late.get("room_status_at_write")})
        return out

    choreograph.holds = holds
    return choreograph


# where each stage's victim is held, and by what (faults/agent: ``park`` stages, the transfer ``hold``)
ABORT_STAGES = {"decode_prealloc": ("decode", "park"), "prefill_waiting": ("prefill", "park"),
                "transferring": ("prefill", "hold"), "decode_waiting": ("decode", "park"),
                "decoding": (None, None)}


def abort_at_stage_ops(stage: str, rid: str, first: int = 0, settle_s: float = 0.5) -> list:
    """:func:`abort_at_stages`'s choreography for one victim as scenario data (three
    :class:`~kvchaos.workload.scenario.Op`, to sit at nemesis index ``first`` on): what holds ``rid`` at
    ``stage`` (armed when the method starts), the abort of its exact rid on prefill and decode once it is
    held there, and its release ``settle_s`` later. ``decoding`` is not data: nothing holds a request
    there (the choreography waits for its first streamed byte)."""
    role, kind = ABORT_STAGES.get(stage, (None, None))
    if kind is None:
        raise ValueError(f"abort stage {stage!r}: one of {[s for s, (_r, k) in ABORT_STAGES.items() if k]} "
                         "(nothing holds a request at 'decoding': it is no scenario op)")
    params = {"max_hold_s": 30} if kind == "hold" else {"stage": stage}
    return [Op(at_s=0.0, injector="agent", role=role, kind=kind, target={"rid": rid}, params=params),
            Op(at_s=0.0, injector="action", kind="abort", rids=[rid], after=first),
            Op(at_s=0.0, injector="action", kind="release", after=first, delay_s=settle_s)]


def abort_at_stages(ex, cluster, faults, victims: dict, settle_s: float = 0.5, wait_s: float = 90.0):
    """Arm what holds each victim at its stage (call inside the experiment's ``with`` block) and
    return the action for ``ex.during(...)``. ``victims``: stage (:data:`ABORT_STAGES`) -> plan.
    For each, on a thread of its own: wait until it is held there (``decoding``: until its first
    streamed byte — a ``stream`` plan with a long reply), POST ``/abort_request`` with its exact rid to prefill and to
    decode, wait ``settle_s``, let it go. Every abort is a ``fault`` record (action
    ``abort_request``: rid, stage, ``held`` — whether it was provably still at that stage — and the
    two servers' statuses) in the faults log, which the experiment copies into its own."""
    bad = set(victims) - set(ABORT_STAGES)
    if bad:
        raise ValueError(f"unknown abort stage(s) {sorted(bad)}; one of {tuple(ABORT_STAGES)}")
    holds = {}
    for stage, v in victims.items():
        role, kind = ABORT_STAGES[stage]
        if kind == "hold":
            holds[stage] = faults.agent.arm(role, "hold", target={"rid": v.rid}, params={"max_hold_s": 30})
        elif kind == "park":
            holds[stage] = faults.agent.arm(role, "park", target={"rid": v.rid}, params={"stage": stage})

    def first_byte(rid):
        """Whether ``rid`` streamed its first byte (False once it ended without one, or after wait_s)."""
        deadline, seen = time.monotonic() + wait_s, 0
        while time.monotonic() < deadline:
            new = ex.log.records[seen:]  # the log only grows: scan what came since the last look
            seen += len(new)
            for e in new:
                if e.get("rid") == rid and e.get("ev") in ("first_byte", "end"):
                    return e["ev"] == "first_byte"
            time.sleep(0.01)
        return False

    def one(stage, v) -> dict:
        role, _kind = ABORT_STAGES[stage]
        h = holds.get(stage)
        try:
            if h is not None:
                faults.agent.wait_event(role, "fault_fired", fault=h.id, phase="held", timeout=wait_s)
                held = True
            else:
                held = False  # decoding: nothing holds it; the reply may finish before the abort lands
                if not first_byte(v.rid):
                    raise TimeoutError(f"{v.rid} never streamed a byte")
        except TimeoutError as e:
            return {"rid": v.rid, "stage": stage, "error": str(e)}
        t_abort = time.time()
        st = abort_on_both(cluster, v.rid)
        faults.log.emit("fault", action="abort_request", kind="abort", stage=stage, rid=v.rid, held=held,
                        abort_status=st, at=t_abort)
        time.sleep(settle_s)
        if h is not None:
            h.release()
        return {"rid": v.rid, "stage": stage, "held": held, "aborted_at": t_abort, "abort_status": st}

    def choreograph() -> list[dict]:
        # each victim on its own: one held at a late stage must not keep another from being aborted
        # at an early one (or let a decoding one finish before its turn)
        with cf.ThreadPoolExecutor(len(victims) or 1) as pool:
            return [f.result() for f in [pool.submit(one, st, v) for st, v in victims.items()]]

    choreograph.holds = holds
    return choreograph
