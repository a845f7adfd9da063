"""The experiment runner: the one path from a workload under faults to verdicts.

Every suite, the incident reproductions, the detection matrix, the clean control and the planted-leak
self-test run through it. Its steps (Chaos Toolkit's shape):

1. header — the event log opens with an ``experiment`` record: id, name, test id, seed, engine name
   and version (read from the servers), cluster layout;
2. steady state before — KV pools probed (settled, see ``SETTLE_S``);
3. method — the body of the ``with`` block arms faults (recorded with ids), then the workload runs
   (``drive``; default: every plan through the router), with one declared ``during`` action beside
   it (abort choreography, kills);
4. rollback — every fault healed;
5. steady state after — pools drained back to baseline, the cluster answers;
6. checkers — the engines' own events join the log; each checker (options bound at construction,
   ``kvchaos.oracles``) judges it (isolation also judges each reply as it ends, while the method runs:
   a leak is red the moment it is seen — :class:`_LiveWatch` — and stays so whatever the end brings);
7. policy — ``kvchaos.policy`` decides what the verdicts mean (required statuses, known findings).

    with experiment("transfer_delay", plans, [Isolation(), Sensitivity(), Liveness(bound_s=60)]) as ex:
        f = faults.agent.arm("prefill", "delay", target={"tenant": "t001"}, params={"ms": 250})
    f.verify()
    ex.require(isolation=PASS, liveness=PASS)

Writes ``<run dir>/suites/<name>.events.jsonl`` and ``<name>.verdicts.json`` (each verdict with what
was required of it, its outcome and any known finding) and a line in ``<run dir>/experiments.jsonl``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from kvchaos import canary, oracles
from kvchaos.cluster.dry import DryRun  # noqa: F401 - raised on entering a dry run's experiment
from kvchaos.cluster.layouts import DEFAULT_LAYOUT, pace_of
from kvchaos.history import SCHEMA, History, HistoryError, close_record
from kvchaos.oracles import FAIL, PASS, UNKNOWN  # noqa: F401 - re-exported for suites
from kvchaos.policy import KNOWN, Context, Judgement, Policy
from kvchaos.schedule import Schedule, build_checks, check_spec
from kvchaos.workload import EventLog, plans_digest, run_plans
from kvchaos.workload.scenario import Deployment, Op, Scenario, ScenarioError, Traffic, nemesis_from_log, plan_dict
from kvchaos.workload.snapshots import server_field, snapshot

VIAS = ("router", "pd")  # how plans reach the engines: the router, or prefill + decode directly
SETTLE_S = 45.0  # SGLang holds a failed/aborted transfer's decode pages up to 30 s (deferred release)
DURING_JOIN_S = 180.0

# who is told when an experiment opens (its header written), sees a leak while its method runs
# (``verdict=``: the live FAIL, told from the watch's thread; _LiveWatch) and closes (judged by its
# checkers, or ``error=`` when its method raised): ``fn(event, experiment, **info)``, event "open",
# "leak" or "close". The pytest plugin's progress lines listen here; the runner never imports who listens.
OBSERVERS: list[Callable[..., None]] = []


class VerdictsNotMet(AssertionError):
    """The experiment's verdicts are red under the policy (a FAIL or UNKNOWN that is not an accepted
    known finding)."""


class KnownFinding(Exception):
    """Every verdict that is not what was required matches an accepted known engine finding: the
    test's outcome is KNOWN (the pytest plugin shows it as such), never PASS."""

    def __init__(self, judgement: Judgement, message: str):
        super().__init__(message)
        self.judgement = judgement
        self.findings = sorted({i.finding.id for i in judgement.known})


class During:
    """The action run beside the workload; ``result`` is what it returned, ``error`` what it raised;
    ``stop`` (optional) is called when the workload has ended, before the action is joined (a nemesis
    schedule with ops still to come stops there: the method is over)."""

    def __init__(self, fn, stop=None):
        self.fn, self.stop, self.result, self.error = fn, stop, None, None
        self.thread = threading.Thread(target=self._run, name="kvchaos-during", daemon=True)

    def _run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            self.error = e


