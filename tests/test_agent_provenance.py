"""Decode-side KV page provenance (``faults/agent/provenance.py``) without an engine: stand-ins for
``DecodePreallocQueue._pre_alloc`` (the request's slots written into ``req_to_token`` at
``[total_prefix_len, fill_len)``) and ``ScheduleBatch.prepare_for_decode`` (one new slot per request in
``out_cache_loc``), hooked by the agent as in a decode process; page size 1 and 64.

(The same hooks against the real engine: the live check of the short-transfer scenario, where every
``kv_prealloc.dst_pages`` must equal what prefill's ``transfer_start`` / ``write_end`` name for that room.)"""

from __future__ import annotations

import types

import pytest
import torch

import faults.agent as agent_mod
from faults.agent import provenance
from tests.agent_fakes import new_agent


@pytest.fixture
def decode_agent(tmp_path, monkeypatch):
    return new_agent(tmp_path, monkeypatch, "decode")


class Alloc:
    """Hands out whole pages from a fixed order (so a test names the page ids it expects); slots are
    ``page * page_size + offset`` as SGLang's paged allocator gives them (page size 1: page = slot)."""

    def __init__(self, page_size, order):
        self.page_size = page_size
        self.free_pages = list(order)

    def alloc_tokens(self, n):
        ps = self.page_size
        pages = [self.free_pages.pop(0) for _ in range(-(-n // ps))]
        return torch.tensor([p * ps + o for p in pages for o in range(ps)][:n], dtype=torch.int64)

    def free(self, slots):
        ps = self.page_size
        for p in dict.fromkeys((slots // ps).tolist()):
            self.free_pages.append(p)


class Req:
    def __init__(self, rid, n_input, room=None, output=0):
        self.rid, self.bootstrap_room = rid, room
        self.origin_input_ids, self.output_ids = list(range(n_input)), list(range(output))
        self.kv = types.SimpleNamespace(req_pool_idx=None, kv_committed_len=None)


def _decode_module(name, page_size, order, raise_in_pool=False):
    """A stand-in ``disaggregation.decode`` module whose ``DecodePreallocQueue._pre_alloc`` does what
    0.5.23's does with the request's slots (decode.py:2237-2377, no HiSparse, no SWA)."""

    class DecodePreallocQueue:
        def __init__(self):
            self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros(8, 4096, dtype=torch.int32))
            self.token_to_kv_pool_allocator = Alloc(page_size, order)
            self.scheduler = types.SimpleNamespace(enable_hisparse=False)
            self.next_row = 0
            self.calls = 0

        @staticmethod
        def _pre_alloc_fill_len(req):
            return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)

        def _pre_alloc(self, req, prefix_indices=None, prefix_len=None, total_prefix_len=None):
            self.calls += 1
            prefix_len = prefix_len or 0
            total_prefix_len = prefix_len if total_prefix_len is None else total_prefix_len
            req.kv.req_pool_idx, self.next_row = self.next_row, self.next_row + 1
            fill_len = self._pre_alloc_fill_len(req)
            req.kv.kv_committed_len = fill_len
            if prefix_len:
                self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :prefix_len] = prefix_indices
            kv_loc = self.token_to_kv_pool_allocator.alloc_tokens(fill_len - total_prefix_len)
            self.req_to_token_pool.req_to_token[
                req.kv.req_pool_idx, total_prefix_len:total_prefix_len + len(kv_loc)] = kv_loc.to(torch.int32)
            if raise_in_pool:
                self.req_to_token_pool = None  # the evidence cannot read the slots back
            return kv_loc

    mod = types.ModuleType(name)
    mod.DecodePreallocQueue = DecodePreallocQueue
    provenance._hook_prealloc(mod)
    return mod.DecodePreallocQueue()


def _batch_module(name):
    """A stand-in ``managers.schedule_batch`` module: ``prepare_for_decode`` gives each request of the
    batch one new slot (``out_cache_loc``, rows in ``reqs`` order, schedule_batch.py:3780)."""

    class ScheduleBatch:
        def __init__(self, reqs, alloc, next_slots, spec=False):
            self.reqs, self.token_to_kv_pool_allocator = reqs, alloc
            self.next_slots = next_slots
            self.spec_algorithm = types.SimpleNamespace(is_none=lambda: not spec)
            self.beam_tail = None
            self.hisparse_coordinator = None
            self.out_cache_loc = None
            self.prepared = 0

        def prepare_for_decode(self):
            self.prepared += 1
            self.out_cache_loc = self.next_slots

    mod = types.ModuleType(name)
    mod.ScheduleBatch = ScheduleBatch
    provenance._hook_decode_step(mod)
    return mod.ScheduleBatch


def _events(agent, kind):
    return [e for e in agent.events if e["ev"] == kind]


def test_page_size_1_pages_are_slots_and_prev_holders_run_length(decode_agent):
    q = _decode_module("fake_decode_p1", 1, range(10, 100))
    a = Req("rid-a", 6, room=11)
    q._pre_alloc(a)  # slots 10..15
    q.token_to_kv_pool_allocator.free(torch.tensor([12, 13, 14]))  # a finishes part of its pages
    b = Req("rid-b", 8, room=22)
    kv = q._pre_alloc(b)  # slots 16..99 first, then the freed 12, 13, 14 at the end of the free list
    ev = _events(decode_agent, "kv_prealloc")
    assert [e["rid"] for e in ev] == ["rid-a", "rid-b"]
    ea, eb = ev
    assert ea["dst_pages"] == [10, 11, 12, 13, 14, 15] and ea["dst_pages_total"] == 6
    assert ea["prev_holders"] == [[0, 6, None]] and ea["room"] == 11 and ea["page_size"] == 1
    assert eb["dst_pages"] == kv.tolist() == list(range(16, 24))
    assert eb["prev_holders"] == [[0, 8, None]]
    # another order: b's tail lands on a's freed slots
    q2 = _decode_module("fake_decode_p1b", 1, [5, 6, 7, 8, 9, 1, 2, 3, 4])
    x, y = Req("rid-x", 4, room=1), Req("rid-y", 5, room=2)
    q2._pre_alloc(x)  # 5, 6, 7, 8
    q2.token_to_kv_pool_allocator.free_pages = [9, 6, 7, 5, 8]
    q2._pre_alloc(y)
    ey = _events(decode_agent, "kv_prealloc")[-1]
    assert ey["dst_pages"] == [9, 6, 7, 5, 8]
    assert ey["prev_holders"] == [[0, 1, None], [1, 4, "rid-x"]]
    assert ey["fill_len"] == 5 and ey["total_prefix_len"] == 0


def test_a_requests_canaries_are_read_from_its_input_text_or_its_ids(decode_agent):
    """``kv_prealloc.canaries``: the canaries in the request's input text, else in its ids decoded by
    the scheduler's tokenizer (an OpenAI chat request comes as ids); none listed where it holds none."""
    q = _decode_module("fake_decode_canaries", 1, range(10, 400))
    a = Req("from-text", 6, room=1)
    a.origin_input_text = "hello [ABCDEFGHIJ] and [ZZZZZZZZZZ] again [ABCDEFGHIJ]"
    q._pre_alloc(a)
    b = Req("9f1c0e7a", 6, room=2)  # the engine's own id; only token ids, as a chat request has them
    b.origin_input_text = None
    text = "<|user|> [QQQQQQ2345] tail"
    b.origin_input_ids = [ord(ch) for ch in text]
    q.scheduler.tokenizer = types.SimpleNamespace(decode=lambda ids: "".join(chr(i) for i in ids))
    q._pre_alloc(b)
    c = Req("plain", 6, room=3)
    c.origin_input_text = "no canary here [abc]"
    q._pre_alloc(c)
    ea, eb, ec = _events(decode_agent, "kv_prealloc")
    assert ea["canaries"] == ["[ABCDEFGHIJ]", "[ZZZZZZZZZZ]"] and eb["canaries"] == ["[QQQQQQ2345]"]
    assert "canaries" not in ec


def test_page_size_64_lists_page_ids_at_each_pages_first_token(decode_agent):
    q = _decode_module("fake_decode_p64", 64, [7, 3, 9, 4, 12, 2])
    a = Req("rid-a", 130, room=5)  # 3 pages: 64 + 64 + 2 tokens
    kv = q._pre_alloc(a)
    ea = _events(decode_agent, "kv_prealloc")[-1]
    assert ea["dst_pages"] == [7, 3, 9] and ea["dst_pages_total"] == 3 and ea["page_size"] == 64
    # exactly what decode sends prefill: kv_to_page_indices = slots[::64] // 64
    assert ea["dst_pages"] == (kv[::64] // 64).tolist()
    assert ea["prev_holders"] == [[0, 3, None]] and ea["fill_len"] == 130
    # a decode-side prefix of one page: only the pages after it are listed, in the request's order
    q.token_to_kv_pool_allocator.free(kv[64:])  # pages 3 and 9 go back: free list 4, 12, 2, 3, 9
    b = Req("rid-b", 64 + 64 * 4 + 10)
    q._pre_alloc(b, torch.arange(7 * 64, 8 * 64), 64, 64)
    eb = _events(decode_agent, "kv_prealloc")[-1]
    assert eb["total_prefix_len"] == 64 and eb["fill_len"] == 64 * 5 + 10
    assert eb["dst_pages"] == [4, 12, 2, 3, 9]
    assert eb["prev_holders"] == [[0, 3, None], [3, 2, "rid-a"]]
    assert eb["room"] is None


def test_dst_pages_list_is_bounded_and_counted(decode_agent, monkeypatch):
    monkeypatch.setattr(provenance, "DST_PAGES_MAX", 4)
    q = _decode_module("fake_decode_bound", 1, range(1, 100))
    q._pre_alloc(Req("rid-a", 10))
    e = _events(decode_agent, "kv_prealloc")[-1]
    assert e["dst_pages"] == [1, 2, 3, 4] and e["dst_pages_total"] == 10
    assert e["prev_holders"] == [[0, 10, None]]  # the holders cover the whole page list


def test_a_decode_step_makes_each_request_the_holder_of_its_new_slot(decode_agent):
    q = _decode_module("fake_decode_step1", 1, range(10, 40))
    a, b = Req("rid-a", 4, room=1), Req("rid-b", 4, room=2)
    q._pre_alloc(a)  # 10..13
    q._pre_alloc(b)  # 14..17
    SB = _batch_module("fake_sb_1")
    alloc = q.token_to_kv_pool_allocator
    batch = SB([a, b], alloc, torch.tensor([18, 19]))
    batch.prepare_for_decode()
    assert batch.prepared == 1
    batch.next_slots = torch.tensor([20, 21])
    batch.prepare_for_decode()
    # the decode steps' slots go back and a new request gets them: their holders are a and b
    alloc.free_pages = [18, 19, 20, 21, 13]
    q._pre_alloc(Req("rid-c", 5, room=3))
    e = _events(decode_agent, "kv_prealloc")[-1]
    assert e["dst_pages"] == [18, 19, 20, 21, 13]
    assert e["prev_holders"] == [[0, 1, "rid-a"], [1, 1, "rid-b"], [2, 1, "rid-a"], [3, 1, "rid-b"], [4, 1, "rid-a"]]
    assert e["step_stats"]["steps"] == 2 and e["step_stats"]["hook_s"] >= 0
    assert not _events(decode_agent, "hook_error")
    assert len(_events(decode_agent, "kv_prealloc")) == 3  # no event per step


def test_a_decode_step_on_page_size_64_holds_the_slots_page(decode_agent):
    q = _decode_module("fake_decode_step64", 64, [5, 6, 7, 8])
    a = Req("rid-a", 64)
    q._pre_alloc(a)  # page 5, full
    SB = _batch_module("fake_sb_64")
    alloc = q.token_to_kv_pool_allocator
    SB([a], alloc, torch.tensor([6 * 64 + 0])).prepare_for_decode()  # a's 65th token opens page 6
    alloc.free_pages = [6, 5, 7]
    q._pre_alloc(Req("rid-b", 64 * 3))
    e = _events(decode_agent, "kv_prealloc")[-1]
    assert e["dst_pages"] == [6, 5, 7]
    assert e["prev_holders"] == [[0, 2, "rid-a"], [2, 1, None]]


def test_speculative_and_mismatched_steps_are_skipped_not_guessed(decode_agent):
    q = _decode_module("fake_decode_skip", 1, range(10, 40))
    a = Req("rid-a", 2)
    q._pre_alloc(a)  # 10, 11
    SB = _batch_module("fake_sb_skip")
    alloc = q.token_to_kv_pool_allocator
    SB([a], alloc, torch.tensor([12]), spec=True).prepare_for_decode()
    SB([a], alloc, torch.tensor([13, 14])).prepare_for_decode()  # two rows for one request
    SB([a], alloc, torch.tensor([15])).prepare_for_decode()
    alloc.free_pages = [12, 13, 15]
    q._pre_alloc(Req("rid-b", 3))
    e = _events(decode_agent, "kv_prealloc")[-1]
    assert e["prev_holders"] == [[0, 2, None], [2, 1, "rid-a"]]
    assert e["step_stats"]["skipped"] == {"speculative": 1, "rows": 1}
    assert sorted(x["reason"] for x in _events(decode_agent, "provenance_skipped")) == ["rows", "speculative"]


def test_a_failing_hook_does_not_break_the_call(decode_agent):
    q = _decode_module("fake_decode_broken", 1, range(10, 40), raise_in_pool=True)
    r = Req("rid-a", 3)
    kv = q._pre_alloc(r)
    assert kv.tolist() == [10, 11, 12] and q.calls == 1  # the engine's own result
    errs = _events(decode_agent, "hook_error")
    assert len(errs) == 1 and errs[0]["hook"] == "_pre_alloc" and "NoneType" in errs[0]["error"]
    assert not _events(decode_agent, "kv_prealloc")
    # a decode step whose batch cannot be read
    SB = _batch_module("fake_sb_broken")
    b = SB([r], q.token_to_kv_pool_allocator, "not a tensor")
    b.prepare_for_decode()
    assert b.prepared == 1 and b.out_cache_loc == "not a tensor"
    errs = _events(decode_agent, "hook_error")
    assert [e["hook"] for e in errs] == ["_pre_alloc", "prepare_for_decode"]
    for _ in range(provenance.ERRORS_MAX + 5):  # a persistent failure is reported, not flooded
        b.prepare_for_decode()
    assert len(_events(decode_agent, "hook_error")) == 1 + provenance.ERRORS_MAX


def test_other_roles_pass_through(tmp_path, monkeypatch):
    a = new_agent(tmp_path, monkeypatch, "prefill")
    q = _decode_module("fake_decode_prefill", 1, range(10, 40))
    kv = q._pre_alloc(Req("rid-a", 3))
    SB = _batch_module("fake_sb_prefill")
    SB([Req("rid-b", 1)], q.token_to_kv_pool_allocator, torch.tensor([20])).prepare_for_decode()
    assert kv.tolist() == [10, 11, 12]
    assert not a.events and a.peek("provenance") is None


def test_the_package_registers_the_hooks():
    for mod, fn in provenance.HOOKS.items():
        assert fn.__name__ in agent_mod.HOOKS[mod].__name__.split("+")
    assert set(provenance.HOOKS) == {"sglang.srt.disaggregation.decode", "sglang.srt.managers.schedule_batch"}
