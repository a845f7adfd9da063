"""Scheduler side of PD disaggregation: prefill's bootstrap queue (room ↔ rid), the intake reject
path (``reject_admitted``: ``is_unadmitted_reject`` / ``is_aborted``), decode's transfer queue
(``kv_released`` evidence, where ``early_free`` fires; ``deferred_hold`` / ``deferred_release`` with
SGLang's drained-or-timeout outcome), ``Scheduler`` tracking, ``park`` (a request held at a queue
stage: decode pre-allocation, prefill's waiting queue, decode's waiting queue), the switches of the
``reject_admitted`` / ``input_limit`` / ``early_free`` mutations, and the ``deferred_release_timeout``
setting (decode's drain-ack timeout on the live queues)."""

from __future__ import annotations

from . import control as _ctl
from ..wire import PARK_STAGES
from .control import _hook_class, _restore_attrs, _switch_attrs, _wrap, _wrap_function, register_fault


# ---------------------------------------------------------------- mutation switches
def _reject_on(agent, f: dict):
    lim = f["params"].get("prefill_max_input_len", f["params"].get("max_input_len"))
    if lim is not None and _ctl.ROLE == "prefill":
        saved = []
        _switch_attrs(saved, agent.live("Scheduler"), max_req_input_len=int(lim))
        f["_saved"] = saved
        # its own kind: the input_limit setting shares this switch, and must not read as the planted bug
        agent.emit("mutation_on", fault=f["id"], kind=f.get("kind", "reject_admitted"), prefill_max_input_len=lim,
                   schedulers=len(saved))


def _reject_off(agent, f: dict):
    _restore_attrs(agent, f)


def _reject_admitted_off(agent, f: dict):
    _reject_off(agent, f)
    for rid in [r for r, fid in agent.admitted.items() if fid == f["id"]]:
        agent.admitted.pop(rid)
        agent.admitted_seen.discard(rid)


def _early_on(agent, f: dict):
    saved = []
    _switch_attrs(saved, agent.live("DecodeTransferQueue"), enable_deferred_kv_release=False)
    managers = [m for m in agent.live("MooncakeKVManager") if hasattr(m, "enable_deferred_decode_kv_release")]
    _switch_attrs(saved, managers, enable_deferred_decode_kv_release=False)
    f["_saved"] = saved
    agent.emit("mutation_on", fault=f["id"], kind="early_free", switched=len(saved))


def _early_off(agent, f: dict):
    _restore_attrs(agent, f)


def _timeout_on(agent, f: dict):
    """A setting, not a planted bug: what ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``
    sets (decode reads it once, into each ``DecodeTransferQueue``), changed on the live queues so a
    test need not restart decode; heal (``_restore_attrs``) puts the old value back."""
    s = float(f["params"].get("s", 3.0))
    if s <= 0:
        raise ValueError(f"deferred_release_timeout: s must be > 0, got {s}")
    saved = []
    queues = [q for q in agent.live("DecodeTransferQueue") if hasattr(q, "deferred_kv_release_timeout")]
    _switch_attrs(saved, queues, deferred_kv_release_timeout=s)
    f["_saved"] = saved
    agent.emit("mutation_on", fault=f["id"], kind="deferred_release_timeout", s=s, queues=len(saved),
               was=[v for _q, _attr, v in saved])


# ---------------------------------------------------------------- park: a request held at a queue stage
# PARK_STAGES (stage -> role, hook, what it holds): faults.wire, shared with the harness


def _park_check(params: dict) -> None:
    if params.get("stage") not in PARK_STAGES:
        raise ValueError(f"park: params.stage must be one of {tuple(PARK_STAGES)}, got {params.get('stage')!r}")


def _finished(req) -> bool:
    return getattr(req, "finished_reason", None) is not None or getattr(req, "to_finish", None) is not None


def _park_active(A) -> bool:
    """A ``park`` fault is armed or a request is still held: only then do the scheduler hooks look at
    their queues (they run every scheduler iteration)."""
    return A is not None and (bool(A.state("parked", dict)) or any(f["kind"] == "park" for f in list(A.faults.values())))