class Experiment:
    def __init__(self, name: str, plans, checks, *, cluster, run_dir, faults=None, test_id: str | None = None,
                 seed=None, concurrency: int = 8, timeout_s: float = 60.0, settle_s: float = SETTLE_S,
                 drive=None, path: str | Path | None = None, model_name: str | None = None,
                 policy: Policy | None = None, probe_before: bool = True, via: str = "router",
                 run_seed: int | None = None, dry: bool = False, record: bool = True,
                 canaries: canary.Registry | None = None, attempt: int = 1, stall_s: float | None = None):
        if not name or any(c in name for c in "/\\"):
            raise ValueError(f"experiment name {name!r}: non-empty, no path separators")
        self.policy = policy or Policy()
        # the checkers asked for, plus every leak checker that always runs (the policy says which)
        self.checks, self.claimed = self.policy.checks(checks)
        self.name, self.plans = name, list(plans)
        # every canary sent to this cluster (handed to the checkers): this experiment's join it on entry
        if canaries is None:
            canaries = getattr(cluster, "canaries", None)
        self.canaries = canaries if isinstance(canaries, canary.Registry) else canary.Registry()
        self.cluster, self.faults, self.run_dir = cluster, faults, Path(run_dir)
        self.test_id, self.seed, self.run_seed, self.dry = test_id, seed, run_seed, dry
        # record: write the verdicts file and the experiments.jsonl line (a shrink attempt does not)
        self.record = record
        self.shrunk: dict | None = None  # what the plugin's --kvchaos-shrink made of it (kvchaos.plugin.fixtures)
        self.plans_digest = plans_digest(self.plans)
        # timeout_s is the bound at pace 1 (the profile's own probe): the driver waits it times the cluster's pace
        # (ClusterSpec.pace, a like: probe on CPU), the header records both, and liveness reads the pace back
        self.pace = pace_of(cluster)
        self.concurrency, self.settle_s = concurrency, settle_s
        self.timeout_s, self.unpaced_timeout_s = timeout_s * self.pace, timeout_s
        self.stall_s = stall_s  # stop sending once the cluster is seen wedged (kvchaos.workload.driver)
        self.drive_fn, self.model_name, self.probe_before = drive, model_name, probe_before
        if via not in VIAS:
            raise ValueError(f"via={via!r}: one of {', '.join(VIAS)}")
        self.via = via
        # the same suite on another KV layout writes beside it, named by that layout
        self.kv_layout = kv_layout(cluster)
        stem = name if self.kv_layout in (None, DEFAULT_LAYOUT) else f"{name}@{self.kv_layout}"
        self.path = _fresh(Path(path) if path else self.run_dir / "suites" / f"{stem}.events.jsonl")
        self.verdicts_path = _verdicts_for(self.path)
        self.id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.log: EventLog | None = None
        self.verdicts: list[oracles.Verdict] = []
        self.judgement: Judgement | None = None
        self.engine_errors: list[dict] = []
        self.history: History | None = None
        self.attempt = attempt  # 2: a re-run after an accepted engine failure blinded the first
        self.rerun: str | None = None  # set when this attempt was blinded and its test runs again
        self.judged = False
        self._during: During | None = None
        self.live: _LiveWatch | None = None
        self.t_start = None
        self.engine_info: dict = {}  # the engines as read at the start (_engine): the header's "engine"
        self.t_method = self.t_method_end = None  # wall times: the workload started, ended
        self.scenario_path: Path | None = None  # <stem>.scenario.json: this experiment as data (kvchaos.workload.scenario)
        self.scenario_error: str | None = None
        self.schedule = None  # the nemesis schedule, when run from a scenario (run_scenario)
        self.source: Scenario | None = None  # that scenario

    # ------------------------------------------------------------------ the with block
    def __enter__(self) -> "Experiment":
        if self.dry:
            rec = {"test": self.test_id, "name": self.name, "kv_layout": self.kv_layout, "seed": self.seed,
                   "run_seed": self.run_seed, "n": len(self.plans), "plans_digest": self.plans_digest}
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "plans.jsonl", "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            raise DryRun(f"dry run: {self.name} — {len(self.plans)} plans, digest {self.plans_digest} "
                         f"(seed {self.seed}, run seed {self.run_seed}); nothing sent")
        self.t_start = time.time()
        if self.model_name is None and any(getattr(p, "endpoint", "generate") != "generate" for p in self.plans):
            # OpenAI endpoints name the model: the one decode serves
            self.model_name = server_field(self.cluster.server_info("decode"), "served_model_name")
        # what happened before this experiment is not its own — but a launched engine broken before it
        # (a Mooncake transfer thread died in the last experiment of the same test) is restarted now,
        # or this one would run on it and go red with no witness of its own
        healed_before = _heal_engine_errors(self.cluster)
        self.canaries.add_plans({p.rid: {"canaries": p.canaries, "tenant": p.tenant, "prompt": p.prompt} for p in self.plans},
                                f"experiment {self.name}")
        self.log = EventLog(self.path)
        self.engine_info = _engine(self.cluster)
        self.log.emit("experiment", schema=SCHEMA, id=self.id, name=self.name, test=self.test_id, seed=self.seed,
                      run_seed=self.run_seed, plans_digest=self.plans_digest, n=len(self.plans),
                      concurrency=self.concurrency, timeout_s=self.timeout_s, engine=self.engine_info, layout=_layout(self.cluster), via=self.via,
                      checkers=[repr(c) for c in self.checks.checkers], claimed=sorted(self.claimed))
        for e in healed_before:
            _log_healed(self.log, e, before=True)
        _tell("open", self)
        if self.probe_before:
            snapshot(self.cluster, self.log, "before", answer=False, settle_s=self.settle_s)
        return self

    def during(self, fn, stop=None) -> During:
        """Declare the one action that runs beside the workload (started with it, joined after; ``stop``,
        if given, is called first, once the workload has ended)."""
        if self._during is not None:
            raise RuntimeError(f"experiment {self.name}: one during action only (compose them in one function)")
        self._during = During(fn, stop)
        return self._during

    def nemesis(self, ops, gates: dict | None = None) -> Schedule:
        """Carry out ``ops`` (:class:`kvchaos.workload.scenario.Op`: a scenario's nemesis) beside the
        workload, through the faults kit (call inside the ``with`` block): those due at 0 s with nothing to
        wait for are armed now, the rest on their times or when what they wait for happened, each op
        healed in the rollback. ``gates``: rid -> op index, a plan sent only once that op happened (B once
        A's write is parked). This is the experiment's one during action, and its ``scenario.json`` holds
        these very ops and gates: it replays and shrinks as data. ``handles[i]`` is op ``i``'s fault
        handle."""
        if self.faults is None:
            raise RuntimeError(f"experiment {self.name}: nemesis ops need the faults kit")
        if self.schedule is not None:
            raise RuntimeError(f"experiment {self.name}: one nemesis schedule only (put every op in it)")
        ops = list(ops)
        for i, op in enumerate(ops):  # refused here, by index, before anything is armed
            Op.from_dict(op.to_dict(), f"nemesis[{i}]", i)
        rids = {p.rid for p in self.plans}
        bad = sorted(r for r in (gates or {}) if r not in rids)
        if bad:
            raise ScenarioError(f"gates: {bad[:3]} are not this experiment's plans")
        self.schedule = Schedule(ops, self.faults, self.cluster, client_log=self.log, gates=gates)
        self.schedule.start()
        self.during(self.schedule.run, stop=self.schedule.stop.set)
        return self.schedule

    def send(self, plans, concurrency: int | None = None, timeout_s: float | None = None,
             via: str | None = None) -> list[dict]:
        """Drive ``plans`` into this experiment's log (for custom ``drive``): through the router, or
        (``via="pd"``) straight to prefill and decode as SGLang's mini load balancer does."""
        ep = self.cluster.endpoints
        via = via or self.via
        kw = {"model_name": self.model_name} if self.model_name else {}
        if via == "pd":
            if not ep.bootstrap_port or ep.prefill == ep.decode:
                raise ValueError(f"experiment {self.name}: via='pd' needs a prefill/decode cluster with a bootstrap port")
            kw["pd_direct"] = {"prefill": ep.prefill, "decode": ep.decode, "bootstrap_port": ep.bootstrap_port,
                               "bootstrap_host": urlsplit(ep.prefill).hostname}
        elif via != "router":
            raise ValueError(f"via={via!r}: one of {', '.join(VIAS)}")
        gates = self.schedule.gates if self.schedule is not None else {}
        if gates:  # the plans that wait for a nemesis op (ex.nemesis(ops, gates))
            kw.update(gate=self.schedule.gate, gated=[p.rid for p in plans if p.rid in gates])
        return run_plans(ep.router, plans, self.log, concurrency=concurrency or self.concurrency,
                         timeout_s=timeout_s or self.timeout_s, abort_urls=(ep.prefill, ep.decode),
                         stall_s=self.stall_s, incremental=bool(self.engine_info.get("incremental_streaming_output")),
                         **kw)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # the method itself failed: nothing ran to judge
            self.log.emit("aborted", error=repr(exc))
            close_record(self.log, self.id)
            self.log.close()
            _tell("close", self, error=repr(exc))
            return False
        try:
            self.t_method = self.log.emit("method", faults=self._fault_ids(), during=self._during is not None)["wall"]
            if self._during:
                self._during.thread.start()
            watch = _EngineWatch(self.cluster, self.log, grace_s=self.timeout_s + 5)
            self.live = _LiveWatch(self)
            try:
                (self.drive_fn or (lambda ex: ex.send(ex.plans)))(self)
            finally:
                self.t_method_end = time.time()
                self.live.stop()
                watch.stop()
                if self._during:
                    if self._during.stop is not None:
                        self._during.stop()
                    self._during.thread.join(timeout=DURING_JOIN_S)
            if self.schedule is not None:  # rollback: the scenario's ops first, then whatever else the kit armed
                for err in self.schedule.heal():
                    self.log.emit("heal_failed", error=err)
            if self.faults is not None:  # rollback before the steady-state probe: pools must drain
                # after a run that stopped sending to a wedged cluster, waiting up to 60 s for it to serve
                # again only delays the steady-state probe, which asks the same (a 0.5.19 wedge: 61 s)
                stalled = any(r.get("ev") == "stall" for r in self.log.records)
                self.faults.heal_all(wait_s=0.0 if stalled else 60.0)
            # the pools get settle_s to drain even after a run that stopped sending to a wedged cluster: a
            # 5 s wait there (2026-12-05) left the pages of requests the engine was still aborting, a pool
            # witness the hang band's signature (every witness a timeout) does not allow, and turned a
            # KNOWN sglang-pd-hang-band into a NEW find
            snapshot(self.cluster, self.log, "after", settle_s=self.settle_s)
            if self.faults is not None:
                self._copy_fault_records()
            # what this experiment's requests left in decode's pages, for the experiments after it on the cluster
            self.canaries.add_page_evidence(self.log.records)
            self.engine_errors = watch.seen + _engine_errors(self.cluster)
            for e in self.engine_errors:
                self.log.emit("engine_error", **{k: v for k, v in e.items() if k != "healed"})
            close_record(self.log, self.id)
        except BaseException as e:
            _tell("close", self, error=repr(e))
            raise
        finally:
            self.log.close()
        self._write_scenario()
        try:
            self.history = History(self.log.records, source=str(self.path))
        except HistoryError:  # e.g. a record written twice: every checker says it cannot judge it
            self.history = None
        verdicts = self.checks.check(self.history or self.log.records, self.canaries)
        self.verdicts = self.policy.gate(_keep_live(verdicts, self.live.fail), self.history)
        self._record(self.policy.judge(self.verdicts, self.context(), claimed=self.claimed))
        _tell("close", self)
        for v in self.verdicts:
            print(v)
        if self._during and self._during.thread.is_alive():
            raise RuntimeError(f"experiment {self.name}: the during action did not finish in {DURING_JOIN_S} s")
        if self._during and self._during.error is not None:
            raise self._during.error
        return False

    # ------------------------------------------------------------------ results
    @property
    def events(self) -> list[dict]:
        return self.log.records

    @property
    def run(self) -> History:
        """The judged history (after the with block), else the records so far, indexed."""
        return self.history or History(self.log.records, source=str(self.path))

    @property
    def by(self) -> dict[str, oracles.Verdict]:
        """Every verdict, by checker: those asked for and the leak checkers that always run."""
        return {v.oracle: v for v in self.verdicts}

    @property
    def claimed_verdicts(self) -> dict[str, str]:
        """checker -> status, of the checkers this experiment was given (not the always-run ones)."""
        return {v.oracle: v.status for v in self.verdicts if v.oracle in self.claimed}

    def context(self) -> Context:
        if self.history is None:
            head = next((e for e in self.log.records if e.get("ev") == "experiment"), {})
            eng = head.get("engine") or {}
            return Context(None, eng.get("name") or "sglang", eng.get("version"), list(self.engine_errors),
                           self.canaries)
        return Context.of(self.history, self.engine_errors, self.canaries)

    def judge(self, planted: str | None = None, **wanted) -> Judgement:
        """The policy's judgement with these required statuses (``isolation=PASS``, or ``FAIL`` for
        a bug planted on purpose — say what with ``planted``); recorded, never raises."""
        self._check_ran()
        j = self.policy.judge(self.verdicts, self.context(), wanted, planted=planted, claimed=self.claimed)
        self._record(j)
        self.judged = True
        return j

    def require(self, planted: str | None = None, **wanted) -> Judgement:
        """Raise :class:`VerdictsNotMet` unless every verdict is as required (leak checkers are held
        to not-FAIL even when not named, unless a bug was ``planted`` on purpose and its FAIL is what
        is required); :class:`KnownFinding` when what differs is all accepted known findings."""
        j = self.judge(planted, **wanted)
        msg = f"experiment {self.name} ({self.id}): {j.status.upper()}\n{j.message()}\nevents: {self.path}"
        if j.red:
            raise VerdictsNotMet(msg)
        if j.status == KNOWN:
            raise KnownFinding(j, msg)
        return j

    def engine_broke(self) -> Judgement | None:
        """Why a fault may have acted fewer times than a test required: the engine broke during this
        experiment (a known engine failure found in the servers' logs). The judgement with liveness
        required — KNOWN when an accepted finding explains the failure and nothing else is red — or
        None when no engine failure was seen (then a fault that did not fire means a blind run)."""
        if not self.verdicts or not self.engine_errors or "liveness" not in self.by:
            return None
        return self.judge(liveness=PASS)

    def _check_ran(self):
        if not self.verdicts:
            raise RuntimeError(f"experiment {self.name}: judge after the with block has run it")

    def _record(self, j: Judgement) -> None:
        self.judgement = j
        if not self.record:
            return
        self.verdicts_path.parent.mkdir(parents=True, exist_ok=True)
        self.verdicts_path.write_text(json.dumps([i.to_dict() for i in j.items], indent=2, default=str))
        ctx = j.ctx
        rec = {"id": self.id, "name": self.name, "test": self.test_id, "engine": ctx.engine, "version": ctx.version,
               "kv_layout": self.kv_layout, "seed": self.seed, "run_seed": self.run_seed,
               "plans_digest": self.plans_digest, "n": len(self.plans),
               "status": j.status, "exit_code": j.exit_code, "planted": j.planted,
               "known": sorted({i.finding.id for i in j.known}), "problems": j.problems,
               "attempt": self.attempt, "rerun": self.rerun,
               "accepted": sorted({i.finding.id for i in j.known if i.accepted}),
               "verdicts": {i.verdict.oracle: i.verdict.status for i in j.items},
               "required": {i.verdict.oracle: i.wanted for i in j.items if i.wanted},
               "events": _rel(self.path, self.run_dir), "verdicts_file": _rel(self.verdicts_path, self.run_dir),
               "scenario": _rel(self.scenario_path, self.run_dir) if self.scenario_path else None,
               "scenario_error": self.scenario_error,
               "wall": time.time()}
        with open(self.run_dir / "experiments.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    def scenario(self) -> Scenario:
        """This experiment as data (:class:`kvchaos.workload.scenario.Scenario`): its plans, checkers, the cluster's
        restart knobs, and the nemesis it carried out (from its log's fault records, after the method).
        ``origin.complete`` is false, with the reasons, where something it did is not in the schema (a
        custom ``drive`` sends plans in its own order; a ``during`` action other than a nemesis schedule
        does more than the aborts and releases it logged)."""
        if self.source is not None:  # run from a scenario: that is what ran
            sc = Scenario.from_dict(self.source.to_dict())
            sc.origin = {**sc.origin, "test": self.test_id, "experiment": self.id, "run_seed": self.run_seed,
                         "plans_digest": self.plans_digest, "complete": True, "why_incomplete": []}
            return sc.validate()
        why = []
        if self.drive_fn is not None:
            why.append("a custom drive function sent the plans (their order and timing are not data)")
        if self._during is not None and self.schedule is None:
            why.append(f"a during action ({getattr(self._during.fn, '__name__', 'callable')}) ran beside the "
                       "workload: only the aborts and releases it logged are ops")
        checks = []
        for c in self.checks.checkers:
            try:
                checks.append(check_spec(c))
            except ScenarioError as e:
                why.append(str(e))
        spec = getattr(self.cluster, "spec", None)
        head = next((e for e in self.log.records if e.get("ev") == "experiment"), {})
        version = (head.get("engine") or {}).get("version")
        dep = Deployment.from_spec(spec, self.kv_layout, version) if spec is not None else Deployment()
        if self.schedule is not None:  # ex.nemesis(ops): the ops themselves, and what was armed beside them
            ops = list(self.schedule.ops)
            outside = _outside(self.log.records, self.schedule, self.t_start or 0.0)
            if outside:
                why.append("faults armed beside the nemesis ops are not in it: " + ", ".join(outside[:5]))
        else:
            ops = nemesis_from_log(self.log.records, self.t_method or self.t_start or 0.0, self.t_method_end,
                                   skipped=why)
        gates = dict(self.schedule.gates) if self.schedule is not None else {}
        sc = Scenario(name=self.name, seed=self.seed, deployment=dep,
                      traffic=Traffic([plan_dict(p) for p in self.plans], self.concurrency, float(self.unpaced_timeout_s), self.via,
                                      self.stall_s, gates),
                      nemesis=ops, checks=checks,
                      origin={"test": self.test_id, "experiment": self.id, "run_seed": self.run_seed,
                              "plans_digest": self.plans_digest, "complete": not why, "why_incomplete": why})
        return sc.validate()

    def _write_scenario(self) -> None:
        """``<stem>.scenario.json`` beside the event log; a scenario that cannot be written is said in the
        experiment's record (``scenario_error``), never silently missing."""
        if not self.record:
            return
        try:
            self.scenario_path = self.scenario().save(_scenario_for(self.path))
        except Exception as e:  # noqa: BLE001 - the run's verdicts stand; the record says what is missing
            self.scenario_error = f"{type(e).__name__}: {e}"[:600]
            warnings.warn(f"experiment {self.name}: no scenario.json: {self.scenario_error}", stacklevel=2)

    def _fault_ids(self) -> list[str]:
        if self.faults is None or self.faults.log is None:
            return []
        return sorted({e.get("fault") for e in self.faults.log.records
                       if e.get("ev") == "fault" and e.get("action") == "armed" and e["wall"] >= self.t_start
                       and e.get("fault")})

    def _copy_fault_records(self) -> None:
        """The faults' own records (armed/fired/healed, process kills) and the engines' events
        (transfers, writes, releases, faults fired) join the experiment's log."""
        for e in self.faults.log.records:
            if e.get("ev") == "fault" and e["wall"] >= self.t_start:
                # "at": when it happened (the injector's own time if it gives one, else when it logged it)
                self.log.emit("fault", **{**{k: v for k, v in e.items() if k not in ("t", "wall", "ev")},
                                          "at": e.get("at", e["wall"])})
        self.faults.copy_agent_events(self.log, since=self.t_start)


def _outside(records, schedule, t_start: float) -> list[str]:
    """The faults this experiment's log shows armed, fired or aborted other than by ``schedule``'s ops:
    agent and proxy faults by their ids, process signals and aborts by count and op."""
    ids = {getattr(h, "id", None) for h in schedule.handles.values()} - {None}
    procs = sum(1 for o in schedule.ops if o.injector == "process")
    out, fired = [], 0
    for e in records:
        if e.get("ev") != "fault" or float(e.get("at", e.get("wall", t_start)) or 0) < t_start:
            continue
        act = e.get("action")
        if act == "armed" and e.get("fault") not in ids:
            out.append(f"{e.get('injector')} {e.get('kind')} ({e.get('fault')})")
        elif act == "abort_request" and e.get("op") is None:
            out.append(f"abort of {e.get('rid')}")
        elif act == "fired" and e.get("injector") == "process":
            fired += 1
            if fired > procs:
                out.append(f"process {e.get('kind')} of {e.get('role')}")
    return out


def _tell(event: str, ex: Experiment, **info) -> None:
    for fn in list(OBSERVERS):
        try:
            fn(event, ex, **info)
        except Exception as e:  # noqa: BLE001 - a listener never changes an experiment's outcome; said, not hidden
            warnings.warn(f"kvchaos: experiment listener {fn!r} failed on {event} of {ex.name}: {e!r}",
                          RuntimeWarning, stacklevel=3)


def _fresh(path: Path) -> Path:
    """``path``, or ``<stem>-2<suffix>``, ``-3``, ... when an earlier experiment of this run wrote it
    (the same test once per transfer backend): one experiment, one log, one verdicts file."""
    base = path.name[: -len(".events.jsonl")] if path.name.endswith(".events.jsonl") else path.stem
    suffix = path.name[len(base):]
    n = 1
    while path.exists() or _verdicts_for(path).exists():
        n += 1
        path = path.with_name(f"{base}-{n}{suffix}")
    return path


def _scenario_for(events_path: Path) -> Path:
    name = events_path.name
    return events_path.with_name((name[:-len(".events.jsonl")] if name.endswith(".events.jsonl") else events_path.stem)
                                 + ".scenario.json")


def _verdicts_for(events_path: Path) -> Path:
    """The verdicts file beside an experiment's log: ``x.events.jsonl`` -> ``x.verdicts.json``,
    ``events.jsonl`` -> ``verdicts.json``, anything else -> ``<stem>.verdicts.json``."""
    name = events_path.name
    if "events.jsonl" in name:
        return events_path.with_name(name.replace("events.jsonl", "verdicts.json"))
    return events_path.with_name(events_path.stem + ".verdicts.json")


def _rel(p: Path, base: Path) -> str:
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(p)


def _engine_errors(cluster) -> list[dict]:
    return cluster.engine_errors() if hasattr(cluster, "engine_errors") else []


class _EngineWatch:
    """While the method runs: a launched engine that broke (a registry engine error in its log, e.g. a
    Mooncake transfer thread that died) is restarted once ``grace_s`` (the request timeout, and some)
    has passed since it was seen — by then the requests it stranded have timed out, so the experiment
    keeps the evidence (its liveness FAIL, the engine's witness), and the rest of its plans run on a
    working engine instead of each waiting out the timeout in turn (a CI run spent 13 minutes of serial
    60 s timeouts so, and would have spent 2 hours). ``seen``: what it found (with ``healed``)."""

    PERIOD_S = 2.0

    def __init__(self, cluster, log, grace_s: float):
        self.cluster, self.log, self.grace_s = cluster, log, grace_s
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = None
        if hasattr(cluster, "heal_engine_errors"):
            self._thread = threading.Thread(target=self._run, name="kvchaos-engine-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        first = None
        while not self._stop.wait(self.PERIOD_S):
            try:
                new = self.cluster.engine_errors()
                self.seen += new
                if new and first is None:
                    first = time.monotonic()
                if first is not None and time.monotonic() - first >= self.grace_s:
                    for e in self.cluster.heal_engine_errors():
                        if not any(e is x for x in self.seen):
                            self.seen.append(e)
                        _log_healed(self.log, e, during=True)
                    first = None
            except Exception as e:  # noqa: BLE001 - the watch must not take the run down; said in the log
                self.log.emit("observed", engine_watch_error=repr(e))
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=600)  # a restart under way finishes (bounded by its startup timeout)


class _LiveWatch:
    """While the method runs: each reply judged as it ends by every checker that can judge part of a
    run (:meth:`kvchaos.oracles.Checker.live`; isolation). The first FAIL is the experiment's leak
    verdict then, seconds into the run rather than after its last request: its log gets a
    ``leak_seen`` record (when, which replies, whose canaries) and :data:`OBSERVERS` hear ``leak``
    (at the latest when the method ends: :meth:`stop` judges what the ticks had not).
    The run goes on to its end and is judged whole as ever; a leak seen here stays in its verdicts
    whatever the whole judgement says (:func:`_keep_live`). Nothing here can make a run green."""

    PERIOD_S = 0.5

    def __init__(self, ex):
        self.ex = ex
        self.fail: oracles.Verdict | None = None
        self.after_s: float | None = None  # when the FAIL was seen, seconds after the experiment opened
        self.error: str | None = None
        self._pos = 0
        self._header: dict | None = None
        self._plans: dict[str, dict] = {}
        self._records: dict[str, list[dict]] = {}
        self._judges: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvchaos-live-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S) and self.fail is None and self.error is None:
            self._tick_safely()

    def _tick_safely(self) -> None:
        try:
            self.tick()
        except Exception as e:  # noqa: BLE001 - the watch is an early word, never the judgement: said in the log
            self.error = repr(e)
            self.ex.log.emit("observed", live_watch_error=self.error[:600])

    def tick(self) -> oracles.Verdict | None:
        """Judge the replies that ended since the last tick; the FAIL when one leaked."""
        new = self.ex.log.since(self._pos)
        self._pos += len(new)
        ended, planned = [], False
        for e in new:
            ev, rid = e.get("ev"), e.get("rid")
            if ev == "experiment" and self._header is None:
                self._header = e
            if not isinstance(rid, str):
                continue
            if ev == "plan":
                self._plans[rid] = {"canaries": e.get("canaries") or [], "tenant": e.get("tenant")}
                planned = True
            self._records.setdefault(rid, []).append(e)
            if ev == "end":
                ended.append(rid)
        if planned:  # every canary this run sent, and the session's: a reply's own one is never foreign
            self._judges = [j for j in (c.live(dict(self._plans), self.ex.canaries)
                                        for c in self.ex.checks.checkers) if j is not None]
        if not ended or not self._judges:
            return None
        part = History(([self._header] if self._header else []) + [r for rid in ended for r in self._records.pop(rid)],
                       source=f"{self.ex.path} (replies ended by now)")
        for judge in self._judges:
            v = judge(part)
            if v.status == FAIL:
                self.fail, self.after_s = v, round(time.time() - self.ex.t_start, 3)
                victims = sorted({w.get("victim_rid") for w in v.witnesses if w.get("victim_rid")})
                owners = sorted({w.get("owner_rid") or "unknown origin" for w in v.witnesses})
                self.ex.log.emit("leak_seen", oracle=v.oracle, victims=victims, owners=owners, after_s=self.after_s)
                _tell("leak", self.ex, verdict=v)
                return v
        return None

    def stop(self) -> None:
        """Once the method has run: the replies not judged yet are, so every run that leaked has its
        ``leak`` (a fast run may end between two ticks)."""
        self._stop.set()
        self._thread.join(timeout=60)
        if not self._thread.is_alive() and self.fail is None and self.error is None:
            self._tick_safely()


