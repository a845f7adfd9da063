"""A scenario as data: the deployment, the traffic and the nemesis schedule of one experiment, as one
JSON document (``kvchaos.scenario/1``) that a run writes, a replay reads and a search mutates.

    {"schema": "kvchaos.scenario/1", "name": "...", "seed": 7,
     "deployment": {"restart": {...}, "live": {...}},
     "traffic": {"plans": [...], "concurrency": 8, "timeout_s": 60, "via": "router"},
     "nemesis": [{"at_s": 0, "injector": "agent", "role": "prefill", "kind": "delay", ...}, ...],
     "checks": [{"name": "isolation"}, {"name": "liveness", "bound_s": 60}],
     "expect": {"isolation": "pass"}, "origin": {...}}

**Deployment** knobs come in two kinds, because a search pays for them differently:

- ``restart`` (:data:`RESTART_KNOBS`): the engine reads them at start (pool, context, command-line
  flags, the transfer backend, the router, the KV layout, the engine release). Scenarios with the same
  :meth:`Deployment.restart_key` share a cluster; a new key costs a cluster start.
- ``live`` (:data:`LIVE_KNOBS`): settings the in-engine agent changes on the running processes
  (prefill's input limit, chunked-prefill size, decode's deferred-release timeout and per-request
  reservation) — each becomes an agent op armed when the method starts and healed at its end
  (:meth:`Scenario.ops`).

**Nemesis** ops (:class:`Op`) are timed: ``at_s`` after the method starts, healed at ``heal_s`` (or
when the method ends). Injectors: ``agent`` (every in-engine fault kind and mutation,
:data:`AGENT_KINDS`), ``proxy`` (toxiproxy toxics, :data:`TOXIC_TYPES`), ``process`` (kill, stop,
restart a role) and ``action`` (client-side choreography: abort requests, release a held write).

This module is data only: it imports no fault injector (``faults`` imports ``kvchaos``, never the
reverse). Its kind tables mirror the injectors' own registries, and ``tests/test_scenario.py`` fails
when the two part. Every error names the field (``nemesis[2].params.ms``), the value and what is
allowed: a scenario that does not say what it means is refused, never run with a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.cluster.layouts import LayoutError, parse as parse_layout
from kvchaos.cluster.spec import flag_value

from .plan import RequestPlan

SCHEMA = "kvchaos.scenario/1"
FILE = "scenario.json"


class ScenarioError(ValueError):
    """A scenario document that is not valid: the message names the field and what is allowed."""


# --------------------------------------------------------------------------- kinds (data tables)
ROLES = ("prefill", "decode")
# faults/agent: every kind register_fault() declares (tests/test_scenario.py compares the two)
AGENT_KINDS = ("delay", "fail", "short", "hold", "stall_status_read", "park", "chunked_prefill", "reject_admitted",
               "deferred_release_timeout", "early_free", "input_limit", "double_alloc", "salt_ignored",
               "prefix_collision", "retract", "token_flip", "meta_swap")
# planted engine bugs (a mutated engine, not a fault a correct engine must survive): a scenario that arms
# one is a detection test, and a search never arms one (kvchaos fuzz looks for the engine's own bugs)
AGENT_MUTATIONS = ("reject_admitted", "early_free", "double_alloc", "salt_ignored", "prefix_collision", "token_flip",
                   "meta_swap")
TARGET_KEYS = ("any", "room", "rid", "rid_regex", "tenant")
# faults/proxy/toxics.py TOXIC_TYPES: type -> its attributes (plus ``seed``, kvchaos' extension)
TOXIC_TYPES = {
    "latency": ("latency", "jitter"),
    "bandwidth": ("rate",),
    "slow_close": ("delay",),
    "timeout": ("timeout",),
    "reset_peer": ("timeout",),
    "limit_data": ("bytes",),
    "slicer": ("average_size", "size_variation", "delay"),
}
PROXIES = ("client", "prefill", "decode", "bootstrap")  # client -> router, router -> each server, decode -> bootstrap
STREAMS = ("upstream", "downstream")
PROCESS_KINDS = ("kill", "stop", "restart")
PROCESS_ROLES = ("prefill", "decode")
ACTION_KINDS = ("abort", "release", "heal")
# what an ``on`` trigger waits for (Op.on): an event the in-engine agent of a role logs (any of its event
# names: ``transfer_start``, ``kv_prealloc``, ``fault_fired``...), or one the client's driver logs
ON_ROLES = ("prefill", "decode", "client")
ON_CLIENT_EVENTS = ("first_byte",)
ON_KEYS = ("role", "ev", "rid", "phase", "op")
MAX_DELAY_S = 120.0  # an action's delay after the op it waits for (Op.delay_s): the method waits that long at most
INJECTORS = ("agent", "proxy", "process", "action")
VIAS = ("router", "pd")
STATUSES = ("pass", "fail", "unknown")

# restart knob -> (type, allowed values or None, what it sets)
RESTART_KNOBS = {
    "engine_version": (str, None, "the SGLang release (its environment: scripts/setup-engine.sh)"),
    "layout": (str, None, "the KV layout: <mha|gqa|mla>-p<page>-<fp32|bf16|fp16> (kvchaos.cluster.layouts)"),
    "pool_tokens": (int, None, "--max-total-tokens on each server"),
    "prefill_pool_tokens": (int, None, "--max-total-tokens on prefill alone, after pool_tokens (a prefill pool "
                            "below the context and decode's pool: the GLM-5.3 incident's shape)"),
    "context_length": (int, None, "--context-length"),
    "chunked_prefill_size": (int, None, "--chunked-prefill-size on prefill"),
    "allow_auto_truncate": (bool, None, "--allow-auto-truncate on both servers"),
    "decode_radix_cache": (bool, None, "--disaggregation-decode-enable-radix-cache on decode"),
    "retraction_backup": (str, ("cpu_tensor", "host_pool", "none"), "--disaggregation-decode-retraction-backup"),
    "deferred_release": (bool, None, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE on decode"),
    "transfer_backend": (str, ("mooncake_tcp", "mooncake", "nixl"), "--disaggregation-transfer-backend"),
    "router": (str, ("sglang-router", "mini-lb"), "the load balancer"),
}
# live knob -> (role, agent kind, its parameter, type, minimum)
LIVE_KNOBS = {
    "prefill_input_limit": ("prefill", "input_limit", "prefill_max_input_len", int, 1),
    "chunked_prefill": ("prefill", "chunked_prefill", "size", int, 1),
    "deferred_release_timeout_s": ("decode", "deferred_release_timeout", "s", float, 1e-3),
    "decode_reservation": ("decode", "retract", "reserve", int, 1),
}
# the checkers a scenario can name (kvchaos.oracles), with the options each takes
CHECKS = {
    "isolation": {"partial_len": int, "echo_rate": float},
    # a probe's replies are judged by its contract; a real model's reference is not in the schema
    "integrity": {"min_judged": float, "tie_nats": float},
    "sensitivity": {"echo_rate": float},
    "http_semantics": {},
    "liveness": {"bound_s": float, "pool_tolerance_tokens": int},
    "kv_lifecycle": {"tolerance_s": float, "skew_s": float},
    "page_ownership": {},
    "abort_semantics": {},
    "retraction": {"min_retractions": int},
    "cache_isolation": {"min_hits": int, "min_cross": int},
    "timing_isolation": {"alpha": float, "min_n": int},
    # the reference is the named plans served alone by a clean single server, taken when the scenario runs
    "differential": {"reference_rids": list},
    # the engine's own defences (the GPU profile's defence arm; kvchaos.oracles.defences)
    "kv_checksum": {"read_logs": bool},
    "kv_canary": {"read_logs": bool},
}
# kvchaos.workload.plan.RequestPlan's fields, as a plan is written (``prompt_chars`` is derived)
PLAN_FIELDS = {"rid": str, "tenant": str, "kind": str, "endpoint": str, "prompt": str, "canaries": list,
               "n_tokens": int, "max_new_tokens": int, "abort_after_ms": (int, float, type(None)),
               "expect_echo": bool, "oversized": bool, "cache_salt": (str, type(None)), "sharing": str,
               "shared_chars": int, "group": (str, type(None)), "after": (str, type(None)),
               "timing": (str, type(None)), "extra": dict}
PLAN_REQUIRED = ("rid", "tenant", "prompt")
ENDPOINTS = ("generate", "completions", "chat")


# --------------------------------------------------------------------------- validation helpers
def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(_type_name(x) for x in t)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(t, t.__name__)


def _check_type(where: str, v, t):
    """``v`` as type ``t`` (an int is a float; a bool is never a number)."""
    ts = t if isinstance(t, tuple) else (t,)
    if isinstance(v, bool) and bool not in ts:
        raise ScenarioError(f"{where}={v!r}: must be {_type_name(t)}")
    if float in ts and isinstance(v, int) and not isinstance(v, bool):
        return float(v) if int not in ts else v
    if not isinstance(v, ts):
        raise ScenarioError(f"{where}={v!r}: must be {_type_name(t)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ScenarioError(f"{where}={v!r}: must be finite")
    return v


def _obj(where: str, d, allowed, required=()) -> dict:
    if not isinstance(d, dict):
        raise ScenarioError(f"{where}: must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ScenarioError(f"{where}: missing field(s) {missing}")
    return d


def _choice(where: str, v, allowed):
    if v not in allowed:
        raise ScenarioError(f"{where}={v!r}: one of {list(allowed)}")
    return v


def _json_value(where: str, v):
    """Params and attributes are plain JSON (numbers, strings, booleans, null, lists, objects)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ScenarioError(f"{where}={v!r}: must be finite")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ScenarioError(f"{where}: key {k!r} must be a string")
            _json_value(f"{where}.{k}", x)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _json_value(f"{where}[{i}]", x)
    elif not isinstance(v, (str, int, float, bool, type(None))):
        raise ScenarioError(f"{where}={v!r}: not a JSON value")
    return v


