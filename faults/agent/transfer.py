"""KV transfer (prefill → decode): chunk tracking, the transfer faults on every KV write path of the
Mooncake and NIXL managers, ``transfer_start`` / ``write_end`` evidence, where the ``early_free``
mutation fires in the Mooncake manager, and ``stall_status_read`` (a timing fault on the Mooncake
transfer worker's status re-read: ``_make_check_status``).

Units: SGLang hands every KV write path *page* indices (``kv_to_page_indices``: ``token // page_size``
of each page's first token, prefill.py ``send_kv_chunk`` and decode.py ``_send_kv_metadata``), so
``pages``, ``reserved``, ``pages_sent`` / ``pages_reserved`` and the ``short`` fault's ``pages``
param are KV pages of ``page_size`` tokens (the events carry ``page_size`` when the manager's
``kv_args`` has it). With page size 1 a page is a token slot.

Decode page indices: ``transfer_start`` carries ``dst_pages`` (the decode pages reserved for that chunk,
as ints, in the request's token order: the chunk's page j holds its tokens from
``(dst_page_offset + j) * page_size``), ``write_end`` the ``dst_pages`` actually written (after a
``short`` truncation) and the ``short`` firing the chunk's reserved ``dst_pages``; each list is bounded
to its first ``DST_PAGES_MAX`` entries, with ``dst_pages_total`` the full count and
``dst_page_offset`` the chunk's first page in the request's page list (``TransferKVChunk.index_slice``).
With them the stale pages a ``short`` leaves behind can be traced to the request that last wrote them
(``kvchaos.probe.measure.stale_map``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

from . import control as _ctl
from .control import _hook_class, _unwrap, _wrap, register_fault

# sglang.srt.disaggregation.base.conn.KVPoll (a plain int class in 0.5.23)
_KVPOLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def _fail_off(agent, f: dict):
    """SGLang reacts to one failed send by blacklisting the decode session (every later request to that
    decode fails until its probe loop clears it); heal undoes that for the sessions this fault failed,
    so the next test starts clean."""
    for ref, sess in f.pop("_sessions", []):
        mgr = ref()
        if mgr is not None and hasattr(mgr, "_unblacklist_session"):
            _unblacklist(mgr, sess)
            agent.emit("session_unblacklisted", fault=f["id"], session=str(sess))


def _unblacklist(mgr, sess) -> bool:
    """Take ``sess`` off the manager's blacklist under its ``session_lock`` (SGLang's
    ``_unblacklist_session`` expects the caller to hold it); whether it was on it."""
    with getattr(mgr, "session_lock", None) or contextlib.nullcontext():
        was = sess in getattr(mgr, "failed_sessions", ())
        mgr._unblacklist_session(sess)
    return was


def _unblacklist_soon(agent, f: dict, mgr, sess, after_s: float, bound_s: float = 5.0) -> None:
    """The ``fail`` fault's ``unblacklist_after_ms``: once SGLang has blacklisted the session the failed
    send came from (it does so as the send returns, ``mooncake/conn.py`` ``transfer_worker``:
    ``failed_sessions.add``), wait ``after_s`` and take it off again, in the engine (a heal sent from the
    harness arrives after its round trip, and on a loaded machine the blacklist failed every request
    sent to decode meanwhile). Bounded: gives up after ``bound_s`` if the session is never blacklisted."""
    def run():
        deadline = time.monotonic() + bound_s
        while sess not in getattr(mgr, "failed_sessions", ()) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(after_s)
        was = _unblacklist(mgr, sess)
        agent.emit("session_unblacklisted", fault=f["id"], session=str(sess), by="fault", was_blacklisted=was)

    threading.Thread(target=run, name="kvchaos-unblacklist", daemon=True).start()


def _fail_check(params: dict) -> None:
    ms = params.get("unblacklist_after_ms")
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms <= 60_000):
        raise ValueError(f"fail: unblacklist_after_ms must be a number of ms in 0..60000, got {ms!r}")


register_fault("delay", unlimited=True)
register_fault("fail", off=_fail_off, check=_fail_check)
register_fault("short")
register_fault("hold", held=True)
# The Mooncake managers' check_status is wrapped only while a stall_status_read is armed: the wrapper
# runs between the transfer worker's two reads of a room's status, so installed for good it widened
# the very race (sglang-mooncake-transfer-worker-dies) in every test that never asked for it.
_STATUS_READERS: list = []  # manager classes whose check_status the fault wraps (filled at import)


def _stall_on(agent, f: dict):
    if not _STATUS_READERS:
        raise ValueError("stall_status_read: no Mooncake KV manager loaded in this process "
                         "(prefill's scheduler loads it)")
    for cls in _STATUS_READERS:
        _wrap(cls, "check_status", _make_check_status)


def _stall_off(agent, f: dict):
    if any(g["kind"] == "stall_status_read" for g in agent.faults.values()):
        return  # another one is still armed
    if os.environ.get("KVCHAOS_AGENT_STATUS_HOOK") == "always":
        return
    for cls in _STATUS_READERS:
        _unwrap(cls, "check_status")


register_fault("stall_status_read", on=_stall_on, off=_stall_off)


DST_PAGES_MAX = 4096  # decode page indices listed per event (dst_pages_total has the full count)


def _dst_fields(pages, offset, upto: int | None = None) -> dict:
    """``dst_pages`` (the first ``upto`` of ``pages``, at most DST_PAGES_MAX of them, as ints),
    ``dst_pages_total`` (how many there are), ``dst_page_offset``."""
    try:
        if upto is not None:
            pages = pages[:upto]
        n = int(len(pages))
        head = pages[:DST_PAGES_MAX]
        head = head.tolist() if hasattr(head, "tolist") else list(head)
        listed = [int(p) for p in head]
    except Exception:  # noqa: BLE001 - evidence must never break a transfer
        return {"dst_pages": None, "dst_pages_total": None, "dst_page_offset": offset}
    return {"dst_pages": listed, "dst_pages_total": n, "dst_page_offset": offset}


def _chunk_offset(chunk):
    """First page of the chunk in the request's page list (``index_slice.start``), or None."""
    sl = getattr(chunk, "index_slice", None)
    start = getattr(sl, "start", None)
    try:
        return int(start) if start is not None else 0 if sl is not None else None
    except (TypeError, ValueError):
        return None


