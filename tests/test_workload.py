"""Workload plans replay from their seed; the driver logs every step and bounds every request.
Runs against tests/fake_engine.py (loopback), never a real engine."""

import json
import time

import pytest

from faults.request import expect_caught, plant_leak
from kvchaos import canary, oracles
from kvchaos.workload import EventLog, Workload, load_events, run_plans
from tests.fake_engine import FakeEngine


def test_same_seed_same_plans():
    a = Workload(7, n_tenants=5).mix(50, weights={"plain": 2, "stream": 1, "abort_after": 1})
    b = Workload(7, n_tenants=5).mix(50, weights={"plain": 2, "stream": 1, "abort_after": 1})
    assert [(p.rid, p.tenant, p.kind, p.prompt, p.canaries, p.abort_after_ms) for p in a] == \
           [(p.rid, p.tenant, p.kind, p.prompt, p.canaries, p.abort_after_ms) for p in b]
    c = Workload(8, n_tenants=5).mix(50)
    assert [p.prompt for p in c] != [p.prompt for p in a]


def test_plans_carry_their_canaries_and_tenants():
    wl = Workload(1, n_tenants=32)
    plans = wl.mix(64)
    assert len({p.tenant for p in plans}) == 32
    for p in plans:
        assert [c for _, c in canary.find(p.prompt)] == p.canaries or sorted(c for _, c in canary.find(p.prompt)) == sorted(p.canaries)
        assert len(p.prompt) == p.n_tokens and p.prompt.endswith("[")
    # a canary is in several plans only when they share the part that holds it: one tenant's system
    # prompt or conversation, or one prompt sent by several tenants (identical)
    holders = {}
    for p in plans:
        for c in p.canaries:
            holders.setdefault(c, []).append(p)
    for c, ps in holders.items():
        if len(ps) > 1:
            assert len({p.group for p in ps}) == 1 or len({p.tenant for p in ps}) == 1, (c, [p.rid for p in ps])
            assert all(p.sharing != "none" for p in ps), (c, [p.rid for p in ps])
    flat = Workload(1, n_tenants=32).mix(64, sharing={"none": 1})
    payloads = [canary.payload(c) for p in flat for c in p.canaries]
    assert len(payloads) == len(set(payloads))


@pytest.mark.parametrize("bad,msg", [({"kind": "explode"}, "unknown request kind"),
                                     ({"endpoint": "grpc"}, "unknown endpoint")])
def test_bad_plan_input_is_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        Workload(1).request(**bad)
    with pytest.raises(ValueError, match="unknown request kinds"):
        Workload(1).mix(3, weights={"nope": 1})


def test_driver_logs_every_step_over_all_endpoints(tmp_path):
    wl = Workload(3, n_tenants=4)
    plans = [wl.request(kind=k, endpoint=e) for k in ("plain", "stream") for e in ("generate", "completions", "chat")]
    with FakeEngine() as eng, EventLog(tmp_path / "ev.jsonl") as log:
        ends = run_plans(eng.url, plans, log, concurrency=4, timeout_s=10)
    assert [e["outcome"] for e in ends] == ["ok"] * 6
    ev = load_events(tmp_path / "ev.jsonl")
    for p in plans:
        kinds = [e["ev"] for e in ev if e.get("rid") == p.rid]
        assert kinds[0] == "plan" and "send" in kinds and "first_byte" in kinds and kinds[-1] == "end"
        body = next(e for e in ev if e["ev"] == "body" and e["rid"] == p.rid)
        assert all(canary.payload(c) in body["text"] for c in p.canaries), (p.endpoint, p.kind, body)
    ts = [e["t"] for e in ev]
    assert ts == sorted(ts)
    iso = oracles.isolation(ev)  # no leak; six replies may be too few for sensitivity to vouch for a PASS
    assert iso.status != oracles.FAIL and not iso.witnesses, iso