def _parked(req, stage: str) -> bool:
    """Whether ``req`` is held at ``stage`` now. The first time a ``park`` fault of that stage matches
    it: ``fault_fired`` phase ``held``; it is let go once the harness releases it, the fault is healed,
    or the request has finished (an abort reached it): phase ``released``. Never blocks: the
    scheduler keeps running (and ingesting aborts) while the request waits."""
    A = _ctl.AGENT
    if not _park_active(A):
        return False
    rid, room = getattr(req, "rid", None), getattr(req, "bootstrap_room", None)
    table = A.state("parked", dict)
    fid = table.get(rid)
    if fid is None:
        f = A.match("park", room, rid, where=lambda f: f["params"].get("stage") == stage)
        if f is None:
            return False
        fid = table[rid] = f["id"]
        A.emit("fault_fired", fault=fid, kind="park", stage=stage, rid=rid, room=room, phase="held")
    ev = A.holds.get(fid)
    if ev is None or ev.is_set() or _finished(req):
        table.pop(rid, None)
        A.emit("fault_fired", fault=fid, kind="park", stage=stage, rid=rid, room=room, phase="released",
               finished=_finished(req), healed=ev is None)
        return False
    return True


def _hide_parked(queue_attr: str, stage: str):
    """A wrapper maker: the method runs with the requests parked at ``stage`` taken out of
    ``self.<queue_attr>`` (so it cannot schedule them), put back in front afterwards (the method
    may have replaced the list)."""
    def make(orig):
        def wrapper(self, *a, **k):
            if _ctl.ROLE != PARK_STAGES[stage][0] or not _park_active(_ctl.AGENT):
                return orig(self, *a, **k)
            q = getattr(self, queue_attr)
            held = [r for r in q if _parked(r, stage)]
            if not held:
                return orig(self, *a, **k)
            ids = {id(r) for r in held}
            setattr(self, queue_attr, [r for r in q if id(r) not in ids])
            try:
                return orig(self, *a, **k)
            finally:
                setattr(self, queue_attr, held + getattr(self, queue_attr))
        return wrapper
    return make


def _make_handshake(orig):
    """``DecodePreallocQueue._update_handshake_waiters``: a parked request stays not ready for
    pre-allocation (``waiting_for_input`` False) after the handshake, so decode neither allocates
    its pages nor sends prefill the metadata; the poll sets it True again on the next pass."""
    def _update_handshake_waiters(self, *a, **k):
        out = orig(self, *a, **k)
        if _park_active(_ctl.AGENT):
            for dr in list(getattr(self, "queue", ())):
                if getattr(dr, "waiting_for_input", False) and _parked(dr.req, "decode_prealloc"):
                    dr.waiting_for_input = False
        return out
    return _update_handshake_waiters


def _chunked_check(params: dict) -> None:
    size = params.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"chunked_prefill: params.size must be a positive int (tokens per chunk), got {size!r}")


def _chunked_on(agent, f: dict):
    """A setting, not a planted bug: what ``--chunked-prefill-size`` sets, on the live prefill
    schedulers (read each time a prefill batch is built); heal (``_restore_attrs``) puts the old value
    back. The size must be a multiple of the KV page size (SGLang sends KV per chunk, page-aligned)."""
    size = int(f["params"]["size"])
    saved = []
    if _ctl.ROLE == "prefill":
        schedulers = agent.live("Scheduler")
        for s in schedulers:
            page = int(getattr(s, "page_size", 1) or 1)
            if size % page:
                raise ValueError(f"chunked_prefill: size {size} is not a multiple of the page size {page}")
        _switch_attrs(saved, schedulers, chunked_prefill_size=size)
    f["_saved"] = saved
    agent.emit("mutation_on", fault=f["id"], kind="chunked_prefill", size=size, schedulers=len(saved),
               was=[v for _s, _attr, v in saved])


register_fault("park", check=_park_check, held=True)
register_fault("chunked_prefill", mutation=True, on=_chunked_on, off=_restore_attrs, check=_chunked_check)
register_fault("reject_admitted", mutation=True, on=_reject_on, off=_reject_admitted_off)
register_fault("deferred_release_timeout", mutation=True, on=_timeout_on, off=_restore_attrs)
register_fault("early_free", mutation=True, on=_early_on, off=_early_off)
register_fault("input_limit", mutation=True, on=_reject_on, off=_reject_admitted_off)


