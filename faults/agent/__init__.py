"""In-engine fault agent: loaded into every SGLang server process, controlled over a Unix socket (or a
TCP gateway, ``net``) by :class:`faults.client.AgentClient`; one module per SGLang subsystem.

How it loads, what it hooks in SGLang 0.5.23, its commands, units and targets: docs/reference/agent.md.
``faults.agent.AGENT`` and ``faults.agent.ROLE`` read ``control.AGENT`` / ``control.ROLE`` (what the
hooks read; assign those).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys

from kvchaos.cpucompat import PostImportLoader

from .. import wire

# subsystem modules register their fault kinds as they import: this order is the order of FAULT_KINDS
from . import control  # noqa: I001
from . import net
from . import transfer
from . import scheduler
from . import allocator
from . import cache
from . import retraction
from . import provenance
from . import output
from .allocator import _hook_allocator, _hook_paged_allocator, _shared, _swallow, _whole_pages
from .control import (
    FAULT_KINDS,
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
HOOKS = _merged(transfer.HOOKS, scheduler.HOOKS, allocator.HOOKS, cache.HOOKS, retraction.HOOKS, provenance.HOOKS,
                output.HOOKS)


# ================================================================== import machinery
def _After(inner, _hook):
    """Run ``_apply`` right after the module executes (the compat layer's post-import loader)."""
    return PostImportLoader(inner, lambda module: _apply(module.__name__, module))


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
            host, port = wire.parse_url(d)
            role = os.environ.get("KVCHAOS_AGENT_ROLE", "")
            d = os.environ.get("KVCHAOS_AGENT_DIR") or os.path.join("/tmp", f"kvchaos-agent-{role or 'engine'}-{port}")
            os.makedirs(d, exist_ok=True)
            gw = net.Gateway(d, host, port, os.environ.get("KVCHAOS_AGENT_TOKEN", ""), role)
        except (wire.AgentAddressError, OSError) as e:
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
    arm_at_boot(os.environ.get("KVCHAOS_AGENT_ARM", ""))


def arm_at_boot(spec: str) -> list[str]:
    """``KVCHAOS_AGENT_ARM``: a JSON list of faults (``{"kind", "target", "params", "count", "role"}``)
    armed as this process starts, those of its role (or of none) — an engine built with a planted bug:
    the session's self-test and every experiment run on it, a heal of everything leaves it (set it in a
    profile's ``[cluster.env]``). What cannot be armed is said on stderr and in the agent's events."""
    if not spec.strip():
        return []
    try:
        reqs = json.loads(spec)
        if not isinstance(reqs, list) or not all(isinstance(r, dict) for r in reqs):
            raise ValueError("not a list of objects")
    except ValueError as e:
        sys.stderr.write(f"kvchaos agent: KVCHAOS_AGENT_ARM is not a JSON list of faults ({e}): nothing armed\n")
        return []
    out = []
    for r in reqs:
        if r.get("role") not in (None, control.ROLE):
            continue
        try:
            f = control.AGENT.arm({**{k: v for k, v in r.items() if k != "role"}, "ttl_s": r.get("ttl_s", 10.0 ** 9)},
                                  boot=True)
            out.append(f["id"])
        except Exception as e:  # noqa: BLE001 - said, never a crash of the engine
            sys.stderr.write(f"kvchaos agent: KVCHAOS_AGENT_ARM: {r!r} not armed: {e}\n")
            control.AGENT.emit("hook_error", hook="KVCHAOS_AGENT_ARM", error=f"{r!r}: {e!r}"[:500])
    return out


def __getattr__(name):
    """``faults.agent.AGENT`` / ``.ROLE``: ``control``'s, the names the hooks read (assign those)."""
    if name in ("AGENT", "ROLE"):
        return getattr(control, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["AGENT", "Agent", "HOOKS", "FAULT_KINDS", "MUTATIONS", "ROLE", "boot", "register_fault"]
