"""Every injector against the live CPU PD cluster: it fires, the event log proves it, the effect is
measured, a control aimed at the wrong target does not fire, and heal restores the cluster."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import httpx
import pytest

from faults import FaultDidNotFire
from kvchaos import canary
from kvchaos.probe import max_new_tokens, prompt

pytestmark = pytest.mark.cluster


def _req(cluster, rid, n_tokens=200, seed=None, k=2, url=None, timeout=60.0):
    rng = random.Random(seed if seed is not None else rid)
    cs = canary.mint(rng, k)
    for c in cs:  # it may stay in decode's pages: a later reply reciting it names this origin
        cluster.canaries.add(c, rid, None, "test_faults_live")
    body = {"text": prompt(rng, n_tokens, cs), "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens(k), "temperature": 0}}
    t0 = time.monotonic()
    try:
        r = httpx.post((url or cluster.endpoints.router) + "/generate", json=body, timeout=timeout)
        out = {"status": r.status_code, "text": r.json().get("text", "") if r.status_code == 200 else r.text}
    except httpx.HTTPError as e:
        out = {"status": None, "error": repr(e), "text": ""}
    out.update(latency=time.monotonic() - t0, canaries=cs, rid=rid)
    return out


def _own_echo(out) -> bool:
    return out["status"] == 200 and all(canary.payload(c) in out["text"] for c in out["canaries"])


def _serves_again(cluster, prefix, within_s=60.0):
    """A clean request echoes its own canaries again within ``within_s`` (recovery is bounded)."""
    deadline = time.monotonic() + within_s
    while True:
        nxt = _req(cluster, f"{prefix}-{int(time.monotonic() * 1000)}")
        if _own_echo(nxt) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert _own_echo(nxt), nxt


def _fault_events(faults, action=None):
    return [e for e in faults.log.records if e["ev"] == "fault" and (action is None or e["action"] == action)]


# ------------------------------------------------------------------ in-engine agent
def test_transfer_delay_hits_only_its_target(cluster, faults):
    f = faults.agent.arm("prefill", "delay", target={"rid": "dly-target"}, params={"ms": 800})
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(_req, cluster, "dly-target")
        time.sleep(0.05)
        b = ex.submit(_req, cluster, "dly-bystander")
        a, b = a.result(), b.result()
    ev = f.verify()
    assert [e["rid"] for e in ev] == ["dly-target"] and ev[0]["ms"] == 800
    assert a["latency"] >= 0.8, a
    assert b["latency"] < 0.8 or b["status"] == 200  # bystander was not delayed by the agent
    assert not [e for e in faults.agent.events("prefill") if e.get("fault") == f.id and e.get("rid") == "dly-bystander"]
    assert _own_echo(a) and _own_echo(b)
    assert _fault_events(faults, "fired")[0]["rid"] == "dly-target"


def test_fault_aimed_at_wrong_target_is_reported_as_not_fired(cluster, faults):
    # 3 s: a bound well above a clean request's time on a loaded machine (0.75 s seen on CI)
    f = faults.agent.arm("prefill", "delay", target={"rid": "no-such-request"}, params={"ms": 3000})
    out = _req(cluster, "ctl-real")
    assert out["latency"] < 3.0 and _own_echo(out)
    with pytest.raises(FaultDidNotFire, match="0 firing"):
        f.verify()
    # tenant targeting: rid carries the tenant
    g = faults.agent.arm("prefill", "delay", target={"tenant": "t007"}, params={"ms": 1})
    _req(cluster, "r1-000001-t003")
    with pytest.raises(FaultDidNotFire):
        g.verify()
    _req(cluster, "r1-000002-t007")
    assert g.verify()[0]["rid"] == "r1-000002-t007"


def test_transfer_start_event_marks_the_window(cluster, faults):
    out = _req(cluster, "start-evt")
    assert out["status"] == 200
    e = faults.agent.wait_event("prefill", "transfer_start", rid="start-evt", timeout=5)
    assert e["pages"] >= 1 and e["reserved"] >= e["pages"] and isinstance(e["room"], int)


def test_transfer_failure_is_an_error_not_a_200(cluster, faults):
    f = faults.agent.arm("prefill", "fail", target={"rid": "fail-1"})
    out = _req(cluster, "fail-1", timeout=90)
    ev = f.verify()
    assert ev[0]["ret"] == -1
    # the failed transfer must not come back as a fluent 200: an error status or a closed stream. Decode
    # answers the failed room 500 and sglang-router 0.3.2 re-sends it (the registry's
    # sglang-router-retries-aborted-requests); prefill's Mooncake session stays blacklisted until decode
    # re-probes it, and a retry sent after that succeeds (fresh clone of 2026-12-07: two rooms failed, the
    # third was written whole; earlier runs: five failed and the router gave up). A 200 is then that
    # retry's reply: its own canaries, and a later room of this rid whose KV prefill wrote whole — never
    # the failed room's
    if out["status"] == 200:
        whole = {e["room"] for e in faults.agent.events("prefill")
                 if e["ev"] == "write_end" and e.get("rid") == "fail-1" and e.get("ret") == 0}
        assert _own_echo(out) and whole and ev[0]["room"] not in whole, (out, ev[0]["room"], whole)
    # and the cluster recovers for other tenants (the failed mooncake session is re-probed)
    _serves_again(cluster, "after-fail")


def test_short_transfer_leaves_decode_reading_unwritten_pages(cluster, faults):
    clean = _req(cluster, "short-ref", n_tokens=300, seed=11)
    assert _own_echo(clean)
    f = faults.agent.arm("prefill", "short", target={"rid": "short-1"}, params={"pages": 1})
    out = _req(cluster, "short-1", n_tokens=300, seed=11)  # same prompt as the reference
    ev = f.verify()
    assert ev[0]["pages_sent"] == 1 and ev[0]["pages_reserved"] >= 300 - 1
    # decode was told "success" and produced a reply over pages nobody wrote in this request
    assert out["status"] == 200, out
    assert out["text"] != clean["text"], "short transfer had no effect on the reply"


def test_hold_then_late_write_after_abort(cluster, faults):
    f = faults.agent.arm("prefill", "hold", target={"rid": "late-1"}, params={"max_hold_s": 30})
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_req, cluster, "late-1", 300, None, 2, None, 60.0)
        held = faults.agent.wait_event("prefill", "fault_fired", fault=f.id, phase="held", timeout=30)
        assert held["rid"] == "late-1"
        # abort inside the window, on both servers (the router does not forward /abort_request)
        codes = [httpx.post(f"{u}/abort_request", json={"rid": "late-1"}, timeout=10).status_code
                 for u in (cluster.endpoints.prefill, cluster.endpoints.decode)]
        assert codes == [200, 200]
        time.sleep(0.5)
        f.release()
        late = faults.agent.wait_event("prefill", "fault_fired", fault=f.id, phase="late_write", timeout=30)
        out = fut.result()
    assert late["released"] is True and late["ret"] == 0
    # the write landed after prefill had already torn the aborted room down: the late write
    assert late["room_status_at_write"] == "gone", late
    # sglang-router retries the aborted request (a new bootstrap room, same rid); whatever came
    # back may carry only this request's own canaries
    rooms = {e["room"] for e in faults.agent.events("prefill")
             if e["ev"] == "transfer_start" and e["rid"] == "late-1"}
    faults.log.emit("observed", rid="late-1", status=out["status"], rooms=len(rooms), text=out["text"][:200])
    found = {c for _, c in canary.find("[" + out["text"])} if out["status"] == 200 else set()
    assert found <= set(out["canaries"]), f"foreign canaries after a late write: {found - set(out['canaries'])}"
    assert _own_echo(_req(cluster, "after-late"))


def test_client_disconnect_inside_the_transfer_window(cluster, faults):
    import json as _json
    import socket
    from urllib.parse import urlparse

    h = faults.agent.arm("prefill", "hold", target={"rid": "disc-1"}, params={"max_hold_s": 30})
    rng = random.Random("disc-1")
    text = prompt(rng, 300, canary.mint(rng, 2))
    cluster.canaries.add_text(text, "disc-1", "test_faults_live")
    body = _json.dumps({"text": text, "rid": "disc-1",
                        "sampling_params": {"max_new_tokens": 26, "temperature": 0}}).encode()
    u = urlparse(cluster.endpoints.router)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    held = faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=30)
    s.close()  # the client goes away while its KV is in flight
    faults.log.emit("abort", rid="disc-1", method="client_disconnect", room=held["room"])
    time.sleep(1.0)
    h.release()
    late = faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="late_write", timeout=30)
    # on record: whether prefill had torn the room down when the write landed
    faults.log.emit("observed", rid="disc-1", room_status_at_write=late["room_status_at_write"], ret=late["ret"])
    assert late["released"] is True
    assert _own_echo(_req(cluster, "after-disc"))


def test_mutation_reject_admitted_replays_the_pre_fix_path(cluster, faults):
    # The incident's shape: prefill's input limit (256, as if its pool were small) below the declared
    # context; a 600-token prompt is rejected at prefill intake (Req.set_finish_with_abort: prompt
    # swapped for one token, verdict parked in to_finish). The mutation re-opens both doors the fixes
    # closed: the PD bootstrap queue admits it, and the PD queues do not see its to_finish.
    # other tenants' prompts pass through decode first and leave their KV in freed pages
    fill = [_req(cluster, f"fill-{i}", n_tokens=600, seed=f"fill{i}", k=8) for i in range(4)]
    assert all(_own_echo(x) for x in fill)
    others = {c for x in fill for c in x["canaries"]}
    f = faults.agent.arm("prefill", "reject_admitted", target={"rid_regex": "^rej-1"},
                         params={"prefill_max_input_len": 256}, count=3)
    outs = [_req(cluster, f"rej-1{x}", n_tokens=n, timeout=30) for x, n in zip("abc", (600, 800, 1000))]
    ev = f.verify(at_least=3, timeout=5)
    admitted = [e for e in ev if "phase" not in e]
    assert {e["rid"] for e in admitted} == {"rej-1a", "rej-1b", "rej-1c"}
    assert all(e["input_len"] == 1 for e in admitted)  # the one-token placeholder
    assert any(e.get("phase") == "abort_invisible" for e in ev)
    on = [e for e in faults.agent.events("prefill") if e["ev"] == "mutation_on" and e["fault"] == f.id]
    assert on and max(e["schedulers"] for e in on) >= 1  # the scheduler process lowered its limit
    foreign_any = set()
    for out in outs:
        starts = [e for e in faults.agent.events("prefill") if e["ev"] == "transfer_start" and e["rid"] == out["rid"]]
        found = {c for _, c in canary.find("[" + out["text"])} if out["status"] == 200 else set()
        faults.log.emit("observed", rid=out["rid"], status=out["status"], text=out["text"][:300],
                        pages_sent=[e["pages"] for e in starts], foreign=sorted(found - set(out["canaries"])),
                        foreign_from_fill=sorted(found & others), own=sorted(found & set(out["canaries"])))
        # the incident's signature: a prompt the engine rejected comes back HTTP 200, without its own data
        assert out["status"] == 200, out
        assert not (found & set(out["canaries"])), out["text"]
        foreign_any |= found - set(out["canaries"])
    # ... and with other tenants' data: decode reserved the full prompt, got one page, read stale pages
    assert foreign_any, [o["text"][:60] for o in outs]
    f.heal()
    # healed: the same prompt is served normally again
    assert _own_echo(_req(cluster, "rej-2", n_tokens=600, seed="rej-1a"))


def test_mutation_double_alloc_makes_two_requests_share_pages(cluster, faults):
    # A is still decoding (ignore_eos) when B's pre-allocation is handed 64 of A's live pages.
    # Whether a reply shows it depends on timing (with the probe model a request that already
    # recited its canaries keeps emitting "["); the detection matrix of the suites measures that.
    # Here: the aliasing happened (page ids on record), replies came back, and the pool's
    # accounting stayed whole (SGLang's idle invariant check would otherwise crash decode).
    f = faults.agent.arm("decode", "double_alloc", params={"pages": 64}, count=1)
    with cf.ThreadPoolExecutor(1) as ex:
        rng = random.Random("dbl-a")
        a_cs = canary.mint(rng, 2)
        cluster.canaries.add_text(" ".join(a_cs), "dbl-a", "test_faults_live")
        a_body = {"text": prompt(rng, 400, a_cs), "rid": "dbl-a",
                  "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
        fa = ex.submit(lambda: httpx.post(cluster.endpoints.router + "/generate", json=a_body, timeout=120))
        faults.agent.wait_event("prefill", "transfer_start", rid="dbl-a", timeout=30)
        time.sleep(0.3)
        b = _req(cluster, "dbl-b", n_tokens=400, seed="dbl-b", k=3)
        a = fa.result()
    ev = f.verify(timeout=5)
    assert len(ev[0]["shared"]) == 64 and ev[0]["need_size"] >= 64
    assert a.status_code == 200 and b["status"] == 200
    faults.log.emit("observed", a_text=a.json()["text"][:120], b_text=b["text"][:200], a_canaries=a_cs,
                    b_canaries=b["canaries"])
    time.sleep(1.0)  # let decode go idle: its invariant checker runs then
    cluster.check_alive()
    assert _own_echo(_req(cluster, "dbl-after"))


def test_mutation_early_free_switches_the_release_path(cluster, faults):
    f = faults.agent.arm("decode", "early_free", hooks=("_handle_legacy_abort_notification",))
    on = faults.agent.wait_event("decode", "mutation_on", fault=f.id, timeout=5)
    assert on["switched"] >= 1
    h = faults.agent.arm("prefill", "hold", target={"rid": "ef-1"}, params={"max_hold_s": 30})
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_req, cluster, "ef-1", 300)
        faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=30)
        for u in (cluster.endpoints.prefill, cluster.endpoints.decode):
            httpx.post(f"{u}/abort_request", json={"rid": "ef-1"}, timeout=10)
        time.sleep(0.5)
        h.release()
        faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="late_write", timeout=30)
        fut.result()
    ev = f.verify(timeout=5)  # decode's failure path ran with the deferral switched off
    faults.log.emit("observed", early_free_firings=len(ev), reasons=[e.get("reason") for e in ev])
    f.heal()
    assert _own_echo(_req(cluster, "after-ef"))


# ------------------------------------------------------------------ network proxy
def test_latency_toxic_on_client_path(cluster, faults):
    # 2.5 s, not a fraction of a second: with the unit tests beside the cluster session a clean
    # request took 0.75 s on CI, so a sub-second bound measured the machine's load, not the toxic.
    net = faults.need("net")
    base = _req(cluster, "net-base")
    t = net.toxic("client", "latency", stream="downstream", latency=2500)
    out = _req(cluster, "net-lat")
    st = t.verify()
    assert st["fired"]["bytes"] > 0
    assert out["latency"] >= 2.5 > base["latency"], (base["latency"], out["latency"])
    assert _own_echo(out)
    t.heal()
    assert t.stats() is None  # gone from the proxy, not only marked healed here
    after = _req(cluster, "net-after")
    assert _own_echo(after) and after["latency"] < 2.5, after["latency"]


def test_latency_toxic_between_router_and_decode(cluster, faults):
    net = faults.need("net")
    t = net.toxic("decode", "latency", stream="upstream", latency=500)
    out = _req(cluster, "net-dec")
    t.verify()
    assert out["latency"] >= 0.5 and _own_echo(out)


def test_reset_peer_on_client_path_is_an_error(cluster, faults):
    net = faults.need("net")
    t = net.toxic("client", "reset_peer", stream="downstream", timeout=0)
    out = _req(cluster, "net-rst", timeout=10)
    t.verify()
    assert out["status"] is None and "Error" in out["error"]
    t.heal()
    assert _own_echo(_req(cluster, "net-rst-after"))


def test_limit_data_cuts_the_response(cluster, faults):
    net = faults.need("net")
    t = net.toxic("client", "limit_data", stream="downstream", bytes=40)
    out = _req(cluster, "net-lim", timeout=10)
    t.verify()
    assert out["status"] != 200 or not _own_echo(out)


# ------------------------------------------------------------------ process faults
def test_sigstop_decode_then_resume(cluster, faults):
    proc = faults.need("proc")
    with cf.ThreadPoolExecutor(1) as ex:
        pids = proc.stop("decode")
        fut = ex.submit(_req, cluster, "stop-1", 200, None, 2, None, 60.0)
        time.sleep(2.0)
        assert not fut.done()  # nothing answers while decode is frozen
        proc.cont("decode")
        out = fut.result()
    assert pids and out["latency"] >= 2.0
    assert pids.healed and set(pids.verify()["states"].values()) <= {"T", "t", None}  # cont healed the handle
    assert out["status"] != 200 or _own_echo(out)  # late, or an error; never someone else's data
    assert _own_echo(_req(cluster, "stop-after"))


def test_sigstop_handle_proves_and_heals_itself(cluster, faults):
    """The process fault is a faults.Fault like the others: verify() gives the evidence, heal() resumes, once."""
    from faults import Fault

    proc = faults.need("proc")
    f = proc.stop("decode")
    try:
        assert isinstance(f, Fault) and (f.injector, f.kind, f.role) == ("process", "sigstop", "decode")
        ev = f.verify()
        assert ev["pids"] == f.pids and len(f.pids) >= 2  # the server and its scheduler/detokenizer
        assert proc.armed() == ["stopped:decode"]
    finally:
        f.heal()
    f.heal()
    assert proc.armed() == [] and len([e for e in _fault_events(faults, "healed") if e["kind"] == "sigcont"]) == 1
    assert _own_echo(_req(cluster, "stop-handle-after"))


@pytest.mark.slow  # CI time; suites/test_process_kill.py kills prefill mid-write by default
def test_sigkill_prefill_mid_transfer_then_restart_and_rejoin(cluster, faults):
    proc = faults.need("proc")
    h = faults.agent.arm("prefill", "hold", target={"rid": "kill-1"}, params={"max_hold_s": 60})
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_req, cluster, "kill-1", 300, None, 2, None, 120.0)
        faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=30)
        killed = proc.kill("prefill")  # the transfer is in flight (held) when prefill dies
        out = fut.result()
    assert killed and killed.verify()["pids"] == killed.pids
    assert out["status"] != 200, out  # a dead prefill mid-transfer must not yield a 200
    rec = proc.restart("prefill")
    assert rec["rejoined_s"] > 0
    assert killed.healed and killed.heal_record == rec
    faults.log.emit("observed", rid="kill-1", status=out["status"], restart=rec)
    _serves_again(cluster, "after-kill")
