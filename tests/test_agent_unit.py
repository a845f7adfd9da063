"""The in-engine agent's logic without SGLang: control socket, targeting, each transfer fault on a
stand-in KV manager, mutations on stand-in modules, heal, expiry, bad input.

(The same hooks against the real engine: tests/test_faults_live.py.)"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

import faults.agent as agent_mod
from faults.engine import AgentClient, AgentError, FaultDidNotFire


class FakeManager:
    """Stands in for MooncakeKVManager: send_kvcache records what it was asked to write."""

    def __init__(self):
        self.calls = []
        self.request_status = {}

    def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None):
        self.calls.append((session_id, list(prefill_kv_indices), list(dst_kv_indices)))
        return 0

    def check_status(self, room):
        return self.request_status[room]


def _start(tmp_path, monkeypatch, role):
    d = tmp_path / f"ag-{role}"
    d.mkdir()
    monkeypatch.setattr(agent_mod, "ROLE", role)
    a = agent_mod.Agent(str(d))
    monkeypatch.setattr(agent_mod, "AGENT", a)
    a.serve()
    return a


@pytest.fixture(params=["prefill"])
def agent(request, tmp_path, monkeypatch):
    a = _start(tmp_path, monkeypatch, request.param)
    yield a
    a._srv.shutdown()
    a._srv.server_close()


decode_agent = pytest.fixture(params=["decode"], name="decode_agent")(agent.__wrapped__)


@pytest.fixture
def mgr(agent):
    cls = type("FakeManager", (FakeManager,), {})
    cls.send_kvcache = agent_mod._make_send(FakeManager.send_kvcache, "mooncake")
    return cls()


def _send(mgr, room, rid, n=8):
    agent_mod.AGENT.tls.chunk = types.SimpleNamespace(room=room, index_slice=slice(0, n), is_last_chunk=True)
    with agent_mod.AGENT.lock:
        agent_mod.AGENT.room_rid[room] = rid
    idx = np.arange(n, dtype=np.int32)
    return mgr.send_kvcache("sess", idx, [0], idx + 100)


def test_discovery_and_bad_input_named(agent):
    ctl = AgentClient(agent.dir)
    assert [a["pid"] for a in ctl.agents("prefill")] == [agent.pid]
    assert ctl.agents("decode") == []
    sock = ctl.agents()[0]["sock"]
    from faults.engine import _call

    with pytest.raises(AgentError, match="unknown fault kind 'dealy'"):
        _call(sock, {"cmd": "arm", "kind": "dealy"})
    with pytest.raises(AgentError, match="unknown target key 'ridd'"):
        _call(sock, {"cmd": "arm", "kind": "delay", "target": {"ridd": "x"}})
    with pytest.raises(AgentError, match="regular expression|unterminated|missing"):
        _call(sock, {"cmd": "arm", "kind": "delay", "target": {"rid_regex": "("}})
    with pytest.raises(AgentError, match="unknown command 'explode'"):
        _call(sock, {"cmd": "explode"})


def test_delay_fires_only_on_target_and_is_logged(agent, mgr, tmp_path):
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "delay", target={"rid": "r-a"}, params={"ms": 150}, hooks=())
    t = time.monotonic()
    assert _send(mgr, 1, "r-b") == 0
    assert time.monotonic() - t < 0.1
    with pytest.raises(FaultDidNotFire):
        f.verify()
    t = time.monotonic()
    assert _send(mgr, 2, "r-a") == 0
    assert time.monotonic() - t >= 0.15
    ev = f.verify()
    assert ev[0]["rid"] == "r-a" and ev[0]["room"] == 2
    starts = [e for e in ctl.events("prefill") if e["ev"] == "transfer_start"]
    assert [e["room"] for e in starts] == [1, 2]
    assert len(mgr.calls) == 2  # both writes happened


def _teardown_check(mgr, room):
    """mooncake/conn.py transfer_worker's teardown test, as 0.5.23 writes it."""
    return room not in mgr.request_status or mgr.check_status(room) == 4


