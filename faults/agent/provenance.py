"""Decode-side KV page provenance: which request last HELD each decode KV page, so the data in a page
a request reads but its transfer never wrote can be attributed — to another request's prompt KV
(written by prefill), to another request's generated tokens (written by decode's own forward), or to
a request of an earlier experiment on the same engine.

Decode role only (``control.ROLE == "decode"``); prefill and single servers pass straight through.

State: one map per decode process, page id -> rid of the last request that held the page (set when a
request is given the page, never cleared when it is freed: a freed page keeps its last holder's
bytes until the next writer). Keyed by page id, so it never holds more entries than the pool has
pages (a hard cap of ``HOLDERS_MAX`` clears it if something feeds it foreign ids; ``resets`` in the
stats counts that). Its own lock (never ``AGENT.lock`` on the per-step path).

Evidence:

* ``kv_prealloc`` (one per ``DecodePreallocQueue._pre_alloc``): ``rid``, ``room``
  (``req.bootstrap_room``), ``page_size``, ``fill_len``, ``total_prefix_len``, ``dst_pages`` (the
  request's pages for its tokens ``[total_prefix_len, fill_len)`` in request order, first
  ``DST_PAGES_MAX`` of them, ints), ``dst_pages_total`` (their count), ``prev_holders``: run-length
  list ``[[first_index, count, rid_or_null], ...]`` over that page list (index = position in the
  request's page list, the same index space as ``write_end.dst_page_offset``; null = no holder
  since the agent started in this process; at most ``RUNS_MAX`` runs, ``prev_holders_truncated``
  says when cut), and ``step_stats`` (the decode-step hook's own cost so far: ``steps``,
  ``hook_s``, ``orig_s``, ``skipped`` per reason, ``resets``). A retracted request resumed into new
  pages (``resume_retracted_reqs``) gets one too (same room; its KV comes back from the host copy,
  not from prefill). ``canaries``, where its input text holds any: the kvchaos canaries in
  the request's input text (``req.origin_input_text``, else its ``origin_input_ids`` decoded by the
  scheduler's tokenizer; at most ``CANARIES_MAX``), which name the request a page's holder was when
  its id is the engine's own: an OpenAI-route request through sglang-router reaches decode under a
  uuid of decode's, not the client's rid, and only its text says which request it was.
* ``provenance_skipped`` (once per reason per process): a path the map does not follow (HiSparse,
  speculative decoding, beam rows, a row count that does not match the batch).
* ``hook_error`` (``hook``: ``_pre_alloc`` / ``prepare_for_decode``; at most ``ERRORS_MAX`` per
  hook, then counted silently): the evidence failed; the engine's call returned its own result.

Decode steps update the map silently (one ``.tolist()`` and a dict update per step, no event).

Page ids: with page size 1 a page id is the token slot; with page size P > 1 it is
``slot // P`` — SGLang's ``kv_to_page_indices`` (``token[::P] // P``: the page of each page's first
token), so ``dst_pages`` here and prefill's ``transfer_start`` / ``write_end`` ``dst_pages`` for the
same room are the same ids in the same order (prefill's chunk ``j`` page = this list's index
``dst_page_offset + j``).

SGLang lines relied on (read in the installed sources):

sglang 0.5.23 (``srt/``):

* ``disaggregation/decode.py:2237`` ``DecodePreallocQueue._pre_alloc(self, req, prefix_indices=None,
  prefix_len=None, total_prefix_len=None)``; ``:2252-2255`` ``prefix_len`` None -> 0,
  ``total_prefix_len`` None -> ``prefix_len`` (mirrored here from the call's arguments);
  ``:2263`` ``fill_len = self._pre_alloc_fill_len(req)`` (``:947``, a staticmethod of the request's
  lengths, which ``_pre_alloc`` does not change: re-asked here after the call);
  ``:2371-2377`` ``req_to_token_pool.write((req.kv.req_pool_idx, slice(total_prefix_len,
  total_prefix_len + len(kv_loc))), kv_loc)`` — the slots read back here.
* its callers: ``pop_preallocated`` ``:1611`` (then ``:1640-1642`` ``raw_kv_indices =
  req_to_token[req_pool_idx][total_prefix_len:origin_input_len]``, ``:1654-1658``
  ``translate_kv_indices_for_transfer`` (identity on the static pools, ``mem_cache/allocator/base.py:235``),
  ``_send_kv_metadata`` ``:1851`` -> ``_transfer_page_indices`` ``:2231-2235`` ->
  ``kv_to_page_indices(kv_indices, page_size)``: what prefill receives as ``dst_kv_indices``;
  ``origin_input_len`` (``:1496``, ``_rebootstrap_prefill_len``) equals ``fill_len`` for every request
  that is transferred); ``resume_retracted_reqs`` ``:1071`` and the host-staging path ``:1990``
  (``self._pre_alloc(req)``, no prefix).
* ``disaggregation/decode.py`` HiSparse (``self.scheduler.enable_hisparse``): the transfer goes to
  host indices, not these pages — skipped.
* ``mem_cache/common.py:47-48`` ``kv_to_page_indices``: ``(kv_indices[::page_size] // page_size)``.
* ``mem_cache/allocator/paged.py`` ``PagedTokenToKVPoolAllocator``: slots are ``page * P + offset``
  (``alloc_extend`` for the pre-allocation, ``alloc_decode`` one slot per request per step); page
  size 1: ``mem_cache/allocator/token.py`` ``TokenToKVPoolAllocator.alloc`` hands out slots.
* ``managers/schedule_batch.py:3736`` ``ScheduleBatch.prepare_for_decode(self)``: ``:3754-3762``
  speculative decoding returns early (skipped here); ``:3766-3767`` ``strip_beam_tail`` /
  ``append_beam_tail`` (beam rows: ``self.beam_tail`` set — skipped); ``:3780``
  ``self.out_cache_loc = alloc_for_decode(self, token_per_req=1)`` — one new slot per row, rows in
  ``self.reqs`` order (``mem_cache/allocation.py:729``); ``:3793`` HiSparse maps them to buffer
  locations (``self.hisparse_coordinator`` set — skipped). ``self.token_to_kv_pool_allocator``
  (``:2465``) gives the page size.

sglang 0.5.19 (``srt/``): the same functions and lines of the same shape —
``disaggregation/decode.py:1755`` ``_pre_alloc`` (same signature), ``:1781`` ``fill_len =
self._pre_alloc_fill_len(req)`` (``:740``), ``:1869-1875`` the ``req_to_token_pool.write``; callers
``:838`` (resume) and ``:1332`` (``pop_preallocated``), ``:1374-1381`` the slice and translate,
``:1479`` ``kv_to_page_indices(kv_indices, kv_transfer_page_size)`` inline (no
``_transfer_page_indices``); ``mem_cache/common.py:42-43`` ``kv_to_page_indices``;
``managers/schedule_batch.py:3286`` ``prepare_for_decode``, ``:3296`` speculative return, ``:3309``
``append_beam_tail``, ``:3322`` ``out_cache_loc = alloc_for_decode(...)`` (``mem_cache/allocation.py:521``),
``:3335`` HiSparse. No difference the hooks depend on.
"""

