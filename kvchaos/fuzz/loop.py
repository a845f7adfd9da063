"""The fuzz loop: generate or mutate a scenario, run it on a cluster of its deployment, keep it if the
engines did something new, triage what is not PASS, and confirm, shrink and write up what is NEW: a NEW
leak at once, anything else at the end of the search (:data:`CONFIRM_RESERVE`). Guided chooses how it
makes each scenario (draw, mutate, splice) by how each way has paid (:class:`Operators`).

Clusters (:class:`Clusters`) are the expensive part: a scenario whose restart knobs differ from the
running cluster's waits in a queue of its deployment until that queue is worth a restart
(:data:`SWITCH_AFTER` scenarios), the running deployment went :data:`STALE_AFTER` runs without a new
feature, or it has had :data:`AMORTIZE` cluster starts' worth of the search's time; otherwise the loop
runs what fits the cluster it has. A corpus entry mutated or spliced while another deployment runs is
run on that deployment (its restart knobs are the running cluster's; a ``restart_knob`` mutation still
queues): the corpus is traffic and nemesis, and a deployment the search switched to gets its share of
them instead of sending every mutation back to the queue it left. Live knobs cost nothing: they are
agent ops of the scenario.

``strategy="random"`` uses the same generator with no feedback (every scenario drawn fresh, the corpus
only counts coverage), so guidance can be measured against it with the same budget and seed.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.experiment import Experiment, run_scenario
from kvchaos.shrink.scenario import ShrinkError, as_on_a_fresh_cluster as fresh_plans
from kvchaos.workload.scenario import Deployment, Scenario, plan_dict
from kvchaos.workload.snapshots import settle as settle_cluster

from .corpus import Corpus
from .feedback import features
from .grammar import Base, avoid, baseline, generate, mutate, rebase, splice, wedge_traits
from .shrink import shrink
from .triage import Find, is_leak, triage

SWITCH_AFTER = 3
STALE_AFTER = 12
# ... or the running deployment has had this many cluster starts' worth of the search's time (a start's
# cost amortized to at most 1/AMORTIZE of it): the first 30-minute searches (2026-12-04/05) never left the
# base deployment, so no scenario with a restart knob ran (auto-truncate's deployment among them)
AMORTIZE = 8
START_COST_FLOOR_S = 30.0  # a start's cost before one was measured, and the least one counts
CONFIRM_RUNS = 3  # a NEW find must show its mechanism again in 2 of 3 runs
CONFIRM_NEEDED = 2
SHRINK_SHARE = 0.25  # at most this share of the budget shrinks one leak find
# ... and one find that is no leak (an availability or protocol failure): a first 30-minute search spent
# 8 of its minutes shrinking a router 503 the faults themselves had caused
SHRINK_SHARE_OTHER = 0.1
# A NEW find that is no leak waits for the end of the search (:meth:`Fuzzer._confirm_pending`): its
# confirmation, control and shrink take the budget's last minutes, at most this share of it, instead of the
# search's middle. Inline, a third 30-minute pair's guided arm (2026-12-05) spent 1334 of its 1800 s in five
# executions of over 100 s, confirming and shrinking liveness finds, and found fewer findings than random
CONFIRM_RESERVE = 0.25
REDRAWS = 50  # at most this many draws in a row may repeat a scenario the search already ran
FLUSH_TIMEOUT_S = 30.0  # how long a run as on a fresh cluster waits for both roles to flush (idle)
# after every run: how long each role may take to go idle (and again after aborting what the run left)
# before the cluster is replaced. A first 10-minute search on 0.5.19 (2026-12-04) left hang-band requests
# in the engine: every later confirmation, control and run met a cluster that never went idle
SETTLE_TIMEOUT_S = 15.0


class FuzzError(RuntimeError):
    pass


class Operators:
    """Which way the guided search makes its next scenario — ``generate`` a fresh one, ``mutate`` a
    corpus entry, ``splice`` two — chosen by Thompson sampling over each way's record: a run pays when
    the engines showed a state not seen before (the corpus kept it) or a finding or NEW signature not
    seen before. A fixed 80 % mutation share lost to plain random drawing on both coverage and findings
    in a third 30-minute pair (2026-12-05, ``reports/fuzz/20261205-0.5.23-pair3/``: 50 vs 73 engine
    states): where fresh draws still pay more than mutations, the search now learns that and draws more,
    and mutates more where mutations pay. Every choice comes from the search's own ``random.Random``."""

    WAYS = ("generate", "mutate", "splice")

    def __init__(self):
        self.record = {w: [0, 0] for w in self.WAYS}  # way -> [runs, runs that paid]

    def pick(self, rng: random.Random, splice: bool = True) -> str:
        ways = [w for w in self.WAYS if splice or w != "splice"]
        draws = {w: rng.betavariate(1 + self.record[w][1], 1 + self.record[w][0] - self.record[w][1]) for w in ways}
        return max(ways, key=lambda w: draws[w])

    def paid(self, way: str | None, paid: bool) -> None:
        if way in self.record:
            self.record[way][0] += 1
            self.record[way][1] += bool(paid)


