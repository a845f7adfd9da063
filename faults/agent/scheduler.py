"""Scheduler side of PD disaggregation: prefill's bootstrap queue (room ↔ rid), the intake reject
path (``reject_admitted``: ``is_unadmitted_reject`` / ``is_aborted``), decode's transfer queue
(``kv_released`` evidence, where ``early_free`` fires), ``Scheduler`` tracking, and the switches of
the ``reject_admitted`` / ``input_limit`` / ``early_free`` mutations."""

from __future__ import annotations

from . import control as _ctl
from .control import _track_instances, _wrap, register_fault


# ---------------------------------------------------------------- mutation switches
def _reject_on(agent, f: dict):
    lim = f["params"].get("prefill_max_input_len", f["params"].get("max_input_len"))
    if lim is not None and _ctl.ROLE == "prefill":
        saved = []
        for s in agent.live("Scheduler"):
            saved.append((s, s.max_req_input_len))
            s.max_req_input_len = int(lim)
        f["_saved"] = saved
        agent.emit("mutation_on", fault=f["id"], kind="reject_admitted", prefill_max_input_len=lim,
                   schedulers=len(saved))


def _reject_off(agent, f: dict):
    for s, v in f.pop("_saved", []):
        s.max_req_input_len = v


def _reject_admitted_off(agent, f: dict):
    _reject_off(agent, f)
    for rid in [r for r, fid in agent.admitted.items() if fid == f["id"]]:
        agent.admitted.pop(rid)
        agent.admitted_seen.discard(rid)


def _early_on(agent, f: dict):
    saved = []
    for q in agent.live("DecodeTransferQueue"):
        saved.append((q, "enable_deferred_kv_release", q.enable_deferred_kv_release))
        q.enable_deferred_kv_release = False
    for m in agent.live("MooncakeKVManager"):
        if hasattr(m, "enable_deferred_decode_kv_release"):
            saved.append((m, "enable_deferred_decode_kv_release", m.enable_deferred_decode_kv_release))
            m.enable_deferred_decode_kv_release = False
    f["_saved"] = saved
    agent.emit("mutation_on", fault=f["id"], kind="early_free", switched=len(saved))


def _early_off(agent, f: dict):
    for obj, attr, v in f.pop("_saved", []):
        setattr(obj, attr, v)


register_fault("reject_admitted", mutation=True, on=_reject_on, off=_reject_admitted_off)
register_fault("early_free", mutation=True, on=_early_on, off=_early_off)
register_fault("input_limit", mutation=True, on=_reject_on, off=_reject_admitted_off)


# ================================================================== hooks
def _hook_prefill(mod):
    q = getattr(mod, "PrefillBootstrapQueue", None)
    if q is not None:
        def make_add(orig):
            def add(self, req, *a, **k):
                room = getattr(req, "bootstrap_room", None)
                if room is not None:
                    AGENT = _ctl.AGENT
                    with AGENT.lock:
                        AGENT.room_rid[int(room)] = req.rid
                        if len(AGENT.room_rid) > 100000:
                            for r in list(AGENT.room_rid)[:50000]:
                                AGENT.room_rid.pop(r, None)
                return orig(self, req, *a, **k)
            return add
        _wrap(q, "add", make_add)
    _hook_reject(mod)


def _hook_reject(mod):
    _hook_is_aborted(mod)
    orig = getattr(mod, "is_unadmitted_reject", None)
    if orig is None or getattr(orig, "_kvchaos_orig", None):
        return

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

    is_unadmitted_reject._kvchaos_orig = orig
    mod.is_unadmitted_reject = is_unadmitted_reject
    _ctl.AGENT.hooks.append(f"{mod.__name__}.is_unadmitted_reject")


def _hook_is_aborted(mod):
    """Second half of the reject replay (the part PR #38935 closed): before the fixes the PD queues
    asked ``req.finished()``, which does not read ``to_finish``, so the rejected request's abort was
    invisible to them. For requests the mutation admitted, ``is_aborted`` answers the pre-fix way
    (``finished_reason`` only) while the mutation is armed."""
    orig = getattr(mod, "is_aborted", None)
    if orig is None or getattr(orig, "_kvchaos_orig", None):
        return

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

    is_aborted._kvchaos_orig = orig
    mod.is_aborted = is_aborted
    _ctl.AGENT.hooks.append(f"{mod.__name__}.is_aborted")


def _hook_decode(mod):
    _hook_reject(mod)
    tq = getattr(mod, "DecodeTransferQueue", None)
    if tq is not None:
        _track_instances(tq, "DecodeTransferQueue")
        if hasattr(tq, "_record_transfer_failure"):
            # reached from the failure branch of the transfer poll, after decode decided whether to
            # defer the page release; with early_free armed it did not: the proof of firing
            def make_fail(orig):
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
            _wrap(tq, "_record_transfer_failure", make_fail)
        if hasattr(tq, "_release_request"):
            # where decode gives a failed/aborted transfer's pre-allocated pages back: at once from
            # the poll's failure branch, or from ``_do_release`` after the deferred drain/timeout
            def make_release(orig):
                def _release_request(self, decode_req, *a, **k):
                    req = getattr(decode_req, "req", None)
                    _ctl.AGENT.emit("kv_released", room=getattr(req, "bootstrap_room", None),
                                    rid=getattr(req, "rid", None),
                                    deferred_release_enabled=bool(getattr(self, "enable_deferred_kv_release", False)))
                    return orig(self, decode_req, *a, **k)
                return _release_request
            _wrap(tq, "_release_request", make_release)


def _hook_scheduler(mod):
    sch = getattr(mod, "Scheduler", None)
    if sch is not None:
        _track_instances(sch, "Scheduler")


HOOKS = {
    "sglang.srt.disaggregation.prefill": _hook_prefill,
    "sglang.srt.disaggregation.decode": _hook_decode,
    "sglang.srt.managers.scheduler": _hook_scheduler,
}
