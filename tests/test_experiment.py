"""The experiment runner on its own, against tests/fake_engine.py: the log's header, the method record
with the armed fault ids, the faults' own records copied in, one log per experiment, the during
action's error, and judging before running."""

import functools
import json
import time

import pytest

from kvchaos import httpclient
from kvchaos.cluster.spec import ClusterSpec
from kvchaos.experiment import Experiment, VerdictsNotMet, run_scenario
from kvchaos.oracles import PASS, Isolation, Liveness
from kvchaos.policy import Policy
from kvchaos.workload import EventLog, Workload
from kvchaos.workload.scenario import Deployment, Op, Scenario, ScenarioError, Traffic, plan_dict
from tests.fake_engine import FakeEngine


class StandIn:
    def __init__(self, url):
        self.endpoints = type("E", (), {"router": url, "prefill": url, "decode": url, "as_dict": lambda s: {"router": url}})()

    def server_info(self, role="decode"):
        return {"version": "0.5.23"}

    def generate(self, text=None, max_new_tokens=1, timeout=30, **kw):
        return httpclient.post(self.endpoints.router + "/generate", json={"text": text}, timeout=timeout)


class Kit:
    """What the runner needs of a FaultKit: its log, heal_all, copy_agent_events."""

    def __init__(self, log):
        self.log, self.healed, self.waits = log, 0, []

    def heal_all(self, wait_s=60.0):
        self.healed += 1
        self.waits.append(wait_s)
        return []

    def copy_agent_events(self, log, since=0.0):
        return []


@pytest.fixture
def fake():
    with FakeEngine() as eng:
        yield StandIn(eng.url)


def _ex(tmp_path, fake, name="exp", faults=None, **kw):
    plans = Workload(3, n_tenants=4, prefix=name[:3]).mix(24)
    return Experiment(name, plans, [Isolation(), Liveness(bound_s=30)], cluster=fake, run_dir=tmp_path,
                      faults=faults, settle_s=0, timeout_s=10, test_id="t::x", seed=3, policy=Policy(), **kw)


def test_header_method_and_fault_records(tmp_path, fake):
    flog = EventLog()
    kit = Kit(flog)
    with _ex(tmp_path, fake, faults=kit) as ex:
        # an injector's record carrying its own time ("at", as the proxy and process faults write)
        flog.emit("fault", action="armed", fault="limit_data-1", kind="limit_data", injector="proxy", at=123.0)
        flog.emit("fault", action="armed", fault="delay-2", kind="delay", injector="agent")
    ev = [json.loads(x) for x in ex.path.read_text().splitlines()]
    head = ev[0]
    assert head["ev"] == "experiment" and head["test"] == "t::x" and head["seed"] == 3
    assert head["engine"]["version"] == "0.5.23" and head["id"] == ex.id
    (method,) = [e for e in ev if e["ev"] == "method"]
    assert method["faults"] == ["delay-2", "limit_data-1"]
    copied = {e["fault"]: e for e in ev if e["ev"] == "fault"}
    assert copied["limit_data-1"]["at"] == 123.0 and isinstance(copied["delay-2"]["at"], float)
    assert kit.healed == 1  # rolled back before the steady-state probe
    rec = [json.loads(x) for x in (tmp_path / "experiments.jsonl").read_text().splitlines()]
    assert rec[-1]["id"] == ex.id and rec[-1]["test"] == "t::x" and rec[-1]["version"] == "0.5.23"


def test_each_experiment_gets_its_own_files(tmp_path, fake):
    with _ex(tmp_path, fake) as a:
        pass
    with _ex(tmp_path, fake) as b:
        pass
    assert a.path.name == "exp.events.jsonl" and b.path.name == "exp-2.events.jsonl"
    assert b.verdicts_path.name == "exp-2.verdicts.json" and a.verdicts_path.exists() and b.verdicts_path.exists()


def test_during_error_is_raised_after_the_verdicts_are_recorded(tmp_path, fake):
    ex = _ex(tmp_path, fake)
    with pytest.raises(RuntimeError, match="kill failed"):
        with ex:
            ex.during(lambda: (_ for _ in ()).throw(RuntimeError("kill failed")))
    assert ex.verdicts and ex.verdicts_path.exists()
    with pytest.raises(RuntimeError, match="one during action only"):
        ex.during(lambda: None)


def test_judging_before_running_and_unmet_requirements(tmp_path, fake):
    ex = _ex(tmp_path, fake)
    with pytest.raises(RuntimeError, match="judge after"):
        ex.require(isolation=PASS)
    with ex:
        pass
    # 24 replies of the fake engine: no leak, but too little evidence for isolation to PASS
    with pytest.raises(VerdictsNotMet, match="isolation: UNKNOWN"):
        ex.require(isolation=PASS)
    with pytest.raises(ValueError, match="no path separators"):
        _ex(tmp_path, fake, name="a/b")


