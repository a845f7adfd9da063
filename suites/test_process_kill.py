"""Engine processes killed or frozen under multi-tenant load, then restarted.

A node dying mid-transfer is the harshest abort: nothing is notified, the KV write is cut, and the
other side holds pre-allocated pages for a peer that will never answer. A correct cluster may fail
the requests in flight (5xx), but never answers one with another tenant's data, gives the pages
back, and serves cleanly once the node has rejoined.

Each test runs wave 1 (8 tenants) with the fault fired in the middle of it, heals (restart +
router rejoin, or SIGCONT), then wave 2 on the healed cluster. Judged by isolation, kv_lifecycle
and liveness on wave 1 (errors allowed, hangs not; pools back at baseline after the deferred-release
timeout) and by all of them plus sensitivity on wave 2 (every request answered, with its own
canaries). Each proves its fault fired: the pids signalled and their ``/proc`` state, the held
write's ``held`` event.
"""

from __future__ import annotations

import threading

import pytest

from kvchaos import canary, oracles
from kvchaos.suite import run_judged
from kvchaos.workload import Workload

pytestmark = [pytest.mark.cluster, pytest.mark.disruptive]
BOUND_S = 90
KILL_BOUND_S = 45
DECODE_DEATH_HANG = (
    "known engine/router finding (sglang 0.5.23 + sglang-router 0.3.2, PD, CPU): when decode is SIGKILLed "
    "under load, requests already routed to it are not failed — the client waits until its own timeout "
    "(seen with the fault proxy in the path and without it: 19 and 22 of 32 requests unanswered after 60 s). No foreign "
    "data is served and the restarted decode serves wave 2 cleanly. README 'What the faults showed'.")


def _judges(wave2=False):
    j = [oracles.isolation, oracles.kv_lifecycle, lambda ev: oracles.liveness(ev, bound_s=BOUND_S)]
    return j + [oracles.sensitivity] if wave2 else j


def _wave2(cluster, faults, run_dir, name, seed):
    plans = Workload(seed, n_tenants=8, prefix=f"{name[:2]}2").mix(24, lengths=(150, 450))
    ev, (iso, life, live, sens) = run_judged(cluster, faults, run_dir, f"{name}_wave2", plans, _judges(True),
                                             concurrency=8, timeout_s=BOUND_S)
    run = oracles.Run(ev)
    assert iso.status == oracles.PASS, iso
    assert live.status == oracles.PASS, live.witnesses[:3]
    assert sens.status == oracles.PASS, sens  # answered, with its own canaries: the node really rejoined
    assert all(run.statuses.get(p.rid) == 200 for p in plans), {p.rid: run.statuses.get(p.rid) for p in plans}


def _during(fn):
    """Run ``fn`` beside the workload; its exception is kept in ``thread.error`` for the test."""
    def wrapper():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            t.error = e

    t = threading.Thread(target=wrapper, daemon=True)
    t.error = None
    t.start()
    return t


def test_prefill_killed_while_a_write_is_in_flight(cluster, faults, kvchaos_run_dir):
    proc = faults.need("proc")
    wl = Workload(301, n_tenants=8, prefix="kp")
    plans = wl.mix(32, lengths=(150, 450))
    victim = plans[10]
    h = faults.agent.arm("prefill", "hold", target={"rid": victim.rid}, params={"max_hold_s": 60})
    killed = {}

    def kill_when_held():
        faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=120)
        killed["pids"] = proc.kill("prefill")  # the write is parked mid-transfer when prefill dies

    t = _during(kill_when_held)
    ev, (iso, life, live) = run_judged(cluster, faults, kvchaos_run_dir, "kill_prefill", plans, _judges(),
                                       concurrency=8, timeout_s=BOUND_S)
    t.join(timeout=30)
    assert t.error is None, t.error
    assert killed.get("pids"), "prefill was not killed"
    run = oracles.Run(ev)
    assert iso.status == oracles.PASS, iso  # errors are allowed; foreign data is not
    if run.statuses.get(victim.rid) == 200:  # a 200 must be a full retry, never built on the cut write
        text = run.response_text(victim.rid)
        assert all(canary.payload(c) in text for c in victim.canaries), (victim.rid, text[:200])
    assert live.status == oracles.PASS, live.witnesses[:3]  # nothing hung; decode gave the pages back
    assert life.status != oracles.FAIL, life  # no write into pages decode had already given back
    restarts = [e for e in faults.log.records if e.get("kind") == "restart"]
    assert restarts and restarts[-1].get("rejoined_s"), restarts
    _wave2(cluster, faults, kvchaos_run_dir, "kill_prefill", 311)


