"""Decode's KV allocator: the ``double_alloc`` mutation (the next prefill-sized allocation is handed
KV that a live allocation already holds — one page, two owners; both owners free it, the second free
is swallowed so the pool's accounting stays whole and only the aliasing is wrong).

Two allocators, picked by ``--page-size`` (sglang 0.5.19–0.5.23, ``mem_cache/allocator/``):

* page size 1: ``TokenToKVPoolAllocator`` (``token.py``). Decode's PD pre-allocation
  (``disaggregation/decode.py`` ``alloc_for_decode_prealloc``) calls ``alloc(delta_len)``; token slots
  are pages. ``params.pages`` = N token slots aliased.
* page size > 1: ``PagedTokenToKVPoolAllocator`` (``paged.py``). The same pre-allocation calls
  ``alloc_extend(prefix_lens, …, seq_lens=[fill_len], last_loc, extend_num_tokens)`` (never ``alloc``;
  per-step decode growth is ``alloc_decode``, one token per request). ``params.pages`` is still N
  *tokens* (the same request works on every layout): ``max(1, N // page_size)`` whole pages are
  aliased. Every page release funnels through ``_release_page_ids`` (from ``free`` after
  ``torch.unique(index // page_size)``, ``free_segment`` / ``free_page_ids`` and ``free_group_end``),
  where the second owner's release is swallowed; ``free`` dedups pages, so two owners freed in one
  call (a free group that ended) count as two there.
"""

from __future__ import annotations

from . import control as _ctl
from . import ownership
from .control import _hook_class, register_fault

register_fault("double_alloc", mutation=True)


def _make_alloc(orig):
    """``TokenToKVPoolAllocator.alloc``: where ``double_alloc`` hands out pages a live allocation holds;
    the ownership ledger sees what the allocator handed out and what the engine got."""
    def alloc(self, need_size):
        out = orig(self, need_size)
        if out is None:
            return out
        given = _handed(self, out, 1, "alloc")
        if _ctl.ROLE != "decode":
            return out
        got = _mutated_alloc(self, need_size, out)
        if got is not out:
            _handed_beyond(self, got, given, 1, "alloc")
        return got
    return alloc


def _mutated_alloc(self, need_size, out):
    """``double_alloc`` on a page-size-1 allocation (``out``): the allocation the engine gets."""
    AGENT = _ctl.AGENT
    st = AGENT.tls.__dict__.setdefault("alloc_state", {})
    f = None
    armed = AGENT.switched_on("double_alloc")
    n = int(armed["params"].get("pages", 8)) if armed else 0
    if armed and st.get("fid") != armed["id"]:  # a newly armed fault starts fresh: only
        st["fid"], st["last"] = armed["id"], None  # allocations made since it was armed
    if armed and len(out) >= n:  # a prefill-sized allocation, not a 1-token decode step
        prev = st.get("last")
        if prev is not None and len(prev) >= n:
            f = AGENT.match("double_alloc")
        if f is not None:
            import torch  # on use: this module loads in the engine before torch and sglang are imported

            shared = prev[:n].clone()
            displaced = out[:n].clone()
            out = torch.cat([shared, out[n:]])
            self.free(displaced)  # nothing leaks from the pool: only the sharing is wrong
            # both owners will free the shared pages; the second free is swallowed (see
            # free() below) so the pool's accounting stays whole and only the aliasing is
            # wrong — otherwise SGLang's idle invariant check ("pool memory leak detected",
            # available > total) crashes decode, which we saw and do not want as a side effect
            with AGENT.lock:
                for p in shared.tolist():
                    AGENT.shared_pages[p] = AGENT.shared_pages.get(p, 0) + 1
            AGENT.emit("fault_fired", fault=f["id"], kind="double_alloc", pages=n,
                       shared=shared.tolist()[:64], need_size=int(need_size))
        st["last"] = out
    return out


def _make_free(orig):
    """``TokenToKVPoolAllocator.free``: the second owner's free of a shared page is swallowed; the
    ownership ledger counts a release where the allocator takes pages back (outside a free group:
    inside one they come back at its end, in one more call)."""
    def free(self, free_index):
        if _ctl.AGENT is None:
            return orig(self, free_index)
        free_index = _swallowed(self, free_index)
        if free_index is not None and free_index.numel() and getattr(self, "free_group", None) is None:
            ownership.note("free", ownership.ledger().released, self, free_index.tolist(), "free")
        return orig(self, free_index)
    return free


def _swallowed(self, free_index):
    """``free_index`` less the frees of shared pages still owed a swallowed free (``double_alloc``)."""
    AGENT = _ctl.AGENT
    if AGENT.shared_pages and free_index is not None and free_index.numel():
        with AGENT.lock:
            idx = free_index.tolist()
            keep = []
            for p in idx:
                c = AGENT.shared_pages.get(p, 0)
                if c > 0:  # first free of an aliased page: the other owner frees it later
                    if c == 1:
                        AGENT.shared_pages.pop(p)
                    else:
                        AGENT.shared_pages[p] = c - 1
                else:
                    keep.append(p)
        if len(keep) != len(idx):
            import torch  # on use: this module loads in the engine before torch and sglang are imported

            free_index = torch.tensor(keep, dtype=free_index.dtype, device=free_index.device)
    return free_index