class Healing(StandIn):
    """A launched cluster whose prefill broke before the experiment (a Mooncake transfer thread died in
    the test's previous experiment): the runner restarts it before its own traffic."""

    def __init__(self, url):
        super().__init__(url)
        self.pending = [{"role": "prefill", "signature": "mooncake_transfer_worker_died", "line": "RuntimeError"}]
        self.restarts, self.scans = [], 0

    def heal_engine_errors(self):
        todo, self.pending = self.pending, []
        for f in todo:
            self.restarts.append(f["role"])
            f["healed"] = {"role": f["role"], "rejoined_s": 2.5}
        return todo

    def engine_errors(self):
        self.scans += 1
        return []


def test_an_engine_broken_before_the_experiment_is_restarted_first_and_not_counted_as_its_own(tmp_path):
    with FakeEngine() as eng:
        c = Healing(eng.url)
        with _ex(tmp_path, c) as ex:
            assert c.restarts == ["prefill"]  # before any of its requests
        ev = [json.loads(x) for x in ex.path.read_text().splitlines()]
    (healed,) = [e for e in ev if e["ev"] == "engine_healed"]
    assert healed["before"] and healed["role"] == "prefill" and healed["restart"] == 2.5
    assert ev.index(healed) < min(i for i, e in enumerate(ev) if e["ev"] == "send")
    assert ex.engine_errors == []  # not this experiment's: nothing of it may be matched to a finding
    assert {v.oracle for v in ex.verdicts} >= {"isolation", "liveness"}  # then it ran and was judged


class Breaks:
    """A launched cluster whose prefill's transfer thread dies on the third look at its log."""

    def __init__(self):
        self.looks, self.pending, self.restarts, self.broke_at = 0, [], [], None

    def engine_errors(self):
        self.looks += 1
        if self.looks == 3:
            self.broke_at = time.monotonic()
            self.pending = [{"role": "prefill", "signature": "mooncake_transfer_worker_died", "line": "RuntimeError"}]
            return list(self.pending)
        return []

    def heal_engine_errors(self):
        todo, self.pending = self.pending, []
        for f in todo:
            self.restarts.append((f["role"], self.looks, time.monotonic() - self.broke_at))
            f["healed"] = {"role": f["role"], "rejoined_s": 1.5}
        return todo


def test_an_engine_that_breaks_mid_run_is_restarted_after_the_grace_and_its_error_kept(monkeypatch):
    from kvchaos import experiment as exp_mod

    monkeypatch.setattr(exp_mod._EngineWatch, "PERIOD_S", 0.02)
    c, log = Breaks(), EventLog()
    w = exp_mod._EngineWatch(c, log, grace_s=0.2)
    deadline = time.monotonic() + 10
    while not c.restarts and time.monotonic() < deadline:
        time.sleep(0.02)
    w.stop()
    (role, at, after_s), = c.restarts
    # not before the grace: its stranded requests time out first. In seconds, not looks: on a busy machine
    # (make test runs these tests beside the cluster session) fewer looks fit in the grace than it holds periods
    assert role == "prefill" and at > 3 and after_s >= 0.2, c.restarts
    (e,) = w.seen
    assert e["signature"] == "mooncake_transfer_worker_died" and e["healed"]["rejoined_s"] == 1.5
    (rec,) = [r for r in log.records if r["ev"] == "engine_healed"]
    assert rec["during"] and rec["role"] == "prefill"


def test_no_watch_where_nothing_can_be_restarted():
    from kvchaos import experiment as exp_mod

    w = exp_mod._EngineWatch(object(), EventLog(), grace_s=0.1)
    assert w._thread is None
    w.stop()


# ------------------------------------------------------------------ every experiment as data (kvchaos.workload.scenario)
def test_every_experiment_writes_its_scenario_with_the_faults_it_armed(tmp_path, fake):
    flog = EventLog()
    kit = Kit(flog)
    ex = _ex(tmp_path, fake, faults=kit)
    with ex:
        flog.emit("fault", action="armed", fault="delay-2", kind="delay", injector="agent", role="prefill",
                  target={"tenant": "t001"}, params={"ms": 40}, count=None)
    sc = Scenario.load(ex.scenario_path)
    assert ex.scenario_path.name == "exp.scenario.json" and sc.name == "exp" and sc.seed == 3
    assert [p["rid"] for p in sc.traffic.plans] == [p.rid for p in ex.plans] and sc.traffic.concurrency == ex.concurrency
    (op,) = sc.nemesis
    assert (op.kind, op.role, op.target, op.params, op.at_s) == ("delay", "prefill", {"tenant": "t001"}, {"ms": 40}, 0.0)
    assert {c["name"] for c in sc.checks} >= {"isolation", "liveness"}
    assert sc.origin["complete"] is True and sc.origin["test"] == "t::x"
    rec = [json.loads(x) for x in (tmp_path / "experiments.jsonl").read_text().splitlines()][-1]
    assert rec["scenario"] == "suites/exp.scenario.json" and rec["scenario_error"] is None


