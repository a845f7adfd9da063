"""KV-transfer faults under multi-tenant load: delay (with jitter, per chunk), one failed send,
late writes after aborts, and short transfers (success reported after one page). A correct engine may slow down or fail a request, but never serves one
tenant's data to another, and every request ends.

Each test arms its fault on one tenant's requests from the engine side (the in-engine agent),
proves it fired, runs 48 requests of 8 tenants through the router, and judges the event log with
the isolation, sensitivity and liveness oracles."""

from __future__ import annotations

import pytest

from kvchaos import canary, oracles
from kvchaos.suite import run_judged
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60


def _run(cluster, faults, kvchaos_run_dir, name, plans, concurrency=8):
    return run_judged(cluster, faults, kvchaos_run_dir, name, plans,
                      [oracles.isolation, oracles.sensitivity, lambda ev: oracles.liveness(ev, bound_s=BOUND_S)],
                      concurrency=concurrency, timeout_s=BOUND_S)


def test_transfer_delay_with_jitter_keeps_isolation(cluster, faults, kvchaos_run_dir):
    wl = Workload(101, n_tenants=8, prefix="d")
    plans = wl.mix(48, lengths=(100, 500))
    target = wl.tenants[1].name
    f = faults.agent.arm("prefill", "delay", target={"tenant": target}, params={"ms": 250, "jitter_ms": 200})
    _, (iso, sens, live) = _run(cluster, faults, kvchaos_run_dir, "transfer_delay", plans)
    fired = f.verify(at_least=sum(p.tenant == target for p in plans))
    assert {e["rid"].rsplit("-", 1)[1] for e in fired} == {target}
    assert len({e["ms"] for e in fired}) > 1  # jitter: not one fixed delay
    assert iso.status == oracles.PASS, iso
    assert live.status == oracles.PASS, live.witnesses[:3]


def test_one_failed_send_is_an_error_for_its_request_only(cluster, faults, kvchaos_run_dir):
    wl = Workload(102, n_tenants=8, prefix="f")
    plans = wl.mix(48, lengths=(100, 500))
    victim = plans[5]
    f = faults.agent.arm("prefill", "fail", target={"rid": victim.rid})
    ev, (iso, sens, live) = _run(cluster, faults, kvchaos_run_dir, "transfer_fail", plans, concurrency=4)
    f.verify()
    run = oracles.Run(ev)
    if run.statuses.get(victim.rid) == 200:
        # acceptable only as a complete retry (sglang-router retries; seen on NIXL): a second transfer
        # under a new bootstrap room, and the reply holds the request's own canaries
        rooms = {e["room"] for e in ev if e.get("agent_ev") == "transfer_start" and e.get("rid") == victim.rid}
        assert len(rooms) >= 2, f"answered 200 although its only KV transfer failed (rooms {rooms})"
        text = run.response_text(victim.rid)
        assert all(canary.payload(c) in text for c in victim.canaries), (victim.rid, text[:200])
    assert iso.status == oracles.PASS, iso  # failures may cost availability, never isolation
    assert live.status == oracles.PASS, live.witnesses[:3]
    # on record: the bystanders the blacklisted Mooncake session took down with it (README finding)
    failed = sorted(r for r, st in run.statuses.items() if st != 200 and r != victim.rid)
    faults.log.emit("observed", victim=victim.rid, bystanders_failed=len(failed), of=len(plans) - 1)


def test_late_writes_after_aborts_keep_isolation(cluster, faults, kvchaos_run_dir):
    wl = Workload(103, n_tenants=8, prefix="l")
    plans = wl.mix(40, weights={"plain": 3, "abort_after": 1}, lengths=(150, 500))
    # every chunk of the aborted tenants' requests is delayed past its abort, then lands late
    aborters = {p.tenant for p in plans if p.kind == "abort_after"}
    fs = [faults.agent.arm("prefill", "delay", target={"tenant": t}, params={"ms": 400}) for t in sorted(aborters)]
    _, (iso, sens, live) = _run(cluster, faults, kvchaos_run_dir, "late_write", plans)
    assert sum(len(f.fired_events()) for f in fs) >= 1
    assert iso.status == oracles.PASS, iso
    assert live.status == oracles.PASS, live.witnesses[:3]


SHORT_FINDING = (
    "known engine limitation (sglang 0.5.23 default config): decode does not check that the KV it "
    "received covers what it pre-allocated — a transfer that reports success after writing 1 page is "
    "decoded over whatever the other pages held (other tenants' prompts). The KV checksum "
    "(--disaggregation-enable-kv-checksum) is off by default; PR #38704 (open) adds a transferred-length "
    "check. kvchaos sees it: isolation FAIL with the shorted request as victim.")


def test_short_transfer_is_not_served_as_a_clean_reply(cluster, faults, kvchaos_run_dir):
    wl = Workload(104, n_tenants=8, prefix="s")
    plans = wl.mix(40, lengths=(200, 500))
    target = wl.tenants[5].name
    shorted = [p.rid for p in plans if p.tenant == target][:3]
    # every KV send of these requests (a transfer can come in several chunks) stops after one page
    fs = [faults.agent.arm("prefill", "short", target={"rid": r}, params={"pages": 1}, count=100) for r in shorted]
    ev, (iso, sens, live) = _run(cluster, faults, kvchaos_run_dir, "short_transfer", plans)
    for f in fs:
        fired = f.verify()
        assert any(e["pages_reserved"] > 100 and e["pages_sent"] == 1 for e in fired), fired
    assert live.status == oracles.PASS, live.witnesses[:3]
    victims = {w["victim_rid"] for w in iso.witnesses}
    assert victims <= set(shorted), sorted(victims - set(shorted))  # bystanders are never affected
    run = oracles.Run(ev)
    served = [r for r in shorted if run.statuses.get(r) == 200]
    faults.log.emit("observed", shorted=shorted, served_200=served, isolation=iso.status)
    if served:  # answered from pages that were never written
        pytest.xfail(f"{SHORT_FINDING} Witness: {len(served)}/{len(shorted)} shorted requests answered HTTP 200; "
                     f"isolation {iso.status.upper()}: {iso.summary}")
    # a correct engine fails the shorted requests instead of answering from unwritten pages
    assert iso.status == oracles.PASS, iso