def test_stall_status_read_widens_the_transfer_workers_check_then_read(agent):
    """Only the transfer worker's re-read of its own chunk's concluded room stalls; a clear() on
    another thread inside the stall turns SGLang's own read into the KeyError that kills the worker."""
    cls = type("FakeManager", (FakeManager,), {})
    cls.check_status = agent_mod._make_check_status(FakeManager.check_status)
    mgr = cls()
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "stall_status_read", target={"rid": "r-a"}, params={"ms": 200}, hooks=())
    mgr.request_status = {1: 3, 2: 4}
    with agent_mod.AGENT.lock:
        agent_mod.AGENT.room_rid.update({1: "r-a", 2: "r-a"})
    agent_mod.AGENT.tls.chunk = None  # the scheduler's polls: never stalled
    t = time.monotonic()
    assert mgr.check_status(2) == 4 and time.monotonic() - t < 0.1
    agent_mod.AGENT.tls.chunk = types.SimpleNamespace(room=1, index_slice=slice(0, 1))
    assert mgr.check_status(1) == 3 and time.monotonic() - t < 0.1  # not concluded: not stalled
    assert mgr.check_status(2) == 4 and time.monotonic() - t < 0.1  # another room than the chunk's
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
    assert _teardown_check(mgr, 2) and time.monotonic() - t < 0.1


def test_fail_short_and_tenant_targets(agent, mgr):
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "fail", target={"tenant": "t003"}, hooks=())
    assert _send(mgr, 10, "r7-000001-t030") == 0  # t030 is not t003
    assert _send(mgr, 11, "r7-000002-t003") == -1
    assert len(mgr.calls) == 1  # the failed send wrote nothing
    assert f.verify()[0]["rid"] == "r7-000002-t003"
    assert _send(mgr, 12, "r7-000003-t003") == 0  # count=1 by default: fired once
    s = ctl.arm("prefill", "short", target={"room": 13}, params={"pages": 2}, hooks=())
    assert _send(mgr, 13, "x", n=8) == 0
    assert mgr.calls[-1][1] == [0, 1] and mgr.calls[-1][2] == [100, 101]
    ev = s.verify()[0]
    assert ev["pages_sent"] == 2 and ev["pages_reserved"] == 8


def test_hold_blocks_until_release_then_lands_late(agent, mgr):
    ctl = AgentClient(agent.dir)
    h = ctl.arm("prefill", "hold", target={"rid": "late"}, params={"max_hold_s": 10}, hooks=())
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("ret", _send(mgr, 5, "late")))
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
    th = threading.Thread(target=lambda: _send(mgr, 6, "any"))
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
    assert _send(mgr, 7, "r") == 0
    assert any(e["ev"] == "fault_expired" for e in ctl.events())


def test_reject_mutation_flips_only_rejected_requests(agent):
    mod = types.ModuleType("fake_prefill")
    mod.is_unadmitted_reject = lambda req: req.rejected
    mod.__name__ = "fake_prefill"
    agent_mod._hook_reject(mod)
    ctl = AgentClient(agent.dir)
    req = types.SimpleNamespace(rid="big", bootstrap_room=9, rejected=True, origin_input_ids=[0], to_finish="ABORT")
    ok = types.SimpleNamespace(rid="fine", bootstrap_room=8, rejected=False, origin_input_ids=[1, 2], to_finish=None)
    assert mod.is_unadmitted_reject(req) is True  # not armed: the fixed behaviour
    f = ctl.arm("prefill", "reject_admitted", hooks=())
    assert mod.is_unadmitted_reject(ok) is False
    assert mod.is_unadmitted_reject(req) is False  # armed: the rejected request goes through
    ev = f.verify()
    assert ev[0]["rid"] == "big" and ev[0]["input_len"] == 1
    f.heal()
    assert mod.is_unadmitted_reject(req) is True