def test_a_scenario_says_what_of_the_experiment_it_cannot_hold(tmp_path, fake):
    ex = _ex(tmp_path, fake, drive=lambda e: e.send(e.plans[:3]))
    with ex:
        ex.during(lambda: None)
    sc = Scenario.load(ex.scenario_path)
    assert sc.origin["complete"] is False
    assert any("custom drive" in w for w in sc.origin["why_incomplete"])
    assert any("during action" in w for w in sc.origin["why_incomplete"])


def test_a_suites_nemesis_ops_are_its_scenario_and_a_fault_armed_beside_them_is_said(tmp_path, fake):
    """``ex.nemesis(ops)``: the ops are armed through the kit, healed in the rollback, and written as the
    experiment's scenario (complete: it replays as data). A fault the suite armed beside them makes the
    scenario incomplete, by name."""
    armed, healed = [], []

    class Agent:
        def arm(self, role, kind, target=None, params=None, count=None):
            fid = f"{kind}-{len(armed)}"
            h = type("H", (), {"id": fid, "heal": lambda s: healed.append(s.id)})()
            armed.append(fid)
            flog.emit("fault", action="armed", fault=fid, kind=kind, injector="agent", role=role, target=target,
                      params=params or {}, count=count)
            return h

        def events(self, role):
            return []

    for beside in (False, True):
        flog = EventLog()
        kit = Kit(flog)
        kit.agent = Agent()
        ex = _ex(tmp_path / str(beside), fake, faults=kit)
        ops = [Op(at_s=0, injector="agent", role="prefill", kind="delay", target={"tenant": "t001"}, params={"ms": 5}),
               Op(at_s=0, injector="action", kind="abort", rids=[ex.plans[3].rid], delay_s=0.1,
                  on={"role": "prefill", "ev": "transfer_start", "rid": ex.plans[3].rid})]
        with ex:
            sched = ex.nemesis(ops)
            if beside:
                flog.emit("fault", action="armed", fault="fail-9", kind="fail", injector="agent", role="decode",
                          target=None, params={}, count=None)
        assert sched.handles[0].id in healed  # the rollback healed it
        sc = Scenario.load(ex.scenario_path)
        assert sc.nemesis == ops
        assert sc.origin["complete"] is (not beside), sc.origin
        if beside:
            assert "faults armed beside the nemesis ops are not in it: agent fail (fail-9)" in sc.origin["why_incomplete"][0]
    with pytest.raises(ScenarioError, match=r"nemesis\[0\]: a release names the op it acts on"):
        with _ex(tmp_path / "bad", fake, faults=kit) as ex:
            ex.nemesis([Op(at_s=0, injector="action", kind="release")])


def test_a_gated_plan_is_sent_once_the_op_it_waits_for_happened_and_the_scenario_says_so(tmp_path, fake):
    """The driver holds a gated plan until its op happened (here an action on an engine event 0.4 s after
    the nemesis first looked: a loaded machine may take longer than that to open the experiment); the
    others go at once, before the op; the scenario.json keeps the gate."""
    first_look = []

    class Agent:
        def events(self, role):
            first_look.append(time.time())
            at = first_look[0] + 0.4
            return [{"ev": "transfer_start", "rid": "x", "wall": at}] if time.time() >= at else []

    kit = Kit(EventLog())
    kit.agent = Agent()
    ex = _ex(tmp_path, fake, faults=kit)
    late = ex.plans[5].rid
    ops = [Op(at_s=0, injector="process", kind="stop", role="decode",
              on={"role": "prefill", "ev": "transfer_start", "rid": "x"})]
    stopped = []
    kit.proc = type("P", (), {"stop": lambda s, role: stopped.append(time.time()) or
                              type("H", (), {"id": "stop-1", "heal": lambda h: None})()})()
    with ex:
        ex.nemesis(ops, {late: 0})
    sends = {e["rid"]: e["wall"] for e in ex.events if e["ev"] == "send"}
    assert stopped and sends[late] >= stopped[0] >= first_look[0] + 0.4
    assert min(sends.values()) < stopped[0]  # the others did not wait for the op
    sc = Scenario.load(ex.scenario_path)
    assert sc.traffic.gates == {late: 0} and sc.origin["complete"] is True


