"""In-engine fault agent: loaded into every SGLang server process, controlled over a Unix socket.

Loading. The launcher sets ``KVCHAOS_AGENT=<control dir>`` and ``KVCHAOS_AGENT_ROLE=<prefill|decode>``
on each server; ``kvchaos/_boot/sitecustomize.py`` (first on PYTHONPATH) then calls :func:`boot`
in every Python process of that server — the HTTP process and the scheduler/detokenizer
subprocesses SGLang spawns. ``boot`` only installs import hooks; the hooks patch SGLang classes
right after their modules load, and the first one starts the control server of that process.
Nothing here depends on the device, so the same path works on the GPU profile (it composes
with ``kvchaos.cpucompat`` when that is loaded: each hook wraps whatever loader the rest of
``sys.meta_path`` returns).

Control. Each process that patched something listens on ``<dir>/agent-<pid>.sock`` and describes
itself in ``<dir>/agent-<pid>.json``. Requests and replies are one JSON object each
(``faults.engine.AgentClient`` is the harness side). Commands: ``ping``, ``arm``, ``heal``,
``release``, ``events``, ``armed``. Every fault that acts appends an event to
``<dir>/events-<pid>.jsonl`` (and the in-memory log ``events`` returns) — the proof it fired.

Where it hooks (sglang 0.5.23; functions read in the installed source):

=============================== ===========================================================
hook                            purpose
=============================== ===========================================================
``common.utils.FastQueue.get``  the prefill transfer worker (``MooncakeKVManager.transfer_worker``)
                                dequeues one ``TransferKVChunk`` here; the agent remembers it in a
                                thread-local so the send below knows its ``room``
``PrefillBootstrapQueue.add``   records ``req.rid`` ↔ ``req.bootstrap_room`` (targets by rid/tenant)
``MooncakeKVManager.send_kvcache`` one call per KV chunk, just before ``_send_kvcache_generic`` →
                                ``_transfer_data`` → ``engine.batch_transfer_sync`` (the real write):
                                ``transfer_start`` events and the faults ``delay``, ``fail``
                                (return -1, no write), ``short`` (send only the first N pages of
                                the chunk, report success), ``hold`` (block the write until the
                                harness releases it, then land it: the late write after an abort);
                                after every write a ``write_end`` event (room, start, end)
``DecodeTransferQueue``          decode gives a failed/aborted transfer's pages back (at once or
``._release_request`` (decode)  after the deferred drain): ``kv_released`` event (room, rid) — with
                                ``write_end`` the evidence the ``kv_lifecycle`` oracle judges
``disaggregation.prefill/decode`` mutation ``reject_admitted``: ``is_unadmitted_reject`` answers
``.is_unadmitted_reject``,      False, so a request the scheduler rejected at intake
``disaggregation.prefill``      (``Req.set_finish_with_abort``: prompt swapped for one token,
``.is_aborted``                 verdict parked in ``to_finish``) is bootstrapped (PR #36988's gate),
                                and for that request ``is_aborted`` reads ``finished_reason`` only,
                                as ``req.finished()`` did before PR #38935, so the PD queues do not
                                see the parked abort and transfer the one-token KV. Optional
                                ``prefill_max_input_len`` lowers ``Scheduler.max_req_input_len`` in
                                the prefill scheduler while armed (a smaller prefill pool than the
                                declared context, as in the incident), without a restart
``DecodeTransferQueue``,        mutation ``early_free``: turns off deferred decode KV release
``MooncakeKVManager``           (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, default on):
(decode)                        decode frees an aborted request's pages without waiting for
                                in-flight writes to drain (``_handle_legacy_abort_notification``)
``TokenToKVPoolAllocator.alloc`` mutation ``double_alloc``: the next allocation hands out N
(decode)                        pages that a live allocation already holds (one page, two requests)
=============================== ===========================================================

Configuration fault ``input_limit`` (``max_input_len``): only lowers prefill's
``Scheduler.max_req_input_len`` while armed — the incident's deployment (prefill pool smaller than the
declared context) on an engine whose fixes are intact; the control for ``reject_admitted``.

Targets: ``{"any": true}``, ``{"room": int}``, ``{"rid": str}``, ``{"rid_regex": str}``,
``{"tenant": "t003"}`` (rids carry their tenant: ``...-t003-...``). ``count`` bounds how many
times a fault fires (default unlimited for delay, 1 for others); every fault expires after
``ttl_s`` (default 600) so a crashed harness cannot leave an engine poisoned forever.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import random
import re
import socket
import socketserver
import sys
import threading
import time
import weakref

ROLE = os.environ.get("KVCHAOS_AGENT_ROLE", "")
KINDS = ("delay", "fail", "short", "hold", "reject_admitted", "early_free", "double_alloc", "input_limit")
# switched on at arm time, off at heal (engine-bug replays, and one configuration fault)
MUTATIONS = ("reject_admitted", "early_free", "double_alloc", "input_limit")


class Agent:
    def __init__(self, ctl_dir: str):
        self.dir = ctl_dir
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.faults: dict[str, dict] = {}
        self.events: list[dict] = []
        self.hooks: list[str] = []
        self.room_rid: dict[int, str] = {}
        self.started_rooms: set[int] = set()
        self.holds: dict[str, threading.Event] = {}
        self.shared_pages: dict[int, int] = {}  # double_alloc: page -> extra owners still to free
        self.admitted: dict[str, str] = {}  # reject_admitted: rid -> fault id
        self.admitted_seen: set[str] = set()
        self.tls = threading.local()
        self.instances: dict[str, weakref.WeakSet] = {}
        self._srv = None
        self._efile = None
        self._seq = 0

    # ------------------------------------------------------------- events
    def emit(self, ev: str, **fields) -> dict:
        with self.lock:
            self._seq += 1
            rec = {"t": time.monotonic(), "wall": time.time(), "ev": ev, "seq": self._seq, "pid": self.pid,
                   "role": ROLE, "source": "agent", **fields}
            self.events.append(rec)
            if len(self.events) > 20000:
                del self.events[:5000]
            if self._efile is None:
                self._efile = open(os.path.join(self.dir, f"events-{self.pid}.jsonl"), "a", buffering=1)
            self._efile.write(json.dumps(rec, default=str) + "\n")
        return rec

    # ------------------------------------------------------------- faults
    def match(self, kind: str, room=None, rid=None) -> dict | None:
        """The first live fault of ``kind`` whose target matches; consumes one of its count."""
        now = time.monotonic()
        with self.lock:
            for f in list(self.faults.values()):
                if f["kind"] != kind:
                    continue
                if now > f["expires"]:
                    self.faults.pop(f["id"], None)
                    self.emit("fault_expired", fault=f["id"], kind=kind)
                    continue
                if not _target_ok(f["target"], room, rid):
                    continue
                if f["count"] is not None and f["fired"] >= f["count"]:
                    continue
                f["fired"] += 1
                return f
        return None

    def switched_on(self, kind: str, fire: bool = False) -> dict | None:
        """The first armed fault of ``kind`` (mutations are switches: no target, no count);
        ``fire`` counts a firing on it."""
        with self.lock:
            f = next((x for x in self.faults.values() if x["kind"] == kind), None)
            if f is not None and fire:
                f["fired"] += 1
            return f

    def armed(self) -> list[dict]:
        with self.lock:
            return [_public(f) for f in self.faults.values()]

    def arm(self, req: dict) -> dict:
        kind = req.get("kind")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {KINDS}")
        target = req.get("target") or {"any": True}
        _check_target(target)
        fid = str(req.get("id") or f"f{int(time.time() * 1000) % 10**9}-{random.randrange(10**6)}")
        params = dict(req.get("params") or {})
        count = req.get("count", None if kind in ("delay",) else 1)
        f = {"id": fid, "kind": kind, "target": target, "params": params, "count": count, "fired": 0,
             "armed_at": time.time(), "expires": time.monotonic() + float(req.get("ttl_s", 600))}
        with self.lock:
            if fid in self.faults:
                raise ValueError(f"fault id {fid!r} already armed")
            self.faults[fid] = f
            if kind == "hold":
                self.holds[fid] = threading.Event()
            if kind in MUTATIONS:
                _MUT_ON[kind](self, f)
        self.emit("armed", fault=fid, kind=kind, target=target, params=params)
        return _public(f)

    def heal(self, fid: str | None = None) -> list[str]:
        with self.lock:
            ids = [fid] if fid else list(self.faults)
            healed = []
            for i in ids:
                f = self.faults.pop(i, None)
                if f is None:
                    continue
                if i in self.holds:
                    self.holds.pop(i).set()  # never leave a write parked
                if f["kind"] in MUTATIONS:
                    _MUT_OFF[f["kind"]](self, f)
                for rid in [r for r, fid in self.admitted.items() if fid == i]:
                    self.admitted.pop(rid)
                    self.admitted_seen.discard(rid)
                for ref, sess in f.pop("_sessions", []):
                    mgr = ref()
                    if mgr is not None and hasattr(mgr, "_unblacklist_session"):
                        mgr._unblacklist_session(sess)
                        self.emit("session_unblacklisted", fault=i, session=str(sess))
                healed.append(i)
                self.emit("healed", fault=i, kind=f["kind"], fired=f["fired"])
        return healed

    def release(self, fid: str) -> bool:
        with self.lock:
            ev = self.holds.get(fid)
        if ev is None:
            return False
        ev.set()
        return True

    # ------------------------------------------------------------- control server
    def serve(self):
        if self._srv is not None:
            return
        path = os.path.join(self.dir, f"agent-{self.pid}.sock")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        agent = self

        class H(socketserver.StreamRequestHandler):
            def handle(self):
                line = self.rfile.readline(1 << 20)
                try:
                    req = json.loads(line)
                    out = {"ok": True, **agent.command(req)}
                except Exception as e:  # noqa: BLE001 - every error goes back to the caller, named
                    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.wfile.write((json.dumps(out, default=str) + "\n").encode())

        class S(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self._srv = S(path, H)
        threading.Thread(target=self._srv.serve_forever, name="kvchaos-agent", daemon=True).start()
        info = {"pid": self.pid, "role": ROLE, "sock": path, "argv": sys.argv[:3], "hooks": self.hooks}
        tmp = os.path.join(self.dir, f".agent-{self.pid}.json")
        with open(tmp, "w") as fh:
            json.dump(info, fh)
        os.replace(tmp, os.path.join(self.dir, f"agent-{self.pid}.json"))
        self.emit("agent_up", hooks=list(self.hooks))

    def command(self, req: dict) -> dict:
        cmd = req.get("cmd")
        if cmd == "ping":
            return {"pid": self.pid, "role": ROLE, "hooks": list(self.hooks), "armed": self.armed()}
        if cmd == "arm":
            return {"fault": self.arm(req)}
        if cmd == "heal":
            return {"healed": self.heal(req.get("id"))}
        if cmd == "release":
            return {"released": self.release(req["id"])}
        if cmd == "armed":
            return {"armed": self.armed()}
        if cmd == "events":
            since = int(req.get("since", 0))
            with self.lock:
                return {"events": [e for e in self.events if e["seq"] > since]}
        raise ValueError(f"unknown command {cmd!r}; one of ping arm heal release armed events")

    def track(self, name: str, obj) -> None:
        self.instances.setdefault(name, weakref.WeakSet()).add(obj)

    def live(self, name: str) -> list:
        return list(self.instances.get(name, ()))


def _public(f: dict) -> dict:
    return {k: v for k, v in f.items() if k != "expires" and not k.startswith("_")}


def _check_target(t: dict) -> None:
    if not isinstance(t, dict) or len(t) != 1:
        raise ValueError(f"target must be one of {{any|room|rid|rid_regex|tenant: value}}, got {t!r}")
    (k, v), = t.items()
    if k not in ("any", "room", "rid", "rid_regex", "tenant"):
        raise ValueError(f"unknown target key {k!r}; one of any, room, rid, rid_regex, tenant")
    if k == "rid_regex":
        re.compile(v)


def _target_ok(t: dict, room, rid) -> bool:
    (k, v), = t.items()
    if k == "any":
        return bool(v)
    if k == "room":
        return room is not None and int(v) == int(room)
    if rid is None:
        return False
    if k == "rid":
        return rid == v
    if k == "rid_regex":
        return re.search(v, rid) is not None
    if k == "tenant":
        return re.search(rf"(^|-){re.escape(v)}(-|$)", rid) is not None
    return False


AGENT: Agent | None = None
# sglang.srt.disaggregation.base.conn.KVPoll (a plain int class in 0.5.23)
_KVPOLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


# ================================================================== hooks
def _wrap(cls, name, make):
    orig = getattr(cls, name)
    if getattr(orig, "_kvchaos_orig", None) is not None:
        return
    new = make(orig)
    new._kvchaos_orig = orig
    new.__name__ = getattr(orig, "__name__", name)
    setattr(cls, name, new)
    AGENT.hooks.append(f"{cls.__module__}.{cls.__qualname__}.{name}")


def _track_instances(cls, name: str) -> None:
    """Wrap ``cls.__init__`` so the agent keeps a weak reference to every instance (mutations switch
    attributes on live engine objects)."""
    def make_init(orig):
        def __init__(self, *a, **k):
            orig(self, *a, **k)
            AGENT.track(name, self)
        return __init__

    _wrap(cls, "__init__", make_init)


def _hook_common_utils(mod):
    FQ = getattr(mod, "FastQueue", None)
    if FQ is None:
        return

    def make(orig):
        def get(self):
            item = orig(self)
            if hasattr(item, "room") and hasattr(item, "index_slice"):
                AGENT.tls.chunk = item
            return item
        return get

    _wrap(FQ, "get", make)


def _hook_prefill(mod):
    q = getattr(mod, "PrefillBootstrapQueue", None)
    if q is not None:
        def make_add(orig):
            def add(self, req, *a, **k):
                room = getattr(req, "bootstrap_room", None)
                if room is not None:
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
    AGENT.hooks.append(f"{mod.__name__}.is_unadmitted_reject")


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
    AGENT.hooks.append(f"{mod.__name__}.is_aborted")


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
                        on = AGENT.switched_on("early_free", fire=True)
                    if on is not None:
                        AGENT.emit("fault_fired", fault=on["id"], kind="early_free",
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
                    AGENT.emit("kv_released", room=getattr(req, "bootstrap_room", None),
                               rid=getattr(req, "rid", None),
                               deferred_release_enabled=bool(getattr(self, "enable_deferred_kv_release", False)))
                    return orig(self, decode_req, *a, **k)
                return _release_request
            _wrap(tq, "_release_request", make_release)


def _hook_scheduler(mod):
    sch = getattr(mod, "Scheduler", None)
    if sch is not None:
        _track_instances(sch, "Scheduler")


def _hook_allocator(mod):
    cls = getattr(mod, "TokenToKVPoolAllocator", None)
    if cls is None:
        return

    def make(orig):
        def alloc(self, need_size):
            out = orig(self, need_size)
            if out is None or ROLE != "decode":
                return out
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
                    import torch

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
        return alloc

    _wrap(cls, "alloc", make)

    def make_free(orig):
        def free(self, free_index):
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
                    import torch

                    free_index = torch.tensor(keep, dtype=free_index.dtype, device=free_index.device)
            return orig(self, free_index)
        return free

    _wrap(cls, "free", make_free)


def _make_send(orig, backend: str):
    """Wrap ``<Backend>KVManager.send_kvcache(self, session/peer, prefill_kv_indices, dst_kv_ptrs,
    dst_kv_indices, ...)`` — the same leading arguments in the Mooncake and NIXL managers."""
    def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **k):
        chunk = getattr(AGENT.tls, "chunk", None)
        room = getattr(chunk, "room", None)
        with AGENT.lock:
            rid = AGENT.room_rid.get(int(room)) if room is not None else None
            first = room is not None and room not in AGENT.started_rooms
            if first:
                AGENT.started_rooms.add(room)
        pages = int(len(prefill_kv_indices))
        reserved = int(len(dst_kv_indices))
        if first:
            AGENT.emit("transfer_start", room=room, rid=rid, pages=pages, reserved=reserved,
                       is_last=getattr(chunk, "is_last_chunk", None), backend=backend)
        f = AGENT.match("delay", room, rid)
        if f is not None:
            p = f["params"]
            ms = float(p.get("ms", 100)) + random.uniform(-1, 1) * float(p.get("jitter_ms", 0))
            AGENT.emit("fault_fired", fault=f["id"], kind="delay", room=room, rid=rid, ms=round(ms, 2),
                       pages=pages)
            time.sleep(max(ms, 0) / 1000.0)
        f = AGENT.match("fail", room, rid)
        if f is not None:
            # SGLang reacts to one failed send by blacklisting the decode session (every later
            # request to that decode fails until its probe loop clears it); heal undoes that
            # for the sessions this fault failed, so the next test starts clean.
            f.setdefault("_sessions", []).append((weakref.ref(self), session_id))
            AGENT.emit("fault_fired", fault=f["id"], kind="fail", room=room, rid=rid, pages=pages,
                       ret=-1, session=str(session_id), note="no byte written; transfer reported failed")
            if backend == "nixl":  # NIXL returns transfer handles, not a status: fail by raising
                raise RuntimeError("kvchaos injected KV transfer failure")
            return -1
        f = AGENT.match("short", room, rid)
        if f is not None:
            keep = max(0, min(pages, int(f["params"].get("pages", 1))))
            prefill_kv_indices = prefill_kv_indices[:keep]
            dst_kv_indices = dst_kv_indices[:keep]
            AGENT.emit("fault_fired", fault=f["id"], kind="short", room=room, rid=rid, pages_sent=keep,
                       pages_reserved=reserved, note="success reported; remaining decode pages unwritten")
        f = AGENT.match("hold", room, rid)
        if f is not None:
            ev = AGENT.holds.get(f["id"])
            limit = float(f["params"].get("max_hold_s", 60))
            AGENT.emit("fault_fired", fault=f["id"], kind="hold", phase="held", room=room, rid=rid,
                       pages=pages)
            released = ev.wait(limit) if ev is not None else True
            try:
                if room in self.request_status:
                    st = self.check_status(room)
                    status = getattr(st, "name", None) or _KVPOLL.get(int(st), str(st))
                else:
                    status = "gone"
            except Exception as e:  # noqa: BLE001
                status = f"unknown: {e}"
            w0 = time.time()
            ret = orig(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **k)
            AGENT.emit("fault_fired", fault=f["id"], kind="hold", phase="late_write", room=room, rid=rid,
                       pages=pages, released=released, room_status_at_write=status,
                       ret=ret if isinstance(ret, int) else "handles")
            _write_end(room, rid, pages, w0, ret)
            return ret
        w0 = time.time()
        ret = orig(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *a, **k)
        _write_end(room, rid, pages, w0, ret)
        return ret
    return send_kvcache


def _write_end(room, rid, pages, wall_start, ret):
    """Every KV write prefill made into decode's pages, with its time span: the ``kv_lifecycle``
    oracle pairs it with decode's ``kv_released`` for the same room (a write that ends after decode
    gave the pages back landed in pages that may already belong to someone else)."""
    if room is not None:
        AGENT.emit("write_end", room=room, rid=rid, pages=pages, wall_start=wall_start,
                   ret=ret if isinstance(ret, int) else "handles")


def _hook_mooncake(mod):
    mgr = getattr(mod, "MooncakeKVManager", None)
    if mgr is None:
        return
    _track_instances(mgr, "MooncakeKVManager")
    _wrap(mgr, "send_kvcache", lambda orig: _make_send(orig, "mooncake"))

    if hasattr(mgr, "_handle_legacy_abort_notification"):
        def make_legacy(orig):
            def _handle_legacy_abort_notification(self, notification, room_active):
                on = AGENT.switched_on("early_free", fire=True)
                if on is not None:
                    AGENT.emit("fault_fired", fault=on["id"], kind="early_free",
                               room=getattr(notification, "room", None), room_active=room_active,
                               note="decode released pages without waiting for the drain ack")
                return orig(self, notification, room_active)
            return _handle_legacy_abort_notification
        _wrap(mgr, "_handle_legacy_abort_notification", make_legacy)


def _hook_nixl(mod):
    """NIXL backend: same transfer faults on ``NixlKVManager.send_kvcache`` (not exercised on CPU
    machines: nixl is not installed there)."""
    mgr = getattr(mod, "NixlKVManager", None)
    if mgr is None or not hasattr(mgr, "send_kvcache"):
        return
    _wrap(mgr, "send_kvcache", lambda orig: _make_send(orig, "nixl"))


# ---------------------------------------------------------------- mutation switches
def _reject_on(agent: Agent, f: dict):
    lim = f["params"].get("prefill_max_input_len", f["params"].get("max_input_len"))
    if lim is not None and ROLE == "prefill":
        saved = []
        for s in agent.live("Scheduler"):
            saved.append((s, s.max_req_input_len))
            s.max_req_input_len = int(lim)
        f["_saved"] = saved
        agent.emit("mutation_on", fault=f["id"], kind="reject_admitted", prefill_max_input_len=lim,
                   schedulers=len(saved))


def _reject_off(agent: Agent, f: dict):
    for s, v in f.pop("_saved", []):
        s.max_req_input_len = v


def _early_on(agent: Agent, f: dict):
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


def _early_off(agent: Agent, f: dict):
    for obj, attr, v in f.pop("_saved", []):
        setattr(obj, attr, v)


def _noop(agent, f):
    pass


_MUT_ON = {"reject_admitted": _reject_on, "early_free": _early_on, "double_alloc": _noop,
           "input_limit": _reject_on}
_MUT_OFF = {"reject_admitted": _reject_off, "early_free": _early_off, "double_alloc": _noop,
            "input_limit": _reject_off}

HOOKS = {
    "sglang.srt.disaggregation.common.utils": _hook_common_utils,
    "sglang.srt.disaggregation.mooncake.conn": _hook_mooncake,
    "sglang.srt.disaggregation.nixl.conn": _hook_nixl,
    "sglang.srt.disaggregation.prefill": _hook_prefill,
    "sglang.srt.disaggregation.decode": _hook_decode,
    "sglang.srt.managers.scheduler": _hook_scheduler,
    "sglang.srt.mem_cache.allocator.token": _hook_allocator,
}


# ================================================================== import machinery
def _After(inner, _hook):
    """Run ``_apply`` right after the module executes (the compat layer's post-import loader)."""
    from kvchaos.cpucompat import _PostImportLoader

    return _PostImportLoader(inner, lambda module: _apply(module.__name__, module))


def _apply(name, module):
    try:
        HOOKS[name](module)
        AGENT.serve()
    except Exception as e:  # noqa: BLE001 - a broken hook must be loud, not fatal to the engine
        sys.stderr.write(f"kvchaos agent: hook for {name} failed: {type(e).__name__}: {e}\n")
        AGENT.emit("hook_error", module=name, error=repr(e))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in HOOKS:
            return None
        after = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in after:
            fs = getattr(finder, "find_spec", None)
            if fs is None:
                continue
            spec = fs(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _After(spec.loader, HOOKS[fullname])
                return spec
        return None


def boot() -> None:
    """Called by the boot hook when KVCHAOS_AGENT is set (idempotent)."""
    global AGENT
    if AGENT is not None:
        return
    d = os.environ.get("KVCHAOS_AGENT", "")
    if not d or not os.path.isdir(d):
        sys.stderr.write(f"kvchaos agent: KVCHAOS_AGENT={d!r} is not a directory; agent not loaded\n")
        return
    AGENT = Agent(d)
    for name in HOOKS:  # already imported before us (rare): patch in place
        if name in sys.modules:
            _apply(name, sys.modules[name])
    sys.meta_path.insert(0, _Finder())