def _hooked_allocator(name: str):
    """A 100-page stand-in for SGLang's TokenToKVPoolAllocator (hand out the front of the free list,
    append freed pages), hooked by the agent like the real one."""
    import torch

    class Alloc:
        def __init__(self):
            self.free_pages = torch.arange(1, 101)

        def alloc(self, n):
            out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            return out

        def free(self, idx):
            self.free_pages = torch.cat([self.free_pages, idx])

    mod = types.ModuleType(name)
    mod.TokenToKVPoolAllocator = Alloc
    agent_mod._hook_allocator(mod)
    return Alloc()


def test_double_alloc_aliases_pages_and_keeps_the_pool_whole(decode_agent):
    agent = decode_agent

    a = _hooked_allocator("fake_alloc")
    ctl = AgentClient(agent.dir)
    f = ctl.arm("decode", "double_alloc", params={"pages": 4}, hooks=())
    x = a.alloc(10)
    y = a.alloc(10)
    assert set(x[:4].tolist()) == set(y[:4].tolist())  # one page, two owners
    assert f.verify()[0]["shared"] == x[:4].tolist()
    a.free(x)
    a.free(y)
    ctl.heal_all()
    assert sorted(a.free_pages.tolist()) == list(range(1, 101))  # no page lost, none counted twice


def test_double_alloc_only_aliases_allocations_made_while_armed(decode_agent):
    """Found in CI: an allocation remembered under an earlier fault (long finished) was 'shared'
    with the next request - free pages, harming nobody - and the matrix trial missed. Each armed
    fault starts fresh."""
    a = _hooked_allocator("fake_alloc2")
    ctl = AgentClient(decode_agent.dir)
    f1 = ctl.arm("decode", "double_alloc", params={"pages": 4}, hooks=(), count=5)
    x = a.alloc(10)
    ctl.heal_all()
    a.free(x)
    f2 = ctl.arm("decode", "double_alloc", params={"pages": 4}, hooks=(), count=1)
    y = a.alloc(10)
    assert not f2.fired_events(), "aliased an allocation remembered under an earlier fault"
    z = a.alloc(10)
    ev = f2.verify()
    assert ev[0]["shared"] == y[:4].tolist() and set(z[:4].tolist()) == set(y[:4].tolist())
    assert not f1.fired_events()
    a.free(y)
    a.free(z)
    ctl.heal_all()
    assert sorted(a.free_pages.tolist()) == list(range(1, 101))


# ------------------------------------------------------------------ package layout
def test_subsystem_modules_declare_the_kinds_and_hooks_read_the_live_agent(agent):
    """faults.agent is a package, one module per SGLang subsystem; its KINDS / MUTATIONS / HOOKS are
    assembled from them, and ``faults.agent.AGENT`` is a live view of ``control.AGENT`` (what every
    hook reads at call time — the fixture set it through ``faults.agent``)."""
    from faults.agent import allocator, cache, control, provenance, retraction, scheduler, transfer

    assert agent_mod.AGENT is agent and control.AGENT is agent
    assert set(agent_mod.KINDS) == {"delay", "fail", "short", "hold", "stall_status_read", "reject_admitted",
                                    "early_free", "double_alloc", "input_limit", "salt_ignored", "prefix_collision",
                                    "deferred_release_timeout", "retract", "park", "chunked_prefill"}
    assert set(agent_mod.MUTATIONS) == {"reject_admitted", "early_free", "double_alloc", "input_limit", "salt_ignored",
                                        "deferred_release_timeout", "retract", "chunked_prefill"}
    mods = (transfer, scheduler, allocator, cache, retraction, provenance)
    # a module two subsystems hook gets one hook running both, in table order
    want = {}
    for m in mods:
        for k, v in m.HOOKS.items():
            want.setdefault(k, []).append(v.__name__)
    assert {k: v.__name__ for k, v in agent_mod.HOOKS.items()} == {k: "+".join(v) for k, v in want.items()}
    assert "sglang.srt.mem_cache.allocator.paged" in allocator.HOOKS
    with pytest.raises(ValueError, match="registered twice"):
        control.register_fault("delay")


def _paged_mgr(agent, page_size=16):
    cls = type("PagedManager", (FakeManager,), {})
    cls.send_kvcache = agent_mod._make_send(FakeManager.send_kvcache, "mooncake")
    m = cls()
    m.kv_args = types.SimpleNamespace(page_size=page_size)
    return m