def _keep_live(verdicts: list, live: oracles.Verdict | None) -> list:
    """The whole run's verdicts, with a FAIL the live watch saw kept: a leak seen while the run went
    is not taken back because the whole history could not be judged (a checker crashed, a record
    came twice)."""
    if live is None:
        return verdicts
    out = []
    for v in verdicts:
        if v.oracle == live.oracle and v.status != FAIL:
            v = oracles.Verdict(live.oracle, FAIL, f"{live.summary} — seen while the run went; judged whole, the "
                                f"run said {v.status.upper()}: {v.summary}"[:2000], live.witnesses,
                                {**(live.stats or {}), "whole_run": {"status": v.status, "summary": v.summary[:600]}})
        out.append(v)
    return out


def _log_healed(log, e: dict, **when) -> None:
    """One ``engine_healed`` record: the role restarted for engine error ``e`` (``before`` or ``during``)."""
    log.emit("engine_healed", **when, role=e["role"], signature=e.get("signature"),
             restart=(e.get("healed") or {}).get("rejoined_s"))


def _heal_engine_errors(cluster) -> list[dict]:
    """Restart what broke since the last look (a launched cluster); elsewhere only read past it."""
    if hasattr(cluster, "heal_engine_errors"):
        return cluster.heal_engine_errors()
    _engine_errors(cluster)
    return []