def test_decode_killed_mid_stream(cluster, faults, kvchaos_run_dir):
    proc = faults.need("proc")
    wl = Workload(302, n_tenants=8, prefix="kd")
    plans = wl.mix(32, weights={"plain": 1, "stream": 1}, lengths=(150, 450))
    first = plans[12]

    def kill_mid_load():
        # once requests are streaming (a transfer has started for the 13th request), decode dies
        faults.agent.wait_event("prefill", "transfer_start", rid=first.rid, timeout=120)
        proc.kill("decode")

    t = _during(kill_mid_load)
    ev, (iso, live) = run_judged(cluster, faults, kvchaos_run_dir, "kill_decode", plans,
                                       [oracles.isolation, lambda ev: oracles.liveness(ev, bound_s=KILL_BOUND_S)],
                                       concurrency=8, timeout_s=KILL_BOUND_S)
    t.join(timeout=30)
    assert t.error is None, t.error
    run = oracles.Run(ev)
    failed = [r for r, s in run.statuses.items() if s != 200] + [p.rid for p in plans if p.rid not in run.statuses]
    faults.log.emit("observed", failed_in_wave1=len(failed), of=len(plans))
    assert failed, "decode was killed under load but every request succeeded: the kill did not land mid-load"
    assert iso.status == oracles.PASS, iso
    _wave2(cluster, faults, kvchaos_run_dir, "kill_decode", 312)  # recovered, whatever wave 1 showed
    hung = [w for w in live.witnesses if w.get("outcome") == "timeout"]
    if live.status == oracles.FAIL and hung and len(hung) == len([w for w in live.witnesses if w.get("rid")]):
        pytest.xfail(f"{DECODE_DEATH_HANG} Witness: {len(hung)}/{len(plans)} requests unanswered after "
                     f"{KILL_BOUND_S} s (first: {hung[0]['rid']}); {live.summary}")
    assert live.status == oracles.PASS, live.witnesses[:3]


def test_decode_frozen_then_resumed(cluster, faults, kvchaos_run_dir):
    proc = faults.need("proc")
    wl = Workload(303, n_tenants=8, prefix="kf")
    plans = wl.mix(32, lengths=(150, 450))
    first = plans[8]

    def freeze():
        faults.agent.wait_event("prefill", "transfer_start", rid=first.rid, timeout=120)
        proc.stop("decode")  # alive, sockets open, answering nothing: a hung node
        threading.Event().wait(4.0)
        proc.cont("decode")

    t = _during(freeze)
    ev, (iso, life, live) = run_judged(cluster, faults, kvchaos_run_dir, "freeze_decode", plans, _judges(),
                                       concurrency=8, timeout_s=BOUND_S)
    t.join(timeout=30)
    assert t.error is None, t.error
    stops = [e for e in faults.log.records if e.get("kind") == "sigstop"]
    assert stops and all(s in ("T", "t") for s in stops[0]["states"].values() if s), stops
    assert iso.status == oracles.PASS, iso
    assert life.status != oracles.FAIL, life
    assert live.status == oracles.PASS, live.witnesses[:3]
    _wave2(cluster, faults, kvchaos_run_dir, "freeze_decode", 313)