@dataclass
class Stats:
    execs: int = 0
    restarts: int = 0
    errors: int = 0
    stuck: int = 0  # runs after which the engines held requests their clients had given up on
    repeats: int = 0  # draws left unrun: the same scenario (digest) had run already
    blind: int = 0
    expected: int = 0  # non-leak FAILs the scenario's own faults explain (kvchaos.fuzz.triage)
    timeline: list = field(default_factory=list)  # {t, execs, features, corpus, restarts, finds}
    first_known: dict = field(default_factory=dict)  # finding id -> {t, scenario, oracle, ops, live, restart}
    # finding id -> the first find by a scenario that carried no nemesis op (its deployment and traffic
    # alone: the acceptance's "findings injected faults alone do not cause")
    first_known_quiet: dict = field(default_factory=dict)
    new: dict = field(default_factory=dict)  # signature -> {...}


def answers(cluster) -> bool:
    """Whether the cluster still serves a one-token request through the router (a stand-in without
    ``generate``: yes)."""
    gen = getattr(cluster, "generate", None)
    if gen is None:
        return True
    try:
        return gen(text="ping", max_new_tokens=1, timeout=20).status_code == 200
    except Exception:  # noqa: BLE001 - no answer is the answer
        return False


def settle(cluster) -> tuple[bool, dict | None]:
    """After a run: both roles idle with flushed caches (:func:`kvchaos.workload.snapshots.settle`:
    aborting what the run left in the engines where needed). Returns ``(aborted, left)``; ``left`` names
    the roles that would not go idle. A stand-in without endpoints: ``(False, None)``."""
    if getattr(cluster, "endpoints", None) is None:
        return False, None
    return settle_cluster(cluster, SETTLE_TIMEOUT_S)


def as_on_a_fresh_cluster(sc: Scenario, cluster, tag: str) -> Scenario:
    """``sc`` to run as if on a fresh cluster (:func:`kvchaos.shrink.scenario.as_on_a_fresh_cluster`:
    caches flushed, canaries drawn from ``tag``). A confirmation, a control or a shrink step then shows a
    find only when its own traffic makes it, and a minimal repro keeps the traffic it needs. Raises
    :class:`FuzzError` naming the roles that would not flush."""
    new = Scenario.from_dict(copy.deepcopy(sc.to_dict()))
    try:
        fresh = fresh_plans(cluster, new.traffic.request_plans(), random.Random(f"{sc.digest()}/{tag}"),
                            timeout_s=FLUSH_TIMEOUT_S)
    except ShrinkError as e:
        raise FuzzError(f"{sc.name} ({tag}): {e}") from None
    new.traffic.plans = [plan_dict(p) for p in fresh]
    return new


class Clusters:
    """One running cluster at a time, for one deployment; ``start(deployment)`` returns
    ``(cluster, kit, policy)``, ``stop()`` stops it. The default is :func:`launch_clusters`."""

    def __init__(self, start, stop):
        self._start, self._stop = start, stop
        self.key: str | None = None
        self.current = None

    def get(self, dep: Deployment):
        if self.current is not None and dep.restart_key() == self.key:
            return self.current, False
        self.close()
        self.current = self._start(dep)
        self.key = dep.restart_key()
        return self.current, True

    def close(self):
        if self.current is not None:
            try:
                self._stop(self.current)
            finally:
                self.current, self.key = None, None