# --------------------------------------------------------------------------- deployment
@dataclass
class Deployment:
    restart: dict = field(default_factory=dict)
    live: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str = "deployment") -> "Deployment":
        d = _obj(where, d, ("restart", "live"))
        restart = dict(_obj(f"{where}.restart", d.get("restart", {}), RESTART_KNOBS))
        for k, v in restart.items():
            t, allowed, _doc = RESTART_KNOBS[k]
            restart[k] = _check_type(f"{where}.restart.{k}", v, t)
            if allowed is not None:
                _choice(f"{where}.restart.{k}", v, allowed)
            if t is int and v < 1:
                raise ScenarioError(f"{where}.restart.{k}={v!r}: must be >= 1")
        if "layout" in restart:
            try:
                parse_layout(restart["layout"])
            except LayoutError as e:
                raise ScenarioError(f"{where}.restart.layout: {e}") from None
        if "engine_version" in restart and not re.fullmatch(r"\d+\.\d+\.\d+(\.\w+)?", restart["engine_version"]):
            raise ScenarioError(f"{where}.restart.engine_version={restart['engine_version']!r}: a release "
                                "number such as 0.5.23")
        ctx = restart.get("context_length")
        live = dict(_obj(f"{where}.live", d.get("live", {}), LIVE_KNOBS))
        for k, v in live.items():
            _role, _kind, _param, t, lo = LIVE_KNOBS[k]
            live[k] = _check_type(f"{where}.live.{k}", v, t)
            if live[k] < lo:
                raise ScenarioError(f"{where}.live.{k}={v!r}: must be >= {lo}")
        if ctx is not None and live.get("prefill_input_limit", 0) > ctx:
            raise ScenarioError(f"{where}.live.prefill_input_limit={live['prefill_input_limit']}: over the "
                                f"context length {ctx} (the engine's own limit stays below it)")
        return cls(restart, live)

    def to_dict(self) -> dict:
        return {"restart": dict(sorted(self.restart.items())), "live": dict(sorted(self.live.items()))}

    @classmethod
    def from_spec(cls, spec, layout: str | None = None, engine_version: str | None = None) -> "Deployment":
        """The restart knobs a cluster spec (:class:`kvchaos.cluster.spec.ClusterSpec`) runs with: what a
        scenario written by a run records of its cluster."""
        r: dict = {}
        if engine_version:
            r["engine_version"] = engine_version
        if layout:
            r["layout"] = layout
        for k in ("pool_tokens", "context_length", "transfer_backend", "router"):
            if getattr(spec, k, None) is not None:
                r[k] = getattr(spec, k)
        common = list(getattr(spec, "common_args", []))
        prefill = common + list(getattr(spec, "prefill_args", []))
        decode = common + list(getattr(spec, "decode_args", []))
        r["allow_auto_truncate"] = "--allow-auto-truncate" in common or (
            "--allow-auto-truncate" in prefill and "--allow-auto-truncate" in decode)
        r["decode_radix_cache"] = "--disaggregation-decode-enable-radix-cache" in decode
        size = flag_value(prefill, "--chunked-prefill-size")
        if size is not None and size.lstrip("-").isdigit() and int(size) >= 1:
            r["chunked_prefill_size"] = int(size)
        ppool = flag_value(list(getattr(spec, "prefill_args", [])), "--max-total-tokens")  # after the argv's own
        if ppool is not None and ppool.isdigit() and int(ppool) != getattr(spec, "pool_tokens", None):
            r["prefill_pool_tokens"] = int(ppool)
        backup = flag_value(decode, "--disaggregation-decode-retraction-backup")
        if backup in RESTART_KNOBS["retraction_backup"][1]:
            r["retraction_backup"] = backup
        env = dict(getattr(spec, "env", {}) or {})
        if "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE" in env:
            r["deferred_release"] = env["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"].lower() in ("1", "true")
        return cls(r, {})

    def differs(self, actual: "Deployment") -> list[str]:
        """The restart knobs this deployment asks for that ``actual`` (a running cluster's) does not have."""
        out = []
        for k, v in sorted(self.restart.items()):
            got = actual.restart.get(k, False if RESTART_KNOBS[k][0] is bool else None)
            if got != v:
                out.append(f"{k}: the scenario wants {v!r}, the cluster has {got!r}")
        return out

    def restart_key(self) -> str:
        """Scenarios with the same key run on the same cluster; a different key is a cluster start."""
        return json.dumps(dict(sorted(self.restart.items())), sort_keys=True)

    def live_ops(self) -> list["Op"]:
        """The live knobs as agent ops, armed when the method starts and healed when it ends."""
        ops = []
        for k, v in sorted(self.live.items()):
            role, kind, param, _t, _lo = LIVE_KNOBS[k]
            params = {param: v}
            if kind == "retract":
                params["interval"] = 0  # the reservation only: no test-trigger retraction
            ops.append(Op(at_s=0.0, injector="agent", role=role, kind=kind, params=params, knob=k))
        return ops

    def spec_overrides(self, spec) -> dict:
        """The :class:`kvchaos.cluster.spec.ClusterSpec` fields these knobs set on ``spec`` (its argument
        lists and environment extended, not replaced). ``layout`` and ``engine_version`` are the caller's:
        the cluster factory turns them into a model and an interpreter."""
        r = self.restart
        out: dict = {}
        if "pool_tokens" in r:
            out["pool_tokens"] = r["pool_tokens"]
        if "context_length" in r:
            out["context_length"] = r["context_length"]
        if "transfer_backend" in r:
            out["transfer_backend"] = r["transfer_backend"]
        if "router" in r:
            out["router"] = r["router"]
        common, prefill, decode = list(spec.common_args), list(spec.prefill_args), list(spec.decode_args)
        env = dict(spec.env)
        if r.get("allow_auto_truncate"):
            common.append("--allow-auto-truncate")
        if "chunked_prefill_size" in r:
            prefill = _set_flag(prefill, "--chunked-prefill-size", str(r["chunked_prefill_size"]))
        if "prefill_pool_tokens" in r:  # the last --max-total-tokens wins over the one from pool_tokens
            prefill = _set_flag(prefill, "--max-total-tokens", str(r["prefill_pool_tokens"]))
        if r.get("decode_radix_cache"):
            decode.append("--disaggregation-decode-enable-radix-cache")
        if "retraction_backup" in r:
            decode = _set_flag(decode, "--disaggregation-decode-retraction-backup", r["retraction_backup"])
        if "deferred_release" in r:
            env["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] = "1" if r["deferred_release"] else "0"
        if common != spec.common_args:
            out["common_args"] = common
        if prefill != spec.prefill_args:
            out["prefill_args"] = prefill
        if decode != spec.decode_args:
            out["decode_args"] = decode
        if env != spec.env:
            out["env"] = env
        return out


def _set_flag(args: list, flag: str, value: str) -> list:
    """``args`` with ``flag value`` set once (an earlier value replaced)."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(args)
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out + [flag, value]


# --------------------------------------------------------------------------- nemesis
@dataclass
class Op:
    """One timed nemesis operation. ``at_s``: seconds after the method starts; ``heal_s``: when it is
    healed (None: when the method ends — every op is healed then, whatever happened). ``after``: the
    index of an earlier op this one waits for (an ``action`` that aborts requests once a hold parked
    them); ``delay_s``: how long after that op parked its request (or armed) the action is carried out,
    waited out even when the workload ends first (a write released seconds after its request was aborted,
    past decode's deferred-release timeout: the late write needs the wait, not more traffic);
    ``knob``: the live deployment knob it stands for (written by :meth:`Deployment.live_ops`); ``on``: an
    event it waits for, ``{"role", "ev"[, "rid"][, "phase"][, "op"]}`` — an agent event of that role (one
    naming the fault of op ``op``, else of the op in ``after``: the ``fault_fired`` of a ``fail`` it then
    heals) or the client's
    ``first_byte`` of a request — and ``delay_s`` then counts from that event's own time (an abort 0-400 ms
    after a transfer started). A process op or an action may wait (``after``, ``on``); each that waits does
    so on its own, so one waiting does not hold up another (writes parked in another order than drawn).
    ``heal``: an action that heals the op named in ``after`` (SIGCONT of a stopped role, a fault's heal)."""
    at_s: float
    injector: str
    kind: str
    role: str | None = None
    target: dict | None = None
    params: dict = field(default_factory=dict)
    count: int | None = None
    heal_s: float | None = None
    proxy: str | None = None
    stream: str | None = None
    toxicity: float | None = None
    rids: list | None = None
    after: int | None = None
    knob: str | None = None
    delay_s: float | None = None
    on: dict | None = None

    FIELDS = {
        "agent": ("role", "kind", "target", "params", "count"),
        "proxy": ("proxy", "kind", "stream", "toxicity", "params"),
        "process": ("role", "kind", "after", "on", "delay_s"),
        "action": ("kind", "rids", "after", "on", "delay_s"),
    }

    @property
    def waits(self) -> bool:
        """It waits for another op or an event before it acts."""
        return self.after is not None or self.on is not None

    def named_rids(self) -> list:
        """The requests it names: those it aborts, targets, or whose event it waits for."""
        return list(self.rids or []) + [d["rid"] for d in (self.target, self.on) if d and "rid" in d]

    @classmethod
    def from_dict(cls, d, where: str, n_before: int = 0) -> "Op":
        inj = _choice(f"{where}.injector", (d or {}).get("injector") if isinstance(d, dict) else None, INJECTORS)
        allowed = ("at_s", "heal_s", "injector", "knob") + cls.FIELDS[inj]
        d = _obj(where, d, allowed, required=("at_s", "injector", "kind"))
        at = _check_type(f"{where}.at_s", d["at_s"], float)
        if at < 0:
            raise ScenarioError(f"{where}.at_s={at!r}: must be >= 0 (seconds after the method starts)")
        heal = d.get("heal_s")
        if heal is not None:
            heal = _check_type(f"{where}.heal_s", heal, float)
            if heal <= at:
                raise ScenarioError(f"{where}.heal_s={heal!r}: must be after at_s={at!r}")
        op = cls(at_s=float(at), heal_s=None if heal is None else float(heal), injector=inj, kind=d["kind"])
        if d.get("knob") is not None:
            op.knob = _choice(f"{where}.knob", d["knob"], LIVE_KNOBS)
        if inj == "agent":
            op.role = _choice(f"{where}.role", d.get("role"), ROLES)
            _choice(f"{where}.kind", d["kind"], AGENT_KINDS)
            if d.get("target") is not None:
                t = _obj(f"{where}.target", d["target"], TARGET_KEYS)
                if len(t) != 1:
                    raise ScenarioError(f"{where}.target={t!r}: exactly one of {list(TARGET_KEYS)}")
                (k, v), = t.items()
                if k == "rid_regex":
                    try:
                        re.compile(_check_type(f"{where}.target.rid_regex", v, str))
                    except re.error as e:
                        raise ScenarioError(f"{where}.target.rid_regex={v!r}: not a regular expression ({e})") from None
                elif k == "room":
                    _check_type(f"{where}.target.room", v, int)
                elif k == "any":
                    _check_type(f"{where}.target.any", v, bool)
                else:
                    _check_type(f"{where}.target.{k}", v, str)
                op.target = dict(t)
            op.params = dict(_json_value(f"{where}.params", _check_type(f"{where}.params", d.get("params", {}), dict)))
            if d.get("count") is not None:
                op.count = _check_type(f"{where}.count", d["count"], int)
                if op.count < 1:
                    raise ScenarioError(f"{where}.count={op.count}: must be >= 1 (null: the kind's default)")
        elif inj == "proxy":
            op.proxy = _choice(f"{where}.proxy", d.get("proxy"), PROXIES)
            _choice(f"{where}.kind", d["kind"], TOXIC_TYPES)
            op.stream = _choice(f"{where}.stream", d.get("stream", "downstream"), STREAMS)
            tox = _check_type(f"{where}.toxicity", d.get("toxicity", 1.0), float)
            if not 0 <= tox <= 1:
                raise ScenarioError(f"{where}.toxicity={tox!r}: must be in [0, 1]")
            op.toxicity = float(tox)
            params = _obj(f"{where}.params", d.get("params", {}), TOXIC_TYPES[d["kind"]] + ("seed",))
            for k, v in params.items():
                _check_type(f"{where}.params.{k}", v, (int, float))
                if v < 0:
                    raise ScenarioError(f"{where}.params.{k}={v!r}: must be >= 0")
            op.params = dict(params)
        elif inj == "process":
            op.role = _choice(f"{where}.role", d.get("role"), PROCESS_ROLES)
            _choice(f"{where}.kind", d["kind"], PROCESS_KINDS)
            op._trigger(d, where, n_before)
        else:
            _choice(f"{where}.kind", d["kind"], ACTION_KINDS)
            if d["kind"] == "abort" or d.get("rids") is not None:  # a release names its hold (after)
                rids = _check_type(f"{where}.rids", d.get("rids"), list)
                if not rids or not all(isinstance(r, str) and r for r in rids):
                    raise ScenarioError(f"{where}.rids={rids!r}: a non-empty list of request ids")
                op.rids = list(rids)
            op._trigger(d, where, n_before)
            if d["kind"] in ("release", "heal") and op.after is None:
                raise ScenarioError(f"{where}: a {d['kind']} names the op it acts on in 'after'")
        return op

    def _trigger(self, d: dict, where: str, n_before: int) -> None:
        """``after``, ``on`` and ``delay_s`` of a process op or an action, checked."""
        if d.get("after") is not None:
            a = _check_type(f"{where}.after", d["after"], int)
            if not 0 <= a < n_before:
                raise ScenarioError(f"{where}.after={a}: the index of an earlier op (0..{n_before - 1})")
            self.after = a
        if d.get("on") is not None:
            on = _obj(f"{where}.on", d["on"], ON_KEYS, required=("role", "ev"))
            _choice(f"{where}.on.role", on["role"], ON_ROLES)
            for k in ("ev", "rid", "phase"):
                if k in on and not (isinstance(on[k], str) and on[k]):
                    raise ScenarioError(f"{where}.on.{k}={on[k]!r}: a non-empty string")
            if "op" in on:  # the event names that earlier op's fault (with ``after`` naming another op)
                o = _check_type(f"{where}.on.op", on["op"], int)
                if not 0 <= o < n_before:
                    raise ScenarioError(f"{where}.on.op={o}: the index of an earlier op (0..{n_before - 1})")
            if on["role"] == "client":
                _choice(f"{where}.on.ev", on["ev"], ON_CLIENT_EVENTS)
                if "rid" not in on:
                    raise ScenarioError(f"{where}.on: a client event names the request (rid)")
            self.on = dict(on)
        if d.get("delay_s") is not None:
            delay = _check_type(f"{where}.delay_s", d["delay_s"], float)
            if not self.waits:
                raise ScenarioError(f"{where}.delay_s={delay!r}: a delay counts from the op named in 'after' or "
                                    "the event in 'on', and there is neither (use at_s for a time after the method "
                                    "starts)")
            if not 0 <= delay <= MAX_DELAY_S:
                raise ScenarioError(f"{where}.delay_s={delay!r}: must be in [0, {MAX_DELAY_S:g}] seconds")
            self.delay_s = float(delay)

    def to_dict(self) -> dict:
        d = {"at_s": float(self.at_s), "injector": self.injector, "kind": self.kind}
        if self.heal_s is not None:
            d["heal_s"] = float(self.heal_s)
        if self.knob is not None:
            d["knob"] = self.knob
        if self.injector == "agent":
            d.update(role=self.role, params=dict(self.params))
            if self.target is not None:
                d["target"] = dict(self.target)
            if self.count is not None:
                d["count"] = self.count
        elif self.injector == "proxy":
            d.update(proxy=self.proxy, stream=self.stream, toxicity=self.toxicity, params=dict(self.params))
        else:
            if self.injector == "process":
                d["role"] = self.role
            elif self.rids is not None:
                d["rids"] = list(self.rids)
            if self.after is not None:
                d["after"] = self.after
            if self.on is not None:
                d["on"] = dict(self.on)
            if self.delay_s is not None:
                d["delay_s"] = float(self.delay_s)
        return d

    @property
    def mutation(self) -> bool:
        return self.injector == "agent" and self.kind in AGENT_MUTATIONS


# --------------------------------------------------------------------------- traffic
@dataclass
class Traffic:
    plans: list = field(default_factory=list)  # RequestPlan dicts (kvchaos.workload.plan)
    concurrency: int = 8
    timeout_s: float = 60.0
    via: str = "router"
    # stop sending once the cluster is seen wedged (kvchaos.workload.driver); None: send every plan
    stall_s: float | None = None
    # rid -> the nemesis op (index) a plan waits for before it is sent: B once A's write is parked, the
    # requests beside a held write once a planted fault fired (the detection matrix's double_alloc)
    gates: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str = "traffic") -> "Traffic":
        d = _obj(where, d, ("plans", "concurrency", "timeout_s", "via", "stall_s", "gates"), required=("plans",))
        plans = _check_type(f"{where}.plans", d["plans"], list)
        seen: set = set()
        out = []
        for i, p in enumerate(plans):
            w = f"{where}.plans[{i}]"
            p = dict(_obj(w, p, tuple(PLAN_FIELDS) + ("prompt_chars",), required=PLAN_REQUIRED))
            p.pop("prompt_chars", None)
            for k, v in p.items():
                p[k] = _check_type(f"{w}.{k}", v, PLAN_FIELDS[k])
            if not p["rid"]:
                raise ScenarioError(f"{w}.rid: empty")
            if p["rid"] in seen:
                raise ScenarioError(f"{w}.rid={p['rid']!r}: given twice (a request id names one request)")
            if "endpoint" in p:
                _choice(f"{w}.endpoint", p["endpoint"], ENDPOINTS)
            if p.get("after") is not None and p["after"] not in seen:
                raise ScenarioError(f"{w}.after={p['after']!r}: not the rid of an earlier plan")
            seen.add(p["rid"])
            out.append(p)
        conc = _check_type(f"{where}.concurrency", d.get("concurrency", 8), int)
        if conc < 1:
            raise ScenarioError(f"{where}.concurrency={conc}: must be >= 1")
        timeout = _check_type(f"{where}.timeout_s", d.get("timeout_s", 60.0), float)
        if timeout <= 0:
            raise ScenarioError(f"{where}.timeout_s={timeout}: must be > 0")
        via = _choice(f"{where}.via", d.get("via", "router"), VIAS)
        if via == "pd":  # the driver's pd_direct mode speaks SGLang's /generate only
            for i, p in enumerate(out):
                if p.get("endpoint", "generate") != "generate":
                    raise ScenarioError(f"{where}.plans[{i}].endpoint={p['endpoint']!r}: traffic via 'pd' (straight to "
                                        "prefill and decode) sends /generate only; the OpenAI routes need via 'router'")
        stall = d.get("stall_s")
        if stall is not None:
            stall = float(_check_type(f"{where}.stall_s", stall, float))
            if stall <= 0:
                raise ScenarioError(f"{where}.stall_s={stall}: must be > 0 (or absent: send every plan)")
        gates = _check_type(f"{where}.gates", d.get("gates", {}), dict)
        for rid, i in gates.items():
            if rid not in seen:
                raise ScenarioError(f"{where}.gates.{rid}: no plan's rid")
            if _check_type(f"{where}.gates.{rid}", i, int) < 0:
                raise ScenarioError(f"{where}.gates.{rid}={i}: the index of a nemesis op")
        return cls(out, conc, float(timeout), via, stall, dict(gates))

    def to_dict(self) -> dict:
        # stall_s and gates only where set: every scenario written before them keeps its digest. A gate of a
        # plan no longer here (a shrink or a search dropped it) goes with it
        rids = {p["rid"] for p in self.plans}
        gates = {r: i for r, i in self.gates.items() if r in rids}
        return {"plans": [dict(p) for p in self.plans], "concurrency": self.concurrency,
                "timeout_s": self.timeout_s, "via": self.via,
                **({"stall_s": self.stall_s} if self.stall_s is not None else {}),
                **({"gates": gates} if gates else {})}

    def request_plans(self) -> list:
        """The plans as :class:`kvchaos.workload.plan.RequestPlan` objects (what the driver sends)."""
        return [RequestPlan(**p) for p in self.plans]


# --------------------------------------------------------------------------- the scenario
@dataclass
class Scenario:
    name: str
    traffic: Traffic
    deployment: Deployment = field(default_factory=Deployment)
    nemesis: list = field(default_factory=list)  # Op
    checks: list = field(default_factory=lambda: [{"name": "isolation"}])
    expect: dict = field(default_factory=dict)  # checker name -> required status
    seed: int | None = None
    origin: dict = field(default_factory=dict)  # where it came from: a test id, a fuzz parent, ...

    TOP = ("schema", "name", "seed", "deployment", "traffic", "nemesis", "checks", "expect", "origin")

    @classmethod
    def from_dict(cls, d) -> "Scenario":
        if not isinstance(d, dict):
            raise ScenarioError(f"a scenario is a JSON object, got {type(d).__name__}")
        schema = d.get("schema")
        if schema != SCHEMA:
            raise ScenarioError(f"schema={schema!r}: this kvchaos reads {SCHEMA!r} only"
                                + (" (a newer kvchaos wrote it?)" if isinstance(schema, str)
                                   and schema.startswith("kvchaos.scenario/") else ""))
        d = _obj("scenario", d, cls.TOP, required=("schema", "name", "traffic"))
        name = _check_type("name", d["name"], str)
        if not name or any(c in name for c in "/\\"):
            raise ScenarioError(f"name={name!r}: non-empty, no path separators (it names files)")
        seed = d.get("seed")
        if seed is not None:
            _check_type("seed", seed, int)
        traffic = Traffic.from_dict(d["traffic"])
        deployment = Deployment.from_dict(d.get("deployment", {}))
        ops_raw = _check_type("nemesis", d.get("nemesis", []), list)
        ops = [Op.from_dict(o, f"nemesis[{i}]", i) for i, o in enumerate(ops_raw)]
        rids = {p["rid"] for p in traffic.plans}
        for i, op in enumerate(ops):
            for r in op.rids or []:
                if r not in rids:
                    raise ScenarioError(f"nemesis[{i}].rids: {r!r} is no plan's rid")
            if op.target and "rid" in op.target and op.target["rid"] not in rids:
                raise ScenarioError(f"nemesis[{i}].target.rid={op.target['rid']!r}: no plan's rid")
            if op.injector == "action" and op.kind == "release":
                a = op.after
                if a is None or not (ops[a].injector == "agent" and ops[a].kind in ("hold", "park")):
                    raise ScenarioError(f"nemesis[{i}]: a release names the hold or park it ends in 'after'")
            if op.injector == "action" and op.kind == "heal" and ops[op.after].injector == "action":
                raise ScenarioError(f"nemesis[{i}]: a heal names a fault in 'after', not an action")
        for rid, g in traffic.gates.items():
            if g >= len(ops):
                raise ScenarioError(f"traffic.gates.{rid}={g}: no nemesis op {g} ({len(ops)} ops)")
        checks_raw = _check_type("checks", d.get("checks", [{"name": "isolation"}]), list)
        checks, names = [], set()
        for i, c in enumerate(checks_raw):
            w = f"checks[{i}]"
            if not isinstance(c, dict) or "name" not in c:
                raise ScenarioError(f"{w}: an object with a name, one of {sorted(CHECKS)}")
            n = _choice(f"{w}.name", c["name"], CHECKS)
            if n in names:
                raise ScenarioError(f"{w}.name={n!r}: given twice (each oracle judges a run once)")
            names.add(n)
            opts = _obj(w, c, ("name",) + tuple(CHECKS[n]))
            clean = {"name": n}
            for k, v in opts.items():
                if k != "name":
                    clean[k] = _check_type(f"{w}.{k}", v, CHECKS[n][k])
            if n == "differential":
                ref = clean.get("reference_rids")
                if not ref or any(r not in rids for r in ref):
                    raise ScenarioError(f"{w}.reference_rids={ref!r}: a non-empty list of the plans' rids")
            if n == "liveness" and "bound_s" not in clean:
                raise ScenarioError(f"{w}: liveness needs bound_s (seconds a request may take)")
            checks.append(clean)
        expect = _obj("expect", d.get("expect", {}), CHECKS)
        for k, v in expect.items():
            _choice(f"expect.{k}", v, STATUSES)
            if k not in names:
                raise ScenarioError(f"expect.{k}: no check named {k!r} in checks")
        origin = _json_value("origin", _check_type("origin", d.get("origin", {}), dict))
        return cls(name=name, seed=seed, deployment=deployment, traffic=traffic, nemesis=ops, checks=checks,
                   expect=dict(expect), origin=dict(origin))

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "name": self.name, "seed": self.seed, "deployment": self.deployment.to_dict(),
                "traffic": self.traffic.to_dict(), "nemesis": [o.to_dict() for o in self.nemesis],
                "checks": [dict(c) for c in self.checks], "expect": dict(self.expect), "origin": dict(self.origin)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "<scenario>") -> "Scenario":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScenarioError(f"{source}: not JSON ({e})") from None
        try:
            return cls.from_dict(d)
        except ScenarioError as e:
            raise ScenarioError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path) -> "Scenario":
        p = Path(path)
        if p.is_dir():
            p = p / FILE
        if not p.is_file():
            raise ScenarioError(f"{p}: no such scenario file")
        return cls.from_json(p.read_text(), str(p))

    def save(self, path) -> Path:
        p = Path(path)
        if p.is_dir():
            p = p / FILE
        self.validate()
        p.write_text(self.to_json())
        return p

    def validate(self) -> "Scenario":
        """The scenario as it would be read back (what a hand-built one must pass before it runs)."""
        return Scenario.from_dict(json.loads(json.dumps(self.to_dict())))

    def ops(self) -> list[Op]:
        """What the runner arms, in order: the live knobs (at 0 s), then the nemesis schedule, each op's
        ``after`` moved by the live ops put before it (it names a nemesis index: an abort that waited
        for "op 0", its hold, had waited for the first live knob instead, and fired before anything was
        held; a release of "op 0" released the knob, and the run died)."""
        live = self.deployment.live_ops()
        out = []
        for o in self.nemesis:
            on = dict(o.on, op=o.on["op"] + len(live)) if o.on and "op" in o.on else o.on
            out.append(o if o.after is None and on is o.on else
                       dataclasses.replace(o, after=None if o.after is None else o.after + len(live), on=on))
        return live + out

    def gates(self) -> dict:
        """The plans' gates (``traffic.gates``) on :meth:`ops`' indices (moved by the live ops)."""
        n = len(self.deployment.live_ops())
        return {r: i + n for r, i in self.traffic.gates.items()}

    def digest(self) -> str:
        """A short id of the scenario's content (its name and origin left out): equal scenarios, equal ids."""
        d = self.validate().to_dict()  # the form it is read back in (0 and 0.0 are one time)
        d.pop("name"), d.pop("origin")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def mutated(self) -> bool:
        """It arms a planted engine bug (a detection test), not only faults and knobs."""
        return any(o.mutation for o in self.nemesis)