def test_transfer_events_count_pages_and_say_the_page_size(agent):
    """With page size > 1 SGLang hands the KV write page indices (kv_to_page_indices): the events'
    pages, the short fault's pages and write_end's pages are KV pages, and the events carry page_size."""
    m = _paged_mgr(agent)
    ctl = AgentClient(agent.dir)
    s = ctl.arm("prefill", "short", target={"room": 21}, params={"pages": 2}, hooks=())
    assert _send(m, 21, "p16", n=5) == 0  # a 70-token prompt: 5 pages of 16
    assert m.calls[-1][1] == [0, 1] and m.calls[-1][2] == [100, 101]
    ev = ctl.events("prefill")
    start = next(e for e in ev if e["ev"] == "transfer_start" and e["room"] == 21)
    end = next(e for e in ev if e["ev"] == "write_end" and e["room"] == 21)
    assert (start["pages"], start["reserved"], start["page_size"]) == (5, 5, 16)
    assert (end["pages"], end["page_size"]) == (5, 16) and "path" not in end
    fired = s.verify()[0]
    assert (fired["pages_sent"], fired["pages_reserved"], fired["page_size"]) == (2, 5, 16)


def test_short_cuts_every_destination_list_of_the_hisparse_send(agent):
    seen = {}

    class M(FakeManager):
        def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None,
                         dst_device_kv_indices=None):
            seen["dev"] = list(dst_device_kv_indices)
            return super().send_kvcache(session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)

    M.send_kvcache = agent_mod._make_send(M.send_kvcache, "mooncake")
    m = M()
    AgentClient(agent.dir).arm("prefill", "short", target={"room": 22}, params={"pages": 3}, hooks=())
    agent.tls.chunk = types.SimpleNamespace(room=22, index_slice=slice(0, 6), is_last_chunk=True)
    idx = np.arange(6, dtype=np.int32)
    assert m.send_kvcache("s", idx, [0], idx + 100, None, dst_device_kv_indices=idx + 500) == 0
    assert m.calls[-1][1] == [0, 1, 2] and seen["dev"] == [500, 501, 502]


def test_mla_dcp_send_is_hooked_and_short_keeps_the_whole_destination(agent):
    """Mooncake's send_kvcache_dcp (MLA with decode context parallel) is a second KV write path:
    same evidence and faults; its destination list is the request's whole reservation, so short cuts
    the source pages and num_kv_tokens only."""
    calls = []

    class M(FakeManager):
        def send_kvcache_dcp(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *,
                             num_kv_tokens, src_page_offset=0, executor=None):
            calls.append((list(prefill_kv_indices), list(dst_kv_indices), num_kv_tokens))
            return 0

    M.send_kvcache_dcp = agent_mod._make_send_dcp(M.send_kvcache_dcp, "mooncake")
    m = M()
    m.kv_args = types.SimpleNamespace(page_size=64)
    ctl = AgentClient(agent.dir)
    s = ctl.arm("prefill", "short", target={"room": 23}, params={"pages": 1}, hooks=())
    agent.tls.chunk = types.SimpleNamespace(room=23, index_slice=slice(0, 3), is_last_chunk=True)
    src, dst = np.arange(3, dtype=np.int32), np.arange(6, dtype=np.int32) + 100
    assert m.send_kvcache_dcp("s", src, [0], dst, num_kv_tokens=150, src_page_offset=0) == 0
    assert calls[-1] == ([0], list(range(100, 106)), 64)
    fired = s.verify()[0]
    assert fired["path"] == "send_kvcache_dcp" and fired["pages_sent"] == 1 and fired["page_size"] == 64
    start = next(e for e in ctl.events("prefill") if e["ev"] == "transfer_start" and e["room"] == 23)
    assert start["path"] == "send_kvcache_dcp" and start["pages"] == 3
    # not shorted: passed through untouched
    agent.tls.chunk = types.SimpleNamespace(room=24, index_slice=slice(0, 3), is_last_chunk=True)
    assert m.send_kvcache_dcp("s", src, [0], dst, num_kv_tokens=150) == 0
    assert calls[-1] == ([0, 1, 2], list(range(100, 106)), 150)