class Fuzzer:
    def __init__(self, *, clusters: Clusters, base: Base, registry, out: Path, corpus: Corpus, seed: int,
                 budget_s: float, strategy: str = "guided", clock=time.monotonic, say=print,
                 engine_version: str | None = None, deployments: bool = True, confirm_all: bool = True):
        """``deployments`` False: every scenario runs on the base deployment's restart knobs (a search on
        a cluster it may not restart, such as a test session's); live knobs still vary. ``confirm_all``
        False: only a NEW leak is confirmed and shrunk; other NEW finds are written up unconfirmed (a
        short search, such as CI's smoke, whose budget confirmations of non-leak finds would triple)."""
        if strategy not in ("guided", "random"):
            raise FuzzError(f"strategy {strategy!r}: guided or random")
        if budget_s <= 0:
            raise FuzzError(f"budget {budget_s} s: must be > 0")
        self.clusters, self.base, self.registry = clusters, base, registry
        self.out, self.corpus = Path(out), corpus
        self.rng = random.Random(seed)
        self.seed, self.budget_s, self.strategy = seed, budget_s, strategy
        self.clock, self.say = clock, say
        self.stats = Stats()
        self.queues: dict[str, list[Scenario]] = {}
        self.operators = Operators()
        self._draws = 0  # scenarios drawn (each gets its own name: _name)
        self.since_new = 0
        self.engine_version = engine_version
        self.deployments = deployments
        self.confirm_all = confirm_all
        self.t0 = None
        self._last_wall = 0.0  # the last run's wall time: what a confirmation run is expected to take
        self._start_cost = 0.0  # the longest cluster start seen (s)
        self._on_since = 0.0  # when the running cluster started (search time)
        self._running: Deployment | None = None  # the running cluster's deployment
        self.pending: list[dict] = []  # NEW finds that are no leak, to confirm at the end (CONFIRM_RESERVE)
        # restart key -> traffic traits a run that wedged that deployment's cluster was blamed on (guided):
        # per deployment, since one that wedges on the base (a prompt past decode's admission edge: the hang
        # band) is what another one is for (--allow-auto-truncate truncates exactly those). A client's cut
        # is the engine's front end, not a deployment's: once blamed it is left out everywhere ("*"; a
        # 0.5.19 search left cuts out of the base deployment, then wedged a decode-radix-cache one with them)
        self.wedges: dict[str, set[str]] = {}
        self.ran: set[str] = set()  # digests of the scenarios run: a draw that repeats one is drawn again
        self.out.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ the loop
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def run(self) -> dict:
        self.t0 = self.clock()
        repeats = 0
        if self.clusters.current is not None:  # the base cluster, started before the search (its self-test too)
            self._selftest_finds(*self.clusters.current)
        try:
            while self.elapsed() < self.budget_s:
                # the next run (about as long as the last) must leave the pending finds their reserve,
                # counted on the cluster it will run on
                if self.pending and self.elapsed() + self._last_wall >= self.budget_s - self._reserve():
                    self._confirm_pending()  # then search on if time is left
                    continue
                sc = self._next()
                if self.strategy == "guided":  # what already wedged this deployment's cluster, left out
                    sc = avoid(sc, self.base, self._avoided(sc.deployment.restart_key()))
                if sc.digest() in self.ran and repeats < REDRAWS:
                    # the same engines, knobs and traffic again show what they showed (a confirmation
                    # reruns on purpose, elsewhere): a 0.5.19 search (2026-12-05, seed 3) spent 2 of its 10
                    # runs on one knob mutation of its steady state, drawn twice
                    repeats += 1
                    self.stats.repeats += 1
                    continue
                repeats = 0
                key = sc.deployment.restart_key()
                if self.pending and key != self.clusters.key and \
                        self.elapsed() + self._last_wall + self._start_estimate() >= self.budget_s - self._reserve(key):
                    self.queues.setdefault(key, []).insert(0, sc)  # it waits; the pending finds go first
                    self._confirm_pending()
                    continue
                self._exec(sc)
            if self.pending:  # what the budget left no time to confirm is written up so
                self._confirm_pending()
        finally:
            self.clusters.close()
        return self.summary()

    def _name(self) -> str:
        """A name no other scenario of this search has: one per draw (a scenario queued for another
        deployment runs later, and a name taken from the run count gave it the name of the run after it:
        two scenarios under one name in the search's output and its finds' write-ups)."""
        self._draws += 1
        return f"fz{self._draws - 1:05d}"

    def _draw(self) -> Scenario:
        name = self._name()
        if self.stats.execs == 0 and not self.corpus.resumed:
            return baseline(self.rng, self.base, name)
        if self.strategy == "guided" and len(self.corpus):
            how = self.operators.pick(self.rng, splice=len(self.corpus) > 1)
            if how == "splice":
                return splice(self.rng, self.corpus.pick(self.rng), self.corpus.pick(self.rng), name)
            if how == "mutate":
                return mutate(self.rng, self.corpus.pick(self.rng), self.base, name)
        return generate(self.rng, self.base, name)

    def _next(self) -> Scenario:
        """A scenario for the running cluster if there is one; a deployment change only when its queue
        is worth it (module doc)."""
        waiting = [k for k, q in self.queues.items() if q]
        if waiting and self.clusters.key is not None and \
                self.elapsed() - self._on_since >= AMORTIZE * self._start_estimate():
            self.since_new = 0  # the running deployment has had its share: the longest queue gets the cluster
            return self.queues[max(waiting, key=lambda k: len(self.queues[k]))].pop(0)
        for _ in range(50):
            sc = self._draw()
            if not self.deployments:  # on the base deployment: each plan and check labelled for it
                rebase(sc, self.base, self.base.restart)
            if self.engine_version:
                sc.deployment.restart["engine_version"] = self.engine_version
            key = sc.deployment.restart_key()
            if self.clusters.key is not None and key != self.clusters.key and self._running is not None \
                    and sc.origin.get("by") in ("mutate", "splice") and sc.origin.get("how") != "restart_knob":
                rebase(sc, self.base, self._running.restart)
                key = sc.deployment.restart_key()
            if self.clusters.key is None or key == self.clusters.key:
                return sc
            q = self.queues.setdefault(key, [])
            q.append(sc)
            if len(q) >= SWITCH_AFTER or self.since_new >= STALE_AFTER:
                self.since_new = 0
                return q.pop(0)
        # nothing drawn fits: run the longest queue
        key = max(self.queues, key=lambda k: len(self.queues[k]))
        return self.queues[key].pop(0)

    def _start_estimate(self) -> float:
        """What a cluster start is expected to cost: the longest seen, at least :data:`START_COST_FLOOR_S`."""
        return max(self._start_cost, START_COST_FLOOR_S)

    def _avoided(self, key: str) -> set[str]:
        """The traits left out of scenarios on the deployment of restart key ``key``: its own wedges' and
        the cut, where one wedged any deployment."""
        return self.wedges.get(key, set()) | self.wedges.get("*", set())

    def _cluster(self, dep: Deployment):
        """The running cluster if it is of ``dep``'s deployment, else a new one (counted, and its start
        timed)."""
        t_get = self.clock()
        (cluster, kit, policy), started = self.clusters.get(dep)
        if started:
            self.stats.restarts += 1
            self._start_cost = max(self._start_cost, self.clock() - t_get)
            self._on_since = self.elapsed()
            self._running = Deployment(dict(dep.restart), {})
            self._selftest_finds(cluster, kit, policy)
        return cluster, kit, policy

    def _selftest_finds(self, cluster, kit, policy) -> None:
        """A new cluster's planted-leak self-test that saw the engine leak (``kvchaos.selftest``: what
        nothing planted explains) is a find like any run's, triaged on those verdicts alone; written up,
        not re-run (its scenario carries the planted leaks, which any re-run shows again), and the search
        goes on."""
        st = getattr(policy, "selftest", None) or {}
        ex = getattr(cluster, "selftest_experiment", None)
        if st.get("status") != "engine_leak" or ex is None:
            return
        self.say(f"  the cluster's planted-leak self-test saw the engine leak (planted leaks caught: "
                 f"{st.get('planted_caught')}): triaged as a find")
        try:
            sc = ex.scenario()
        except Exception as e:  # noqa: BLE001 - the find is written without its scenario's document
            self.say(f"  (its scenario could not be written: {e})")
            return
        for f in triage(ex.verdicts, ex.context(), self.registry, ex.events):
            self.say(f"  self-test: {f.kind.upper()} {f.finding or f.signature} ({f.oracle} {f.status.upper()})")
            if f.kind == "new" and f.signature not in self.stats.new:
                rec = {"t": round(self.elapsed(), 1), "oracle": f.oracle, "status": f.status, "mechanism": f.mechanism,
                       "seen": 1, "leak": is_leak(f), "scenario": sc.digest(), "why_not_known": f.why_not_known,
                       "confirmed": None, "during": "planted-leak self-test",
                       "reproduced": "not re-run (its scenario carries the planted leaks, which any re-run shows "
                                     "again)"}
                self.stats.new[f.signature] = rec
                self._write_find(f"new-{f.signature}", sc, f, ex, rec)
            elif f.kind == "new":
                self.stats.new[f.signature]["seen"] += 1
            else:
                self._note(f, sc, ex, self.elapsed(), cluster, kit, policy, self.out / "execs")

    def _exec(self, sc: Scenario) -> None:
        cluster, kit, policy = self._cluster(sc.deployment)
        run_dir = self.out / "execs"
        t = self.elapsed()
        self.stats.execs += 1
        self.ran.add(sc.digest())
        t_run = self.clock()
        try:
            ex = self._run(sc, cluster, kit, policy, run_dir)
        except Exception as e:  # noqa: BLE001 - a scenario the engines or faults refused: counted, not fatal
            self.stats.errors += 1
            self.say(f"  {sc.name}: not run: {type(e).__name__}: {str(e)[:200]}")
            if not self._still_serves(kit):  # a broken cluster is replaced; a refused op costs no restart
                self.clusters.close()
            return
        wall_s = self._last_wall = self.clock() - t_run
        # the next run, a confirmation or a shrink step starts on an idle cluster with flushed caches,
        # as on a fresh one: requests this run left in the engines (the hang band, a request parked past
        # its client) are aborted; a cluster that will not go idle even then is replaced
        aborted, left = settle(cluster)
        feats = features(ex.events)
        if aborted:  # the engines kept requests their clients had given up on: an engine state too
            self.stats.stuck += 1
            feats = feats | {"after_run:requests_left_in_engine"}
        blamed = set()
        if self.strategy == "guided":  # random draws on regardless: the baseline guidance is measured against
            seen = self.wedges.setdefault(sc.deployment.restart_key(), set())
            blamed = wedge_traits(sc, ex.events, self.base) - self._avoided(sc.deployment.restart_key())
            if blamed:
                seen |= blamed - {"cut"}
                if "cut" in blamed:
                    self.wedges.setdefault("*", set()).add("cut")
                self.say(f"  {sc.name} wedged the cluster: later scenarios leave out {sorted(blamed)}")
        # both strategies count coverage the same way; only guided draws from what the corpus kept. A run
        # a wedge took long is not picked less for it: its mutations leave the wedge's traits out
        kept = self.corpus.add(sc, feats, t, run=str(ex.path), wall_s=None if blamed else wall_s)
        self.since_new = 0 if kept else self.since_new + 1
        finds = triage(ex.verdicts, ex.context(), self.registry, ex.events)
        broken = f"it would not go idle: {left}" if left else None
        if not broken and not answers(cluster):  # whatever the find: the next run would meet it dead
            broken = "it no longer answers"
        if broken:
            # a cluster this run broke (its transfer thread dead, a role gone, requests stuck) would fail
            # every confirmation and shrink step, each into its timeouts: a fresh one of the same deployment
            self.say(f"  {sc.name}: the cluster is replaced, {str(broken)[:300]}")
            self.clusters.close()
            if any(f.kind == "new" and is_leak(f) for f in finds):  # confirmed now, on a working cluster
                cluster, kit, policy = self._cluster(sc.deployment)
        first = [f for f in finds if (f.kind == "known" and f.finding not in self.stats.first_known)
                 or (f.kind == "new" and f.signature not in self.stats.new)]
        self.operators.paid(sc.origin.get("by"), kept or bool(first))
        for f in finds:
            self._note(f, sc, ex, t, cluster, kit, policy, run_dir)
        self.stats.timeline.append({"t": round(self.elapsed(), 1), "execs": self.stats.execs,
                                    "features": len(self.corpus.seen), "corpus": len(self.corpus),
                                    "restarts": self.stats.restarts, "known": len(self.stats.first_known),
                                    "new": len(self.stats.new)})
        verdicts = {v.oracle: v.status for v in ex.verdicts}
        self.say(f"  {sc.name} [{self.elapsed():6.0f} s] {len(sc.traffic.plans)} plans, {len(sc.nemesis)} ops"
                 f"{', kept' if kept else ''}: {verdicts}"
                 + "".join(f"  {f.kind.upper()} {f.finding or f.signature} ({f.oracle})" for f in finds
                           if f.kind in ("known", "new")))

    def _still_serves(self, kit) -> bool:
        try:
            left = kit.heal_all()
        except Exception as e:  # noqa: BLE001
            left = [repr(e)]
        if left:
            self.say(f"  the cluster is replaced: {'; '.join(map(str, left))[:300]}")
        return not left

    def _run(self, sc, cluster, kit, policy, run_dir):
        factory = functools.partial(Experiment, cluster=cluster, run_dir=run_dir, faults=kit, policy=policy,
                                    test_id=f"fuzz::{sc.name}")
        return run_scenario(factory, sc, kit, cluster)

    # ------------------------------------------------------------------ finds
    def _note(self, f: Find, sc, ex, t, cluster, kit, policy, run_dir) -> None:
        if f.kind in ("blind", "expected"):
            setattr(self.stats, f.kind, getattr(self.stats, f.kind) + 1)
            return
        if f.kind == "known":
            rec = {"t": round(t, 1), "scenario": sc.digest(), "oracle": f.oracle, "events": str(ex.path),
                   "power_met": f.power_met, "ops": sorted({o.kind for o in sc.nemesis}),
                   "live": sorted(sc.deployment.live), "restart": sorted(k for k in sc.deployment.restart
                                                                         if k != "engine_version")}
            if f.finding not in self.stats.first_known:
                self.stats.first_known[f.finding] = rec
                self._write_find(f"known-{f.finding}", sc, f, ex)
            if not sc.nemesis and f.finding not in self.stats.first_known_quiet:
                self.stats.first_known_quiet[f.finding] = rec
                if self.stats.first_known[f.finding] is not rec:
                    self._write_find(f"known-{f.finding}-no-fault", sc, f, ex)
            return
        if f.signature in self.stats.new:
            self.stats.new[f.signature]["seen"] += 1
            return
        rec = {"t": round(t, 1), "oracle": f.oracle, "status": f.status, "mechanism": f.mechanism, "seen": 1,
               "leak": is_leak(f), "scenario": sc.digest(),
               "why_not_known": f.why_not_known}
        self.stats.new[f.signature] = rec
        if not (self.confirm_all or rec["leak"]):
            rec.update(confirmed=None, reproduced="not confirmed: this search confirms NEW leaks only")
            self._write_find(f"new-{f.signature}", sc, f, ex, rec)
            return
        if not rec["leak"]:  # confirmed at the end of the search (CONFIRM_RESERVE); written up now as pending
            rec.update(confirmed=None, reproduced="pending: confirmed at the end of the search")
            self.pending.append({"find": f, "scenario": sc, "ex": ex, "rec": rec, "wall_s": self._last_wall})
            self._write_find(f"new-{f.signature}", sc, f, ex, rec)
            return
        # a NEW leak is confirmed and shrunk now, whatever the clock says
        self._confirm_and_write(f, sc, ex, rec, cluster, kit, policy, run_dir)

    def _confirm_and_write(self, f, sc, ex, rec, cluster, kit, policy, run_dir) -> None:
        rec.update(self._confirm(f, sc, cluster, kit, policy, run_dir))
        minimal = None
        if rec["confirmed"]:
            minimal, rec["shrink"] = self._shrink(f, sc, cluster, kit, policy, run_dir)
        self._write_find(f"new-{f.signature}", sc, f, ex, rec, minimal)

    def _cost(self, p: dict, running: str | None = None) -> float:
        """What confirming a pending find is expected to take: its reruns and control at its own run's
        wall time, and a cluster start where its deployment is not the running one (``running``: the
        restart key of the cluster it would follow; the running cluster's by default)."""
        running = self.clusters.key if running is None else running
        start = 0.0 if p["scenario"].deployment.restart_key() == running else self._start_estimate()
        return CONFIRM_RUNS * p["wall_s"] + start

    def _reserve(self, running: str | None = None) -> float:
        """The end of the budget kept for the pending finds: their expected cost, at most
        :data:`CONFIRM_RESERVE` of the budget (a find whose confirmation would not fit even then is
        written up unconfirmed: on 0.5.19 a wedge's three runs are over 6 of a 10-minute search's
        minutes, and confirming one took the search's place from its fourth minute on)."""
        return min(CONFIRM_RESERVE * self.budget_s, sum(self._cost(p, running) for p in self.pending))

    def _confirm_pending(self) -> None:
        """Confirm (and shrink, with what is left) the pending finds, the most often seen first, those on
        the running deployment before those that need a cluster start; a find there is no time left for is
        written up unconfirmed, saying so. Empties :attr:`pending`."""
        todo = sorted(self.pending, key=lambda p: (-p["rec"]["seen"], self._cost(p), p["rec"]["t"]))
        self.pending = []
        for p in todo:
            f, sc, ex, rec = p["find"], p["scenario"], p["ex"], p["rec"]
            if self.budget_s - self.elapsed() < self._cost(p):
                rec.update(confirmed=None, reproduced=f"not confirmed: too little of the budget was left for "
                                                      f"{CONFIRM_RUNS} runs (NEW leaks are confirmed past it)")
                self._write_find(f"new-{f.signature}", sc, f, ex, rec)
                continue
            try:
                cluster, kit, policy = self._cluster(sc.deployment)
            except Exception as e:  # noqa: BLE001 - a deployment that would not start: said, not fatal
                rec.update(confirmed=None, reproduced=f"not confirmed: its deployment did not start: {e}"[:300])
                self._write_find(f"new-{f.signature}", sc, f, ex, rec)
                continue
            self.say(f"  confirming {f.signature} ({f.oracle}, seen {rec['seen']}x) from {sc.name}")
            self._confirm_and_write(f, sc, ex, rec, cluster, kit, policy, self.out / "execs")

    def _fresh(self, sc: Scenario, cluster, tag: str) -> Scenario:
        settle(cluster)  # what the run before left in the engines is aborted first
        return as_on_a_fresh_cluster(sc, cluster, tag)

    def _same(self, f: Find, ex) -> bool:
        return any(g.signature == f.signature for g in triage(ex.verdicts, ex.context(), self.registry, ex.events))

    def _confirm(self, f: Find, sc: Scenario, cluster, kit, policy, run_dir) -> dict:
        """Rerun the scenario (2 of 3 must show the same mechanism, the first run counted) and its
        control — the same traffic with no nemesis op and no live knob — which must not show it; each
        as if on a fresh cluster (:meth:`_fresh`)."""
        again = 1
        for i in range(CONFIRM_RUNS - 1):
            if again >= CONFIRM_NEEDED:
                break
            try:
                again_sc = Scenario.from_dict({**sc.to_dict(), "name": f"{sc.name}-confirm{i + 1}"})
                rerun = self._run(self._fresh(again_sc, cluster, f"confirm{i + 1}"), cluster, kit, policy, run_dir)
                again += self._same(f, rerun)
            except Exception as e:  # noqa: BLE001
                self.say(f"  confirm run of {sc.name} failed: {e}")
        ctrl = Scenario.from_dict({**sc.to_dict(), "name": f"{sc.name}-control", "nemesis": [],
                                   "deployment": {"restart": sc.deployment.restart, "live": {}}})
        # labelled by the control's own limits: a prompt only a lowered live limit refused is an ordinary
        # one without it (a control that kept the label judged ordinary replies as rejected-size ones)
        rebase(ctrl, self.base, sc.deployment.restart)
        control_shows = None
        try:
            ctrl_run = self._fresh(ctrl, cluster, "control")
            control_shows = self._same(f, self._run(ctrl_run, cluster, kit, policy, run_dir))
        except Exception as e:  # noqa: BLE001
            self.say(f"  control run of {sc.name} failed: {e}")
        return {"reproduced": f"{again}/{CONFIRM_RUNS}", "confirmed": again >= CONFIRM_NEEDED,
                "control_shows_it": control_shows, "control": ctrl.to_dict() if control_shows is False else None}

    def _shrink(self, f: Find, sc: Scenario, cluster, kit, policy, run_dir):
        """The find shrunk (kvchaos.fuzz.shrink), within :data:`SHRINK_SHARE` of the search's budget for a
        leak, :data:`SHRINK_SHARE_OTHER` for anything else; every step as on a fresh cluster."""
        n = {"i": 0}

        def shows(cand):
            n["i"] += 1
            try:
                return self._same(f, self._run(self._fresh(cand, cluster, f"shrink{n['i']}"), cluster, kit, policy,
                                               run_dir))
            except Exception as e:  # noqa: BLE001 - a candidate the engines refused does not show the find
                self.say(f"  shrink attempt failed: {e}")
                return False
        budget = SHRINK_SHARE * self.budget_s
        if not is_leak(f):  # a leak's shrink may run past the search's end; nothing else's
            budget = min(SHRINK_SHARE_OTHER * self.budget_s, max(0.0, self.budget_s - self.elapsed()))
        minimal, stats = shrink(sc, shows, budget_s=budget, clock=self.clock)
        return minimal, stats

    def _write_find(self, key: str, sc: Scenario, f: Find, ex, rec: dict | None = None,
                    minimal: Scenario | None = None) -> None:
        d = self.out / "finds" / key
        d.mkdir(parents=True, exist_ok=True)
        sc.save(d / "scenario.json")
        if minimal is not None:  # a repro candidate: minimal.json once --verify showed it in 9 of 10 fresh runs
            minimal.save(d / "shrunk.json")
        (d / "find.json").write_text(json.dumps({**f.to_dict(), **(rec or {}), "events": str(ex.path)}, indent=1,
                                                default=str) + "\n")
        lines = [f"# {f.kind.upper()}: {f.finding or f.signature} ({f.oracle} {f.status.upper()})", "",
                 f.summary, "", "Mechanism (from the verdict's witnesses and the engines' events):", "",
                 "```json", json.dumps(f.mechanism, indent=1), "```", "",
                 f"Scenario: `scenario.json` (digest {sc.digest()}); its event log: `{ex.path}`.", "",
                 f"Re-run it: `kvchaos fuzz --replay {d / 'scenario.json'}`"
                 + (f"; the shrunk one (`shrunk.json`), each run on a fresh cluster: `kvchaos fuzz --verify {d}` "
                    "(it becomes `minimal.json`, the minimal repro, where 9 in 10 runs show the find)" if minimal else "")]
        if f.power_met is False:
            lines += ["", "The run was under its power floor in some exposure class (the summary says which): "
                      "the leak's mechanism is the finding's, but the policy would not accept this run as KNOWN."]
        if rec and rec.get("during"):
            lines += ["", f"Seen during the cluster's {rec['during']}: {rec.get('reproduced')}."]
        elif rec:
            lines += ["", f"Reproduced {rec.get('reproduced')}; the control (no faults, no live knobs) "
                      f"showed it: {rec.get('control_shows_it')}."]
            if f.why_not_known:
                lines += ["", f"Why no registered finding covers it: {f.why_not_known}"]
        (d / "BUG.md").write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ the summary
    def summary(self) -> dict:
        el = max(self.elapsed(), 1e-9)
        s = {"strategy": self.strategy, "seed": self.seed, "budget_s": self.budget_s, "elapsed_s": round(el, 1),
             "execs": self.stats.execs, "execs_per_min": round(60 * self.stats.execs / el, 2),
             "cluster_restarts": self.stats.restarts, "errors": self.stats.errors, "blind": self.stats.blind,
             "stuck": self.stats.stuck, "repeats": self.stats.repeats,
             "expected": self.stats.expected,
             "features": len(self.corpus.seen), "corpus": len(self.corpus), "corpus_resumed": self.corpus.resumed,
             "known": self.stats.first_known, "known_without_faults": self.stats.first_known_quiet,
             "new": self.stats.new, "timeline": self.stats.timeline,
             "operators": {w: {"runs": n, "paid": k} for w, (n, k) in self.operators.record.items()},
             "wedges_avoided": {k: sorted(v) for k, v in self.wedges.items() if v}}
        (self.out / "fuzz.json").write_text(json.dumps(s, indent=1, default=str) + "\n")
        return s