def test_a_scenario_runs_through_the_runner_and_every_op_is_healed(tmp_path, fake):
    plans = Workload(3, n_tenants=4, prefix="rs").mix(24)
    sc = Scenario(name="from-data", seed=3, traffic=Traffic([plan_dict(p) for p in plans], 4, 10.0),
                  deployment=Deployment({}, {"deferred_release_timeout_s": 2.0}),
                  nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="delay", target={"tenant": "t001"},
                              params={"ms": 5}),
                           Op(at_s=60, injector="agent", role="decode", kind="fail")],  # after the traffic: never armed
                  checks=[{"name": "isolation"}, {"name": "liveness", "bound_s": 30.0}])
    armed, healed = [], []

    class Agent:
        def arm(self, role, kind, target=None, params=None, count=None):
            h = type("H", (), {"id": f"{kind}-{len(armed)}", "heal": lambda s: healed.append(s.id)})()
            armed.append((role, kind, target, params))
            return h

    kit = Kit(EventLog())
    kit.agent, kit.net, kit.proc = Agent(), None, None
    factory = functools.partial(Experiment, cluster=fake, run_dir=tmp_path, faults=kit, settle_s=0, policy=Policy())
    ex = run_scenario(factory, sc, kit, fake)
    assert armed == [("decode", "deferred_release_timeout", None, {"s": 2.0}),
                     ("prefill", "delay", {"tenant": "t001"}, {"ms": 5})]
    assert sorted(healed) == sorted(f"{k}-{i}" for i, (_r, k, _t, _p) in enumerate(armed))
    assert ex.verdicts and Scenario.load(ex.scenario_path).digest() == sc.digest()


def test_a_scenario_for_another_deployment_is_refused_before_anything_is_sent(tmp_path, fake):
    fake.spec = ClusterSpec.load("cpu")
    sc = Scenario(name="big-pool", traffic=Traffic([plan_dict(p) for p in Workload(3).mix(2)]),
                  deployment=Deployment({"pool_tokens": 8192}, {}))
    with pytest.raises(ScenarioError, match="pool_tokens: the scenario wants 8192, the cluster has 2048"):
        run_scenario(functools.partial(Experiment, cluster=fake, run_dir=tmp_path), sc, Kit(EventLog()), fake)
    assert not (tmp_path / "experiments.jsonl").exists()



def test_a_run_that_stopped_sending_to_a_wedged_cluster_still_gives_its_pools_settle_s(tmp_path, monkeypatch):
    """The driver stops sending to a wedged cluster (its stall record), but the after snapshot still
    gives the pools settle_s: pages the engine is still aborting a few seconds later are no evidence
    of a wedge, and a pool witness breaks the hang band's signature (every witness a timeout)."""
    import kvchaos.experiment as experiment_mod
    seen = []
    monkeypatch.setattr(experiment_mod, "snapshot", lambda cluster, log, phase, settle_s=0.0, **kw: seen.append((phase, settle_s)))
    kits = []
    for stall_s, behaviour in ((1.0, "hang"), (None, "ok")):
        kits.append(Kit(EventLog()))
        with FakeEngine(behaviour=behaviour) as eng:
            plans = Workload(4, n_tenants=2, prefix="st").mix(12)
            ex = Experiment("stall", plans, [Liveness(bound_s=1)], cluster=StandIn(eng.url), run_dir=tmp_path / behaviour,
                            settle_s=45.0, timeout_s=1.0, stall_s=stall_s, test_id="t::s", seed=4, policy=Policy(),
                            concurrency=4, probe_before=False, faults=kits[-1])
            with ex:
                pass
        if stall_s:
            stalled = ex
    ex = stalled
    assert ("after", 45.0) in seen
    # the rollback does not wait for a wedged cluster to serve again (the after probe asks that), an
    # ordinary run's does
    assert kits[0].waits == [0.0] and kits[1].waits == [60.0]
    assert any(e["ev"] == "stall" for e in ex.events) and ex.by["liveness"].status == "fail"
    assert ex.scenario().traffic.stall_s == 1.0  # the scenario it writes says so too


def test_a_slower_pace_stretches_the_drivers_wait_and_the_liveness_bound_and_the_scenario_keeps_pace_1(tmp_path, fake):
    """A like: probe on CPU (ClusterSpec.pace 4 here): the driver waits 4 x the suite's timeout, the
    header records the pace liveness reads back, and the scenario it writes holds the suite's own
    figure, so replaying it on a pace-1 cluster does not stretch anything."""
    fake.spec = ClusterSpec.load("cpu", pace=4.0)
    with _ex(tmp_path, fake) as ex:
        pass
    head = ex.events[0]
    assert ex.timeout_s == 40 and head["timeout_s"] == 40 and head["layout"]["spec"]["pace"] == 4.0
    lv = ex.by["liveness"]
    assert lv.stats["bound_s"] == 120 and lv.stats["pace"] == 4, lv
    assert Scenario.load(ex.scenario_path).traffic.timeout_s == 10
