"""Helpers for writing suites on top of :mod:`kvchaos.experiment` (the one runner).

- :func:`mix_with` — plain requests with one kind among them (one in four).
- :func:`delay_tenants_of_kind` — delay the transfers of the tenants sending one kind of request.
- :func:`abort_in_flight_ops` — the abort choreography as scenario ops (for ``ex.nemesis``): each
  victim's KV write is held inside prefill's transfer, the request is aborted on both engines while
  held, then the write is released and lands late (:func:`in_flight_outcomes` reads it back).
- :func:`abort_at_stages_ops` — one victim per PD stage (held in decode's pre-allocation, prefill's
  waiting queue, the KV transfer, decode's waiting queue, or decoding), each aborted on both engines
  while it is there; the aborts are recorded for :class:`kvchaos.oracles.AbortSemantics`
  (:func:`stage_outcomes` reads them back).
- :func:`server_field` — a value from a nested ``/server_info`` answer.
- :func:`single_server_reference` — the same prompts served alone by a clean single server (greedy),
  for :class:`kvchaos.oracles.Differential`.
- :func:`own_cluster` — a cluster of a test's own (another release, another deployment), with its own
  planted-leak self-test gating the policy its experiments are judged by.
"""

from __future__ import annotations

import contextlib

from kvchaos.cluster import Cluster
from kvchaos.history import agent_kind
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


def abort_in_flight_ops(victims, hold_s: float = 0.3, first: int = 0) -> list:
    """The abort choreography as scenario ops, to sit at nemesis index ``first`` on (for
    ``ex.nemesis(...)``): for each victim a hold on its KV write inside prefill's transfer (armed when the
    method starts), the abort of its exact rid on both engines once the write is parked, and the
    write's release ``hold_s`` after decode's scheduler acted on the abort (the agent's
    ``abort_ingested``): it lands late, after decode handled the abort, not merely after the abort was
    queued (with both cores busy decode read it 0.4-1.7 s after the send, and a write let go 0.3 s
    after it parked landed while its room still waited for input: the matrix's early_free arm saw
    nothing, make test 2026-12-06). Each victim's ops wait on their own, in the order the engine parks
    the writes (a parked write can keep the next one from starting). :func:`in_flight_outcomes` reads
    back what happened."""
    ops = []
    for v in victims:
        i = first + len(ops)
        ops += [Op(at_s=0.0, injector="agent", role="prefill", kind="hold", target={"rid": v.rid},
                   params={"max_hold_s": 30}),
                Op(at_s=0.0, injector="action", kind="abort", rids=[v.rid], after=i),
                Op(at_s=0.0, injector="action", kind="release", after=i, delay_s=hold_s,
                   on={"role": "decode", "ev": "abort_ingested", "rid": v.rid})]
    return ops


def in_flight_outcomes(ex, victims) -> list[dict]:
    """Per victim of :func:`abort_in_flight_ops` (from the experiment's own log): ``rid``, ``room`` (where
    its write was parked), ``aborted_at``, ``abort_status``, ``late_write_at`` and
    ``room_status_at_write`` (the held write's late landing, as prefill's agent saw it), or ``error``
    saying which step never happened."""
    ev = ex.events
    out = []
    for v in victims:
        fired = [e for e in ev if agent_kind(e) == "fault_fired" and e.get("rid") == v.rid and e.get("kind") == "hold"]
        held = next((e for e in fired if e.get("phase") == "held"), None)
        late = next((e for e in fired if e.get("phase") == "late_write"), None)
        ab = next((e for e in ev if e.get("ev") == "fault" and e.get("action") == "abort_request"
                   and e.get("rid") == v.rid), None)
        missing = [what for what, e in (("parked", held), ("aborted", ab), ("late write", late)) if e is None]
        if missing:
            out.append({"rid": v.rid, "error": f"{v.rid}: never {', '.join(missing)}"})
            continue
        out.append({"rid": v.rid, "room": held.get("room"), "aborted_at": ab.get("at"),
                    "abort_status": ab.get("abort_status"), "late_write_at": late.get("wall"),
                    "room_status_at_write": late.get("room_status_at_write")})
    return out