def test_abort_and_disconnect_are_bounded_and_logged(tmp_path):
    wl = Workload(4)
    ab = wl.request(kind="abort_after", abort_after_ms=100)
    dc = wl.request(kind="disconnect_before_first_token")
    with FakeEngine(chunk_delay_s=0.2) as eng, EventLog() as log:
        t0 = time.monotonic()
        ends = run_plans(eng.url, [ab, dc], log, concurrency=2, timeout_s=10, abort_urls=(eng.url,))
        assert time.monotonic() - t0 < 5
        aborted = [b for p, b in eng.requests if p == "/abort_request"]
    assert {e["outcome"] for e in ends} == {"aborted", "disconnected"}
    assert {b["rid"] for b in aborted} == {ab.rid, dc.rid}
    assert not any(e["ev"] == "first_byte" and e["rid"] == dc.rid for e in log.records)
    # what each received is logged once, marked incomplete (the disconnect had its headers; the abort
    # almost surely too): tests/test_driver_bytes.py
    bodies = {e["rid"]: e for e in log.records if e["ev"] == "body"}
    assert dc.rid in bodies and set(bodies) <= {ab.rid, dc.rid} and not any(b["complete"] for b in bodies.values())
    assert sum(e["ev"] == "body" for e in log.records) == len(bodies)


def test_hang_becomes_a_timeout_within_the_bound(tmp_path):
    p = Workload(5).request()
    with FakeEngine(behaviour="hang") as eng, EventLog() as log:
        t0 = time.monotonic()
        (end,) = run_plans(eng.url, [p], log, timeout_s=1.0)
        assert time.monotonic() - t0 < 4
    assert end["outcome"] == "timeout"
    assert oracles.liveness(log.records, bound_s=1.0).status == oracles.FAIL


def test_planted_leak_fault_fires_and_is_caught(tmp_path):
    wl = Workload(6, n_tenants=3)
    plans = [wl.request(wl.tenants[i]) for i in range(3)]
    with FakeEngine() as eng, EventLog() as log:
        fault = plant_leak(plans[2], plans[0], log)
        run_plans(eng.url, plans, log)
    assert any(e["ev"] == "fault" and e["type"] == "planted_leak" for e in log.records)
    v = oracles.isolation(log.records)
    ok, why = expect_caught(v, fault)
    assert ok, why
    # control: the same fault aimed at the wrong victim is not "caught"
    wrong = dict(fault, victim=plans[1].rid)
    assert expect_caught(v, wrong)[0] is False


def test_truncated_event_log_is_reported(tmp_path):
    p = tmp_path / "ev.jsonl"
    p.write_text(json.dumps({"ev": "send", "rid": "a", "t": 1}) + "\n{\"ev\": \"bo")
    ev = load_events(p)
    assert ev[-1]["ev"] == "truncated"
    p.write_text("{bad\n" + json.dumps({"ev": "send"}) + "\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_events(p)


def test_gated_plans_wait_each_on_a_thread_of_its_own(tmp_path):
    """Ten plans wait for something the last plan's sending sets off (an op on its first byte): each
    gated plan waits on a thread of its own, so the last one's gate is not queued behind theirs (in the
    loop's shared pool of 6 threads it was, until their bound)."""
    import threading

    wl = Workload(7, n_tenants=4, prefix="gt")
    plans = wl.mix(11)
    last = plans[-1].rid
    went = threading.Event()
    waited = []

    def gate(rid):
        if rid == last:
            went.set()  # what the others wait for happens once this one may go
            return
        waited.append(went.wait(5.0))

    with FakeEngine() as eng, EventLog(tmp_path / "ev.jsonl") as log:
        t0 = time.monotonic()
        run_plans(eng.url, plans, log, concurrency=11, timeout_s=10, gate=gate, gated=[p.rid for p in plans[1:]])
    assert waited == [True] * 9 and time.monotonic() - t0 < 4.5
    with pytest.raises(ValueError, match="wait for a gate, and there is none"):
        run_plans("http://127.0.0.1:9", plans, EventLog(), gated=[last])
