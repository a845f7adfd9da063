"""The in-engine agent's logic without SGLang: control socket, targeting, each transfer fault on a
stand-in KV manager, heal, expiry, the faults' seed, bad input, the package's layout.

(Mutations on stand-in modules: tests/test_agent_mutations.py; the other KV write paths:
tests/test_agent_send_paths.py; the same hooks against the real engine: tests/test_faults_live.py.)"""

from __future__ import annotations

import threading
import time
import types

import pytest

import faults.agent as agent_mod
from faults.agent import allocator, cache, control, output, provenance, retraction, scheduler, transfer
from faults.client import AgentClient, AgentError, FaultDidNotFire, _call
from kvchaos.workload.seed import Seeds

# fixtures (tests/test_agent_cache.py imports agent and decode_agent from this module)
from tests.agent_fakes import FakeManager, agent, decode_agent, mgr, send_chunk  # noqa: F401 - fixtures


def test_discovery_and_bad_input_named(agent):
    ctl = AgentClient(agent.dir)
    assert [a["pid"] for a in ctl.agents("prefill")] == [agent.pid]
    assert ctl.agents("decode") == []
    sock = ctl.agents()[0]["sock"]
    with pytest.raises(AgentError, match="unknown fault kind 'dealy'"):
        _call(sock, {"cmd": "arm", "kind": "dealy"})
    with pytest.raises(AgentError, match="unknown target key 'ridd'"):
        _call(sock, {"cmd": "arm", "kind": "delay", "target": {"ridd": "x"}})
    with pytest.raises(AgentError, match="regular expression|unterminated|missing"):
        _call(sock, {"cmd": "arm", "kind": "delay", "target": {"rid_regex": "("}})
    with pytest.raises(AgentError, match="unknown command 'explode'"):
        _call(sock, {"cmd": "explode"})


# Timed with margins a loaded machine keeps (make test runs clusters beside): a 3 s delay against an
# untargeted send under half of it, so no other test has to stop for this one (1.5 s against 0.75 s
# was not enough: the CI run of 2026-12-07 stalled a unit worker's thread 0.9 s).
def test_delay_fires_only_on_target_and_is_logged(agent, mgr, tmp_path):
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "delay", target={"rid": "r-a"}, params={"ms": 3000}, hooks=())
    t = time.monotonic()
    assert send_chunk(mgr, 1, "r-b") == 0
    assert time.monotonic() - t < 1.5
    with pytest.raises(FaultDidNotFire):
        f.verify()
    t = time.monotonic()
    assert send_chunk(mgr, 2, "r-a") == 0
    assert time.monotonic() - t >= 3.0
    ev = f.verify()
    assert ev[0]["rid"] == "r-a" and ev[0]["room"] == 2
    starts = [e for e in ctl.events("prefill") if e["ev"] == "transfer_start"]
    assert [e["room"] for e in starts] == [1, 2]
    assert len(mgr.calls) == 2  # both writes happened


def _teardown_check(mgr, room):
    """mooncake/conn.py transfer_worker's teardown test, as 0.5.23 writes it."""
    return room not in mgr.request_status or mgr.check_status(room) == 4


# Margins a loaded machine keeps: a 2 s stall against unstalled reads under 1 s in all.
def test_stall_status_read_widens_the_transfer_workers_check_then_read(agent, monkeypatch):
    """Only the transfer worker's re-read of its own chunk's concluded room stalls; a clear() on
    another thread inside the stall turns SGLang's own read into the KeyError that kills the worker."""
    cls = type("FakeManager", (FakeManager,), {})
    monkeypatch.setattr(transfer, "_STATUS_READERS", [cls])  # as _hook_mooncake registers MooncakeKVManager
    mgr = cls()
    ctl = AgentClient(agent.dir)
    assert "check_status" not in cls.__dict__  # SGLang's own read until a stall is armed
    f = ctl.arm("prefill", "stall_status_read", target={"rid": "r-a"}, params={"ms": 2000}, hooks=())
    assert "check_status" in cls.__dict__
    mgr.request_status = {1: 3, 2: 4}
    with agent_mod.AGENT.lock:
        agent_mod.AGENT.room_rid.update({1: "r-a", 2: "r-a"})
    agent_mod.AGENT.tls.chunk = None  # the scheduler's polls: never stalled
    t = time.monotonic()
    assert mgr.check_status(2) == 4 and time.monotonic() - t < 1.0
    agent_mod.AGENT.tls.chunk = types.SimpleNamespace(room=1, index_slice=slice(0, 1))
    assert mgr.check_status(1) == 3 and time.monotonic() - t < 1.0  # not concluded: not stalled
    assert mgr.check_status(2) == 4 and time.monotonic() - t < 1.0  # another room than the chunk's
    with pytest.raises(FaultDidNotFire):
        f.verify()
    agent_mod.AGENT.tls.chunk = types.SimpleNamespace(room=2, index_slice=slice(0, 1))
    clear = threading.Timer(0.05, lambda: mgr.request_status.pop(2, None))  # the scheduler's clear()
    clear.start()
    with pytest.raises(KeyError):
        _teardown_check(mgr, 2)
    clear.join()
    ev = f.verify()
    assert len(ev) == 1 and ev[0]["room"] == 2 and ev[0]["cleared_during_stall"] is True
    mgr.request_status[2] = 4  # count 1: spent, no second stall
    t = time.monotonic()
    assert _teardown_check(mgr, 2) and time.monotonic() - t < 1.0
    f.heal()  # the wrapper goes with the fault: the class inherits SGLang's check_status again
    assert "check_status" not in cls.__dict__ and cls.check_status is FakeManager.check_status
    assert not any(h.endswith("FakeManager.check_status") for h in agent_mod.AGENT.hooks)


