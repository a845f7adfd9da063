"""The SGLang allocator scripts of ``tests/test_agent_paged.py`` and ``tests/test_agent_ownership.py``, run in
one child (:func:`run`): SGLang imported under the CPU compat layer and the agent booted once, as in an
engine's decode process, then each script on its own globals. One import of SGLang (about 10 s of CPU)
serves both modules' tests: the session fixture ``sglang_allocators`` (tests/conftest.py) runs it once per
session, its xdist workers included."""

from __future__ import annotations

import json

PREAMBLE = r'''
import json, types
from kvchaos import cpucompat
cpucompat.install()
import faults.agent as agent
agent.boot()
import torch
'''

PAGED = r'''from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.common import free_kv_row_segments
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

A = agent.control.AGENT
PS, SIZE = 16, 1024  # 64 pages; page 0 is SGLang's padding page, never handed out
out = {"hooks": [h for h in A.hooks if "PagedTokenToKVPoolAllocator" in h]}


def pool():
    kv = MHATokenToKVPool(SIZE, PS, torch.float32, 1, 4, 1, "cpu", False, enable_alt_stream=False)
    return kv, PagedTokenToKVPoolAllocator(SIZE, PS, torch.float32, "cpu", kv, True)  # need_sort: as PD decode


def prealloc(a, fill_len):
    req = types.SimpleNamespace(kv=types.SimpleNamespace())
    return alloc_for_decode_prealloc(a, req=req, fill_len=fill_len, delta_len=fill_len, prefix_len=0,
                                     total_prefix_len=0, prefix_indices=None, uses_swa_tail=False, swa_tail_len=0)


def pages(idx):
    return sorted(set((idx // PS).tolist()))


def whole(a):
    free = a.get_all_free_pages().tolist()
    return {"available": a.available_size(), "free_pages_unique": len(free) == len(set(free)),
            "free_pages_all": sorted(free) == list(range(1, SIZE // PS + 1))}


def fired():
    return [e for e in A.events if e["ev"] == "fault_fired" and e["kind"] == "double_alloc"]


def scenario(name, armed, release):
    kv, a = pool()
    n0 = len(fired())
    if armed:
        A.arm({"kind": "double_alloc", "params": {"pages": 40}, "id": name})  # 40 tokens -> 2 pages of 16
    x = prealloc(a, 100)  # 7 pages: 6 whole + 4 tokens of a 7th
    y = prealloc(a, 100)
    r = {"x_pages": pages(x), "y_pages": pages(y), "x_len": len(x), "y_len": len(y),
         "shared": sorted(set(pages(x)) & set(pages(y))), "fired": fired()[n0:],
         "available_both_live": a.available_size()}
    # the two owners really share KV memory: what y writes, x reads
    kv.k_buffer[0][y[:2 * PS]] = 7.0
    r["x_reads_y_kv"] = bool((kv.k_buffer[0][x[:2 * PS]] == 7.0).all())
    r.update(release(a, x, y) or {})
    A.heal()
    r["after"] = whole(a)
    out[name] = r


def release_row_by_row(a, x, y):  # decode's release of a finished request, one after the other
    free_kv_row_segments(a, [(x, 0)], swa_evicted_seqlen=0)
    mid = a.available_size()
    free_kv_row_segments(a, [(y, 0)], swa_evicted_seqlen=0)
    return {"available_after_first_owner": mid}


def release_in_one_group(a, x, y):  # both finish in one batch: free() of a free group, pages deduped once
    a.free_group_begin()
    a.free(x)
    a.free(y)
    a.free_group_end()


scenario("aliased", True, release_row_by_row)
scenario("aliased_group", True, release_in_one_group)
scenario("clean", False, release_row_by_row)
'''

OWNERSHIP = r'''from faults.agent import provenance
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
'''

SCRIPTS = {"paged": PAGED, "ownership": OWNERSHIP}

DRIVER = PREAMBLE + r'''
results = {}
for name, body in SCRIPTS.items():
    scope = dict(globals())
    exec(compile(body, f"<{name} script>", "exec"), scope)
    results[name] = scope["out"]
print("RESULT " + json.dumps(results))
'''


def driver() -> str:
    """The child's program: the preamble, then each script exec'd on a copy of its globals."""
    return "SCRIPTS = " + json.dumps(SCRIPTS) + "\n" + DRIVER