# ================================================================== hooks
def _make_add(orig):
    """``PrefillBootstrapQueue.add``: room -> rid, and ``bootstrap_queued``."""
    def add(self, req, *a, **k):
        room = getattr(req, "bootstrap_room", None)
        if room is not None:
            AGENT = _ctl.AGENT
            with AGENT.lock:
                AGENT.room_rid[int(room)] = req.rid
                if len(AGENT.room_rid) > 100000:
                    for r in list(AGENT.room_rid)[:50000]:
                        AGENT.room_rid.pop(r, None)
            # one per attempt: a request a load balancer re-sends comes back under a new room
            AGENT.emit("bootstrap_queued", rid=req.rid, room=room)
        return orig(self, req, *a, **k)
    return add


def _hook_prefill(mod):
    _hook_class(mod, "PrefillBootstrapQueue", {"add": _make_add})
    _hook_reject(mod)


def _make_unadmitted_reject(orig):
    """``is_unadmitted_reject``: a request it rejects is admitted to the disaggregation queue (the
    pre-#36988 path) where a ``reject_admitted`` fault targets it."""
    def is_unadmitted_reject(req):
        verdict = orig(req)
        if verdict:
            AGENT = _ctl.AGENT
            f = AGENT.match("reject_admitted", getattr(req, "bootstrap_room", None), getattr(req, "rid", None))
            if f is not None:
                with AGENT.lock:
                    AGENT.admitted[req.rid] = f["id"]
                AGENT.emit("fault_fired", fault=f["id"], kind="reject_admitted", rid=req.rid,
                           room=getattr(req, "bootstrap_room", None),
                           input_len=len(req.origin_input_ids),
                           to_finish=str(getattr(req, "to_finish", None))[:200],
                           note="rejected request admitted to the disaggregation queue (pre-#36988 path)")
                return False
        return verdict
    return is_unadmitted_reject


def _hook_reject(mod):
    _hook_is_aborted(mod)
    _wrap_function(mod, "is_unadmitted_reject", _make_unadmitted_reject)


def _make_is_aborted(orig):
    def is_aborted(req):
        verdict = orig(req)
        AGENT = _ctl.AGENT
        if verdict and AGENT.admitted and getattr(req, "rid", None) in AGENT.admitted:
            fid = AGENT.admitted[req.rid]
            if fid in AGENT.faults and getattr(req, "finished_reason", None) is None:
                if req.rid not in AGENT.admitted_seen:
                    AGENT.admitted_seen.add(req.rid)
                    AGENT.emit("fault_fired", fault=fid, kind="reject_admitted", phase="abort_invisible",
                               rid=req.rid, note="to_finish ignored by the PD queues (pre-#38935)")
                return False
        return verdict
    return is_aborted


def _hook_is_aborted(mod):
    """Second half of the reject replay (the part PR #38935 closed): before the fixes the PD queues
    asked ``req.finished()``, which does not read ``to_finish``, so the rejected request's abort was
    invisible to them. For requests the mutation admitted, ``is_aborted`` answers the pre-fix way
    (``finished_reason`` only) while the mutation is armed."""
    _wrap_function(mod, "is_aborted", _make_is_aborted)


def _make_fail(orig):
    """``DecodeTransferQueue._record_transfer_failure``: reached from the failure branch of the transfer
    poll, after decode decided whether to defer the page release; with early_free armed it did not:
    the proof of firing."""
    def _record_transfer_failure(self, *a, **k):
        on = None
        if not getattr(self, "enable_deferred_kv_release", True):
            on = _ctl.AGENT.switched_on("early_free", fire=True)
        if on is not None:
            _ctl.AGENT.emit("fault_fired", fault=on["id"], kind="early_free",
                            reason=str(a[0] if a else k.get("failure_reason", ""))[:200],
                            note="failed/aborted transfer: decode pages released without waiting "
                                 "for in-flight writes to drain")
        return orig(self, *a, **k)
    return _record_transfer_failure