def test_nixl_peer_paths_fail_by_raising_and_short_both_lists(agent):
    """NIXL's send_kvcache_mixed / send_kvcache_slice (peer, src, dst): hooked like send_kvcache."""
    calls = []

    class M(FakeManager):
        def send_kvcache_mixed(self, peer_name, prefill_kv_indices, dst_kv_indices):
            calls.append((list(prefill_kv_indices), list(dst_kv_indices)))
            return ["handle"]

    M.send_kvcache_mixed = agent_mod._make_send_peer(M.send_kvcache_mixed, "nixl")
    m = M()
    ctl = AgentClient(agent.dir)
    ctl.arm("prefill", "short", target={"room": 25}, params={"pages": 2}, hooks=())
    f = ctl.arm("prefill", "fail", target={"room": 26}, hooks=())
    idx = np.arange(4, dtype=np.int32)
    agent.tls.chunk = types.SimpleNamespace(room=25, index_slice=slice(0, 4), is_last_chunk=True)
    assert m.send_kvcache_mixed("peer", idx, idx + 10) == ["handle"]
    assert calls[-1] == ([0, 1], [10, 11])
    agent.tls.chunk = types.SimpleNamespace(room=26, index_slice=slice(0, 4), is_last_chunk=True)
    with pytest.raises(RuntimeError, match="kvchaos injected"):
        m.send_kvcache_mixed("peer", idx, idx + 10)
    assert len(calls) == 1 and f.verify()[0]["room"] == 26
    end = [e for e in ctl.events("prefill") if e["ev"] == "write_end" and e["room"] == 25]
    assert end[0]["ret"] == "handles" and end[0]["path"] == "send_kvcache_mixed"


# ------------------------------------------------------------------ decode's deferred release
class _DecodeTransferQueue:
    """decode.py's deferred release, reduced to its decisions: an aborted transfer's pages are held
    until prefill acks the drain or the deadline set at hold time passes (then released anyway)."""

    def __init__(self):
        self.deferred_kv_release_timeout = 30.0
        self.enable_deferred_kv_release = True
        self._deferred_releases, self.acked, self.released = [], set(), []

    def _defer_release(self, decode_req):
        start = time.monotonic()
        self._deferred_releases.append((decode_req, start, start + self.deferred_kv_release_timeout))

    def _release_request(self, decode_req):
        self.released.append(decode_req.req.rid)

    def _do_release(self, decode_req, idx):
        self._release_request(decode_req)

    def _observe_deferred_kv_release(self, duration_seconds, outcome):
        pass

    def resolve_deferred_releases(self):
        now, keep = time.monotonic(), []
        for e in self._deferred_releases:
            req, start, deadline = e
            drained = req.req.rid in self.acked
            if drained or now >= deadline:
                self._do_release(req, 0)
                self._observe_deferred_kv_release(now - start, "drained" if drained else "timeout")
            else:
                keep.append(e)
        self._deferred_releases = keep