def _page_size(mgr):
    ps = getattr(getattr(mgr, "kv_args", None), "page_size", None)
    try:
        return int(ps) if ps is not None else None
    except (TypeError, ValueError):
        return None


# ================================================================== hooks
def _make_get(orig):
    """``FastQueue.get``: the transfer worker's dequeued chunk, kept for the writes it makes next."""
    def get(self):
        item = orig(self)
        if hasattr(item, "room") and hasattr(item, "index_slice"):
            _ctl.AGENT.tls.chunk = item
        return item
    return get


def _hook_common_utils(mod):
    _hook_class(mod, "FastQueue", {"get": _make_get})


def _guarded_write(mgr, backend: str, session_id, src, dst, write, path: str = "send_kvcache"):
    """One KV write of the chunk the transfer worker dequeued: evidence and the transfer faults.
    ``src`` / ``dst``: the prefill and decode page indices; ``write(src, dst)`` performs the real
    write (with ``short``: the first N pages of each)."""
    AGENT = _ctl.AGENT
    chunk = getattr(AGENT.tls, "chunk", None)
    room = getattr(chunk, "room", None)
    with AGENT.lock:
        rid = AGENT.room_rid.get(int(room)) if room is not None else None
        first = room is not None and room not in AGENT.started_rooms
        if first:
            AGENT.started_rooms.add(room)
    pages = int(len(src))
    reserved = int(len(dst))
    ps = _page_size(mgr)
    extra = {} if path == "send_kvcache" else {"path": path}
    off = _chunk_offset(chunk)
    chunk_dst = dst
    if path == "send_kvcache_dcp":
        # dst is the request's whole reservation, addressed by the chunk's page offset
        try:
            chunk_dst = dst[(off or 0):(off or 0) + pages]
        except Exception:  # noqa: BLE001
            chunk_dst = ()
    if first:
        AGENT.emit("transfer_start", room=room, rid=rid, pages=pages, reserved=reserved,
                   is_last=getattr(chunk, "is_last_chunk", None), backend=backend, page_size=ps,
                   **_dst_fields(chunk_dst, off), **extra)
    f = AGENT.match("delay", room, rid)
    if f is not None:
        p = f["params"]
        ms = float(p.get("ms", 100)) + f["_rng"].uniform(-1, 1) * float(p.get("jitter_ms", 0))
        AGENT.emit("fault_fired", fault=f["id"], kind="delay", room=room, rid=rid, ms=round(ms, 2),
                   pages=pages)
        time.sleep(max(ms, 0) / 1000.0)
    f = AGENT.match("fail", room, rid)
    if f is not None:
        # heal un-blacklists the sessions this fault failed (_fail_off)
        f.setdefault("_sessions", []).append((weakref.ref(mgr), session_id))
        AGENT.emit("fault_fired", fault=f["id"], kind="fail", room=room, rid=rid, pages=pages,
                   ret=-1, session=str(session_id), note="no byte written; transfer reported failed")
        after_ms = f["params"].get("unblacklist_after_ms")
        if after_ms is not None and backend != "nixl" and hasattr(mgr, "_unblacklist_session"):
            _unblacklist_soon(AGENT, f, mgr, session_id, max(0.0, float(after_ms)) / 1000.0)
        if backend == "nixl":  # NIXL returns transfer handles, not a status: fail by raising
            raise RuntimeError("kvchaos injected KV transfer failure")
        return -1
    f = AGENT.match("short", room, rid)
    if f is not None:
        keep = max(0, min(pages, int(f["params"].get("pages", 1))))
        src = src[:keep]
        dst = dst[:keep]
        AGENT.emit("fault_fired", fault=f["id"], kind="short", room=room, rid=rid, pages_sent=keep,
                   pages_reserved=reserved, page_size=ps, **_dst_fields(chunk_dst, off), **extra,
                   note="success reported; remaining decode pages unwritten")
    f = AGENT.match("hold", room, rid)
    if f is not None:
        ev = AGENT.holds.get(f["id"])
        limit = float(f["params"].get("max_hold_s", 60))
        AGENT.emit("fault_fired", fault=f["id"], kind="hold", phase="held", room=room, rid=rid,
                   pages=pages)
        released = ev.wait(limit) if ev is not None else True
        try:
            if room in mgr.request_status:
                st = mgr.check_status(room)
                status = getattr(st, "name", None) or _KVPOLL.get(int(st), str(st))
            else:
                status = "gone"
        except Exception as e:  # noqa: BLE001
            status = f"unknown: {e}"
        w0 = time.time()
        ret = write(src, dst)
        AGENT.emit("fault_fired", fault=f["id"], kind="hold", phase="late_write", room=room, rid=rid,
                   pages=pages, released=released, room_status_at_write=status,
                   ret=ret if isinstance(ret, int) else "handles")
        _write_end(room, rid, pages, w0, ret, ps, extra, _dst_fields(chunk_dst, off, len(src)))
        return ret
    w0 = time.time()
    ret = write(src, dst)
    _write_end(room, rid, pages, w0, ret, ps, extra, _dst_fields(chunk_dst, off, len(src)))
    return ret


