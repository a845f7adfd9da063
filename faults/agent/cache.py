"""Prefix cache: ``prefix_match`` evidence and the mutations ``salt_ignored`` and ``prefix_collision``.

SGLang 0.5.23 (read in the installed source): the prefix tree is ``UnifiedRadixCache``
(``mem_cache/unified_radix_cache.py``) over a Rust core; its Python methods ``match_prefix(params)``,
``insert(params)`` and ``touch_prefix(key)`` carry a ``RadixKey`` (token ids, ``extra_key``,
``cache_salt``: the core keys every child edge by (extra_key, cache_salt), so salts are separate
namespaces). ``checkpoint_into_tree(req, up_to)`` is where a request's tokens are inserted.
Prefill reports a request's cached prefix to decode in ``MetadataBuffers.set_buf(req)``
(``disaggregation/utils.py``, once per request, last chunk): ``req.cached_tokens`` there is what the
client later reads as ``meta_info.cached_tokens``. With ``--disaggregation-decode-enable-radix-cache``
decode matches its own tree in ``DecodePreallocQueue._match_prefix_and_lock(req)``.

Evidence: ``prefix_match`` (rid, ``cache_salt`` the engine received, ``lookup_salt`` its tree lookups
used, ``cached_tokens``, ``input_len``, role) — prefill at ``set_buf``, decode at its own match.

Mutations (deliberate engine bugs for the detection matrix):

* ``salt_ignored`` (switch): every lookup and insert drops ``cache_salt`` (a key copy with
  ``cache_salt=None``): requests of different salts share cached prefixes — the engine-side twin of
  a proxy that drops the field.
* ``prefix_collision`` (targeted by victim: ``{"tenant": ...}`` / rid): a targeted request whose
  lookup stops at ``d`` tokens (its tokens part there from a cached sequence A of the same namespace)
  is handed A's KV for positions ``d..m`` (``m``: ``d`` + ``params.span`` tokens, default 32, rounded
  up to whole pages, capped at A's length and the request's length − 1): the lookup is re-run with
  A's tokens, as a block hash that collides would (vLLM CVE-2025-25183: one block of another prompt). The request computes only its tokens after ``m``; it is not inserted back into the
  tree (``skip_radix_cache_insert``), so the pool's accounting stays whole and only the KV is wrong.
  Prefill only; its candidates are the sequences inserted while it is armed.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import deque

from . import control as _ctl
from .control import _hook_class, _target_ok, register_fault

register_fault("salt_ignored", mutation=True)
register_fault("prefix_collision", unlimited=True)
SEQS_KEPT = 256  # inserted sequences remembered per process (prefix_collision's candidates)


_MISSING = object()


def _remember(agent, name: str, rid, value):
    """Set ``rid``'s ``value`` in the per-rid table ``name`` (bounded: the oldest half goes past
    50,000 rids) and return what it held before (``_MISSING`` if nothing)."""
    table = agent.state(name, dict)
    before = table.get(rid, _MISSING)
    table[rid] = value
    if len(table) > 50000:
        for r in list(table)[:25000]:
            table.pop(r, None)
    return before


def _targeted(agent, kind: str, rid) -> dict | None:
    """The first live fault of ``kind`` aimed at ``rid``; not consumed (a lookup repeats every
    scheduling round until the request is admitted: it must be forged the same way each time)."""
    if rid is None or not agent.faults:
        return None
    with agent.lock:
        for f in agent.faults.values():
            if f["kind"] == kind and _target_ok(f["target"], None, rid):
                return f
    return None


def _armed(agent, kind: str) -> bool:
    return bool(agent.faults) and any(f["kind"] == kind for f in list(agent.faults.values()))


def _unsalted(key):
    if key is None or getattr(key, "cache_salt", None) is None:
        return key
    return type(key)(key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=key.limit, cache_salt=None)


def _salt_ignored(agent, key, rid=None):
    """``key`` without its salt while ``salt_ignored`` is switched on (first firing per rid logged)."""
    if getattr(key, "cache_salt", None) is None:
        return key
    f = agent.switched_on("salt_ignored")
    if f is None:
        return key
    if rid is not None and _remember(agent, "salt_ignored_rids", rid, True) is _MISSING:
        agent.switched_on("salt_ignored", fire=True)
        agent.emit("fault_fired", fault=f["id"], kind="salt_ignored", rid=rid, cache_salt=key.cache_salt,
                   note="prefix lookup and insert without the request's cache_salt")
    return _unsalted(key)


def _ns(key):
    return (key.extra_key, key.cache_salt)


def _forge(self, orig, params, r, f):
    """prefix_collision: re-run the lookup with the tokens of a cached sequence that parts from the
    request's exactly where its own match stopped."""
    key, req = params.key, params.req
    if getattr(key, "is_bigram", False):
        return r
    d = int(r.device_prefix_len)
    toks = key.raw_token_ids()
    n = len(key)
    ps = max(1, int(getattr(self, "page_size", 1) or 1))
    full = len(getattr(req, "origin_input_ids", toks) or toks)
    cap = min(n, full - 1)
    span = int(f["params"].get("span", 32))  # foreign tokens handed over: one colliding block
    want_ns = _ns(key)
    seqs = _ctl.AGENT.peek("cache_seqs") or ()
    for ns, a, owner in reversed(list(seqs)):
        if ns != want_ns or len(a) <= d or owner == req.rid:
            continue
        if a[:d] != toks[:d]:
            continue
        m = min(len(a), cap, -(-(d + span) // ps) * ps) // ps * ps
        # another sequence from where the match stopped (with pages, the match stops at the page
        # floor of the divergence: the sequences differ somewhere in [d, m), not necessarily at d)
        if m <= d or a[d:m] == toks[d:m]:
            continue
        forged = dataclasses.replace(params, key=type(key)(array("q", a[:m]), key.extra_key, cache_salt=key.cache_salt))
        r2 = orig(self, forged)
        if int(r2.device_prefix_len) <= d:
            continue  # A's tail was evicted meanwhile
        req.skip_radix_cache_insert = True
        if _remember(_ctl.AGENT, "collision_rids", req.rid, owner) is _MISSING:
            with _ctl.AGENT.lock:
                f["fired"] += 1
            _ctl.AGENT.emit("fault_fired", fault=f["id"], kind="prefix_collision", rid=req.rid, owner_rid=owner,
                            matched=d, forged=int(r2.device_prefix_len), input_len=full, page_size=ps,
                            note="prefix lookup handed the KV of another cached sequence past the divergence")
        return r2
    return r


def _make_match(orig):
    def match_prefix(self, params):
        AGENT = _ctl.AGENT
        req = getattr(params, "req", None)
        rid = getattr(req, "rid", None)
        key = _salt_ignored(AGENT, params.key, rid)
        if key is not params.key:
            params = dataclasses.replace(params, key=key)
        if rid is not None:
            _remember(AGENT, "lookup_salt", rid, getattr(key, "cache_salt", None))
        r = orig(self, params)
        if rid is not None and _ctl.ROLE != "decode" and params.key is not None:
            f = _targeted(AGENT, "prefix_collision", rid)
            if f is not None:
                return _forge(self, orig, params, r, f)
        return r
    return match_prefix


def _make_insert(orig):
    def insert(self, params):
        AGENT = _ctl.AGENT
        rid = getattr(AGENT.tls, "cache_rid", None)
        key = _salt_ignored(AGENT, params.key)
        if key is not params.key:
            params = dataclasses.replace(params, key=key)
        # prefix_collision's candidates, kept only while one is armed (a copy of every insert
        # would cost memory and time on long production prompts)
        if key is not None and not getattr(key, "is_bigram", False) and _armed(AGENT, "prefix_collision"):
            AGENT.state("cache_seqs", lambda: deque(maxlen=SEQS_KEPT)).append(
                (_ns(key), array("q", key.raw_token_ids()), rid))
        return orig(self, params)
    return insert


def _make_touch(orig):
    def touch_prefix(self, key):
        return orig(self, _salt_ignored(_ctl.AGENT, key))
    return touch_prefix


def _make_checkpoint(orig):
    def checkpoint_into_tree(self, req, *a, **k):
        tls = _ctl.AGENT.tls
        tls.cache_rid = getattr(req, "rid", None)
        try:
            return orig(self, req, *a, **k)
        finally:
            tls.cache_rid = None
    return checkpoint_into_tree


def _hook_unified(mod):
    _hook_class(mod, "UnifiedRadixCache", {"match_prefix": _make_match, "insert": _make_insert},
                {"touch_prefix": _make_touch, "checkpoint_into_tree": _make_checkpoint})


def _emit_match(req, cached, where):
    AGENT = _ctl.AGENT
    rid = getattr(req, "rid", None)
    AGENT.emit("prefix_match", rid=rid, where=where, cache_salt=getattr(req, "cache_salt", None),
               lookup_salt=(AGENT.peek("lookup_salt") or {}).get(rid, getattr(req, "cache_salt", None)),
               extra_key=getattr(req, "extra_key", None), input_len=len(getattr(req, "origin_input_ids", ()) or ()),
               cached_tokens=None if cached is None else int(cached))


def _make_set_buf(orig, module: str):
    """``MetadataBuffers.set_buf``: prefill's ``prefix_match`` (what it reports to decode)."""
    def set_buf(self, req):
        try:
            _emit_match(req, getattr(req, "cached_tokens", None), "prefill_report")
        except Exception as e:  # noqa: BLE001 - evidence must never break the engine
            _ctl.AGENT.emit("hook_error", module=module, error=repr(e))
        return orig(self, req)
    return set_buf


def _make_decode_match(orig, module: str):
    """``DecodePreallocQueue._match_prefix_and_lock``: decode's ``prefix_match`` on its own tree."""
    def _match_prefix_and_lock(self, req, *a, **k):
        out = orig(self, req, *a, **k)
        try:
            # decode retries the match every round until it can pre-allocate: one event per rid and value
            n = getattr(out, "l1_prefix_len", None)  # DecodePrefixMatch
            if _remember(_ctl.AGENT, "decode_match_last", getattr(req, "rid", None), n) != n:
                _emit_match(req, n, "decode_match")
        except Exception as e:  # noqa: BLE001
            _ctl.AGENT.emit("hook_error", module=module, error=repr(e))
        return out
    return _match_prefix_and_lock


def _hook_disagg_utils(mod):
    _hook_class(mod, "MetadataBuffers", optional={"set_buf": lambda orig: _make_set_buf(orig, mod.__name__)})


def _hook_decode_match(mod):
    _hook_class(mod, "DecodePreallocQueue",
                optional={"_match_prefix_and_lock": lambda orig: _make_decode_match(orig, mod.__name__)})


HOOKS = {
    "sglang.srt.mem_cache.unified_radix_cache": _hook_unified,
    "sglang.srt.disaggregation.utils": _hook_disagg_utils,
    "sglang.srt.disaggregation.decode": _hook_decode_match,
}