def test_deferred_release_says_drained_or_timeout_and_the_timeout_setting_heals(decode_agent):
    from faults.agent import scheduler as sched_mod

    mod = types.ModuleType("fake_decode")
    mod.DecodeTransferQueue = type("DecodeTransferQueue", (_DecodeTransferQueue,), {})
    sched_mod._hook_decode(mod)
    q = mod.DecodeTransferQueue()
    ctl = AgentClient(decode_agent.dir)
    with pytest.raises(AgentError, match="s must be > 0"):
        ctl.arm("decode", "deferred_release_timeout", params={"s": 0}, hooks=())
    f = ctl.arm("decode", "deferred_release_timeout", params={"s": 0.2}, hooks=())
    assert q.deferred_kv_release_timeout == 0.2
    a, b = (types.SimpleNamespace(req=types.SimpleNamespace(rid=r, bootstrap_room=n))
            for r, n in (("r-a", 1), ("r-b", 2)))
    q._defer_release(a)
    q._defer_release(b)
    q.acked.add("r-a")
    q.resolve_deferred_releases()
    time.sleep(0.25)
    q.resolve_deferred_releases()
    evs = decode_agent.events
    assert [(e["rid"], e["timeout_s"]) for e in evs if e["ev"] == "deferred_hold"] == [("r-a", 0.2), ("r-b", 0.2)]
    rel = [(e["room"], e["rid"], e["outcome"]) for e in evs if e["ev"] == "deferred_release"]
    assert rel == [(1, "r-a", "drained"), (2, "r-b", "timeout")], rel
    assert [e["rid"] for e in evs if e["ev"] == "kv_released"] == ["r-a", "r-b"]
    f.heal()
    assert q.deferred_kv_release_timeout == 30.0


def test_delay_jitter_draws_from_the_faults_seed(agent, mgr):
    """A run's seed reaches the agent as the fault's ``seed`` param: the same seed draws the same
    jitter sequence (a replay), another seed another one; the kit's Seeds fills it in."""
    from kvchaos.workload.seed import Seeds

    def draws(seed, rooms):
        ctl = AgentClient(agent.dir, seeds=Seeds(seed, "t"))
        f = ctl.arm("prefill", "delay", target={"rid_regex": "^j-"}, params={"ms": 5, "jitter_ms": 5}, hooks=())
        assert f.params["seed"] == Seeds(seed, "t").fault()
        for room in rooms:
            _send(mgr, room, f"j-{room}")
        got = [e["ms"] for e in f.verify(at_least=len(rooms))]
        f.heal()
        return got

    a, b, c = draws(11, range(10, 16)), draws(11, range(20, 26)), draws(12, range(30, 36))
    assert a == b and len(set(a)) > 1
    assert a != c


class _Pool:
    """Stands in for decode's KV allocator: one K and one V buffer per layer, SGLang's host-copy API."""

    def __init__(self, slots=64, layers=2):
        import torch

        self.k = [torch.arange(slots * 4, dtype=torch.float32).reshape(slots, 4) + 1000 * i for i in range(layers)]
        self.v = [-t for t in self.k]

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        return [[[k[indices].clone(), v[indices].clone()]] for k, v in zip(self.k, self.v)]

    def load_cpu_copy(self, copy, indices, mamba_indices=None, req_pool_index=None):
        for layer, ((k, v),) in enumerate(copy):
            self.k[layer][indices], self.v[layer][indices] = k, v


class _Req:
    """Stands in for schedule_batch.Req's retraction path (offload_kv_cache / load_kv_cache, 0.5.23)."""

    def __init__(self, rid, seqlen):
        self.rid, self.seqlen, self.output_ids, self.retraction_count = rid, seqlen, [1, 2, 3], 0
        self.kv = types.SimpleNamespace(req_pool_idx=0, retraction_backup=None, mamba_pool_idx=None)

    def offload_kv_cache(self, req_to_token_pool, alloc):
        idx = req_to_token_pool.req_to_token[self.kv.req_pool_idx, : self.seqlen - 1]
        self.kv.retraction_backup = types.SimpleNamespace(cpu_tensors=alloc.get_cpu_copy(idx))

    def load_kv_cache(self, req_to_token_pool, alloc):
        idx = req_to_token_pool.req_to_token[self.kv.req_pool_idx, : self.seqlen - 1]
        alloc.load_cpu_copy(self.kv.retraction_backup.cpu_tensors, idx)
        self.kv.retraction_backup = None