def _make_clear(orig):
    """``clear()``: the allocator starts over (its free list rebuilt, no frees): the ledger forgets it."""
    def clear(self, *a, **k):
        out = orig(self, *a, **k)
        if _ctl.AGENT is not None:
            ownership.note("clear", ownership.ledger().cleared, self)
        return out
    return clear


def _handed(alloc, out, page_size: int, where: str) -> list:
    """Tell the ledger the pages ``out`` (token slots) starts; returns them."""
    if _ctl.AGENT is None:
        return []
    try:
        pages = ownership.pages_of_slots(out, page_size)
    except Exception:  # noqa: BLE001 - evidence must never break the engine
        return []
    ownership.note(where, ownership.ledger().handed, alloc, pages, where)
    return pages


def _handed_beyond(alloc, out, given: list, page_size: int, where: str) -> None:
    """The engine got pages beyond those the allocator handed out in this call (something between them
    put pages of its own in): those are handed out now, in the ledger's eyes."""
    if _ctl.AGENT is None:
        return
    try:
        mine = set(given)
        extra = [p for p in ownership.pages_of_slots(out, page_size) if p not in mine]
    except Exception:  # noqa: BLE001 - evidence must never break the engine
        return
    if extra:
        ownership.note(where, ownership.ledger().handed, alloc, extra, where)


def _hook_allocator(mod):
    _hook_class(mod, "TokenToKVPoolAllocator", {"alloc": _make_alloc, "free": _make_free},
                {"clear": _make_clear})


# ---------------------------------------------------------------- page size > 1
def _shared(alloc, create: bool = False) -> dict | None:
    """Pages of this allocator handed to two owners: page id -> extra owner frees still to swallow
    (per allocator instance: a hybrid pool has several paged allocators with their own page ids).
    None while nothing of it is shared (and ``create`` is False)."""
    if create:
        return _ctl.AGENT.state("double_alloc.paged", dict).setdefault(id(alloc), {})
    by_alloc = _ctl.AGENT.peek("double_alloc.paged")
    return by_alloc.get(id(alloc)) if by_alloc else None


def _whole_pages(out, ps: int):
    """(positions in ``out``, page ids) of the pages ``out`` covers entirely, in order (the partial
    page after a cached prefix, and a partial last page, are not whole)."""
    import torch  # on use: this module loads in the engine before torch and sglang are imported

    n = len(out)
    if n < ps:
        empty = torch.empty((0,), dtype=torch.int64)
        return empty, empty
    starts = torch.nonzero(out[: n - ps + 1] % ps == 0).flatten()
    starts = starts[out[starts + ps - 1] == out[starts] + ps - 1]
    return starts, out[starts] // ps


def _make_extend(orig):
    def alloc_extend(self, *a, **k):
        out = orig(self, *a, **k)
        if out is None:
            return out
        ps = int(self.page_size)
        given = _handed(self, out, ps, "alloc_extend")
        got = _paged_double_alloc(self, out)
        if got is not out:
            _handed_beyond(self, got, given, ps, "alloc_extend")
        return got
    return alloc_extend


def _make_paged_alloc(name: str):
    """``alloc`` / ``alloc_decode`` of the paged allocator: the pages they start, to the ledger."""
    def make(orig):
        def alloc(self, *a, **k):
            out = orig(self, *a, **k)
            if out is not None:
                _handed(self, out, int(self.page_size), name)
            return out
        return alloc
    return make


def _make_paged_free(orig):
    def free(self, free_index):
        _fold_group_frees(self, free_index)
        return orig(self, free_index)
    return free


def _make_release(orig):
    """``_release_page_ids``: every page a paged allocator takes back passes here, once a release."""
    def _release_page_ids(self, *page_ids):
        kept = _swallow_releases(self, page_ids)
        if _ctl.AGENT is not None:
            ownership.note("_release_page_ids", _release_pages, self, kept)
        return orig(self, *kept)
    return _release_page_ids


def _release_pages(alloc, kept) -> None:
    ownership.ledger().released(alloc, [int(p) for ids in kept for p in ids.tolist()], "_release_page_ids")


def _hook_paged_allocator(mod):
    _hook_class(mod, "PagedTokenToKVPoolAllocator", {"alloc_extend": _make_extend, "free": _make_paged_free},
                {"_release_page_ids": _make_release, "alloc": _make_paged_alloc("alloc"),
                 "alloc_decode": _make_paged_alloc("alloc_decode"), "clear": _make_clear})