# where each stage's victim is held, and by what (faults/agent: ``park`` stages, the transfer ``hold``)
ABORT_STAGES = {"decode_prealloc": ("decode", "park"), "prefill_waiting": ("prefill", "park"),
                "transferring": ("prefill", "hold"), "decode_waiting": ("decode", "park"),
                "decoding": (None, None)}


def abort_at_stage_ops(stage: str, rid: str, first: int = 0, settle_s: float = 0.5) -> list:
    """One victim's abort at ``stage`` (:data:`ABORT_STAGES`) as scenario ops, to sit at nemesis index
    ``first`` on: what holds ``rid`` at the stage (armed when the method starts), the abort of its exact
    rid on prefill and decode once it is held there, and its release ``settle_s`` later. ``decoding``:
    nothing holds a request there; the abort comes once the client read its first streamed byte (a
    ``stream`` plan with a long reply). Every abort is a ``fault`` record (action ``abort_request``: rid,
    stage, ``held``: whether it was provably still at that stage) for ``abort_semantics``."""
    if stage not in ABORT_STAGES:
        raise ValueError(f"unknown abort stage {stage!r}; one of {tuple(ABORT_STAGES)}")
    role, kind = ABORT_STAGES[stage]
    if kind is None:
        return [Op(at_s=0.0, injector="action", kind="abort", rids=[rid],
                   on={"role": "client", "ev": "first_byte", "rid": rid})]
    params = {"max_hold_s": 30} if kind == "hold" else {"stage": stage}
    # let go once the holding role's scheduler has acted on the abort (the agent's abort_ingested), not a
    # fixed time after /abort_request answered: that only queues it, and a busy scheduler read it 1.4 s
    # later, after a release 0.8 s on had let the request finish (make test, 2026-12-06)
    return [Op(at_s=0.0, injector="agent", role=role, kind=kind, target={"rid": rid}, params=params),
            Op(at_s=0.0, injector="action", kind="abort", rids=[rid], after=first),
            Op(at_s=0.0, injector="action", kind="release", after=first, delay_s=settle_s,
               on={"role": role, "ev": "abort_ingested", "rid": rid})]


def abort_at_stages_ops(victims: dict, settle_s: float = 0.5) -> list:
    """:func:`abort_at_stage_ops` for each ``stage -> plan`` of ``victims``, one after the other (each
    victim's ops wait on their own: one held at a late stage does not keep another from being aborted at
    an early one)."""
    bad = set(victims) - set(ABORT_STAGES)
    if bad:
        raise ValueError(f"unknown abort stage(s) {sorted(bad)}; one of {tuple(ABORT_STAGES)}")
    ops = []
    for stage, v in victims.items():
        ops += abort_at_stage_ops(stage, v.rid, first=len(ops), settle_s=settle_s)
    return ops


def stage_outcomes(ex, victims: dict) -> list[dict]:
    """Per ``stage -> plan`` of :func:`abort_at_stages_ops` (from the experiment's log): ``rid``, ``stage``,
    ``held``, ``aborted_at``, ``abort_status``; or ``error`` where no abort was sent (the request never
    reached its stage, or never streamed a byte)."""
    out = []
    for stage, v in victims.items():
        ab = next((e for e in ex.events if e.get("ev") == "fault" and e.get("action") == "abort_request"
                   and e.get("rid") == v.rid), None)
        if ab is None:
            out.append({"rid": v.rid, "stage": stage, "error": f"{v.rid} was never aborted at {stage}"})
            continue
        out.append({"rid": v.rid, "stage": stage, "held": ab.get("held"), "aborted_at": ab.get("at"),
                    "abort_status": ab.get("abort_status")})
    return out