from __future__ import annotations

import threading
import time

from kvchaos.canary import PATTERN as _CANARY

from . import control as _ctl
from . import ownership
from .control import _wrap
from .transfer import DST_PAGES_MAX

RUNS_MAX = 4096  # prev_holders runs listed per event
HOLDERS_MAX = 1 << 22  # pages remembered (a pool never has this many; a guard, not a working bound)
ERRORS_MAX = 20  # hook_error events per hook per process
CANARIES_MAX = 64  # canaries of a request's input text listed in its kv_prealloc


class Holders:
    """page id -> rid of its last holder, and the decode-step hook's own accounting."""

    def __init__(self):
        self.lock = threading.Lock()
        self.page: dict[int, str] = {}
        self.resets = 0
        self.steps = 0
        self.hook_s = 0.0
        self.orig_s = 0.0
        self.skipped: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def stats(self) -> dict:
        return {"steps": self.steps, "hook_s": round(self.hook_s, 6), "orig_s": round(self.orig_s, 6),
                "skipped": dict(self.skipped), "resets": self.resets, "pages_known": len(self.page)}


def holders() -> Holders:
    """This process's map (created on first use)."""
    A = _ctl.AGENT
    h = A.peek("provenance")
    return h if h is not None else A.state("provenance", Holders)


