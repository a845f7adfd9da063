"""``double_alloc`` on paged KV layouts (``--page-size`` > 1), against SGLang's real
``PagedTokenToKVPoolAllocator`` over a tiny real ``MHATokenToKVPool`` on CPU.

One subprocess (SGLang imported under the CPU compat layer, the agent booted as in an engine's decode
process: ``KVCHAOS_AGENT`` / ``KVCHAOS_AGENT_ROLE=decode``, so the allocator is hooked by the agent's
own import machinery) drives decode's real pre-allocation function
(``disaggregation.decode.alloc_for_decode_prealloc``, which calls ``alloc_extend`` for page size > 1)
and decode's real release (``mem_cache.common.free_kv_row_segments`` → ``free_segment`` →
``free_page_ids`` → ``_release_page_ids``), plus the ``free`` path of a free group. It prints what it
saw as JSON; the tests below judge it."""

from __future__ import annotations

import pytest

from tests.util import agent_process_result


SCRIPT = r'''
import json, types
from kvchaos import cpucompat
cpucompat.install()
import faults.agent as agent
agent.boot()
import torch
from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc
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
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return agent_process_result(SCRIPT, tmp_path_factory.mktemp("agent-paged"))


def test_the_agent_hooks_the_paged_allocator_on_import(seen):
    names = {h.rsplit(".", 1)[1] for h in seen["hooks"]}
    assert {"alloc_extend", "free", "_release_page_ids"} <= names, seen["hooks"]


def test_paged_double_alloc_shares_whole_pages_and_the_pool_stays_whole(seen):
    r = seen["aliased"]
    # decode's pre-allocation of the second request was handed the first request's first two pages
    assert len(r["shared"]) == 2 and r["x_len"] == r["y_len"] == 100, r
    ev = r["fired"]
    assert len(ev) == 1 and ev[0]["pages"] == 2 and ev[0]["page_size"] == 16 and ev[0]["tokens"] == 32
    assert ev[0]["shared"] == r["x_pages"][:2] == r["shared"]
    assert r["x_reads_y_kv"], "the shared pages are the same KV memory for both owners"
    # 7 + 7 pages allocated, 2 of them the same: 12 pages in use (the displaced two went back)
    assert r["available_both_live"] == 1024 - 12 * 16
    # first owner released: its 5 own pages back, the 2 shared stay with the second owner
    assert r["available_after_first_owner"] == 1024 - 7 * 16
    assert r["after"] == {"available": 1024, "free_pages_unique": True, "free_pages_all": True}


def test_paged_double_alloc_both_owners_freed_in_one_free_group(seen):
    """free() dedups pages (torch.unique) — two owners freed in one group must still give each
    shared page back exactly once."""
    r = seen["aliased_group"]
    assert len(r["shared"]) == 2 and len(r["fired"]) == 1
    assert r["after"] == {"available": 1024, "free_pages_unique": True, "free_pages_all": True}


def test_paged_allocations_share_nothing_without_the_mutation(seen):
    r = seen["clean"]
    assert r["shared"] == [] and r["fired"] == [] and not r["x_reads_y_kv"]
    assert len(r["x_pages"]) == len(r["y_pages"]) == 7
    assert r["available_both_live"] == 1024 - 14 * 16
    assert r["available_after_first_owner"] == 1024 - 7 * 16
    assert r["after"] == {"available": 1024, "free_pages_unique": True, "free_pages_all": True}
