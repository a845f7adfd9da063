"""The agent itself: fault registry, arm / heal / release, targets, events, the control socket, and
the patching helpers every subsystem module uses.

Subsystem modules (``transfer``, ``scheduler``, ``allocator``) declare their fault kinds with
:func:`register_fault` and read the live agent as ``control.AGENT`` at call time — never a copied
name: :func:`faults.agent.boot` (and the unit tests) set it after the hooks are defined.
"""

from __future__ import annotations

import json
import os
import random
import re
import socketserver
import sys
import threading
import time
import weakref

ROLE = os.environ.get("KVCHAOS_AGENT_ROLE", "")

# Filled by register_fault() as the subsystem modules import (faults/agent/__init__.py imports them all).
FAULT_KINDS: tuple[str, ...] = ()
# switched on at arm time, off at heal (engine-bug replays, and one configuration fault)
MUTATIONS: tuple[str, ...] = ()
_UNLIMITED: set[str] = set()  # kinds whose ``count`` defaults to unlimited instead of 1
_MUT_ON: dict = {}  # kind -> fn(agent, fault) at arm (mutations, and kinds hooked only while armed)
_MUT_OFF: dict = {}  # kind -> fn(agent, fault) at heal (mutations, and kinds with something to undo)
_CHECK: dict = {}  # kind -> fn(params) raising ValueError on bad params, before anything is armed
_HELD: set[str] = set()  # kinds that park something until ``release`` (or heal): each gets an Event


def register_fault(kind: str, *, unlimited: bool = False, mutation: bool = False, on=None, off=None,
                   check=None, held: bool = False) -> None:
    """Declare a fault kind. ``mutation``: a switch (no target, no count). ``on`` runs at arm (a
    mutation's switch, or a hook a kind installs only while armed; raising refuses the arm), ``off``
    at heal for any kind that has something to undo. ``unlimited``: ``count`` defaults to
    unlimited (else 1). ``check(params)`` refuses bad params at arm. ``held``: it parks something
    until the harness releases it (or heals it)."""
    global FAULT_KINDS, MUTATIONS
    if kind in FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} registered twice")
    FAULT_KINDS += (kind,)
    if check is not None:
        _CHECK[kind] = check
    if held:
        _HELD.add(kind)
    if unlimited:
        _UNLIMITED.add(kind)
    if mutation:
        MUTATIONS += (kind,)
    if mutation or on is not None:
        _MUT_ON[kind] = on or _noop
    if mutation or off is not None:
        _MUT_OFF[kind] = off or _noop


def _noop(agent, f):
    pass


class Agent:
    def __init__(self, ctl_dir: str):
        self.dir = ctl_dir
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.faults: dict[str, dict] = {}
        self.events: list[dict] = []
        self.hooks: list[str] = []
        # optional hooks this engine's classes do not have (``Class.method``): a fault that needs one is
        # refused at once by name (faults.client.AgentClient.wait_agents), not after a wait for the hook
        self.absent: list[str] = []
        self.room_rid: dict[int, str] = {}
        self.started_rooms: set[int] = set()
        self.holds: dict[str, threading.Event] = {}
        self.shared_pages: dict[int, int] = {}  # double_alloc (page size 1): token slot -> extra owners still to free
        self.admitted: dict[str, str] = {}  # reject_admitted: rid -> fault id
        self.admitted_seen: set[str] = set()
        self.tls = threading.local()
        self.instances: dict[str, weakref.WeakSet] = {}
        self._state: dict[str, object] = {}
        self._srv = None
        self._efile = None
        self._seq = 0

    def state(self, key: str, factory=dict):
        """Per-process state a subsystem keeps on the agent (created on first use)."""
        with self.lock:
            if key not in self._state:
                self._state[key] = factory()
            return self._state[key]

    def peek(self, key: str):
        """That state if a subsystem created it, else None (no lock: a cheap test on hot paths)."""
        return self._state.get(key)

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
    def match(self, kind: str, room=None, rid=None, where=None) -> dict | None:
        """The first live fault of ``kind`` whose target matches (and ``where(fault)``, if given);
        consumes one of its count."""
        now = time.monotonic()
        with self.lock:
            for f in list(self.faults.values()):
                if f["kind"] != kind or (where is not None and not where(f)):
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
        """The faults the harness armed (those armed at boot are the engine as built: not listed)."""
        with self.lock:
            return [_public(f) for f in self.faults.values() if not f.get("_boot")]

    def arm(self, req: dict, boot: bool = False) -> dict:
        kind = req.get("kind")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {FAULT_KINDS}")
        target = req.get("target") or {"any": True}
        _check_target(target)
        fid = str(req.get("id") or f"f{int(time.time() * 1000) % 10**9}-{random.randrange(10**6)}")
        params = dict(req.get("params") or {})
        if kind in _CHECK:
            _CHECK[kind](params)
        count = req.get("count", None if kind in _UNLIMITED else 1)
        f = {"id": fid, "kind": kind, "target": target, "params": params, "count": count, "fired": 0,
             "armed_at": time.time(), "expires": time.monotonic() + float(req.get("ttl_s", 600)),
             # its draws (delay jitter): seeded by the run (param ``seed``) so a replay draws the same
             "_rng": random.Random(params["seed"]) if params.get("seed") is not None else random.Random(),
             # armed at boot (KVCHAOS_AGENT_ARM): the engine as built, for the whole process — a heal of
             # everything leaves it, and the harness's "still armed" checks do not see it
             "_boot": boot}
        with self.lock:
            if fid in self.faults:
                raise ValueError(f"fault id {fid!r} already armed")
            self.faults[fid] = f
            if kind in _HELD:
                self.holds[fid] = threading.Event()
            if kind in _MUT_ON:
                try:
                    _MUT_ON[kind](self, f)
                except Exception:
                    self.faults.pop(fid, None)  # refused: nothing stays armed
                    self.holds.pop(fid, None)
                    raise
        self.emit("armed", fault=fid, kind=kind, target=target, params=params, **({"boot": True} if boot else {}))
        return _public(f)

    def heal(self, fid: str | None = None) -> list[str]:
        with self.lock:
            ids = [fid] if fid else [i for i, f in self.faults.items() if not f.get("_boot")]
            healed = []
            for i in ids:
                f = self.faults.pop(i, None)
                if f is None:
                    continue
                if i in self.holds:
                    self.holds.pop(i).set()  # never leave a write parked
                if f["kind"] in _MUT_OFF:
                    _MUT_OFF[f["kind"]](self, f)
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
            return {"pid": self.pid, "role": ROLE, "hooks": list(self.hooks), "absent": list(self.absent),
                    "armed": self.armed()}
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