def test_stall_status_read_is_refused_where_no_mooncake_manager_is_loaded(agent, monkeypatch):
    """The decode process, or prefill before its scheduler imported Mooncake: the arm is refused, named."""
    monkeypatch.setattr(transfer, "_STATUS_READERS", [])
    with pytest.raises(AgentError, match="no Mooncake KV manager"):
        AgentClient(agent.dir).arm("prefill", "stall_status_read", target={"rid": "r-a"}, hooks=())
    assert not agent_mod.AGENT.faults


def test_fail_short_and_tenant_targets(agent, mgr):
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "fail", target={"tenant": "t003"}, hooks=())
    assert send_chunk(mgr, 10, "r7-000001-t030") == 0  # t030 is not t003
    assert send_chunk(mgr, 11, "r7-000002-t003") == -1
    assert len(mgr.calls) == 1  # the failed send wrote nothing
    assert f.verify()[0]["rid"] == "r7-000002-t003"
    assert send_chunk(mgr, 12, "r7-000003-t003") == 0  # count=1 by default: fired once
    s = ctl.arm("prefill", "short", target={"room": 13}, params={"pages": 2}, hooks=())
    assert send_chunk(mgr, 13, "x", n=8) == 0
    assert mgr.calls[-1][1] == [0, 1] and mgr.calls[-1][2] == [100, 101]
    ev = s.verify()[0]
    assert ev["pages_sent"] == 2 and ev["pages_reserved"] == 8


def _blacklisting(mgr):
    """What mooncake/conn.py's transfer_worker does on a failed send: blacklist the session at once."""
    mgr.failed_sessions, mgr.session_failures, mgr.failed_session_probes = set(), {}, {}
    mgr.session_lock = threading.Lock()

    def unbl(sess):
        mgr.failed_sessions.discard(sess)
        mgr.session_failures.pop(sess, None)
    mgr._unblacklist_session = unbl

    def send(room, rid):
        ret = send_chunk(mgr, room, rid)
        if ret != 0:
            with mgr.session_lock:
                mgr.failed_sessions.add("sess")
        return ret
    return send


def test_fail_takes_the_blacklist_off_itself_only_when_asked(agent, mgr):
    """SGLang blacklists the decode session on a failed send, failing every request sent to that decode
    until a probe or the heal clears it; ``unblacklist_after_ms`` clears it in the engine instead."""
    ctl = AgentClient(agent.dir)
    send = _blacklisting(mgr)
    f = ctl.arm("prefill", "fail", target={"rid": "r-a"}, params={"unblacklist_after_ms": 50}, hooks=())
    assert send(1, "r-a") == -1 and mgr.failed_sessions == {"sess"}
    ev = ctl.wait_event("prefill", "session_unblacklisted", fault=f.id, timeout=5)
    assert ev["by"] == "fault" and ev["was_blacklisted"] is True and not mgr.failed_sessions
    with pytest.raises(AgentError, match="unblacklist_after_ms must be a number of ms in 0..60000, got 'soon'"):
        ctl.arm("prefill", "fail", target={"rid": "r-c"}, params={"unblacklist_after_ms": "soon"}, hooks=())
    # without it, the blacklist stays until the heal takes it off
    g = ctl.arm("prefill", "fail", target={"rid": "r-b"}, hooks=())
    assert send(2, "r-b") == -1
    time.sleep(0.3)
    assert mgr.failed_sessions == {"sess"}
    g.heal()
    assert not mgr.failed_sessions