def _engine(cluster) -> dict:
    """Engine name and version, read from the servers (not assumed from the profile)."""
    out = {"name": getattr(getattr(cluster, "spec", None), "engine", "sglang"), "version": None, "roles": {}}
    infos = {}
    for role in ("prefill", "decode"):
        try:
            infos[role] = cluster.server_info(role)
            out["roles"][role] = server_field(infos[role], "version")
        except Exception as e:  # noqa: BLE001 - an unreachable server is recorded, judged by liveness
            out["roles"][role] = f"unreachable: {e!r}"[:200]
    vs = {v for v in out["roles"].values() if v and not str(v).startswith("unreachable")}
    out["version"] = vs.pop() if len(vs) == 1 else (sorted(vs)[0] if vs else None)
    # how decode streams /generate: each chunk the reply so far, or only its new text (History.reply_text);
    # unrecorded (decode unreachable), the judge reads the chunks as they are
    inc = server_field(infos.get("decode"), "incremental_streaming_output")
    if isinstance(inc, bool):
        out["incremental_streaming_output"] = inc
    return out


def kv_layout(cluster) -> str | None:
    """The KV layout name of the cluster's spec (``kvchaos.cluster.layouts``), None without a spec."""
    spec = getattr(cluster, "spec", None)
    return getattr(spec, "layout", None) if spec is not None and hasattr(spec, "model") else None