# The live agent of this process: set by faults.agent.boot(); hooks read it as ``control.AGENT``.
AGENT: Agent | None = None


# ================================================================== patching helpers
def _wrap(cls, name, make):
    orig = getattr(cls, name)
    if getattr(orig, "_kvchaos_orig", None) is not None:
        return
    new = make(orig)
    new._kvchaos_orig = orig
    new._kvchaos_inherited = name not in cls.__dict__  # what _unwrap puts back
    new.__name__ = getattr(orig, "__name__", name)
    setattr(cls, name, new)
    AGENT.hooks.append(f"{cls.__module__}.{cls.__qualname__}.{name}")


def _unwrap(cls, name) -> bool:
    """Undo :func:`_wrap` of ``cls.<name>`` (a hook installed only while a fault is armed): the
    engine's own method again, inherited where it was. False when it was not wrapped."""
    cur = cls.__dict__.get(name)
    orig = getattr(cur, "_kvchaos_orig", None)
    if orig is None:
        return False
    if getattr(cur, "_kvchaos_inherited", False):
        delattr(cls, name)
    else:
        setattr(cls, name, orig)
    hook = f"{cls.__module__}.{cls.__qualname__}.{name}"
    if hook in AGENT.hooks:
        AGENT.hooks.remove(hook)
    return True


def _track_instances(cls, name: str) -> None:
    """Wrap ``cls.__init__`` so the agent keeps a weak reference to every instance (mutations switch
    attributes on live engine objects)."""
    def make_init(orig):
        def __init__(self, *a, **k):
            orig(self, *a, **k)
            AGENT.track(name, self)
        return __init__

    _wrap(cls, "__init__", make_init)


def _wrap_function(mod, name: str, make) -> None:
    """:func:`_wrap` for a module-level function ``mod.<name>`` (nothing where the module has none,
    or it is wrapped already); its hook is named ``<module>.<name>``."""
    orig = getattr(mod, name, None)
    if orig is None or getattr(orig, "_kvchaos_orig", None):
        return
    new = make(orig)
    new._kvchaos_orig = orig
    setattr(mod, name, new)
    AGENT.hooks.append(f"{mod.__name__}.{name}")


def _hook_class(mod, cls_name: str, makers: dict | None = None, optional: dict | None = None, *,
                track: bool = False):
    """The usual hook of one engine class: ``mod.<cls_name>`` (nothing happens where the module has
    no such class) with its instances tracked (``track``, under ``cls_name``), each method of
    ``makers`` wrapped (the class must have it), then each method of ``optional`` it has; in that
    order. Returns the class, or None."""
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return None
    if track:
        _track_instances(cls, cls_name)
    for name, make in (makers or {}).items():
        _wrap(cls, name, make)
    for name, make in (optional or {}).items():
        if hasattr(cls, name):
            _wrap(cls, name, make)
        elif AGENT is not None and f"{cls_name}.{name}" not in AGENT.absent:
            AGENT.absent.append(f"{cls_name}.{name}")
    return cls


# ================================================================== mutation switches
def _switch_attrs(saved: list, objs, **values) -> None:
    """Set each attribute of ``values`` on each of ``objs`` (live engine objects or modules), noting
    ``(obj, attr, old value)`` in ``saved``: a mutation's ``on`` keeps that list as ``f["_saved"]``
    for :func:`_restore_attrs`. Every old value is read before anything is set."""
    olds = [(obj, attr, getattr(obj, attr)) for obj in objs for attr in values]
    for obj, attr, _old in olds:
        setattr(obj, attr, values[attr])
    saved.extend(olds)


def _restore_attrs(agent, f: dict) -> None:
    """A mutation's ``off``: put back every attribute its ``on`` noted in ``f["_saved"]`` (last first)."""
    for obj, attr, v in reversed(f.pop("_saved", [])):
        setattr(obj, attr, v)