def _make_send(orig, backend: str):
    """Wrap ``<Backend>KVManager.send_kvcache(self, session/peer, prefill_kv_indices, dst_kv_ptrs,
    dst_kv_indices, ...)`` — the same leading arguments in the Mooncake and NIXL managers (and in
    Mooncake's ``send_kvcache_slice``, the heterogeneous-TP MHA path)."""
    path = getattr(orig, "__name__", "send_kvcache")

    def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **k):
        def write(src, dst):
            kk = k
            if len(src) < len(prefill_kv_indices) and k.get("dst_device_kv_indices") is not None:
                # HiSparse: a second destination index list pairs page by page with the source
                kk = {**k, "dst_device_kv_indices": k["dst_device_kv_indices"][:len(src)]}
            return orig(self, session_id, src, dst_kv_ptrs, dst, *a, **kk)
        return _guarded_write(self, backend, session_id, prefill_kv_indices, dst_kv_indices, write, path)
    return send_kvcache


def _make_send_dcp(orig, backend: str):
    """Wrap Mooncake's ``send_kvcache_dcp(self, session, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices,
    *, num_kv_tokens, ...)`` — the MLA-only write path when decode runs decode-context-parallel
    (``requires_dcp_relayout``: prefill dcp 1, decode dcp > 1, MLA). ``dst_kv_indices`` is then the
    request's whole decode reservation, addressed through ``src_page_offset``, so ``short`` cuts the
    source pages and ``num_kv_tokens`` and leaves the destination list whole."""
    def send_kvcache_dcp(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **k):
        def write(src, _dst):
            kk = k
            if len(src) < len(prefill_kv_indices) and k.get("num_kv_tokens") is not None:
                kk = {**k, "num_kv_tokens": min(int(k["num_kv_tokens"]), len(src) * (_page_size(self) or 1))}
            return orig(self, session_id, src, dst_kv_ptrs, dst_kv_indices, *a, **kk)
        return _guarded_write(self, backend, session_id, prefill_kv_indices, dst_kv_indices, write,
                              "send_kvcache_dcp")
    return send_kvcache_dcp