def table(runs: list[dict]) -> str:
    """Side by side (guided vs random): executions, coverage, restarts, time to the first find of each
    finding; and which is ahead, on distinct findings, then on coverage."""
    ids = sorted({k for r in runs for k in r["known"]})
    head = f"{'':34s}" + "".join(f"{r['strategy']:>14s}" for r in runs)
    rows = [head,
            f"{'executions (per minute)':34s}" + "".join(f"{r['execs']:>7d} ({r['execs_per_min']:4.1f})" for r in runs),
            f"{'features (engine states seen)':34s}" + "".join(f"{r['features']:>14d}" for r in runs),
            f"{'corpus':34s}" + "".join(f"{r['corpus']:>14d}" for r in runs),
            f"{'cluster restarts':34s}" + "".join(f"{r['cluster_restarts']:>14d}" for r in runs),
            f"{'distinct known findings':34s}" + "".join(f"{len(r['known']):>14d}" for r in runs),
            f"{'  ... found with no fault op':34s}" + "".join(
                f"{len(r.get('known_without_faults', {})):>14d}" for r in runs),
            f"{'NEW (confirmed)':34s}" + "".join(
                f"{sum(1 for n in r['new'].values() if n.get('confirmed')):>14d}" for r in runs)]
    for i in ids:
        rows.append(f"  first {i[:30]:30s}" + "".join(
            f"{(str(r['known'][i]['t']) + ' s') if i in r['known'] else '-':>14s}" for r in runs))
        if any(i in r.get("known_without_faults", {}) for r in runs):
            rows.append(f"{'    with no fault op':38s}" + "".join(
                f"{(str(r['known_without_faults'][i]['t']) + ' s') if i in r.get('known_without_faults', {}) else '-':>14s}"
                for r in runs))
    if len(runs) == 2:  # each measure said on its own line: one arm can lead on one and trail on the other
        a, b = runs
        for what, (x, y), unit in (("distinct findings", (len(a["known"]), len(b["known"])), ""),
                                   ("coverage", (a["features"], b["features"]), " features")):
            if x == y:
                rows.append(f"ahead on {what}: neither ({x}{unit} each)")
            else:
                w = a if x > y else b
                rows.append(f"ahead on {what}: {w['strategy']} ({max(x, y)} vs {min(x, y)}{unit})")
    return "\n".join(rows)
