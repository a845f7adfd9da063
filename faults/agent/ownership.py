"""The page-ownership ledger: every KV page a process hands out, who holds it, and when it comes back —
and the moment that goes wrong, as an event (``page_conflict``).

Evidence, not a fault: it runs in every role whatever is armed, and changes nothing the engine does.
Called from the allocator's hooks (``allocator``: what the allocator hands out and takes back) and from
decode's page-table hooks (``provenance``: which request a page was given to). Kept per allocator
instance (page ids are an allocator's own), under its own lock.

Two views, each an invariant a correct engine keeps (SGLang's own debug mode asserts the first:
``_debug_check_no_duplicate_pages``; research note docs/engine/page-lifecycle.md):

* **allocator** — a page is handed out (``alloc``, ``alloc_extend``, ``alloc_decode``) only when it is
  free, and released (page size 1: ``free`` outside a free group; paged: ``_release_page_ids``, the one
  sink every free path ends in) only when it is held. ``double_assign``: handed out while held;
  ``double_free``: released while not held. ``clear()`` resets the allocator: the ledger forgets it.
* **requests** (decode) — the pages of a request's page table that decode pre-allocated for it
  (``_pre_alloc``) or a decode step wrote for it (``prepare_for_decode``) belong to it until the
  allocator releases them. ``two_holders``: a page given to a request while another live request
  holds it (a page-table bug the allocator never sees: two rows pointing at one page);
  ``unallocated``: a page given to a request that the allocator holds as free (used after release).

Only the fresh part of a page table is claimed (``_pre_alloc``'s ``[total_prefix_len, fill_len)``): a
prefix matched in a radix cache is shared by design, whole pages only. A request id that gets pages
again (a retry, a resume) while it holds others is the same holder, never a conflict.

``page_conflict``: ``conflict`` (one of the four), ``page`` (the first), ``pages`` (the first
``PAGES_LISTED``), ``n_pages``, ``page_size``, ``holder`` (the request that holds them, or last held
them), ``to`` (the request they were given to), ``where`` (the engine call), ``allocator`` (its class):
one event per kind and pair of holders in one engine call. At most ``CONFLICTS_MAX`` events a process;
beyond, the conflicts are counted (``suppressed`` in the summary every ``kv_prealloc`` carries, which
``page_ownership`` reads: a count that grew during an experiment is its FAIL too).
"""

from __future__ import annotations

import threading

from . import control as _ctl

CONFLICTS_MAX = 5000  # page_conflict events a process (each one engine call's conflicts of one kind and pair)
PAGES_LISTED = 64  # pages named in one event (n_pages counts them all)
PADDING_PAGE = 0  # SGLang's padding slot/page: never in a free list, written by padded rows