def _make_send_peer(orig, backend: str):
    """Wrap NIXL's ``send_kvcache_mixed`` / ``send_kvcache_slice(self, peer, prefill_kv_indices,
    dst_kv_indices)`` (no pointer list: the peer's prepared transfer handles hold it)."""
    path = getattr(orig, "__name__", "send_kvcache")

    def send(self, peer_name, prefill_kv_indices, dst_kv_indices, *a, **k):
        return _guarded_write(self, backend, peer_name, prefill_kv_indices, dst_kv_indices,
                              lambda src, dst: orig(self, peer_name, src, dst, *a, **k), path)
    return send


def _write_end(room, rid, pages, wall_start, ret, page_size=None, extra=None, dst=None):
    """Every KV write prefill made into decode's pages, with its time span: the ``kv_lifecycle``
    oracle pairs it with decode's ``kv_released`` for the same room (a write that ends after decode
    gave the pages back landed in pages that may already belong to someone else). ``pages`` are KV
    pages of ``page_size`` tokens; ``dst`` the decode pages written (``_dst_fields``). NIXL: the write
    was posted, not completed (it returns handles the transfer worker waits on later)."""
    if room is not None:
        _ctl.AGENT.emit("write_end", room=room, rid=rid, pages=pages, wall_start=wall_start,
                        ret=ret if isinstance(ret, int) else "handles", page_size=page_size,
                        **(dst or {}), **(extra or {}))