def _error(h: Holders, hook: str, e: BaseException) -> None:
    n = h.errors.get(hook, 0) + 1
    h.errors[hook] = n
    if n <= ERRORS_MAX:
        _ctl.AGENT.emit("hook_error", hook=hook, error=repr(e), n=n)


def _skip(h: Holders, reason: str) -> None:
    n = h.skipped.get(reason, 0)
    h.skipped[reason] = n + 1
    if n == 0:
        _ctl.AGENT.emit("provenance_skipped", reason=reason,
                        note="decode page holders are not followed on this path")


def _runs(prev: list) -> list:
    """Run-length ``[[first_index, count, value], ...]`` of a list."""
    out: list = []
    for i, v in enumerate(prev):
        if out and out[-1][2] == v:
            out[-1][1] += 1
        else:
            out.append([i, 1, v])
    return out


def _translate(alloc, idx):
    tr = getattr(alloc, "translate_kv_indices_for_transfer", None)
    return tr(idx) if tr is not None else idx


def _pages_of(queue, req, total_prefix_len: int, fill_len: int, ps: int) -> list[int]:
    """The request's decode pages for tokens ``[total_prefix_len, fill_len)``, as decode sends them to
    prefill (``kv_to_page_indices(translate(req_to_token[idx][total:len]), page_size)``)."""
    row = queue.req_to_token_pool.req_to_token[req.kv.req_pool_idx, total_prefix_len:fill_len]
    row = _translate(queue.token_to_kv_pool_allocator, row)
    if ps == 1:
        return [int(x) for x in row.tolist()]
    return [int(x) for x in (row[::ps] // ps).tolist()]


def _input_text(queue, req) -> str:
    """The request's prompt as text: ``origin_input_text``, else its ``origin_input_ids`` decoded by the
    scheduler's own tokenizer (an OpenAI chat request reaches the scheduler as token ids: SGLang's
    serving_chat renders the template to ids); empty when neither is there."""
    text = getattr(req, "origin_input_text", None)
    if isinstance(text, str):
        return text
    tok = getattr(getattr(queue, "scheduler", None), "tokenizer", None)
    ids = getattr(req, "origin_input_ids", None)
    if tok is None or ids is None or not len(ids):
        return ""
    out = tok.decode(list(ids))
    return out if isinstance(out, str) else ""


def _note_prealloc(queue, req, a, k) -> None:
    h = holders()
    if getattr(getattr(queue, "scheduler", None), "enable_hisparse", False):
        _skip(h, "hisparse")
        return
    # _pre_alloc(self, req, prefix_indices=None, prefix_len=None, total_prefix_len=None)
    prefix_len = k["prefix_len"] if "prefix_len" in k else (a[1] if len(a) > 1 else None)
    total = k["total_prefix_len"] if "total_prefix_len" in k else (a[2] if len(a) > 2 else None)
    if prefix_len is None:
        prefix_len = 0
    if total is None:
        total = prefix_len
    total = int(total)
    fl = getattr(queue, "_pre_alloc_fill_len", None)
    fill_len = int(fl(req)) if fl is not None else int(req.kv.kv_committed_len)
    ps = int(queue.token_to_kv_pool_allocator.page_size)
    pages = _pages_of(queue, req, total, fill_len, ps)
    rid = req.rid
    # the pages decode gave the request, beyond a prefix it shares by design: its own now (ownership ledger)
    led = ownership.ledger()
    ownership.note("_pre_alloc", led.claimed, queue.token_to_kv_pool_allocator, rid, pages, "_pre_alloc")
    with h.lock:
        m = h.page
        if len(m) + len(pages) > HOLDERS_MAX:
            m.clear()
            h.resets += 1
        prev = []
        for p in pages:
            prev.append(m.get(p))
            m[p] = rid
    runs = _runs(prev)
    extra = {"prev_holders_truncated": True} if len(runs) > RUNS_MAX else {}
    carried = sorted({m.group() for m in _CANARY.finditer(_input_text(queue, req))})
    if carried:
        extra["canaries"] = carried[:CANARIES_MAX]
    _ctl.AGENT.emit("kv_prealloc", rid=rid, room=getattr(req, "bootstrap_room", None), page_size=ps,
                    fill_len=fill_len, total_prefix_len=total, dst_pages=pages[:DST_PAGES_MAX],
                    dst_pages_total=len(pages), prev_holders=runs[:RUNS_MAX], **extra, step_stats=h.stats(),
                    ledger=led.summary())


def _make_pre_alloc(orig):
    def _pre_alloc(self, req, *a, **k):
        out = orig(self, req, *a, **k)
        if _ctl.ROLE != "decode":
            return out
        try:
            _note_prealloc(self, req, a, k)
        except Exception as e:  # noqa: BLE001 - evidence must never break the engine
            try:
                _error(holders(), "_pre_alloc", e)
            except Exception:  # noqa: BLE001
                pass
        return out
    return _pre_alloc


def _note_step(batch, h: Holders) -> None:
    spec = getattr(batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        _skip(h, "speculative")
        return
    if getattr(batch, "beam_tail", None) is not None:
        _skip(h, "beam")
        return
    if getattr(batch, "hisparse_coordinator", None) is not None:
        _skip(h, "hisparse")
        return
    loc, reqs = batch.out_cache_loc, batch.reqs
    if loc is None or not reqs:
        return
    alloc = batch.token_to_kv_pool_allocator
    slots = _translate(alloc, loc).tolist()
    if len(slots) != len(reqs):
        _skip(h, "rows")
        return
    ps = alloc.page_size
    pages = slots if ps == 1 else [s // ps for s in slots]
    rids = [r.rid for r in reqs]
    ownership.note("prepare_for_decode", ownership.ledger().claimed_each, alloc, rids, pages, "prepare_for_decode")
    with h.lock:
        h.page.update(zip(pages, rids))
        if len(h.page) > HOLDERS_MAX:
            h.page.clear()
            h.resets += 1


def _make_prepare_for_decode(orig):
    def prepare_for_decode(self, *a, **k):
        if _ctl.ROLE != "decode":
            return orig(self, *a, **k)
        t0 = time.perf_counter()
        out = orig(self, *a, **k)
        t1 = time.perf_counter()
        h = None
        try:
            h = holders()
            _note_step(self, h)
        except Exception as e:  # noqa: BLE001 - evidence must never break the engine
            try:
                _error(h or holders(), "prepare_for_decode", e)
            except Exception:  # noqa: BLE001
                pass
        if h is not None:
            h.steps += 1
            h.orig_s += t1 - t0
            h.hook_s += time.perf_counter() - t1
        return out
    return prepare_for_decode


# ================================================================== hooks
def _hook_prealloc(mod):
    q = getattr(mod, "DecodePreallocQueue", None)
    if q is not None and hasattr(q, "_pre_alloc"):
        _wrap(q, "_pre_alloc", _make_pre_alloc)


def _hook_decode_step(mod):
    b = getattr(mod, "ScheduleBatch", None)
    if b is not None and hasattr(b, "prepare_for_decode"):
        _wrap(b, "prepare_for_decode", _make_prepare_for_decode)


HOOKS = {
    "sglang.srt.disaggregation.decode": _hook_prealloc,
    "sglang.srt.managers.schedule_batch": _hook_decode_step,
}