def test_retraction_evidence_checks_the_restored_kv_and_retract_switches_live_settings(decode_agent, monkeypatch):
    import sys

    import torch

    from faults.agent import retraction

    mod = types.ModuleType("fake_schedule_batch")
    mod.Req = type("Req", (_Req,), {})
    retraction._hook_schedule_batch(mod)
    pool, r2t = _Pool(), types.SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=torch.long))
    r2t.req_to_token[0, :10] = torch.arange(10)
    req = mod.Req("rid-a", 11)
    req.offload_kv_cache(r2t, pool)
    r2t.req_to_token[0, :10] = torch.arange(20, 30)  # resumed into new slots: the copy goes there
    req.load_kv_cache(r2t, pool)
    # a request whose new slots another write changes while it is restored
    class Clobbered(_Req):
        def load_kv_cache(self, r, a):
            _Req.load_kv_cache(self, r, a)
            a.k[1][25] += 1.0

    mod2 = types.ModuleType("fake_schedule_batch2")
    mod2.Req = Clobbered
    retraction._hook_schedule_batch(mod2)
    bad = mod2.Req("rid-b", 11)
    bad.offload_kv_cache(r2t, pool)
    bad.load_kv_cache(r2t, pool)
    evs = [e for e in decode_agent.events if e["ev"] in ("kv_retracted", "kv_resumed")]
    assert [(e["ev"], e["rid"]) for e in evs] == [("kv_retracted", "rid-a"), ("kv_resumed", "rid-a"),
                                                 ("kv_retracted", "rid-b"), ("kv_resumed", "rid-b")]
    assert evs[1]["restored_equal"] is True and evs[1]["digest"] == evs[0]["digest"] and evs[1]["restored_tokens"] == 10
    assert evs[3]["restored_equal"] is False and evs[3]["digest"] != evs[2]["digest"]

    # the live settings: the scheduler module's test trigger and the prealloc queues' reservation
    sched = types.ModuleType(retraction.SCHED)
    sched.TEST_RETRACT, sched.TEST_RETRACT_INTERVAL = False, 3
    monkeypatch.setitem(sys.modules, retraction.SCHED, sched)
    dmod = types.ModuleType("fake_decode")
    dmod.DecodePreallocQueue = type("DecodePreallocQueue", (), {"__init__": lambda self: setattr(
        self, "num_reserved_decode_tokens", 512)})
    retraction._hook_decode_queue(dmod)
    q = dmod.DecodePreallocQueue()
    ctl = AgentClient(decode_agent.dir)
    for bad, why in (({"interval": 1}, "interval must be 0"), ({"reserve": 0}, "reserve must be an int >= 1")):
        with pytest.raises(AgentError, match=why):
            ctl.arm("decode", "retract", params=bad, hooks=())
    assert (sched.TEST_RETRACT, q.num_reserved_decode_tokens) == (False, 512)  # a refused arm changed nothing
    assert not decode_agent.faults
    f = ctl.arm("decode", "retract", params={"interval": 4, "reserve": 16}, hooks=())
    assert (sched.TEST_RETRACT, sched.TEST_RETRACT_INTERVAL, q.num_reserved_decode_tokens) == (True, 4, 16)
    f.heal()
    assert (sched.TEST_RETRACT, sched.TEST_RETRACT_INTERVAL, q.num_reserved_decode_tokens) == (False, 3, 512)