def _make_release(orig):
    """``DecodeTransferQueue._release_request``: where decode gives a failed/aborted transfer's
    pre-allocated pages back: at once from the poll's failure branch, or from ``_do_release`` after
    the deferred drain/timeout."""
    def _release_request(self, decode_req, *a, **k):
        req = getattr(decode_req, "req", None)
        _ctl.AGENT.emit("kv_released", room=getattr(req, "bootstrap_room", None),
                        rid=getattr(req, "rid", None),
                        deferred_release_enabled=bool(getattr(self, "enable_deferred_kv_release", False)))
        return orig(self, decode_req, *a, **k)
    return _release_request


def _hook_decode(mod):
    _hook_reject(mod)
    tq = _hook_class(mod, "DecodeTransferQueue", optional={
        "_record_transfer_failure": _make_fail, "_release_request": _make_release}, track=True)
    if tq is not None:
        _hook_deferred(tq)
    _hook_class(mod, "DecodePreallocQueue", optional={"_update_handshake_waiters": _make_handshake})
    _hook_class(mod, "SchedulerDisaggregationDecodeMixin",
                optional={"_get_new_prebuilt_batch": _hide_parked("waiting_queue", "decode_waiting")})


def _room_rid(decode_req):
    req = getattr(decode_req, "req", None)
    return getattr(req, "bootstrap_room", None), getattr(req, "rid", None)


def _hook_deferred(tq):
    """Deferred release (decode.py ``_defer_release`` / ``resolve_deferred_releases``): ``deferred_hold``
    when decode holds an aborted transfer's pages for prefill's drain ack (with the deadline it set),
    ``deferred_release`` when it lets them go, with SGLang's own outcome — ``drained`` (the ack came)
    or ``timeout`` (released anyway: a write may still be in flight). The outcome is what
    ``resolve_deferred_releases`` hands ``_observe_deferred_kv_release`` right after ``_do_release``
    for that room, on the same thread."""
    if hasattr(tq, "_defer_release"):
        def make_defer(orig):
            def _defer_release(self, decode_req, *a, **k):
                room, rid = _room_rid(decode_req)
                _ctl.AGENT.emit("deferred_hold", room=room, rid=rid,
                                timeout_s=getattr(self, "deferred_kv_release_timeout", None))
                return orig(self, decode_req, *a, **k)
            return _defer_release
        _wrap(tq, "_defer_release", make_defer)
    if hasattr(tq, "_do_release") and hasattr(tq, "_observe_deferred_kv_release"):
        def make_do(orig):
            def _do_release(self, decode_req, *a, **k):
                _ctl.AGENT.tls.deferred = _room_rid(decode_req)
                return orig(self, decode_req, *a, **k)
            return _do_release

        def make_observe(orig):
            def _observe_deferred_kv_release(self, duration_seconds, outcome, *a, **k):
                room, rid = getattr(_ctl.AGENT.tls, "deferred", None) or (None, None)
                _ctl.AGENT.tls.deferred = None
                _ctl.AGENT.emit("deferred_release", room=room, rid=rid, outcome=outcome,
                                held_s=round(float(duration_seconds), 3))
                return orig(self, duration_seconds, outcome, *a, **k)
            return _observe_deferred_kv_release
        _wrap(tq, "_do_release", make_do)
        _wrap(tq, "_observe_deferred_kv_release", make_observe)


def _make_abort_ingested(orig):
    """``Scheduler.abort_request``: the scheduler has read an abort off its socket and acted on it
    (``abort_ingested``: its rid, or ``abort_all``). What ``/abort_request``'s HTTP 200 does not say: the
    endpoint only queues the abort for the scheduler, which reads it at a later iteration — more than a
    second later on a busy 2-core machine. A request let go before this event was not aborted in time."""
    def abort_request(self, recv_req, *a, **k):
        out = orig(self, recv_req, *a, **k)
        _ctl.AGENT.emit("abort_ingested", rid=getattr(recv_req, "rid", None),
                        abort_all=bool(getattr(recv_req, "abort_all", False)))
        return out
    return abort_request


def _hook_scheduler(mod):
    _hook_class(mod, "Scheduler", optional={"get_new_batch_prefill": _hide_parked("waiting_queue", "prefill_waiting"),
                                            "abort_request": _make_abort_ingested}, track=True)


HOOKS = {
    "sglang.srt.disaggregation.prefill": _hook_prefill,
    "sglang.srt.disaggregation.decode": _hook_decode,
    "sglang.srt.managers.scheduler": _hook_scheduler,
}
