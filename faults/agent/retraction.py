"""Decode retraction: ``kv_retracted`` / ``kv_resumed`` evidence with a check of the restored KV, and
the ``retract`` setting.

SGLang 0.5.23 (read in the installed source): decode retracts running requests in
``Scheduler.update_running_batch`` when the pool cannot give every running request one more token
(``ScheduleBatch.check_decode_mem``), or every ``TEST_RETRACT_INTERVAL``-th forward step while the
module global ``TEST_RETRACT`` (``SGLANG_TEST_RETRACT``) is on. ``retract_decode`` never retracts the
last running request and takes the one with the fewest output tokens. With
``--disaggregation-decode-retraction-backup cpu_tensor`` the victim's KV (prompt + output − 1
tokens) is copied to host memory in ``Req.offload_kv_cache`` and its slots are freed; it waits in
decode's ``retracted_queue`` (no new request is pre-allocated meanwhile), and
``DecodePreallocQueue.resume_retracted_reqs`` gives it new slots and ``Req.load_kv_cache`` copies the
host copy into them — no re-prefill.

Evidence (decode):

* ``kv_retracted``: rid, tokens whose KV was kept, output tokens so far, how many slots it gave
  back, and a digest of the host copy;
* ``kv_resumed``: rid, its new slots' count, and ``restored_equal``: the pool read back at the new
  slots (with SGLang's own ``get_cpu_copy``) equals the host copy taken at retraction — a KV that
  another request's write or a stale slot changed between the two shows up here even when no reply
  does.

``retract`` (switch, decode): while armed, decode retracts one request every ``params.interval``
forward steps (default 3; >= 2 — at 1 the same victim never runs) — what ``SGLANG_TEST_RETRACT`` and
``SGLANG_TEST_RETRACT_INTERVAL`` set at launch, switched on the live scheduler module (read at call
time). With ``params.reserve`` it also lowers decode's per-request reservation
(``--num-reserved-decode-tokens``, default 512) on the live prealloc queues, so more requests are
admitted than the pool can grow and the real memory-pressure path retracts (``params.interval``: 0
switches the test trigger off). Heal puts every value back.
"""

from __future__ import annotations

import hashlib
import sys

from . import control as _ctl
from .control import _hook_class, _restore_attrs, _switch_attrs, _wrap, register_fault

SCHED = "sglang.srt.managers.scheduler"


def _retract_check(p: dict) -> None:
    interval, reserve = p.get("interval", 3), p.get("reserve")
    if not isinstance(interval, int) or interval == 1 or interval < 0:
        raise ValueError(f"retract: interval must be 0 (off) or an int >= 2 (at 1 the victim never runs again), "
                         f"got {interval!r}")
    if reserve is not None and (not isinstance(reserve, int) or reserve < 1):
        raise ValueError(f"retract: reserve must be an int >= 1 (tokens), got {reserve!r}")


def _retract_on(agent, f: dict):
    p = f["params"]
    interval, reserve = int(p.get("interval", 3)), p.get("reserve")
    saved = []
    mod = sys.modules.get(SCHED)
    if _ctl.ROLE == "decode" and mod is not None and hasattr(mod, "TEST_RETRACT"):
        _switch_attrs(saved, [mod], TEST_RETRACT=interval > 0, TEST_RETRACT_INTERVAL=max(interval, 1))
    queues = agent.live("DecodePreallocQueue") if _ctl.ROLE == "decode" else []
    if reserve is not None:
        _switch_attrs(saved, queues, num_reserved_decode_tokens=int(reserve))
    f["_saved"] = saved
    agent.emit("mutation_on", fault=f["id"], kind="retract", interval=interval, reserve=reserve,
               switched=[f"{getattr(o, '__name__', type(o).__name__)}.{a}" for o, a, _v in saved])


register_fault("retract", mutation=True, on=_retract_on, off=_restore_attrs, check=_retract_check)


# ================================================================== evidence
def _tensors(x):
    """The tensors of a host copy (per layer: a list of chunks, each ``[k, v]`` or one MLA latent)."""
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif x is not None:
        yield x


def _digest(copy) -> str:
    import torch

    h = hashlib.sha1()
    for t in _tensors(copy):
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _equal(a, b) -> bool:
    ta, tb = list(_tensors(a)), list(_tensors(b))
    return len(ta) == len(tb) and all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(ta, tb))


def _hook_schedule_batch(mod):
    req = getattr(mod, "Req", None)
    if req is None or not hasattr(req, "offload_kv_cache") or not hasattr(req, "load_kv_cache"):
        return

    def make_offload(orig):
        def offload_kv_cache(self, req_to_token_pool, allocator, *a, **k):
            out = orig(self, req_to_token_pool, allocator, *a, **k)
            try:
                backup = getattr(getattr(self.kv, "retraction_backup", None), "cpu_tensors", None)
                _ctl.AGENT.emit("kv_retracted", rid=self.rid, room=getattr(self, "bootstrap_room", None),
                                kept_tokens=int(self.seqlen) - 1, output_tokens=len(self.output_ids or ()),
                                retractions_before=int(getattr(self, "retraction_count", 0)),
                                digest=_digest(backup) if backup is not None else None)
            except Exception as e:  # noqa: BLE001 - evidence must never break the engine
                _ctl.AGENT.emit("hook_error", hook="offload_kv_cache", error=repr(e))
            return out
        return offload_kv_cache

    def make_load(orig):
        def load_kv_cache(self, req_to_token_pool, allocator, *a, **k):
            backup = getattr(getattr(self.kv, "retraction_backup", None), "cpu_tensors", None)
            out = orig(self, req_to_token_pool, allocator, *a, **k)
            try:
                idx = req_to_token_pool.req_to_token[self.kv.req_pool_idx, : self.seqlen - 1]
                back = allocator.get_cpu_copy(idx, mamba_indices=getattr(self.kv, "mamba_pool_idx", None),
                                              req_pool_index=self.kv.req_pool_idx)
                _ctl.AGENT.emit("kv_resumed", rid=self.rid, room=getattr(self, "bootstrap_room", None),
                                restored_tokens=int(len(idx)), output_tokens=len(self.output_ids or ()),
                                digest=_digest(back), restored_equal=_equal(back, backup) if backup is not None else None)
            except Exception as e:  # noqa: BLE001
                _ctl.AGENT.emit("hook_error", hook="load_kv_cache", error=repr(e))
            return out
        return load_kv_cache

    _wrap(req, "offload_kv_cache", make_offload)
    _wrap(req, "load_kv_cache", make_load)


def _hook_decode_queue(mod):
    _hook_class(mod, "DecodePreallocQueue", track=True)


HOOKS = {
    "sglang.srt.managers.schedule_batch": _hook_schedule_batch,
    "sglang.srt.disaggregation.decode": _hook_decode_queue,
}
