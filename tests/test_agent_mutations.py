"""The agent's mutations on stand-in SGLang modules: admission (``reject_admitted``), the allocator
(``double_alloc``), decode's deferred release, retraction (``retract``), ``park`` and ``chunked_prefill``
— each armed, evidenced and healed through the control socket."""

from __future__ import annotations

import sys
import time
import types

import pytest

import faults.agent as agent_mod
from faults.agent import retraction
from faults.agent import scheduler as sched_mod
from faults.client import AgentClient, AgentError

from tests.agent_fakes import agent, decode_agent  # noqa: F401 - fixtures


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
    import torch  # only the tests whose stand-ins hold tensors import torch (slow to import)

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


class _Pool:
    """Stands in for decode's KV allocator: one K and one V buffer per layer, SGLang's host-copy API."""

    def __init__(self, slots=64, layers=2):
        import torch  # only the tests whose stand-ins hold tensors import torch (slow to import)

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
    import torch  # only the tests whose stand-ins hold tensors import torch (slow to import)

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


def test_the_scheduler_says_when_it_acted_on_an_abort(decode_agent):
    """``abort_ingested``: logged once ``Scheduler.abort_request`` has run (what the abort at a stage waits
    for before it lets the held request go), with the abort's rid; the engine's own return value kept."""
    mod = types.ModuleType("fake_scheduler_abort")
    seen = []
    mod.Scheduler = type("Scheduler", (), {"abort_request": lambda self, req: seen.append(
        [e["rid"] for e in decode_agent.events if e["ev"] == "abort_ingested"]) or "done"})
    sched_mod._hook_scheduler(mod)
    s = mod.Scheduler()
    assert s.abort_request(types.SimpleNamespace(rid="r-x", abort_all=False)) == "done"
    assert s.abort_request(types.SimpleNamespace(rid="", abort_all=True)) == "done"
    assert seen == [[], ["r-x"]]  # each logged after the engine's own handling, not before
    assert [(e["rid"], e["abort_all"]) for e in decode_agent.events if e["ev"] == "abort_ingested"] == [
        ("r-x", False), ("", True)]


def test_chunked_prefill_sets_the_live_chunk_size_and_refuses_a_size_off_the_page_grid(agent):
    """``chunked_prefill`` (prefill): ``--chunked-prefill-size`` on the live schedulers; a size that is
    not a multiple of the KV page size is refused and leaves nothing armed or changed."""
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


def test_the_input_limit_setting_needs_only_a_live_scheduler_not_the_reject_path_hook(agent):
    """``input_limit`` switches the live schedulers' ``max_req_input_len``: 0.5.19 has no
    ``is_unadmitted_reject`` (a search there was refused the knob by name), so it waits for the
    Scheduler's own hook; the planted ``reject_admitted`` still needs the reject path's."""
    mod = types.ModuleType("sglang_fake_sched")
    mod.__name__ = "sglang_fake_sched"

    class Scheduler:
        def __init__(self):
            self.max_req_input_len = 2042
    mod.Scheduler = Scheduler
    sched_mod._hook_scheduler(mod)
    s = mod.Scheduler()
    ctl = AgentClient(agent.dir)
    f = ctl.arm("prefill", "input_limit", params={"max_input_len": 512})  # the default hooks: found
    assert s.max_req_input_len == 512
    f.heal()
    assert s.max_req_input_len == 2042
    hooks = [h for a in ctl.agents("prefill") for h in ctl._send(a, {"cmd": "ping"})["hooks"]]
    assert any("Scheduler.__init__" in h for h in hooks) and not any("is_unadmitted_reject" in h for h in hooks)
