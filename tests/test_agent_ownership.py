"""The page-ownership ledger (``faults/agent/ownership.py``) against SGLang's real allocators on CPU.

One subprocess boots the agent as in a decode process (``KVCHAOS_AGENT_ROLE=decode``: the allocators are
hooked by the agent's own import machinery) and drives SGLang's real page-size-1 and paged allocators
through decode's real pre-allocation (``alloc_for_decode_prealloc``) and release paths
(``free_kv_row_segments``, ``free`` inside and outside a free group, ``free_page_ids``, ``clear``), with a
stand-in ``DecodePreallocQueue._pre_alloc`` (the request's slots written into ``req_to_token``, as 0.5.23's
does) for the page-table view. It prints the ledger's ``page_conflict`` events per scenario; the tests
below judge them: none on a correct engine's paths, and the conflict — with both holders — where a page is
handed out twice, released twice, or pointed at by two live requests' page tables."""

from __future__ import annotations

import pytest

from kvchaos import oracles
from tests.util import agent_process_result


SCRIPT = r'''
import json, types
from kvchaos import cpucompat
cpucompat.install()
import faults.agent as agent
agent.boot()
import torch
from faults.agent import provenance
from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.common import free_kv_row_segments
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

A = agent.control.AGENT
SIZE = 1024
out = {}


def pool(ps):
    kv = MHATokenToKVPool(SIZE, ps, torch.float32, 1, 4, 1, "cpu", False, enable_alt_stream=False)
    if ps == 1:
        return TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", kv, True)
    return PagedTokenToKVPoolAllocator(SIZE, ps, torch.float32, "cpu", kv, True)  # need_sort: as PD decode


class Queue:
    """What 0.5.23's DecodePreallocQueue._pre_alloc does with a request's slots (no prefix, no SWA)."""

    def __init__(self, alloc):
        self.token_to_kv_pool_allocator = alloc
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros(16, 4096, dtype=torch.int64))
        self.scheduler = types.SimpleNamespace(enable_hisparse=False)
        self.row = 0

    @staticmethod
    def _pre_alloc_fill_len(req):
        return req.n

    def _pre_alloc(self, req, prefix_indices=None, prefix_len=None, total_prefix_len=None):
        req.kv.req_pool_idx, self.row = self.row, self.row + 1
        loc = alloc_for_decode_prealloc(self.token_to_kv_pool_allocator, req=req, fill_len=req.n, delta_len=req.n,
                                        prefix_len=0, total_prefix_len=0, prefix_indices=None, uses_swa_tail=False,
                                        swa_tail_len=0)
        self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(loc)] = loc
        req.loc = loc
        return loc


mod = types.ModuleType("stand_in_decode")
mod.DecodePreallocQueue = Queue
provenance._hook_prealloc(mod)


def req(rid, n):
    return types.SimpleNamespace(rid=rid, n=n, bootstrap_room=None, origin_input_text="", origin_input_ids=[],
                                 kv=types.SimpleNamespace(req_pool_idx=None, kv_committed_len=None))


def conflicts(since):
    return [{k: e.get(k) for k in ("conflict", "page", "n_pages", "holder", "to", "where", "allocator")}
            for e in A.events[since:] if e["ev"] == "page_conflict"]


def scenario(name, ps, body):
    a = pool(ps)
    q = mod.DecodePreallocQueue(a)
    n0 = len(A.events)
    body(a, q)
    A.heal()
    out[name] = {"conflicts": conflicts(n0), "ledger": agent.ownership.ledger().summary()}


def clean(a, q):  # decode's own life of three requests: pre-allocated, released row by row and in a free group
    x, y, z = req("x", 100), req("y", 70), req("z", 33)
    for r in (x, y, z):
        q._pre_alloc(r)
    free_kv_row_segments(a, [(x.loc, 0)], swa_evicted_seqlen=0)
    a.free_group_begin()
    a.free(y.loc)
    a.free(z.loc)
    a.free_group_end()
    w = req("w", 300)  # reuses their pages
    q._pre_alloc(w)
    w2 = req("w", 20)  # the same request again (a retry, a resume): the same holder
    q._pre_alloc(w2)
    a.free(w.loc)
    a.free(w2.loc)
    a.clear()  # the allocator starts over: nothing it held before is held now
    q._pre_alloc(req("v", 50))


def double_free(a, q):
    x = req("x", 40)
    q._pre_alloc(x)
    a.free(x.loc)
    a.free(x.loc)


def double_alloc(a, q):  # the agent's own mutation: the next pre-allocation is handed 32 tokens x holds
    A.arm({"kind": "double_alloc", "params": {"pages": 32}, "id": "da"})
    x, y = req("x", 100), req("y", 100)
    q._pre_alloc(x)
    q._pre_alloc(y)
    a.free(x.loc)
    a.free(y.loc)


def row_alias(a, q):  # a page-table bug the allocator never sees: y's row points at one of x's pages
    x, y = req("x", 64), req("y", 64)
    q._pre_alloc(x)
    y.kv.req_pool_idx = None
    loc = alloc_for_decode_prealloc(a, req=y, fill_len=64, delta_len=64, prefix_len=0, total_prefix_len=0,
                                    prefix_indices=None, uses_swa_tail=False, swa_tail_len=0)
    loc = loc.clone()
    loc[:a.page_size] = x.loc[:a.page_size]  # one page of x's in y's row
    provenance.ownership.ledger().claimed(a, "y", provenance.ownership.pages_of_slots(loc, a.page_size), "test")


for ps in (1, 16):
    scenario(f"clean-p{ps}", ps, clean)
    scenario(f"double_free-p{ps}", ps, double_free)
    scenario(f"double_alloc-p{ps}", ps, double_alloc)
    scenario(f"row_alias-p{ps}", ps, row_alias)
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return agent_process_result(SCRIPT, tmp_path_factory.mktemp("agent-ownership"))


@pytest.mark.parametrize("ps", [1, 16])
def test_a_correct_engines_paths_raise_no_conflict(seen, ps):
    """Pre-allocation, release row by row and in a free group, pages reused, the same request again, clear()."""
    r = seen[f"clean-p{ps}"]
    assert r["conflicts"] == [], r


@pytest.mark.parametrize("ps", [1, 16])
def test_a_page_released_twice_is_a_double_free_naming_its_last_holder(seen, ps):
    c = seen[f"double_free-p{ps}"]["conflicts"]
    assert c and {x["conflict"] for x in c} == {"double_free"} and {x["holder"] for x in c} == {"x"}, c


@pytest.mark.parametrize("ps", [1, 16])
def test_a_page_handed_out_while_held_is_caught_at_the_allocation_and_in_the_page_table(seen, ps):
    c = seen[f"double_alloc-p{ps}"]["conflicts"]
    kinds = {x["conflict"] for x in c}
    assert "double_assign" in kinds and "two_holders" in kinds, c
    pair = [x for x in c if x["conflict"] == "two_holders"]
    assert all((x["holder"], x["to"]) == ("x", "y") for x in pair), pair
    assert sum(x["n_pages"] for x in pair) == 32 // ps  # the aliased pages, each named once
    assert "double_free" not in kinds  # the mutation keeps the pool whole: only the sharing is wrong


@pytest.mark.parametrize("ps", [1, 16])
def test_two_page_tables_on_one_page_are_caught_though_the_allocator_never_saw_it(seen, ps):
    c = seen[f"row_alias-p{ps}"]["conflicts"]
    assert c and all(x["conflict"] == "two_holders" and (x["holder"], x["to"]) == ("x", "y") for x in c), c


# ------------------------------------------------------------------ the checker over the ledger's events
def _agent(ev, **f):
    return {"ev": "agent", "agent_ev": ev, "source": "agent", "wall": 100.5, "role": "decode", "pid": 7, **f}


def test_page_ownership_fails_on_a_conflict_and_names_both_holders():
    ev = [{"ev": "experiment", "id": "x", "wall": 100.0},
          _agent("kv_prealloc", rid="a", ledger={"handed": 10, "claimed": 10}),
          _agent("page_conflict", conflict="two_holders", page=42, holder="a", to="b", where="_pre_alloc", seq=9)]
    v = oracles.page_ownership(ev)
    assert v.status == "fail" and v.witnesses[0]["holder"] == "a" and v.witnesses[0]["to"] == "b", v
    assert "two_holders of page 42" in v.summary and "0.50 s into the experiment" in v.summary


def test_page_ownership_passes_with_the_ledgers_evidence_and_is_unknown_without():
    ev = [{"ev": "experiment", "id": "x"}, _agent("kv_prealloc", rid="a", ledger={"handed": 10, "claimed": 10})]
    assert oracles.page_ownership(ev).status == "pass"
    assert oracles.page_ownership([{"ev": "experiment", "id": "x"}, _agent("kv_prealloc", rid="a")]).status == "unknown"


def test_page_ownership_names_holders_by_the_clients_rid():
    """An OpenAI route reaches decode under an id of decode's own: decode's record of the request's canaries
    names it back (kvchaos.history.History.engine_rids)."""
    c = "[ABCDEFGHIJ]"
    ev = [{"ev": "experiment", "id": "x"}, {"ev": "plan", "rid": "client-1", "tenant": "t", "canaries": [c]},
          _agent("kv_prealloc", rid="eng-9", canaries=[c], ledger={"handed": 1}),
          _agent("page_conflict", conflict="two_holders", page=3, holder="eng-9", to="other", where="_pre_alloc")]
    assert oracles.page_ownership(ev).witnesses[0]["holder"] == "client-1"


def test_conflicts_past_the_event_cap_are_still_a_fail():
    """Past its event cap the ledger counts conflicts: a count that grew during the experiment is a FAIL."""
    ev = [{"ev": "experiment", "id": "x"},
          _agent("kv_prealloc", rid="a", pid=7, ledger={"handed": 10, "suppressed": 3}),
          _agent("kv_prealloc", rid="b", pid=7, ledger={"handed": 20, "suppressed": 9})]
    v = oracles.page_ownership(ev)
    w = v.witnesses[0]
    assert v.status == "fail" and w["conflict"] == "suppressed" and "6 page conflict" in w["problem"]
    ev[2]["ledger"]["suppressed"] = 3
    assert oracles.page_ownership(ev).status == "pass"
