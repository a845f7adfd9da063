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

Layout, one module per SGLang subsystem (a new fault touches one of them: its kind is declared with
``control.register_fault`` and its hooks go in that module's ``HOOKS``):

================ =====================================================================================
module           what
================ =====================================================================================
``control``      ``Agent`` (fault registry, arm / heal / release, targets, events, control socket),
                 ``register_fault``, the live ``AGENT`` of this process, the patching helpers
``transfer``     KV transfer: ``FastQueue`` chunk tracking, every Mooncake / NIXL KV write path,
                 ``transfer_start`` / ``write_end``, faults ``delay`` ``fail`` ``short`` ``hold``
                 ``stall_status_read``; where ``early_free`` fires in the Mooncake manager
``scheduler``    prefill bootstrap queue, the intake reject path, decode's transfer queue, ``Scheduler``
                 tracking; mutations ``reject_admitted``, ``input_limit``, ``early_free``
``allocator``    decode's KV allocator (page size 1 and paged); mutation ``double_alloc``
``cache``        the prefix cache (``UnifiedRadixCache``): ``prefix_match`` evidence (salt received and
                 used, cached tokens); mutations ``salt_ignored``, ``prefix_collision``
``retraction``   decode retraction: ``kv_retracted`` / ``kv_resumed`` evidence (the restored KV read
                 back and compared with the host copy); setting ``retract`` (test trigger, reservation)
``provenance``   decode's KV page holders (decode only): page id -> rid of the request that last held
                 it, from decode's pre-allocation and every decode step; ``kv_prealloc`` evidence
                 (the request's pages and, run-length, who held them before) — whose data sits in a
                 page a request reads but its transfer never wrote
``net``          the TCP gateway: the server's agents and their events for a harness on another host
``__init__``     ``boot``, the ``HOOKS`` table assembled from the modules, the import machinery
================ =====================================================================================

Units. Every KV write path gets *page* indices (``kv_to_page_indices``), so every ``pages`` field of
the transfer events (``transfer_start``: ``pages`` / ``reserved``, ``write_end``: ``pages``, ``short``:
``pages_sent`` / ``pages_reserved``) and the ``short`` fault's ``pages`` param count KV pages of
``page_size`` tokens; the events carry ``page_size`` (from the manager's ``kv_args``). With page size 1
(the CPU profile's own layout) a page is a token slot. ``double_alloc``'s ``pages`` param is N token
slots on every layout (whole pages: ``max(1, N // page_size)`` of them).

Where it hooks (sglang 0.5.23, read in the installed source; 0.5.19–0.5.22 have the same functions):

=============================== ===========================================================
hook                            purpose
=============================== ===========================================================
``common.utils.FastQueue.get``  the prefill transfer worker (``<Backend>KVManager.transfer_worker``)
                                dequeues one ``TransferKVChunk`` here; the agent remembers it in a
                                thread-local so the send below knows its ``room``
``PrefillBootstrapQueue.add``   records ``req.rid`` ↔ ``req.bootstrap_room`` (targets by rid/tenant)
``MooncakeKVManager.send_kvcache`` one call per KV chunk, just before ``_send_kvcache_generic`` →
                                ``_transfer_data`` → ``engine.batch_transfer_sync`` (the real write;
                                MHA/GQA: a K and a V block per layer, MLA: one latent block per
                                layer — same call, same page indices): ``transfer_start`` events
                                and the faults ``delay``, ``fail`` (return -1, no write), ``short``
                                (send only the first N pages of the chunk, report success), ``hold``
                                (block the write until the harness releases it, then land it: the
                                late write after an abort); after every write a ``write_end`` event
                                (room, pages, time span)
``MooncakeKVManager``           the other Mooncake KV write paths, same faults and events (with a
``.send_kvcache_dcp`` /         ``path`` field): ``_dcp`` is MLA-only (decode context parallel:
``.send_kvcache_slice``         ``short`` cuts the source pages and ``num_kv_tokens``), ``_slice`` is
                                MHA/GQA with prefill attn TP != decode attn TP
``MooncakeKVManager``           (inherited from ``CommonKVManager``) the transfer worker's re-read of
``.check_status``               its chunk's room: ``stall_status_read`` stalls it ``ms`` once that room
                                concluded (Success), widening the window in which the scheduler's
                                ``clear()`` pops the room between the worker's ``in`` test and its read
``NixlKVManager.send_kvcache``  the same on NIXL (returns handles: ``fail`` raises, ``write_end`` is
(``_mixed``, ``_slice``)        when the write was posted); ``send_kvcache_dcp`` (a plan, not page
                                lists) and the staging paths are not hooked
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
``Req.offload_kv_cache`` /      decode retraction with the ``cpu_tensor`` backup: ``kv_retracted``
``Req.load_kv_cache`` (decode)  (rid, tokens kept, host-copy digest) and ``kv_resumed`` (the pool read
                                back at the new slots equals the host copy?); the ``retract``
                                setting switches ``scheduler.TEST_RETRACT`` / its interval and
                                ``DecodePreallocQueue.num_reserved_decode_tokens`` on the live process
``TokenToKVPoolAllocator``      mutation ``double_alloc`` (page size 1): the next pre-allocation
``.alloc`` / ``.free`` (decode) (``alloc(delta_len)``) hands out N token slots that a live
                                allocation already holds (one page, two requests); the second free
                                of a shared slot is swallowed
``PagedTokenToKVPoolAllocator`` the same for page size > 1: decode's pre-allocation calls
``.alloc_extend`` / ``.free`` / ``alloc_extend``; whole pages are aliased; the second release of a
``._release_page_ids`` (decode) shared page is swallowed where every paged free ends
=============================== ===========================================================

Configuration fault ``input_limit`` (``max_input_len``): only lowers prefill's
``Scheduler.max_req_input_len`` while armed — the incident's deployment (prefill pool smaller than the
declared context) on an engine whose fixes are intact; the control for ``reject_admitted``.

Targets: ``{"any": true}``, ``{"room": int}``, ``{"rid": str}``, ``{"rid_regex": str}``,
``{"tenant": "t003"}`` (rids carry their tenant: ``...-t003-...``). ``count`` bounds how many
times a fault fires (default unlimited for delay, 1 for others); every fault expires after
``ttl_s`` (default 600) so a crashed harness cannot leave an engine poisoned forever.

``faults.agent.AGENT`` and ``faults.agent.ROLE`` are live views of ``control.AGENT`` / ``control.ROLE``
(reading and assigning them goes to ``control``, which is what the hooks read).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import types

# subsystem modules register their fault kinds as they import: this order is the order of KINDS
from . import control  # noqa: I001
from . import net
from . import transfer
from . import scheduler
from . import allocator
from . import cache
from . import retraction
from . import provenance
from .allocator import _hook_allocator, _hook_paged_allocator, _shared, _swallow, _whole_pages
from .control import (
    KINDS,
    MUTATIONS,
    _MUT_OFF,
    _MUT_ON,
    Agent,
    _check_target,
    _noop,
    _public,
    _target_ok,
    _track_instances,
    _wrap,
    register_fault,
)
from .scheduler import (
    _early_off,
    _early_on,
    _hook_decode,
    _hook_is_aborted,
    _hook_prefill,
    _hook_reject,
    _hook_scheduler,
    _reject_off,
    _reject_on,
)
from .transfer import (
    _KVPOLL,
    _guarded_write,
    _hook_common_utils,
    _hook_mooncake,
    _hook_nixl,
    _make_check_status,
    _make_send,
    _make_send_dcp,
    _make_send_peer,
    _write_end,
)

def _merged(*tables) -> dict:
    """module name -> one hook running every subsystem's hook for that module, in table order."""
    fns: dict = {}
    for t in tables:
        for name, fn in t.items():
            fns.setdefault(name, []).append(fn)

    def chain(hooks):
        if len(hooks) == 1:
            return hooks[0]

        def run(mod):
            for h in hooks:
                h(mod)
        run.__name__ = "+".join(h.__name__ for h in hooks)
        return run

    return {name: chain(hs) for name, hs in fns.items()}


# module name -> hook, in the order the original single-module table had them
HOOKS = _merged(transfer.HOOKS, scheduler.HOOKS, allocator.HOOKS, cache.HOOKS, retraction.HOOKS, provenance.HOOKS)


# ================================================================== import machinery
def _After(inner, _hook):
    """Run ``_apply`` right after the module executes (the compat layer's post-import loader)."""
    from kvchaos.cpucompat import _PostImportLoader

    return _PostImportLoader(inner, lambda module: _apply(module.__name__, module))


def _apply(name, module):
    try:
        HOOKS[name](module)
        control.AGENT.serve()
    except Exception as e:  # noqa: BLE001 - a broken hook must be loud, not fatal to the engine
        sys.stderr.write(f"kvchaos agent: hook for {name} failed: {type(e).__name__}: {e}\n")
        control.AGENT.emit("hook_error", module=name, error=repr(e))


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


GATEWAY = None  # this process's TCP gateway (faults/agent/net.py), when KVCHAOS_AGENT=tcp://...


def boot() -> None:
    """Called by the boot hook when KVCHAOS_AGENT is set (idempotent). ``KVCHAOS_AGENT`` is the
    control directory, or ``tcp://HOST:PORT`` (with ``KVCHAOS_AGENT_TOKEN``; the directory is then
    ``KVCHAOS_AGENT_DIR``, default ``/tmp/kvchaos-agent-<role>-<port>``) for a harness on another host."""
    global GATEWAY
    if control.AGENT is not None:
        return
    d = os.environ.get("KVCHAOS_AGENT", "")
    gw = None
    if d.startswith("tcp://"):
        try:
            host, port = net.parse_url(d)
            role = os.environ.get("KVCHAOS_AGENT_ROLE", "")
            d = os.environ.get("KVCHAOS_AGENT_DIR") or os.path.join("/tmp", f"kvchaos-agent-{role or 'engine'}-{port}")
            os.makedirs(d, exist_ok=True)
            gw = net.Gateway(d, host, port, os.environ.get("KVCHAOS_AGENT_TOKEN", ""), role)
        except (net.AgentAddressError, OSError) as e:
            sys.stderr.write(f"kvchaos agent: {e}; agent not loaded\n")
            return
    if not d or not os.path.isdir(d):
        sys.stderr.write(f"kvchaos agent: KVCHAOS_AGENT={d!r} is not a directory (or tcp://HOST:PORT); agent not loaded\n")
        return
    control.AGENT = Agent(d)
    if gw is not None:
        GATEWAY = gw
        gw.run_or_stand_by()
    for name in HOOKS:  # already imported before us (rare): patch in place
        if name in sys.modules:
            _apply(name, sys.modules[name])
    sys.meta_path.insert(0, _Finder())


class _Package(types.ModuleType):
    """``faults.agent.AGENT`` / ``.ROLE`` read and write ``control``'s (the names the hooks read), as
    the module globals of the single-file agent did."""

    @property
    def AGENT(self):
        return control.AGENT

    @AGENT.setter
    def AGENT(self, value):
        control.AGENT = value

    @property
    def ROLE(self):
        return control.ROLE

    @ROLE.setter
    def ROLE(self, value):
        control.ROLE = value


sys.modules[__name__].__class__ = _Package

__all__ = ["AGENT", "Agent", "HOOKS", "KINDS", "MUTATIONS", "ROLE", "boot", "register_fault"]
