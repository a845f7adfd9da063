"""A scenario's nemesis schedule carried out, and its checkers built (the runner's side of
:mod:`kvchaos.workload.scenario`). The schedule: each op armed at its time, healed at its own
``heal_s`` and, whatever happens, every op still armed healed in :meth:`Schedule.heal` (the runner calls
it in a ``finally``).

It drives the fault injectors through the handles of the kit it is given (``faults.FaultKit``: the
agent client, the network proxy, process faults) and aborts requests through the cluster; it imports
none of them (``faults`` imports ``kvchaos``, never the reverse). Every wait is bounded: an op that
waits for another (``after``: an abort once a hold parked its request) gives up after ``wait_s`` with
a :class:`NemesisError` naming both ops; one that waits for an event (``on``: an abort once a transfer
started, a kill once a hold parked, a heal once a fault fired) gives up when the method ends.

The two client calls a scenario's ops and checkers need live here too (suites import them from
:mod:`kvchaos.suite`): :func:`abort_on_both` and :func:`single_server_reference`.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvchaos import httpclient, oracles
from kvchaos.cluster.layouts import pace_of
from kvchaos.workload.scenario import CHECKS, MAX_DELAY_S, Op, Scenario, ScenarioError


def single_server_reference(server, plans, timeout_s: float = 120.0, concurrency: int = 1, margins: bool = False):
    """``Differential``'s reference (and ``Integrity``'s for a served model that is not a probe): each
    plan's prompt served greedy, with its own ``max_new_tokens``, by ``server`` (a clean single server),
    when the checker runs (after the run).

    ``concurrency`` > 1 sends that many at a time (a reference of 32 long replies one by one is thousands
    of engine steps): the caller keeps them inside the server's pool, so none is retracted. That is
    checked, not assumed: a reply whose ``meta_info.num_retractions`` (the engine's own count) is not 0,
    or is missing, is served again alone. ``margins``: each reply also carries ``top2_margin``, per
    output position the log-probability gap between the engine's first and second choice
    (``return_logprob`` with ``top_logprobs_num`` 2) — where a real model's greedy choice is a near-tie,
    batch composition can turn it (:class:`kvchaos.oracles.Integrity`'s ``tie_nats``)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    extra = {"return_logprob": True, "top_logprobs_num": 2} if margins else {}

    def one(p):
        r = httpclient.post(server.endpoints.router + "/generate", timeout=timeout_s,
                       json={"text": p.prompt, "sampling_params": {"max_new_tokens": p.max_new_tokens,
                                                                   "temperature": 0}, **extra})
        r.raise_for_status()
        out = r.json()
        if margins and isinstance(out, dict):
            out["top2_margin"] = top2_margins((out.get("meta_info") or {}).get("output_top_logprobs"))
        return p.rid, out

    def ref(_events):
        if concurrency == 1 or len(plans) < 2:
            return dict(one(p) for p in plans)
        with ThreadPoolExecutor(min(concurrency, len(plans))) as pool:
            out = dict(pool.map(one, plans))
        for p in plans:
            if ((out[p.rid] or {}).get("meta_info") or {}).get("num_retractions") != 0:
                out[p.rid] = one(p)[1]
        return out
    ref.rids = [p.rid for p in plans]  # what a scenario records of it (check_spec, below)
    return ref


def top2_margins(top) -> list:
    """Per output position, the first choice's log-probability minus the second's, from SGLang's
    ``output_top_logprobs`` (a list per position of ``[logprob, token_id, text]``); None where a position
    has fewer than two."""
    out = []
    for pos in top or ():
        lps = sorted((x[0] for x in pos or () if isinstance(x, (list, tuple)) and x and isinstance(x[0], (int, float))),
                     reverse=True)
        out.append(lps[0] - lps[1] if len(lps) >= 2 else None)
    return out


def abort_on_both(cluster, rid: str) -> dict:
    """``POST /abort_request {"rid": rid}`` to prefill and to decode (sglang-router has no abort
    endpoint); role -> HTTP status, or the error."""
    out = {}
    for role in ("prefill", "decode"):
        try:
            out[role] = httpclient.post(f"{getattr(cluster.endpoints, role)}/abort_request", json={"rid": rid},
                                   timeout=10).status_code
        except httpx.HTTPError as e:
            out[role] = repr(e)
    return out


# an abort counts as sent to a held request only this far inside the hold's own bound (max_hold_s): one
# sent as the bound ran out may reach a request already let go, whose complete reply is then no lost abort
HELD_MARGIN_S = 0.5
WAIT_S = 60.0  # how long an op waits for the op it comes after (at pace 1)
WAIT_SLICE_S = 0.5  # how often a wait for a hold to park looks whether the method has ended
POLL_S = 0.02  # how often an ``on`` trigger reads the events it waits for
# the stage an abort triggered by an event (Op.on) lands at, for abort_semantics
ON_STAGE = {"transfer_start": "transferring", "write_end": "transferring", "first_byte": "decoding",
            "kv_prealloc": "decode_prealloc", "bootstrap_queued": "prefill_waiting"}


class NemesisError(RuntimeError):
    pass


def _who(i) -> str:
    return f"op {i}" if isinstance(i, int) else str(i)


class Schedule:
    """``ops`` (:class:`kvchaos.workload.scenario.Op`: a scenario's
    :meth:`~kvchaos.workload.scenario.Scenario.ops`) on ``kit`` (``.agent``, ``.net``, ``.proc``) and
    ``cluster`` (for ``action`` aborts). Times are seconds after :meth:`start`."""

    def __init__(self, ops: list[Op], kit, cluster=None, *, wait_s: float | None = None, clock=time.monotonic,
                 abort=None, sleep=time.sleep, client_log=None, gates: dict | None = None):
        self.ops, self.kit, self.cluster = list(ops), kit, cluster
        self.gates = dict(gates or {})  # rid -> the op (index) that plan waits for (:meth:`gate`)
        for rid, j in self.gates.items():
            if not 0 <= j < len(self.ops):
                raise NemesisError(f"plan {rid} waits for op {j}: there are {len(self.ops)} ops")
        self.happened = [threading.Event() for _ in self.ops]  # op i armed, acted or skipped
        # an op waits for the one before it at most WAIT_S at the cluster's pace (ClusterSpec.pace: a like: probe
        # on CPU reaches a transfer that many times later; a DeepSeek-shaped one parked its second victim's write
        # after more than 60 s)
        self.wait_s = WAIT_S * pace_of(cluster) if wait_s is None else wait_s
        self.clock, self.sleep = clock, sleep
        self.client_log = client_log  # the experiment's log: the client events an ``on`` may wait for
        self.handles: dict[int, object] = {}
        self.done: set[int] = set()  # ops carried out (armed, or an action taken): each once
        self.held: dict[int, dict] = {}  # op index of a hold or park -> the agent's event: it parked a request
        self.healed: set[int] = set()
        self.released: set[int] = set()  # holds and parks a release action let go
        self.records: list[dict] = []  # what happened, op by op: armed / healed / action / error
        self.errors: list[BaseException] = []  # raised by ops that waited on threads of their own
        self.t0: float | None = None
        self.stop = threading.Event()
        self._abort = abort
        self._lock = threading.Lock()
        self._events: dict[str, tuple] = {}  # role -> (when read, the agent's events then)
        self._events_lock = threading.Lock()

    # ------------------------------------------------------------------ the timeline
    def start(self) -> None:
        """Time 0, and every op due at 0 with nothing to wait for armed now (before traffic starts)."""
        self.t0 = self.clock()
        for i, op in enumerate(self.ops):
            if op.at_s == 0 and not op.waits:
                self._arm(i)

    def run(self) -> list[dict]:
        """Arm and heal the rest in time order (the experiment's ``during`` action). Returns the records.
        An op that waits (``after``, ``on``) waits on a thread of its own from its ``at_s`` on: writes parked
        by holds come in an order of the engine's, and one op waiting for the first of them must not keep
        the others from being aborted (a soak run went red so: a second victim's write parked first)."""
        if self.t0 is None:
            self.start()
        waiting = [threading.Thread(target=self._waiting, args=(i,), name=f"kvchaos-op-{i}", daemon=True)
                   for i, op in enumerate(self.ops) if op.waits and i not in self.done]
        for t in waiting:
            t.start()
        # not what start() already did: an action due at 0 had no handle to say so, and was taken twice
        steps = [(op.at_s, 0, i) for i, op in enumerate(self.ops) if i not in self.done and not op.waits]
        steps += [(op.heal_s, 1, i) for i, op in enumerate(self.ops) if op.heal_s is not None]
        for at, what, i in sorted(steps):
            if self.stop.is_set():
                break
            self._until(at)
            if self.stop.is_set():
                break
            if what == 0:
                self._arm(i)
            else:
                self._heal_one(i)
        # each waiting op ends once the method has ended (or its own wait bound passed), then its delay
        bound = self.wait_s + MAX_DELAY_S + 30
        for t in waiting:
            t.join(timeout=max(0.0, bound))
        if self.errors:
            raise self.errors[0]
        return self.records

    def _waiting(self, i: int) -> None:
        try:
            self._until(self.ops[i].at_s)
            if self.stop.is_set():
                self.done.add(i)
                return self._skip(i, "the method ended before its time")
            self._arm(i)
        except BaseException as e:  # noqa: BLE001 - raised by run(), in the experiment's thread
            self.errors.append(e)
            self.records.append({"op": i, "what": "error", "error": repr(e)})
        finally:
            self.happened[i].set()

    def _until(self, at_s: float) -> None:
        delay = self.t0 + at_s - self.clock()
        if delay > 0:
            self.stop.wait(delay)

    def _skip(self, i: int, why: str) -> None:
        self.records.append({"op": i, "what": "skipped", "at_s": round(self.clock() - self.t0, 3), "why": why})

    # ------------------------------------------------------------------ one op
    def _arm(self, i: int) -> None:
        try:
            self._arm_one(i)
        finally:
            self.happened[i].set()

    def _arm_one(self, i: int) -> None:
        op = self.ops[i]
        self.done.add(i)
        if op.after is not None and not self._wait_for(i, op.after):
            return self._skip(i, f"the method ended before op {op.after}, which it waits for, was armed")
        ev = None
        if op.on is not None:
            ev = self._wait_on(i, op)
            if ev is None:
                return self._skip(i, f"the method ended before {op.on} was seen")
        if op.delay_s:
            # waited out even if the workload ends meanwhile: the op it waits for has fired, and this action
            # is the rest of it (a held write released past decode's release timeout; the schema bounds it).
            # After an event, counted from the event's own time (the engine's clock: time.time())
            wait = op.delay_s if ev is None else float(ev.get("wall", time.time())) + op.delay_s - time.time()
            if wait > 0:
                self.sleep(wait)
        t = round(self.clock() - self.t0, 3)
        if op.injector == "agent":
            h = self._need("agent").arm(op.role, op.kind, target=op.target, params=dict(op.params), count=op.count)
        elif op.injector == "proxy":
            h = self._need("net").toxic(op.proxy, op.kind, stream=op.stream, toxicity=op.toxicity, **op.params)
        elif op.injector == "process":
            proc = self._need("proc")
            h = getattr(proc, op.kind)(op.role)  # kill, stop, restart: the schema's process kinds
        else:
            h = None
            if op.kind == "abort":
                out = {rid: self._abort_logged(i, op, rid) for rid in op.rids}
                self.records.append({"op": i, "what": "action", "kind": "abort", "at_s": t, "status": out})
                return
            held = self.handles.get(op.after)
            if held is None:
                raise NemesisError(f"op {i}: {op.kind} of op {op.after}, which was never armed")
            if op.kind == "heal":
                self._heal_one(op.after)
                self.records.append({"op": i, "what": "action", "kind": "heal", "of": op.after, "at_s": t})
                return
            held.release()
            self.released.add(op.after)
            self.records.append({"op": i, "what": "action", "kind": "release", "of": op.after, "at_s": t})
            return
        with self._lock:
            self.handles[i] = h
        self.records.append({"op": i, "what": "armed", "injector": op.injector, "kind": op.kind, "at_s": t,
                             "id": getattr(h, "id", None)})

    def _wait_on(self, i: int, op: Op) -> dict | None:
        """The event ``op.on`` names (the first logged), with the fault of op ``after`` where it names one;
        None once the method has ended without it. Bounded by the method's own end (every request of it
        bounded by its timeout), not by ``wait_s``: an abort 0.4 s after the transfer of the 90th request
        of a run waits for as long as that request takes to be sent."""
        on = dict(op.on)
        role, ev = on.pop("role"), on.pop("ev")
        # a fault_fired event names its fault: that of op ``on.op``, else of op ``after``; another event
        # (an abort_ingested a release waits for) names none, and ``after`` is only the op it acts on
        of = on.pop("op", op.after if ev == "fault_fired" else None)
        if of is not None and role != "client":
            while of not in self.handles:  # the op whose fault the event names: armed first
                if self.stop.is_set():
                    return None
                self.stop.wait(POLL_S)
            fid = getattr(self.handles.get(of), "id", None)
            if fid is not None:
                on["fault"] = fid
        seen = 0
        while True:
            if role == "client":
                recs = list(getattr(self.client_log, "records", None) or [])
                new, seen = recs[seen:], len(recs)  # the log only grows
            else:
                new = self._agent_events(role)
            for e in new:
                if e.get("ev") == ev and all(e.get(k) == v for k, v in on.items()):
                    return e
            if self.stop.is_set():
                return None
            self.stop.wait(POLL_S)

    def _agent_events(self, role: str) -> list[dict]:
        """The agent's events of ``role``, read at most once per :data:`POLL_S` whatever the number of ops
        waiting (abort_random's 24 aborts each polling the agent every 20 ms would load a 2-core machine
        that also runs both engines)."""
        with self._events_lock:
            t, evs = self._events.get(role, (None, None))
            now = self.clock()
            if t is None or now - t >= POLL_S:
                evs = list(self._need("agent").events(role))
                self._events[role] = (now, evs)
            return evs

    def _abort_logged(self, i: int, op: Op, rid: str):
        """Abort ``rid`` and say so in the kit's log (a ``fault`` record, action ``abort_request``: the stage
        it was held at, or that the event it waited for names, and whether it provably still was held),
        which ``abort_semantics`` judges: an abort the log does not name is never judged."""
        stage, held = None, False
        j = op.after
        if op.on is not None:  # an event set it off: the stage it names, never provably held
            stage = ON_STAGE.get(op.on.get("ev"))
        elif j is not None and j in self.held:
            by, ev = self.ops[j], self.held[j]
            stage = "transferring" if by.kind == "hold" else (by.params or {}).get("stage")
            # held now: the hold parked this very request, was neither healed nor released, and its own bound
            # has not let it go
            bound = float((by.params or {}).get("max_hold_s", 60)) if by.kind == "hold" else math.inf
            held = (ev.get("rid") == rid and j not in self.healed and j not in self.released
                    and time.time() - float(ev.get("wall", 0.0)) < bound - HELD_MARGIN_S)
        at = time.time()
        status = self._abort_one(rid)
        emit = getattr(getattr(self.kit, "log", None), "emit", None)
        if emit is not None:
            emit("fault", action="abort_request", kind="abort", rid=rid, stage=stage, held=held,
                 abort_status=status, at=at, op=i)
        return status

    def _abort_one(self, rid: str):
        if self._abort is not None:
            return self._abort(self.cluster, rid)
        if self.cluster is None:  # the default: POST /abort_request to both servers
            raise NemesisError("an abort action needs the cluster")
        return abort_on_both(self.cluster, rid)

    def gate(self, rid: str) -> None:
        """Block until the op plan ``rid`` waits for (``gates``) has happened — a hold or park: parked a
        request; an op that waits: carried out or skipped; any other: armed — or the method ended. The
        driver calls it before sending the plan. Bounded: an op not armed, or a hold that parks nothing,
        within ``wait_s`` is a :class:`NemesisError` naming the plan and the op."""
        j = self.gates.get(rid)
        if j is None:
            return
        if self.ops[j].waits:
            deadline = self.clock() + self.wait_s + MAX_DELAY_S
            while not self.happened[j].wait(WAIT_SLICE_S):
                if self.stop.is_set():
                    return
                if self.clock() > deadline:
                    raise NemesisError(f"plan {rid} waits for op {j}, which did not happen within "
                                       f"{self.wait_s + MAX_DELAY_S:g} s")
            return
        self._wait_for(f"plan {rid}", j)

    def _wait_for(self, i, j: int) -> bool:
        """Op ``i`` waits until op ``j`` armed and, for a hold or park, parked a request. False when the
        method ended first (the timeline stopped: nothing left to wait for, the action is skipped); an
        error when ``wait_s`` passed with the method still running."""
        deadline = self.clock() + self.wait_s
        while j not in self.handles:
            if self.stop.is_set():
                return False
            if self.clock() > deadline:
                raise NemesisError(f"{_who(i)} waits for op {j}, which was not armed within {self.wait_s} s")
            self.stop.wait(0.02)
        dep = self.ops[j]
        if dep.injector == "agent" and dep.kind in ("hold", "park"):
            # in slices, so the method's end stops the wait: a request that ended before it reached the
            # stage is never parked, and a fuzz run spent 60 s waiting, then lost its verdicts to the error
            while True:
                left = deadline - self.clock()
                if left <= 0:
                    raise NemesisError(f"{_who(i)} waits for op {j} ({dep.kind} on {dep.role}) to park a request: "
                                       f"nothing parked within {self.wait_s} s")
                try:
                    self.held[j] = self.kit.agent.wait_event(dep.role, "fault_fired", timeout=min(left, WAIT_SLICE_S),
                                                             fault=self.handles[j].id, phase="held")
                    return True
                except TimeoutError:
                    if self.stop.is_set():
                        return False
        return True

    def _heal_one(self, i: int) -> None:
        with self._lock:
            h = self.handles.get(i)
            if h is None or i in self.healed:
                return
            self.healed.add(i)
        heal = getattr(h, "heal", None)
        if heal is not None:
            heal()
        self.records.append({"op": i, "what": "healed", "at_s": round(self.clock() - self.t0, 3)})

    def _need(self, what: str):
        need = getattr(self.kit, "need", None)
        if need is not None:
            return need(what)
        got = getattr(self.kit, what, None)
        if got is None:
            raise NemesisError(f"the scenario needs the {what!r} injector, and the kit has none")
        return got

    # ------------------------------------------------------------------ rollback
    def heal(self) -> list[str]:
        """Stop the timeline and heal every op still armed, newest first; every heal is tried. Returns
        the errors (empty when all healed)."""
        self.stop.set()
        errors = []
        for i in sorted(self.handles, reverse=True):
            try:
                self._heal_one(i)
            except Exception as e:  # noqa: BLE001 - heal the others, report every failure
                errors.append(f"op {i} ({self.ops[i].injector} {self.ops[i].kind}): heal failed: {e!r}")
        return errors


# --------------------------------------------------------------------------- checkers
def check_spec(checker) -> dict:
    """A built checker (``kvchaos.oracles``) as a scenario's ``checks`` entry: its name and the options
    bound at its construction. Differential's reference (outputs) becomes the rids it covers; an
    isolation floor other than the default is refused (the schema has no field for it yet)."""
    name = checker.name
    if name not in CHECKS:
        raise ScenarioError(f"checker {name!r}: a scenario can name {sorted(CHECKS)}")
    out = {"name": name}
    for k, v in vars(checker).items():
        if k.startswith("_"):
            continue
        if name == "differential" and k == "reference":
            rids = sorted(v) if isinstance(v, dict) else getattr(v, "rids", None)
            if not rids:
                raise ScenarioError("checker differential: its reference names no plans (build it with "
                                    "kvchaos.suite.single_server_reference, which says which it serves)")
            out["reference_rids"] = list(rids)
            continue
        if name == "integrity" and k == "reference":
            if v is not None:
                raise ScenarioError("checker integrity: a reference of a real model's answers is not in the scenario "
                                    "schema (a probe's replies are judged by its contract)")
            continue
        if k == "floor":
            if v != oracles.DEFAULT_FLOOR:
                raise ScenarioError(f"checker {name}: a sensitivity floor other than the default ({v!r}) "
                                    "is not in the scenario schema")
            continue
        if k in CHECKS[name]:
            out[k] = v
    return out




def build_checks(scenario: Scenario, reference_server=None) -> list:
    """The scenario's checkers, built (``kvchaos.oracles``) with their options; ``differential``'s
    reference is its plans served alone by ``reference_server`` (a clean single server) when it judges."""
    plans = {p.rid: p for p in scenario.traffic.request_plans()}
    out = []
    for c in scenario.checks:
        n, opts = c["name"], {k: v for k, v in c.items() if k != "name"}
        if n == "differential":
            if reference_server is None:
                raise ScenarioError("checks: differential needs a reference server (a clean single server)")
            out.append(oracles.Differential(single_server_reference(reference_server,
                                                                    [plans[r] for r in opts["reference_rids"]])))
            continue
        cls = {"isolation": oracles.Isolation, "integrity": oracles.Integrity, "sensitivity": oracles.Sensitivity,
               "http_semantics": oracles.HttpSemantics, "liveness": oracles.Liveness,
               "kv_lifecycle": oracles.KVLifecycle, "page_ownership": oracles.PageOwnership,
               "abort_semantics": oracles.AbortSemantics,
               "retraction": oracles.Retraction, "cache_isolation": oracles.CacheIsolation,
               "timing_isolation": oracles.TimingIsolation, "kv_checksum": oracles.KvChecksum,
               "kv_canary": oracles.KvCanary}[n]
        out.append(cls(**opts))
    return out