class _Book:
    """One allocator's pages: held (handed out, not released), the request each belongs to, the last
    request that held each released one."""

    __slots__ = ("held", "owner", "last", "name", "page_size", "tracked")

    def __init__(self, name: str, page_size: int):
        self.held: set[int] = set()
        self.owner: dict[int, str] = {}
        self.last: dict[int, str] = {}
        self.name, self.page_size = name, page_size
        # the allocator's own hooks report to this book (a class the agent hooks): only then does "free in the
        # allocator's eyes" mean anything — a page table over an allocator the agent does not follow (a class of
        # a release it does not know) is judged for two holders only
        self.tracked = False


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.books: dict[int, _Book] = {}
        self.stats = {"handed": 0, "released": 0, "claimed": 0, "conflicts": 0, "suppressed": 0, "cleared": 0}

    def book(self, alloc) -> _Book:
        b = self.books.get(id(alloc))
        if b is None:
            b = self.books[id(alloc)] = _Book(type(alloc).__name__, int(getattr(alloc, "page_size", 1) or 1))
        return b

    # ------------------------------------------------------------------ allocator view
    def handed(self, alloc, pages, where: str) -> None:
        """The allocator (or something between it and the engine) handed these pages out."""
        out = []
        with self.lock:
            b = self.book(alloc)
            b.tracked = True
            for p in pages:
                if p == PADDING_PAGE:
                    continue
                if p in b.held:
                    out.append(("double_assign", p, b.owner.get(p), None))
                b.held.add(p)
                self.stats["handed"] += 1
        self._emit(b, out, where)

    def released(self, alloc, pages, where: str) -> None:
        out = []
        with self.lock:
            b = self.book(alloc)
            b.tracked = True
            for p in pages:
                if p == PADDING_PAGE:
                    continue
                if p not in b.held:
                    out.append(("double_free", p, b.last.get(p), None))
                    continue
                b.held.discard(p)
                who = b.owner.pop(p, None)
                if who is not None:
                    b.last[p] = who
                self.stats["released"] += 1
        self._emit(b, out, where)

    def cleared(self, alloc) -> None:
        with self.lock:
            self.books.pop(id(alloc), None)
            self.book(alloc).tracked = True
            self.stats["cleared"] += 1

    # ------------------------------------------------------------------ requests view (decode)
    def claimed(self, alloc, rid: str, pages, where: str) -> None:
        """``rid``'s page table now points at these pages (fresh ones: not a shared prefix)."""
        pages = list(pages)
        self.claimed_each(alloc, [rid] * len(pages), pages, where)

    def claimed_each(self, alloc, rids, pages, where: str) -> None:
        """Page ``pages[i]`` is now in request ``rids[i]``'s page table (a decode step: one slot a request)."""
        out = []
        with self.lock:
            b = self.book(alloc)
            for rid, p in zip(rids, pages):
                if p == PADDING_PAGE:
                    continue
                o = b.owner.get(p)
                if o is not None and o != rid:
                    out.append(("two_holders", p, o, rid))
                elif b.tracked and p not in b.held:
                    out.append(("unallocated", p, b.last.get(p), rid))
                b.owner[p] = rid
                self.stats["claimed"] += 1
        self._emit(b, out, where)

    # ------------------------------------------------------------------ events
    def _emit(self, b: _Book, found: list, where: str) -> None:
        """One event per kind of conflict and pair of holders in one engine call (a pre-allocation that
        aliases 390 pages is one event naming them), so the cap is reached by many bugs, not by one."""
        if not found:
            return
        groups: dict = {}
        for kind, page, holder, to in found:
            groups.setdefault((kind, holder, to), []).append(int(page))
        A = _ctl.AGENT
        for (kind, holder, to), pages in groups.items():
            with self.lock:
                self.stats["conflicts"] += len(pages)
                self.stats["events"] = self.stats.get("events", 0) + 1
                if self.stats["events"] > CONFLICTS_MAX:
                    self.stats["suppressed"] += len(pages)
                    continue
            A.emit("page_conflict", conflict=kind, page=pages[0], pages=pages[:PAGES_LISTED], n_pages=len(pages),
                   page_size=b.page_size, holder=holder, to=to, where=where, allocator=b.name)

    def summary(self) -> dict:
        with self.lock:
            return {**self.stats, "held": sum(len(b.held) for b in self.books.values())}


def ledger() -> Ledger:
    """This process's ledger (created on first use)."""
    A = _ctl.AGENT
    led = A.peek("ownership")
    return led if led is not None else A.state("ownership", Ledger)


def pages_of_slots(slots, page_size: int) -> list[int]:
    """The pages a tensor of token slots starts (``slot % page_size == 0``), in order: what a paged
    allocation hands out new (its other slots continue a page the request holds already)."""
    if page_size == 1:
        return [int(x) for x in slots.tolist()]
    return [int(x) for x in (slots[slots % page_size == 0] // page_size).tolist()]


def note(where: str, fn, *a) -> None:
    """Run a ledger call; evidence must never break the engine (a failure is a ``hook_error``)."""
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001 - evidence must never break the engine
        try:
            _ctl.AGENT.emit("hook_error", hook=f"ownership:{where}", error=repr(e))
        except Exception:  # noqa: BLE001
            pass