def _paged_double_alloc(alloc, out):
    """``alloc_extend``'s result ``out`` (token slots), with the first N whole pages swapped for pages
    of the last prefill-sized allocation when ``double_alloc`` fires on it; remembers this one."""
    if out is None or _ctl.ROLE != "decode":
        return out
    AGENT = _ctl.AGENT
    armed = AGENT.switched_on("double_alloc")
    if not armed:
        alloc.__dict__.pop("_kvchaos_double_alloc", None)
        return out
    # per allocator instance: the last prefill-sized allocation made while this fault is armed,
    # as page ids; forgotten when any of its pages is released (only live allocations are shared)
    st = alloc.__dict__.setdefault("_kvchaos_double_alloc", {})
    if st.get("fid") != armed["id"]:  # a newly armed fault starts fresh
        st["fid"], st["last"] = armed["id"], None
    ps = int(alloc.page_size)
    tokens = int(armed["params"].get("pages", 8))
    n = max(1, tokens // ps)
    pos, pages = _whole_pages(out, ps)
    if len(pages) < n:  # not a prefill-sized allocation
        return out
    prev = st.get("last")
    f = AGENT.match("double_alloc") if prev is not None and len(prev) >= n else None
    if f is not None:
        out, pages = _alias_pages(alloc, out, pos, pages, prev[:n].clone(), f)
    st["last"] = pages
    return out


def _alias_pages(alloc, out, pos, pages, shared, f):
    """Write the ``shared`` page ids over the first ``len(shared)`` whole pages of ``out`` (at
    positions ``pos``), give the displaced pages back, and count the extra owner of each shared page.
    Returns (new ``out``, its page ids)."""
    import torch  # on use: this module loads in the engine before torch and sglang are imported

    AGENT = _ctl.AGENT
    ps, n = int(alloc.page_size), len(shared)
    displaced = pages[:n].clone()
    out = out.clone()
    offs = torch.arange(ps, dtype=out.dtype, device=out.device)
    rows = pos[:n].to(out.device)[:, None] + offs.to(torch.int64)
    out[rows.reshape(-1)] = (shared.to(out.device)[:, None] * ps + offs).reshape(-1).to(out.dtype)
    # the pages handed out in their place go back: nothing leaks, only the sharing is wrong
    alloc.free((displaced.to(out.device)[:, None] * ps + offs).reshape(-1).to(out.dtype))
    with AGENT.lock:
        sh = _shared(alloc, create=True)
        for p in shared.tolist():
            sh[p] = sh.get(p, 0) + 1
    AGENT.emit("fault_fired", fault=f["id"], kind="double_alloc", pages=n, page_size=ps,
               tokens=n * ps, shared=shared.tolist()[:64], need_size=int(len(out)),
               note="shared = page ids (page_size tokens each)")
    return out, torch.cat([shared, pages[n:]])


def _fold_group_frees(alloc, free_index) -> None:
    """Before ``free``: it dedups pages (torch.unique(index // page_size)) before _release_page_ids;
    when k owners of a shared page are freed in one call (a free group ended), k - 1 of those frees
    are folded away there, so count them as swallowed now."""
    sh = _shared(alloc)
    if not (sh and getattr(alloc, "free_group", None) is None and free_index is not None and free_index.numel()):
        return
    import torch  # on use: this module loads in the engine before torch and sglang are imported

    tok, cnt = torch.unique(free_index, return_counts=True)
    page = (tok // int(alloc.page_size)).tolist()
    with _ctl.AGENT.lock:
        k = {}
        for p, c in zip(page, cnt.tolist()):
            if p in sh:
                k[p] = max(k.get(p, 0), c)
        for p, owners in k.items():
            folded = min(owners - 1, sh.get(p, 0))
            if folded > 0:
                _swallow(sh, p, folded)


def _swallow_releases(alloc, page_ids: tuple) -> tuple:
    """``_release_page_ids``' arguments less the releases of shared pages still owed a swallowed free;
    forgets the last allocation once any of its pages is released (it is no longer live)."""
    sh = _shared(alloc)
    st = alloc.__dict__.get("_kvchaos_double_alloc")
    last = st.get("last") if st else None
    if not sh and last is None:
        return page_ids
    import torch  # on use: this module loads in the engine before torch and sglang are imported

    kept = []
    with _ctl.AGENT.lock:
        for ids in page_ids:
            if sh:
                lst = ids.tolist()
                keep = [p for p in lst if not _swallow(sh, p)]
                if len(keep) != len(lst):
                    ids = torch.tensor(keep, dtype=ids.dtype, device=ids.device)
            kept.append(ids)
            if last is not None and ids.numel() and bool(torch.isin(ids, last.to(ids.device)).any()):
                st["last"] = last = None  # its owner gave it back: no longer a live allocation
    return tuple(kept)


def _swallow(sh: dict, p: int, n: int = 1) -> bool:
    """Consume up to ``n`` pending extra frees of page ``p``; True if one was pending."""
    c = sh.get(p, 0)
    if c <= 0:
        return False
    if c <= n:
        sh.pop(p)
    else:
        sh[p] = c - n
    return True


HOOKS = {
    "sglang.srt.mem_cache.allocator.token": _hook_allocator,
    "sglang.srt.mem_cache.allocator.paged": _hook_paged_allocator,
}