def _make_check_status(orig):
    """Wrap ``check_status(self, room)`` (``CommonKVManager``: ``return self.request_status[room]``).
    ``stall_status_read`` acts only where the transfer worker re-reads the status of the room of the
    chunk it is handling and that room has concluded (Success) — the teardown check at the end of
    ``transfer_worker``, which first asks ``room not in self.request_status`` and then reads it while
    the scheduler thread may ``clear()`` the room (prefill.py, after it polled Success). The read is
    stalled ``ms`` and then made by SGLang's own code: timing only, nothing else changes. Installed
    only while a ``stall_status_read`` is armed (``_stall_on`` / ``_stall_off``)."""
    def check_status(self, bootstrap_room):
        AGENT = _ctl.AGENT
        chunk = getattr(AGENT.tls, "chunk", None)
        if chunk is None or getattr(chunk, "room", None) != bootstrap_room:
            return orig(self, bootstrap_room)  # the scheduler's polls, or another room's
        st = orig(self, bootstrap_room)
        try:
            concluded = int(st) == 4  # KVPoll.Success
        except (TypeError, ValueError):
            concluded = False
        if not concluded:
            return st
        with AGENT.lock:
            rid = AGENT.room_rid.get(int(bootstrap_room))
        f = AGENT.match("stall_status_read", bootstrap_room, rid)
        if f is None:
            return st
        ms = float(f["params"].get("ms", 300))
        time.sleep(max(ms, 0) / 1000.0)
        cleared = bootstrap_room not in self.request_status
        AGENT.emit("fault_fired", fault=f["id"], kind="stall_status_read", room=bootstrap_room, rid=rid, ms=ms,
                   cleared_during_stall=cleared,
                   note="the transfer worker's read of a concluded room's status, stalled; SGLang reads it now")
        return orig(self, bootstrap_room)
    return check_status


def _make_legacy(orig):
    """``MooncakeKVManager._handle_legacy_abort_notification``: where ``early_free`` fires in the manager."""
    def _handle_legacy_abort_notification(self, notification, room_active):
        on = _ctl.AGENT.switched_on("early_free", fire=True)
        if on is not None:
            _ctl.AGENT.emit("fault_fired", fault=on["id"], kind="early_free",
                            room=getattr(notification, "room", None), room_active=room_active,
                            note="decode released pages without waiting for the drain ack")
        return orig(self, notification, room_active)
    return _handle_legacy_abort_notification


def _hook_mooncake(mod):
    optional = {
        "send_kvcache_dcp": lambda orig: _make_send_dcp(orig, "mooncake"),  # MLA with decode context parallel
        "send_kvcache_slice": lambda orig: _make_send(orig, "mooncake"),  # MHA/GQA, prefill attn TP != decode's
        "_handle_legacy_abort_notification": _make_legacy,
    }
    cls = _hook_class(mod, "MooncakeKVManager", {"send_kvcache": lambda orig: _make_send(orig, "mooncake")},
                      optional, track=True)
    if cls is not None and hasattr(cls, "check_status") and cls not in _STATUS_READERS:
        _STATUS_READERS.append(cls)  # wrapped while a stall_status_read is armed (_stall_on)
        if os.environ.get("KVCHAOS_AGENT_STATUS_HOOK") == "always":
            # kvchaos before 2026-12-04 (wrapped at import, armed or not): the "before" arm of the
            # worker-death rate measurement (reports/findings/sglang-mooncake-transfer-worker-dies)
            _wrap(cls, "check_status", _make_check_status)


def _hook_nixl(mod):
    """NIXL backend: same transfer faults on ``NixlKVManager.send_kvcache`` and, where present, the
    mixed-memory and heterogeneous-TP paths (not exercised on CPU machines)."""
    mgr = getattr(mod, "NixlKVManager", None)
    if mgr is None or not hasattr(mgr, "send_kvcache"):
        return
    _wrap(mgr, "send_kvcache", lambda orig: _make_send(orig, "nixl"))
    for name in ("send_kvcache_mixed", "send_kvcache_slice"):
        if hasattr(mgr, name):
            _wrap(mgr, name, lambda orig: _make_send_peer(orig, "nixl"))


HOOKS = {
    "sglang.srt.disaggregation.common.utils": _hook_common_utils,
    "sglang.srt.disaggregation.mooncake.conn": _hook_mooncake,
    "sglang.srt.disaggregation.nixl.conn": _hook_nixl,
}
