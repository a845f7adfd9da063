"""``double_alloc`` on paged KV layouts (``--page-size`` > 1), against SGLang's real
``PagedTokenToKVPoolAllocator`` over a tiny real ``MHATokenToKVPool`` on CPU.

One subprocess, shared with tests/test_agent_ownership.py (tests/sglang_allocator_scripts.py: SGLang
imported under the CPU compat layer, the agent booted as in an engine's decode process:
``KVCHAOS_AGENT`` / ``KVCHAOS_AGENT_ROLE=decode``, so the allocator is hooked by the agent's own import
machinery) drives decode's real pre-allocation function
(``disaggregation.decode.alloc_for_decode_prealloc``, which calls ``alloc_extend`` for page size > 1)
and decode's real release (``mem_cache.common.free_kv_row_segments`` → ``free_segment`` →
``free_page_ids`` → ``_release_page_ids``), plus the ``free`` path of a free group. It prints what it
saw as JSON; the tests below judge it."""

from __future__ import annotations

import pytest



@pytest.fixture(scope="module")
def seen(sglang_allocators):
    return sglang_allocators["paged"]


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