def test_hold_blocks_until_release_then_lands_late(agent, mgr):
    ctl = AgentClient(agent.dir)
    h = ctl.arm("prefill", "hold", target={"rid": "late"}, params={"max_hold_s": 10}, hooks=())
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("ret", send_chunk(mgr, 5, "late")))
    th.start()
    held = ctl.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=5)
    assert held["room"] == 5 and not mgr.calls  # nothing written yet
    time.sleep(0.1)
    assert th.is_alive()
    h.release()
    th.join(5)
    assert out["ret"] == 0 and len(mgr.calls) == 1
    late = ctl.wait_event("prefill", "fault_fired", fault=h.id, phase="late_write", timeout=5)
    assert late["released"] is True and late["room_status_at_write"] == "gone"


def test_heal_releases_a_parked_write_and_nothing_stays_armed(agent, mgr):
    ctl = AgentClient(agent.dir)
    ctl.arm("prefill", "hold", params={"max_hold_s": 30}, hooks=())
    th = threading.Thread(target=lambda: send_chunk(mgr, 6, "any"))
    th.start()
    ctl.wait_event("prefill", "fault_fired", kind="hold", phase="held", timeout=5)
    assert ctl.armed()
    ctl.heal_all()
    th.join(5)
    assert not th.is_alive() and len(mgr.calls) == 1
    assert ctl.armed() == []


def test_faults_expire(agent, mgr):
    ctl = AgentClient(agent.dir)
    ctl.arm("prefill", "fail", ttl_s=0.05, hooks=())
    time.sleep(0.1)
    assert send_chunk(mgr, 7, "r") == 0
    assert any(e["ev"] == "fault_expired" for e in ctl.events())


def test_delay_jitter_draws_from_the_faults_seed(agent, mgr):
    """A run's seed reaches the agent as the fault's ``seed`` param: the same seed draws the same
    jitter sequence (a replay), another seed another one; the kit's Seeds fills it in."""
    def draws(seed, rooms):
        ctl = AgentClient(agent.dir, seeds=Seeds(seed, "t"))
        f = ctl.arm("prefill", "delay", target={"rid_regex": "^j-"}, params={"ms": 5, "jitter_ms": 5}, hooks=())
        assert f.params["seed"] == Seeds(seed, "t").fault()
        for room in rooms:
            send_chunk(mgr, room, f"j-{room}")
        got = [e["ms"] for e in f.verify(at_least=len(rooms))]
        f.heal()
        return got

    a, b, c = draws(11, range(10, 16)), draws(11, range(20, 26)), draws(12, range(30, 36))
    assert a == b and len(set(a)) > 1
    assert a != c


# ------------------------------------------------------------------ package layout
def test_subsystem_modules_declare_the_kinds_and_hooks_read_the_live_agent(agent):
    """faults.agent is a package, one module per SGLang subsystem; its KINDS / MUTATIONS / HOOKS are
    assembled from them, and ``faults.agent.AGENT`` is a live view of ``control.AGENT`` (what every
    hook reads at call time — the fixture set it through ``faults.agent``)."""
    assert agent_mod.AGENT is agent and control.AGENT is agent
    assert set(agent_mod.FAULT_KINDS) == {"delay", "fail", "short", "hold", "stall_status_read", "reject_admitted",
                                    "early_free", "double_alloc", "input_limit", "salt_ignored", "prefix_collision",
                                    "deferred_release_timeout", "retract", "park", "chunked_prefill", "token_flip",
                                    "meta_swap"}
    assert set(agent_mod.MUTATIONS) == {"reject_admitted", "early_free", "double_alloc", "input_limit", "salt_ignored",
                                        "deferred_release_timeout", "retract", "chunked_prefill"}
    mods = (transfer, scheduler, allocator, cache, retraction, provenance, output)
    # a module two subsystems hook gets one hook running both, in table order
    want = {}
    for m in mods:
        for k, v in m.HOOKS.items():
            want.setdefault(k, []).append(v.__name__)
    assert {k: v.__name__ for k, v in agent_mod.HOOKS.items()} == {k: "+".join(v) for k, v in want.items()}
    assert "sglang.srt.mem_cache.allocator.paged" in allocator.HOOKS
    with pytest.raises(ValueError, match="registered twice"):
        control.register_fault("delay")


def test_the_input_limit_setting_says_its_own_kind_not_the_planted_bugs(agent):
    """``input_limit`` shares ``reject_admitted``'s switch; its ``mutation_on`` named the planted bug, so a
    run that only lowered prefill's limit listed an exposure class ``agent:reject_admitted``."""
    sched = type("Scheduler", (), {"max_req_input_len": 2042})()  # weak-referenceable, as the agent tracks them
    agent.track("Scheduler", sched)
    for kind in ("input_limit", "reject_admitted"):
        f = agent.arm({"kind": kind, "params": {"prefill_max_input_len": 512}})
        assert sched.max_req_input_len == 512
        on = [e for e in agent.events if e["ev"] == "mutation_on" and e.get("fault") == f["id"]]
        assert [e["kind"] for e in on] == [kind]
        agent.heal(f["id"])
        assert sched.max_req_input_len == 2042