def _layout(cluster) -> dict:
    spec = getattr(cluster, "spec", None)
    ep = getattr(cluster, "endpoints", None)
    keep = ("name", "model", "device", "dtype", "pool_tokens", "context_length", "page_size", "transfer_backend",
            "router", "network_proxy", "agent", "pace")
    out = {"kv_layout": kv_layout(cluster),
           "spec": {k: getattr(spec, k) for k in keep if spec is not None and hasattr(spec, k)},
           "endpoints": ep.as_dict() if ep is not None and hasattr(ep, "as_dict") else None}
    if isinstance(getattr(spec, "model", None), str):
        # whether the served model answers by the probe's reply contract (kvchaos.history.serves_probe): a
        # probe layout, or a model directory whose kvchaos-model.json says it is one (a long-context copy)
        out["spec"]["probe"] = _serves_probe(spec.model)
    return out


def _serves_probe(model: str) -> bool:
    if model.startswith("probe"):
        return True
    try:
        meta = json.loads((Path(model).expanduser() / "kvchaos-model.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("kind") == "probe"


def run_scenario(experiment, scenario: Scenario, kit, cluster, *, reference_server=None, **kw) -> Experiment:
    """Run ``scenario`` through the runner: its plans and checkers, its live knobs armed at 0 s and its
    nemesis ops at their times (:class:`kvchaos.schedule.Schedule`), every op healed in a ``finally``.
    ``experiment``: the factory (the pytest fixture ``experiment``, or ``functools.partial(Experiment,
    cluster=..., run_dir=..., faults=kit)``). The cluster must run the scenario's restart knobs: one it
    does not is refused by name, before anything is sent."""
    spec = getattr(cluster, "spec", None)
    if spec is not None and scenario.deployment.restart:
        have = Deployment.from_spec(spec, kv_layout(cluster), _engine(cluster)["version"])
        wrong = scenario.deployment.differs(have)
        if wrong:
            raise ScenarioError(f"scenario {scenario.name}: the cluster does not run its deployment: " + "; ".join(wrong))
    checks = build_checks(scenario, reference_server)
    schedule = Schedule(scenario.ops(), kit, cluster, gates=scenario.gates())
    ex = experiment(scenario.name, scenario.traffic.request_plans(), checks, seed=scenario.seed,
                    concurrency=scenario.traffic.concurrency, timeout_s=scenario.traffic.timeout_s,
                    via=scenario.traffic.via, stall_s=scenario.traffic.stall_s, **kw)
    ex.schedule, ex.source = schedule, scenario
    errors = []
    try:
        with ex:
            schedule.client_log = ex.log  # what an ``on`` of the client's waits for
            schedule.start()
            ex.during(schedule.run, stop=schedule.stop.set)
    finally:
        errors = schedule.heal()
    if errors:
        raise RuntimeError(f"scenario {scenario.name}: " + "; ".join(errors))
    return ex