def plan_dict(plan) -> dict:
    """A :class:`kvchaos.workload.plan.RequestPlan` as a scenario's plan (``prompt_chars`` left out)."""
    d = dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else dict(plan)
    d.pop("prompt_chars", None)
    return d


# --------------------------------------------------------------------------- from a run's log
PROCESS_FIRED = {"sigkill": "kill", "sigstop": "stop"}


def nemesis_from_log(records, t_method: float, t_end: float | None = None, skipped: list | None = None) -> list[Op]:
    """The nemesis schedule an experiment carried out, from its log's ``fault`` records (each with ``at``,
    the injector's own time): faults armed before the method are at 0 s; a heal before ``t_end`` (when
    the workload ended) is the op's ``heal_s``, later ones are the rollback every op gets. Releases and
    aborts become ``action`` ops after the hold or park they ended. A record that lacks what its op needs
    is left out and said in ``skipped`` (the scenario is then not complete)."""
    ops: list[Op] = []
    by_fault: dict[str, int] = {}
    by_rid_hold: dict[str, int] = {}
    open_proc: dict[str, int] = {}

    def rel(e) -> float:
        return round(max(0.0, float(e.get("at", e.get("wall", t_method))) - t_method), 3)

    def healed_in_method(e) -> bool:
        return t_end is not None and float(e.get("at", e.get("wall", 0))) < t_end

    def add(op: Op) -> int:
        Op.from_dict(op.to_dict(), f"nemesis[{len(ops)}]", len(ops))  # refused here, not in the whole scenario
        ops.append(op)
        return len(ops) - 1

    def _one(e):
        inj, action = e.get("injector"), e.get("action")
        if action == "armed" and inj == "agent":
            target = dict(e.get("target") or {})
            fid = e["fault"]
            i = add(Op(at_s=rel(e), injector="agent", role=e["role"], kind=e["kind"],
                       target=None if target == {"any": True} else target, params=dict(e.get("params") or {}),
                       count=e.get("count")))
            by_fault[fid] = i
            if e["kind"] in ("hold", "park") and "rid" in target:
                by_rid_hold[target["rid"]] = i
        elif action == "armed" and inj == "proxy":
            fid = e["fault"]
            by_fault[fid] = add(Op(at_s=rel(e), injector="proxy", kind=e["kind"], proxy=e["proxy"], stream=e["stream"],
                                   toxicity=float(e["toxicity"]), params=dict(e.get("attributes") or {})))
        elif action == "fired" and inj == "process" and e.get("kind") in PROCESS_FIRED:
            open_proc[e["role"]] = add(Op(at_s=rel(e), injector="process", kind=PROCESS_FIRED[e["kind"]], role=e["role"]))
        elif action == "healed" and inj == "process":
            i = open_proc.pop(e.get("role"), None)
            if i is not None and healed_in_method(e) and rel(e) > ops[i].at_s:
                ops[i].heal_s = rel(e)
        elif action == "healed" and e.get("fault") in by_fault:
            i = by_fault[e["fault"]]
            if healed_in_method(e) and rel(e) > ops[i].at_s:
                ops[i].heal_s = rel(e)
        elif action == "released" and e.get("fault") in by_fault:
            rid = (e.get("target") or {}).get("rid")
            add(Op(at_s=rel(e), injector="action", kind="release", rids=[rid] if rid else None,
                   after=by_fault[e["fault"]]))
        elif action == "abort_request" and e.get("rid"):
            after = by_rid_hold.get(e["rid"]) if e.get("held") else None
            add(Op(at_s=rel(e), injector="action", kind="abort", rids=[e["rid"]], after=after))

    faults = sorted((e for e in records if e.get("ev") == "fault"), key=lambda e: e.get("at", e.get("wall", 0)))
    for e in faults:
        try:
            _one(e)
        except (KeyError, TypeError, ValueError) as err:
            if skipped is not None:
                skipped.append(f"fault record {e.get('fault') or e.get('kind')!r} ({e.get('action')}): "
                               f"not an op ({type(err).__name__}: {err})")
    return ops