def test_park_holds_a_request_at_its_stage_until_released_aborted_or_healed(decode_agent):
    """``park`` keeps one request out of a decode stage without blocking the scheduler: out of
    pre-allocation (not ready after the handshake), out of the waiting queue a batch is built from;
    released by the harness, by its own abort, or by heal."""
    from faults.agent import scheduler as sched_mod

    mod = types.ModuleType("fake_decode")

    class DecodePreallocQueue:
        def __init__(self, rids):
            self.queue = [types.SimpleNamespace(req=types.SimpleNamespace(rid=r, bootstrap_room=i, finished_reason=None),
                                                waiting_for_input=False) for i, r in enumerate(rids)]

        def _update_handshake_waiters(self):
            for dr in self.queue:  # every handshake done
                dr.waiting_for_input = True

    class SchedulerDisaggregationDecodeMixin:
        def _get_new_prebuilt_batch(self, running_batch):
            took, self.waiting_queue = list(self.waiting_queue), []  # SGLang replaces the list
            return [r.rid for r in took]

    mod.DecodePreallocQueue, mod.SchedulerDisaggregationDecodeMixin = DecodePreallocQueue, SchedulerDisaggregationDecodeMixin
    sched_mod._hook_decode(mod)
    ctl = AgentClient(decode_agent.dir)
    with pytest.raises(ValueError, match="params.stage must be one of"):  # the harness refuses before asking
        ctl.arm("decode", "park", target={"rid": "r-b"}, params={"stage": "nowhere"})
    with pytest.raises(ValueError, match="params.stage must be one of"):  # and so does the agent
        decode_agent.command({"cmd": "arm", "id": "p0", "kind": "park", "target": {"rid": "r-b"}, "params": {}})
    assert not decode_agent.faults

    q = DecodePreallocQueue(["r-a", "r-b", "r-c"])
    f = ctl.arm("decode", "park", target={"rid": "r-b"}, params={"stage": "decode_prealloc"}, hooks=())
    for _ in range(3):
        q._update_handshake_waiters()
        assert [dr.waiting_for_input for dr in q.queue] == [True, False, True]
    f.release()
    q._update_handshake_waiters()
    assert [dr.waiting_for_input for dr in q.queue] == [True, True, True]

    s = SchedulerDisaggregationDecodeMixin()
    reqs = {r: types.SimpleNamespace(rid=r, bootstrap_room=i, finished_reason=None) for i, r in enumerate("xyz")}
    s.waiting_queue = list(reqs.values())
    g = ctl.arm("decode", "park", target={"rid": "y"}, params={"stage": "decode_waiting"}, hooks=())
    assert s._get_new_prebuilt_batch(None) == ["x", "z"] and [r.rid for r in s.waiting_queue] == ["y"]
    assert s._get_new_prebuilt_batch(None) == [] and [r.rid for r in s.waiting_queue] == ["y"]
    reqs["y"].finished_reason = "abort"  # an abort reached it: no longer held
    assert s._get_new_prebuilt_batch(None) == ["y"]
    s.waiting_queue = [types.SimpleNamespace(rid="w", bootstrap_room=9, finished_reason=None)]
    h = ctl.arm("decode", "park", target={"rid": "w"}, params={"stage": "decode_waiting"}, hooks=())
    assert s._get_new_prebuilt_batch(None) == []
    h.heal()
    assert s._get_new_prebuilt_batch(None) == ["w"]
    fired = [(e["rid"], e["phase"], e.get("finished"), e.get("healed")) for e in decode_agent.events
             if e["ev"] == "fault_fired" and e["kind"] == "park"]
    assert fired == [("r-b", "held", None, None), ("r-b", "released", False, False), ("y", "held", None, None),
                     ("y", "released", True, False), ("w", "held", None, None), ("w", "released", False, True)]
    g.heal()


def test_chunked_prefill_sets_the_live_chunk_size_and_refuses_a_size_off_the_page_grid(agent):
    """``chunked_prefill`` (prefill): ``--chunked-prefill-size`` on the live schedulers; a size that is
    not a multiple of the KV page size is refused and leaves nothing armed or changed."""
    from faults.agent import scheduler as sched_mod

    mod = types.ModuleType("fake_scheduler")
    mod.Scheduler = type("Scheduler", (), {"__init__": lambda self: self.__dict__.update(
        chunked_prefill_size=8192, page_size=64, waiting_queue=[]), "get_new_batch_prefill": lambda self, rb: None})
    sched_mod._hook_scheduler(mod)
    s = mod.Scheduler()
    ctl = AgentClient(agent.dir)
    with pytest.raises(AgentError, match="not a multiple of the page size 64"):
        ctl.arm("prefill", "chunked_prefill", params={"size": 100}, hooks=())
    with pytest.raises(AgentError, match="positive int"):
        ctl.arm("prefill", "chunked_prefill", params={"size": "big"}, hooks=())
    assert s.chunked_prefill_size == 8192 and not agent.faults
    f = ctl.arm("prefill", "chunked_prefill", params={"size": 256}, hooks=())
    assert s.chunked_prefill_size == 256
    f.heal()
    assert s.chunked_prefill_size == 8192
