"""The scenario schema (kvchaos.workload.scenario): every fault kind, toxic, process fault, action,
deployment knob and checker round-trips through JSON; bad documents are refused by field; the kind
tables agree with the injectors' own registries; a run's log becomes its nemesis schedule; the
schedule arms, waits and heals on time and always heals; every experiment writes its scenario."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from types import SimpleNamespace

import pytest

from faults.agent import control as agent_control
from faults.proxy import toxics
from kvchaos.cluster.spec import ClusterSpec
from kvchaos.oracles import (AbortSemantics, CacheIsolation, Differential, HttpSemantics, Integrity, Isolation,
                             KvCanary, KvChecksum, KVLifecycle,
                             Liveness, PageOwnership, Retraction, Sensitivity, SensitivityFloor, TimingIsolation)
from kvchaos.schedule import NemesisError, Schedule, build_checks, check_spec
from kvchaos.workload import Workload
from kvchaos.workload.plan import RequestPlan
from kvchaos.workload.scenario import (AGENT_KINDS, CHECKS, LIVE_KNOBS, PLAN_FIELDS, PROCESS_KINDS, RESTART_KNOBS,
                                       SCHEMA, TOXIC_TYPES, Deployment, Op, Scenario, ScenarioError, Traffic,
                                       nemesis_from_log, plan_dict)


def _plans(n=4):
    return Workload(5, n_tenants=3, prefix="sc").mix(n)


def _scenario(**kw) -> Scenario:
    plans = _plans()
    base = dict(name="s", seed=5, traffic=Traffic([plan_dict(p) for p in plans], 4, 30.0, "router"),
                checks=[{"name": "isolation"}, {"name": "liveness", "bound_s": 30.0}])
    base.update(kw)
    return Scenario(**base)


def _roundtrip(sc: Scenario) -> Scenario:
    back = Scenario.from_json(sc.to_json())
    assert back.to_dict() == sc.validate().to_dict()
    assert back.to_json() == Scenario.from_json(back.to_json()).to_json()  # stable
    return back


# ------------------------------------------------------------------ the tables agree with the injectors
def test_agent_kinds_are_the_agents_registry():
    assert set(AGENT_KINDS) == set(agent_control.FAULT_KINDS)
    for knob, (_role, kind, _param, _t, _lo) in LIVE_KNOBS.items():
        assert kind in agent_control.FAULT_KINDS, knob


def test_toxic_types_are_the_proxys():
    assert set(TOXIC_TYPES) == set(toxics.TOXIC_TYPES)
    for t, attrs in TOXIC_TYPES.items():
        assert set(attrs) == set(toxics.TOXIC_TYPES[t]), t


def test_plan_fields_are_request_plans():
    assert set(PLAN_FIELDS) == {f.name for f in dataclasses.fields(RequestPlan)}


def test_checks_take_the_checkers_options():
    built = {"isolation": Isolation(), "integrity": Integrity(), "sensitivity": Sensitivity(),
             "http_semantics": HttpSemantics(),
             "liveness": Liveness(bound_s=5), "kv_lifecycle": KVLifecycle(), "page_ownership": PageOwnership(),
             "abort_semantics": AbortSemantics(),
             "retraction": Retraction(), "cache_isolation": CacheIsolation(), "timing_isolation": TimingIsolation(),
             "kv_checksum": KvChecksum(), "kv_canary": KvCanary()}
    assert set(built) | {"differential"} == set(CHECKS)
    for name, c in built.items():
        opts = {k for k in vars(c) if not k.startswith("_") and k not in ("floor", "reference")}
        assert opts == set(CHECKS[name]), name


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind", AGENT_KINDS)
def test_every_agent_kind_round_trips(kind):
    plans = _plans()
    op = Op(at_s=0.5, injector="agent", role="prefill", kind=kind, target={"rid": plans[0].rid},
            params={"ms": 250, "nested": {"a": [1, 2.5, None]}}, count=3, heal_s=2.0)
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans]), nemesis=[op]))
    assert sc.nemesis[0] == op


@pytest.mark.parametrize("ttype", sorted(TOXIC_TYPES))
def test_every_toxic_round_trips(ttype):
    params = {a: 7 for a in TOXIC_TYPES[ttype]} | {"seed": 11}
    op = Op(at_s=1.0, injector="proxy", kind=ttype, proxy="client", stream="upstream", toxicity=0.25, params=params)
    assert _roundtrip(_scenario(nemesis=[op])).nemesis[0] == op


@pytest.mark.parametrize("kind", PROCESS_KINDS)
def test_every_process_fault_round_trips(kind):
    op = Op(at_s=3.0, injector="process", kind=kind, role="decode", heal_s=9.0)
    assert _roundtrip(_scenario(nemesis=[op])).nemesis[0] == op


def test_actions_round_trip():
    plans = _plans()
    hold = Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[1].rid})
    abort = Op(at_s=0, injector="action", kind="abort", rids=[plans[1].rid], after=0)
    release = Op(at_s=0.5, injector="action", kind="release", after=0)
    late = Op(at_s=0, injector="action", kind="release", after=0, delay_s=5.0)
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans]), nemesis=[hold, abort, release, late]))
    assert sc.nemesis == [hold, abort, release, late]
    assert "delay_s" not in sc.to_dict()["nemesis"][2] and sc.to_dict()["nemesis"][3]["delay_s"] == 5.0


@pytest.mark.parametrize("bad, says", [
    ({"delay_s": 2.0}, "a delay counts from the op named in 'after'"),
    ({"after": 0, "delay_s": -1}, "must be in [0, 120]"),
    ({"after": 0, "delay_s": 500}, "must be in [0, 120]"),
    ({"after": 0, "delay_s": "3"}, "nemesis[1].delay_s='3': must be a number"),
])
def test_an_actions_delay_is_refused_by_name_where_it_means_nothing(bad, says):
    plans = _plans()
    d = _scenario(traffic=Traffic([plan_dict(p) for p in plans]),
                  nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[1].rid})]).to_dict()
    d["nemesis"].append({"at_s": 0, "injector": "action", "kind": "abort", "rids": [plans[1].rid], **bad})
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(d)
    assert says in str(e.value)


@pytest.mark.parametrize("knob", sorted(RESTART_KNOBS))
def test_every_restart_knob_round_trips(knob):
    t, allowed, _ = RESTART_KNOBS[knob]
    v = {"engine_version": "0.5.19", "layout": "mla-p64-bf16"}.get(knob, allowed[-1] if allowed else
                                                                     (True if t is bool else 1024 if t is int else "x"))
    sc = _roundtrip(_scenario(deployment=Deployment({knob: v}, {})))
    assert sc.deployment.restart == {knob: v}


@pytest.mark.parametrize("knob", sorted(LIVE_KNOBS))
def test_every_live_knob_round_trips_and_becomes_an_agent_op(knob):
    role, kind, param, t, _lo = LIVE_KNOBS[knob]
    v = t(256)
    sc = _roundtrip(_scenario(deployment=Deployment({}, {knob: v})))
    (op,) = sc.ops()
    assert (op.injector, op.role, op.kind, op.params[param], op.at_s, op.knob) == ("agent", role, kind, v, 0.0, knob)
    if kind == "retract":
        assert op.params["interval"] == 0  # the reservation alone, no test-trigger retraction


def test_every_check_round_trips():
    plans = _plans()
    checks = [{"name": n} for n in CHECKS if n not in ("liveness", "differential")]
    checks += [{"name": "liveness", "bound_s": 12.0, "pool_tolerance_tokens": 3},
               {"name": "differential", "reference_rids": [plans[0].rid]}]
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans]), checks=checks,
                              expect={"isolation": "pass", "liveness": "fail"}))
    assert [c["name"] for c in sc.checks] == [c["name"] for c in checks]


def test_built_checkers_come_back_as_the_same_checks():
    plans = _plans()
    ref = lambda events: {}  # noqa: E731 - a reference that names its plans, as single_server_reference's do
    ref.rids = [plans[0].rid]
    built = [Isolation(partial_len=6), Liveness(bound_s=20, pool_tolerance_tokens=2), Retraction(min_retractions=4),
             CacheIsolation(min_hits=2, min_cross=1), TimingIsolation(alpha=0.01, min_n=9), Differential(ref),
             KvChecksum(read_logs=False), KvCanary()]
    specs = [check_spec(c) for c in built]
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans]), checks=specs))
    again = build_checks(sc, reference_server=object())
    assert [check_spec(c) for c in again] == specs


def test_a_checker_the_schema_cannot_say_is_refused_by_name():
    with pytest.raises(ScenarioError, match="floor"):
        check_spec(Isolation(floor=SensitivityFloor(min_samples=3)))
    with pytest.raises(ScenarioError, match="names no plans"):
        check_spec(Differential(lambda events: {}))
    with pytest.raises(ScenarioError, match="reference server"):
        build_checks(_scenario(checks=[{"name": "differential", "reference_rids": [_plans()[0].rid]}]))


def test_plans_come_back_as_request_plans():
    plans = _plans(6)
    plans[3].after = plans[1].rid
    plans[2].abort_after_ms = 120.0
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans], via="pd")))
    assert sc.traffic.request_plans() == plans


def test_save_and_load(tmp_path):
    sc = _scenario()
    p = sc.save(tmp_path / "x.scenario.json")
    assert Scenario.load(p).to_dict() == sc.to_dict()
    d = tmp_path / "run"
    d.mkdir()
    sc.save(d)
    assert Scenario.load(d).digest() == sc.digest()


def test_stall_s_round_trips_and_is_written_only_where_set():
    """A search's traffic stops sending once the cluster is seen wedged (stall_s); a scenario without it
    says nothing about it, so every scenario written before the field keeps its digest."""
    plain = _scenario()
    assert "stall_s" not in plain.to_dict()["traffic"] and _roundtrip(plain).traffic.stall_s is None
    stalled = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in _plans()], 4, 30.0, "router", 30.0)))
    assert stalled.traffic.stall_s == 30.0 and stalled.digest() != plain.digest()


def test_digest_is_content_only():
    a, b = _scenario(), _scenario(name="other", origin={"test": "x"})
    assert a.digest() == b.digest()
    assert a.digest() != _scenario(seed=6).digest()


# ------------------------------------------------------------------ refused, by field
def _doc(**patch):
    d = _scenario(nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="delay", params={"ms": 5})]).to_dict()
    for k, v in patch.items():
        cur = d
        keys = k.split("__")
        for kk in keys[:-1]:
            cur = cur[int(kk)] if kk.isdigit() else cur[kk]
        cur[keys[-1]] = v
    return d


@pytest.mark.parametrize("patch, where", [
    ({"schema": "kvchaos.scenario/2"}, "newer kvchaos"),
    ({"schema": None}, "schema=None"),
    ({"colour": 1}, r"unknown field\(s\) \['colour'\]"),
    ({"name": "a/b"}, "name='a/b'"),
    ({"seed": "7"}, "seed='7': must be an integer"),
    ({"nemesis__0__kind": "explode"}, r"nemesis\[0\].kind='explode'"),
    ({"nemesis__0__role": "router"}, r"nemesis\[0\].role='router'"),
    ({"nemesis__0__at_s": -1}, r"nemesis\[0\].at_s=-1"),
    ({"nemesis__0__heal_s": 0}, r"nemesis\[0\].heal_s=0"),
    ({"nemesis__0__count": 0}, r"nemesis\[0\].count=0"),
    ({"nemesis__0__target": {"rid": "x", "tenant": "t"}}, "exactly one"),
    ({"nemesis__0__target": {"rid_regex": "("}}, "not a regular expression"),
    ({"nemesis__0__target": {"rid": "nobody"}}, "no plan's rid"),
    ({"nemesis__0__params": {"ms": float("inf")}}, "finite"),
    ({"nemesis__0__stream": "up"}, r"unknown field\(s\) \['stream'\]"),
    ({"traffic__concurrency": 0}, "concurrency=0"),
    ({"traffic__via": "carrier pigeon"}, "traffic.via"),
    ({"traffic__timeout_s": True}, "timeout_s=True"),
    ({"traffic__stall_s": 0}, "stall_s=0"),
    ({"traffic__stall_s": "30"}, "stall_s='30'"),
    ({"traffic__plans__0__endpoint": "grpc"}, r"plans\[0\].endpoint='grpc'"),
    ({"traffic__via": "pd", "traffic__plans__0__endpoint": "chat"}, r"plans\[0\].endpoint='chat': traffic via 'pd'"),
    ({"traffic__plans__1__after": "later"}, r"plans\[1\].after='later'"),
    ({"traffic__plans__0__colour": 1}, r"plans\[0\]: unknown"),
    ({"checks": [{"name": "isolation"}, {"name": "isolation"}]}, "given twice"),
    ({"checks": [{"name": "liveness"}]}, "needs bound_s"),
    ({"checks": [{"name": "isolation", "partial_len": "8"}]}, "partial_len='8'"),
    ({"checks": [{"name": "oracle of delphi"}]}, r"checks\[0\].name"),
    ({"expect": {"sensitivity": "pass"}}, "no check named"),
    ({"expect": {"isolation": "green"}}, "expect.isolation='green'"),
    ({"deployment": {"restart": {"pool_tokens": 0}}}, "pool_tokens=0"),
    ({"deployment": {"restart": {"layout": "mha-p3-fp8"}}}, "restart.layout"),
    ({"deployment": {"restart": {"engine_version": "latest"}}}, "engine_version='latest'"),
    ({"deployment": {"restart": {"router": "nginx"}}}, "restart.router='nginx'"),
    ({"deployment": {"restart": {"warp": 9}}}, r"unknown field\(s\) \['warp'\]"),
    ({"deployment": {"live": {"decode_reservation": 0}}}, "decode_reservation=0"),
    ({"deployment": {"live": {"chunked_prefill": 1.5}}}, "chunked_prefill=1.5"),
])
def test_bad_documents_are_refused_by_field(patch, where):
    with pytest.raises(ScenarioError, match=where):
        Scenario.from_dict(_doc(**patch))


def test_actions_are_refused_without_what_they_need():
    plans = _plans()
    traffic = Traffic([plan_dict(p) for p in plans])
    delay = Op(at_s=0, injector="agent", role="prefill", kind="delay")
    for ops, msg in [([Op(at_s=0, injector="action", kind="abort", rids=[])], "non-empty list"),
                     ([Op(at_s=0, injector="action", kind="abort", rids=["ghost"])], "no plan's rid"),
                     ([delay, Op(at_s=0, injector="action", kind="release", after=0)], "hold or park"),
                     ([Op(at_s=0, injector="action", kind="release", after=0)], "index of an earlier op"),
                     ([Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=1), delay],
                      "index of an earlier op")]:
        with pytest.raises(ScenarioError, match=msg):
            _scenario(traffic=traffic, nemesis=ops).validate()


def test_not_json_and_missing_file(tmp_path):
    with pytest.raises(ScenarioError, match="not JSON"):
        Scenario.from_json("{", "x.json")
    with pytest.raises(ScenarioError, match="no such scenario file"):
        Scenario.load(tmp_path / "nope.json")


# ------------------------------------------------------------------ deployment <-> cluster spec
def test_restart_knobs_set_the_spec_and_read_back_from_it():
    base = ClusterSpec.load("cpu")
    dep = Deployment({"pool_tokens": 1024, "context_length": 8192, "allow_auto_truncate": True,
                      "decode_radix_cache": True, "chunked_prefill_size": 256, "retraction_backup": "none",
                      "deferred_release": False, "router": "mini-lb", "prefill_pool_tokens": 576}, {})
    spec = dataclasses.replace(base, **dep.spec_overrides(base))
    assert spec.prefill_args[-2:] == ["--max-total-tokens", "576"] and "576" not in spec.decode_args
    assert "--allow-auto-truncate" in spec.common_args and spec.prefill_args[-4:-2] == ["--chunked-prefill-size", "256"]
    assert spec.decode_args.count("--disaggregation-decode-retraction-backup") == 1  # the profile's value replaced
    assert spec.env["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] == "0"
    back = Deployment.from_spec(spec)
    assert {k: back.restart[k] for k in dep.restart} == dep.restart
    assert dep.differs(back) == []
    assert Deployment({"pool_tokens": 4096}, {}).differs(back) == ["pool_tokens: the scenario wants 4096, the cluster has 1024"]
    assert Deployment({"pool_tokens": 1024}, {}).restart_key() != Deployment({"pool_tokens": 2048}, {}).restart_key()


# ------------------------------------------------------------------ a run's log -> its schedule
def test_the_log_becomes_the_schedule_it_carried_out():
    t0 = 1000.0
    recs = [
        {"ev": "fault", "action": "armed", "injector": "agent", "fault": "hold-1", "kind": "hold", "role": "prefill",
         "target": {"rid": "r1"}, "params": {"max_hold_s": 30, "seed": 4}, "count": None, "at": t0 - 0.2},
        {"ev": "fault", "action": "armed", "injector": "agent", "fault": "delay-2", "kind": "delay", "role": "prefill",
         "target": {"any": True}, "params": {"ms": 50}, "count": None, "at": t0 + 1.0},
        {"ev": "fault", "action": "abort_request", "kind": "abort", "rid": "r1", "held": True, "at": t0 + 1.5},
        {"ev": "fault", "action": "released", "fault": "hold-1", "kind": "hold", "target": {"rid": "r1"}, "at": t0 + 2.0},
        {"ev": "fault", "action": "healed", "fault": "delay-2", "kind": "delay", "at": t0 + 3.0},
        {"ev": "fault", "action": "armed", "injector": "proxy", "fault": "lat-3", "kind": "latency", "proxy": "client",
         "stream": "downstream", "toxicity": 0.5, "attributes": {"latency": 100, "seed": 2}, "at": t0 + 4.0},
        {"ev": "fault", "injector": "process", "action": "fired", "kind": "sigkill", "role": "prefill", "at": t0 + 5.0},
        {"ev": "fault", "injector": "process", "action": "healed", "kind": "restart", "role": "prefill", "at": t0 + 9.0},
        {"ev": "fault", "action": "healed", "fault": "hold-1", "kind": "hold", "at": t0 + 20.0},  # the rollback
        {"ev": "end", "rid": "r1", "wall": t0 + 10},
    ]
    ops = nemesis_from_log(recs, t0, t_end=t0 + 10.0)
    assert [(o.injector, o.kind, o.at_s, o.heal_s, o.after) for o in ops] == [
        ("agent", "hold", 0.0, None, None), ("agent", "delay", 1.0, 3.0, None), ("action", "abort", 1.5, None, 0),
        ("action", "release", 2.0, None, 0), ("proxy", "latency", 4.0, None, None), ("process", "kill", 5.0, 9.0, None)]
    assert ops[1].target is None and ops[0].target == {"rid": "r1"} and ops[3].rids == ["r1"]
    plans = [plan_dict(RequestPlan(rid="r1", tenant="t000", prompt="x"))]
    _roundtrip(_scenario(traffic=Traffic(plans), nemesis=ops))


# ------------------------------------------------------------------ the schedule, with a kit of stand-ins
class _Handle:
    def __init__(self, log, kind):
        self.log, self.kind, self.id = log, kind, f"{kind}-{len(log)}"
        self.healed = False

    def heal(self):
        if not self.healed:
            self.healed = True
            self.log.append(("heal", self.id, time.monotonic()))

    def release(self):
        self.log.append(("release", self.id, time.monotonic()))


class _Agent:
    def __init__(self, log, park_after_s=0.05, never_parks=False):
        self.log, self.park_after_s, self.never_parks = log, park_after_s, never_parks
        self.targets = {}

    def arm(self, role, kind, target=None, params=None, count=None):
        h = _Handle(self.log, kind)
        self.targets[h.id] = target or {}
        self.log.append(("arm", h.id, time.monotonic()))
        return h

    def wait_event(self, role, ev, timeout=30.0, **match):
        if self.never_parks:
            time.sleep(min(timeout, 0.2))
            raise TimeoutError("never")
        time.sleep(self.park_after_s)
        return {"ev": ev, **match, "rid": self.targets.get(match.get("fault"), {}).get("rid"), "wall": time.time()}


class _Kit:
    def __init__(self, **kw):
        self.log = []
        self.agent = _Agent(self.log, **kw)
        self.net = None
        self.proc = None


def test_ops_are_armed_on_time_healed_at_heal_s_and_the_rest_in_the_rollback():
    plans = _plans()
    sc = _scenario(traffic=Traffic([plan_dict(p) for p in plans]), deployment=Deployment({}, {"decode_reservation": 64}),
                   nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
                            Op(at_s=2.0, injector="agent", role="decode", kind="delay", heal_s=2.5),
                            Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0),
                            Op(at_s=0.05, injector="action", kind="release", after=0)]).validate()
    # ``after`` names a nemesis index; the live knob armed before them does not move what it names
    assert [o.after for o in sc.ops()] == [None, None, None, 1, 1] and [o.after for o in sc.nemesis] == [None, None, 0, 0]
    kit, aborted = _Kit(), []
    s = Schedule(sc.ops(), kit, cluster="c", abort=lambda c, rid: aborted.append((rid, time.monotonic())) or 200)
    s.start()
    assert [x[0] for x in kit.log] == ["arm", "arm"]  # the knob and the hold: due at 0, before traffic
    t0 = s.t0
    s.run()
    arms = [x for x in kit.log if x[0] == "arm"]
    # windows seconds wide, which a loaded machine keeps (make test runs clusters beside): armed at its
    # at_s (2 s), healed at its heal_s counted from the start (2.5 s), not from its arming (4.5 s)
    assert len(arms) == 3 and 1.98 < arms[2][2] - t0 < 4.3
    heals = [x for x in kit.log if x[0] == "heal"]
    assert [h[1] for h in heals] == [arms[2][1]] and 2.48 < heals[0][2] - t0 < 4.3
    assert aborted and aborted[0][0] == plans[0].rid and aborted[0][1] - t0 >= 0.05  # after the hold parked
    assert [x[1] for x in kit.log if x[0] == "release"] == [arms[1][1]]  # the hold's, not the knob's
    assert s.heal() == []
    assert {h[1] for h in kit.log if h[0] == "heal"} == {a[1] for a in arms}  # every op healed, once


class _Log(list):
    def emit(self, ev, **fields):
        self.append({"ev": ev, **fields})


@pytest.mark.parametrize("hold, delay_s, rid_of, want", [
    ({"kind": "hold", "params": {"max_hold_s": 30}}, None, "victim", ("transferring", True)),
    ({"kind": "park", "role": "decode", "params": {"stage": "decode_prealloc"}}, None, "victim", ("decode_prealloc", True)),
    # the hold's own bound let the request go before the abort came: not provably held
    ({"kind": "hold", "params": {"max_hold_s": 0.6}}, 0.3, "victim", ("transferring", False)),
    # another request than the one parked is aborted: not held
    ({"kind": "hold", "params": {"max_hold_s": 30}}, None, "other", ("transferring", False)),
    (None, None, "victim", (None, False)),  # an abort that waits for nothing
    # a release let the request go before the abort came: not held
    ({"kind": "park", "role": "decode", "params": {"stage": "decode_prealloc"}, "released_first": True}, 0.2,
     "victim", ("decode_prealloc", False)),
])
def test_a_scheduled_abort_is_logged_for_abort_semantics_with_its_stage_and_whether_it_was_held(hold, delay_s, rid_of, want):
    """A scenario's abort is a ``fault`` record (action ``abort_request``) as the suites' choreography
    writes it: without one, abort_semantics judged no scenario's abort (UNKNOWN, 0 aborts sent), and a
    lost abort answered 200 passed unseen. The record's ``held`` gates that FAIL; it is true only where
    the request was provably still parked."""
    from kvchaos.oracles import abort_semantics
    plans = _plans()
    victim, other = plans[0].rid, plans[1].rid
    ops = []
    if hold:
        ops.append(Op(at_s=0, injector="agent", role=hold.get("role", "prefill"), kind=hold["kind"],
                      target={"rid": victim}, params=hold["params"]))
    if hold and hold.get("released_first"):
        ops.append(Op(at_s=0, injector="action", kind="release", after=0))
    ops.append(Op(at_s=0, injector="action", kind="abort", rids=[victim if rid_of == "victim" else other],
                  after=0 if hold else None, delay_s=delay_s if hold else None))
    kit = _Kit()
    kit.log = _Log()
    kit.agent.log = kit.log
    s = Schedule(ops, kit, cluster="c", abort=lambda c, rid: {"prefill": 200, "decode": 200})
    s.run()
    s.heal()
    (rec,) = [e for e in kit.log if isinstance(e, dict) and e.get("action") == "abort_request"]
    assert (rec["stage"], rec["held"]) == want and rec["abort_status"] == {"prefill": 200, "decode": 200}
    # the request came back 200 finished as a success: a lost abort exactly when it was provably held
    aborted = rec["rid"]
    log = [{"ev": "plan", "rid": aborted, "tenant": "t000"},
           {"ev": "end", "rid": aborted, "status": 200, "outcome": "ok",
            "body": {"text": "x", "meta": {"finish_reason": {"type": "length"}}}}, rec]
    v = abort_semantics(log)
    assert v.stats["aborted"] == 1 and (v.status == "fail") == want[1], v


def test_a_wait_that_never_ends_is_an_error_naming_both_ops_and_heal_still_heals():
    plans = _plans()
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0)]
    kit = _Kit(never_parks=True)
    s = Schedule(ops, kit, cluster="c", wait_s=0.2, abort=lambda c, rid: 200)
    with pytest.raises(NemesisError, match="op 1 waits for op 0"):
        s.run()
    assert s.heal() == [] and all(h.healed for h in s.handles.values())


def test_a_wait_for_a_park_that_never_comes_ends_with_the_method_and_skips_the_action():
    """The targeted request ended before it reached the stage: nothing is parked. When the method ends,
    the wait ends with it and the abort is skipped, said in the records; the run is no error (a fuzz run
    waited 60 s for such a park and lost its verdicts to the error)."""
    plans = _plans()
    ops = [Op(at_s=0, injector="agent", role="decode", kind="park", target={"rid": plans[0].rid},
              params={"stage": "decode_prealloc"}),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0)]
    aborted = []
    s = Schedule(ops, _Kit(never_parks=True), cluster="c", wait_s=30.0, abort=lambda c, rid: aborted.append(rid))
    th = threading.Thread(target=s.run)
    t0 = time.monotonic()
    th.start()
    time.sleep(0.3)
    s.stop.set()
    th.join(5)
    assert not th.is_alive() and time.monotonic() - t0 < 2.5 and not aborted
    assert [r["what"] for r in s.records if r["op"] == 1] == ["skipped"]
    assert s.heal() == []


def test_an_action_due_before_the_op_it_waits_for_runs_after_it_and_a_method_that_ends_first_skips_it():
    """A fuzz scenario (2026-12-04) had an abort at 0 s waiting for a park armed at 8.45 s: the one
    timeline thread waited on the abort first, the park never armed, and the run died 60 s later."""
    plans = _plans()
    ops = [Op(at_s=0.3, injector="agent", role="prefill", kind="park", target={"rid": plans[0].rid},
              params={"stage": "prefill_waiting"}),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0)]
    kit, aborted = _Kit(), []
    s = Schedule(ops, kit, cluster="c", wait_s=5.0, abort=lambda c, rid: aborted.append(time.monotonic()) or 200)
    t0 = time.monotonic()
    s.run()
    assert time.monotonic() - t0 < 2 and aborted and aborted[0] - s.t0 >= 0.3  # after the park, not 60 s later
    assert s.heal() == []
    # the method ends before the park is due: the abort is skipped and said so, the run is not an error
    kit2 = _Kit()
    s2 = Schedule([Op(at_s=30, injector="agent", role="prefill", kind="park", target={"rid": plans[0].rid},
                      params={"stage": "prefill_waiting"}),
                   Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0)], kit2, cluster="c",
                  abort=lambda c, rid: 200)
    th = threading.Thread(target=s2.run)
    th.start()
    time.sleep(0.1)
    s2.stop.set()
    th.join(2)
    assert not th.is_alive() and not s2.handles
    assert s2.heal() == []


def test_an_actions_delay_counts_from_the_park_and_outlasts_the_workload():
    """A release ``delay_s`` after the hold parked its request is carried out then, even when the method
    ends (stop) during the delay: a late write past decode's release timeout needs the wait itself.
    Waits for the park (the abort after it), not a fixed 0.25 s: on a loaded machine (make test, three
    sessions on two cores) the hold had not parked by then and no release was ever due."""
    plans = _plans()
    ops = [Op(at_s=0.1, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid], after=0),
           Op(at_s=0, injector="action", kind="release", after=0, delay_s=2.0)]
    kit, aborted = _Kit(), []
    s = Schedule(ops, kit, cluster="c", wait_s=10.0, abort=lambda c, rid: aborted.append(time.monotonic()) or 200)
    th = threading.Thread(target=s.run)
    th.start()
    deadline = time.monotonic() + 10
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted, "the hold never parked its request"
    stopped_at = time.monotonic() - s.t0
    s.stop.set()  # the workload ended during the release's delay: the release still comes, 2 s after the park
    th.join(10)
    assert not th.is_alive()
    hold = next(r for r in s.records if r.get("kind") == "hold")
    rel = next(r for r in s.records if r.get("kind") == "release")
    assert rel["at_s"] >= hold["at_s"] + 2.0 - 0.02 and rel["at_s"] > stopped_at, (hold, rel, stopped_at)
    assert s.heal() == []


def test_stop_ends_the_timeline_and_heal_reports_every_failure():
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="delay"),
           Op(at_s=0, injector="agent", role="decode", kind="delay"),
           Op(at_s=30, injector="agent", role="decode", kind="fail")]
    kit = _Kit()
    s = Schedule(ops, kit)
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(0.1)
    s.stop.set()
    th.join(2)
    assert not th.is_alive() and len(s.handles) == 2  # the op at 30 s never armed

    def boom():
        raise RuntimeError("agent gone")
    s.handles[0].heal = boom
    errs = s.heal()
    assert len(errs) == 1 and "op 0" in errs[0] and s.handles[1].healed


def test_an_injector_the_kit_lacks_is_named():
    s = Schedule([Op(at_s=0, injector="proxy", kind="latency", proxy="client", stream="downstream", toxicity=1.0)],
                 _Kit())
    with pytest.raises(NemesisError, match="'net'"):
        s.start()


def test_schema_constant_is_versioned():
    assert SCHEMA == "kvchaos.scenario/1"
    assert json.loads(_scenario().to_json())["schema"] == SCHEMA


def test_a_record_that_is_no_op_is_said_not_dropped_silently():
    skipped = []
    recs = [{"ev": "fault", "action": "armed", "injector": "proxy", "fault": "lat-1", "kind": "latency", "at": 5.0},
            {"ev": "fault", "action": "armed", "injector": "agent", "fault": "x-2", "kind": "teleport", "role": "prefill",
             "target": {"any": True}, "params": {}, "at": 6.0}]
    assert nemesis_from_log(recs, 0.0, 10.0, skipped=skipped) == []
    assert len(skipped) == 2 and "lat-1" in skipped[0] and "teleport" in skipped[1]


def test_a_run_says_which_experiments_replay_from_data_and_why_the_others_do_not(tmp_path):
    from kvchaos.replay import scenario_files

    def rec(i, scenario=None, error=None):
        return {"id": f"e{i}", "name": f"exp{i}", "events": f"e{i}.events.jsonl", "verdicts_file": f"e{i}.v.json",
                "scenario": scenario, "scenario_error": error}
    _scenario(name="ok").save(tmp_path / "ok.scenario.json")
    _scenario(name="part", origin={"complete": False,
                                   "why_incomplete": ["a custom drive function sent the plans"]}).save(tmp_path / "part.scenario.json")
    (tmp_path / "bad.scenario.json").write_text('{"schema": 1, "name": 3}')
    recs = [rec(0, "ok.scenario.json"), rec(1, "part.scenario.json"), rec(2, "bad.scenario.json"),
            rec(3, None, "ScenarioError: checker foo is not in the schema"), rec(4, "gone.scenario.json")]
    (tmp_path / "experiments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = scenario_files(tmp_path)
    assert got["experiments"] == 5 and got["complete"] == ["exp0"]
    assert got["incomplete"] == [("exp1", "a custom drive function sent the plans")]
    missing = dict(got["missing"])
    assert set(missing) == {"exp2", "exp3", "exp4"} and "not in the schema" in missing["exp3"]
    assert "bad.scenario.json" in missing["exp2"] and "gone.scenario.json" in missing["exp4"]
    assert scenario_files(tmp_path / "nothing") == {"experiments": 0, "complete": [], "incomplete": [], "missing": []}


# ------------------------------------------------------------------ ops that wait for events (Op.on)
@pytest.mark.parametrize("bad, says", [
    ({"on": {"role": "prefill"}}, "nemesis[1].on: missing field(s) ['ev']"),
    ({"on": {"role": "router", "ev": "x"}}, "nemesis[1].on.role='router'"),
    ({"on": {"role": "prefill", "ev": "transfer_start", "when": 1}}, "unknown field(s) ['when']"),
    ({"on": {"role": "client", "ev": "first_byte"}}, "a client event names the request (rid)"),
    ({"on": {"role": "client", "ev": "end", "rid": "r"}}, "nemesis[1].on.ev='end'"),
    ({"on": {"role": "prefill", "ev": ""}}, "nemesis[1].on.ev='': a non-empty string"),
])
def test_an_event_trigger_is_refused_by_name_where_it_is_wrong(bad, says):
    plans = _plans()
    d = _scenario(traffic=Traffic([plan_dict(p) for p in plans]),
                  nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="delay")]).to_dict()
    d["nemesis"].append({"at_s": 0, "injector": "action", "kind": "abort", "rids": [plans[1].rid], **bad})
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(d)
    assert says in str(e.value)


def test_a_release_or_heal_without_the_op_it_acts_on_is_refused():
    d = _scenario(traffic=Traffic([plan_dict(p) for p in _plans()])).to_dict()
    for kind in ("release", "heal"):
        d["nemesis"] = [{"at_s": 0, "injector": "action", "kind": kind}]
        with pytest.raises(ScenarioError, match=f"a {kind} names the op it acts on in 'after'"):
            Scenario.from_dict(d)


def test_triggered_process_ops_and_actions_round_trip():
    plans = _plans()
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="process", kind="kill", role="prefill", after=0),
           Op(at_s=0, injector="process", kind="stop", role="decode",
              on={"role": "prefill", "ev": "transfer_start", "rid": plans[1].rid}),
           Op(at_s=0, injector="action", kind="heal", after=2, delay_s=4.0),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[2].rid], delay_s=0.25,
              on={"role": "prefill", "ev": "transfer_start", "rid": plans[2].rid}),
           Op(at_s=0, injector="agent", role="prefill", kind="fail", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="action", kind="heal", after=5, on={"role": "prefill", "ev": "fault_fired"}),
           Op(at_s=0, injector="action", kind="abort", rids=[plans[1].rid],
              on={"role": "client", "ev": "first_byte", "rid": plans[1].rid})]
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans]), nemesis=ops))
    assert sc.nemesis == ops and all(o.waits for o in ops[1:5]) and not ops[5].waits


class _EventAgent(_Agent):
    """An agent whose writes park and whose events come at set times after it was made (rid -> seconds,
    events with ``after_s``), as the engine logs them."""

    def __init__(self, log, parks=None, events=()):
        super().__init__(log)
        self.parks, self.t0 = dict(parks or {}), time.time()
        self.evs, self.reads = list(events), 0

    def wait_event(self, role, ev, timeout=30.0, **match):
        rid = self.targets.get(match.get("fault"), {}).get("rid")
        left = self.t0 + self.parks.get(rid, 0.05) - time.time()
        if left > timeout:
            time.sleep(timeout)
            raise TimeoutError("not yet")
        time.sleep(max(0.0, left))
        return {"ev": ev, **match, "rid": rid, "wall": time.time()}

    def events(self, role):
        self.reads += 1
        now = time.time()
        return [dict(e, wall=self.t0 + e["after_s"]) for e in self.evs if e["role"] == role and self.t0 + e["after_s"] <= now]


def test_ops_that_wait_do_so_each_on_its_own_in_the_engines_order():
    """Two holds whose writes park in the reverse of the ops' order: each abort comes when its own
    request parked (abort_in_flight's choreography), not after the first op's wait (one timeline thread
    would abort the second only once the first parked, or fail after wait_s). Seconds apart, which a loaded
    machine keeps: the CI run of 2026-12-07 stalled this process 0.9 s when they were 0.7 s apart."""
    plans = _plans()
    a, b = plans[0].rid, plans[1].rid
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": a}),
           Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": b}),
           Op(at_s=0, injector="action", kind="abort", rids=[a], after=0),
           Op(at_s=0, injector="action", kind="release", after=0, delay_s=0.1),
           Op(at_s=0, injector="action", kind="abort", rids=[b], after=1),
           Op(at_s=0, injector="action", kind="release", after=1, delay_s=0.1)]
    kit = _Kit()
    kit.agent = _EventAgent(kit.log, parks={a: 2.5, b: 0.2})
    aborted = {}
    s = Schedule(ops, kit, cluster="c", wait_s=6.0, abort=lambda c, rid: aborted.setdefault(rid, time.time() - kit.agent.t0))
    s.run()
    assert 0.2 <= aborted[b] < 2.5 <= aborted[a] < 6.0, aborted
    assert s.heal() == []


def test_a_held_victim_is_let_go_once_its_roles_scheduler_acted_on_the_abort_not_a_fixed_time_after_it():
    """abort_at_stage_ops: /abort_request answering only queues the abort; the release waits for the holding
    role's ``abort_ingested`` (here 2 s after the park, as a busy scheduler reads it), then settles. Another
    request's abort, or the other role's, does not let it go. Seconds apart, so a loaded machine keeps the
    order (make test runs clusters beside) and no other test has to stop for this one."""
    from kvchaos.suite import abort_at_stage_ops

    plans = _plans()
    a, b = plans[0].rid, plans[1].rid
    ops = abort_at_stage_ops("decode_waiting", a, settle_s=0.4) + abort_at_stage_ops("decode_waiting", b, first=3,
                                                                                       settle_s=0.4)
    assert ops[2].on == {"role": "decode", "ev": "abort_ingested", "rid": a} and ops[2].after == 0
    kit = _Kit()
    kit.agent = _EventAgent(kit.log, parks={a: 0.4, b: 0.4},
                            events=[{"role": "decode", "ev": "abort_ingested", "rid": a, "after_s": 2.4},
                                    {"role": "prefill", "ev": "abort_ingested", "rid": b, "after_s": 1.2},
                                    {"role": "decode", "ev": "abort_ingested", "rid": "other", "after_s": 0.8}])
    aborted = {}
    s = Schedule(ops, kit, cluster="c", wait_s=8.0, abort=lambda c, rid: aborted.setdefault(rid, time.time()) and 200)
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(5.0)
    s.stop.set()
    th.join(5)
    t0 = kit.agent.t0
    released = [(h, t) for what, h, t in kit.log if what == "release"]
    assert aborted[a] - t0 < 2.0 and aborted[b] - t0 < 2.0  # each abort once its request parked
    (h, t), = released  # a's alone: b's abort was read by prefill only, which does not hold it
    assert h == s.handles[0].id
    assert 2.8 <= time.time() - (time.monotonic() - t) - t0 < 4.4  # 2.4 s (ingested) + 0.4 s (settle)
    assert s.heal() == []


def test_an_abort_on_an_event_comes_delay_s_after_the_events_own_time_and_names_its_stage():
    """abort_random's aborter as data: each target aborted 0-400 ms after its transfer started (the
    agent's ``transfer_start``, timed by the engine), logged at stage ``transferring``, never held. Here
    scaled to seconds, which a loaded machine keeps: the first's delay counts from its event (1.5 s), not
    from the start (1.0 s)."""
    plans = _plans()
    ops = [Op(at_s=0, injector="action", kind="abort", rids=[p.rid], delay_s=d,
              on={"role": "prefill", "ev": "transfer_start", "rid": p.rid})
           for p, d in zip(plans[:3], (1.0, 0.0, 0.2))]
    kit = _Kit()
    kit.log = _Log()
    kit.agent = _EventAgent(kit.log, events=[{"role": "prefill", "ev": "transfer_start", "rid": plans[0].rid, "after_s": 0.5},
                                              {"role": "prefill", "ev": "transfer_start", "rid": plans[1].rid, "after_s": 1.0},
                                              {"role": "decode", "ev": "transfer_start", "rid": plans[2].rid, "after_s": 0.1}])
    aborted = {}
    s = Schedule(ops, kit, cluster="c", abort=lambda c, rid: aborted.setdefault(rid, time.time() - kit.agent.t0) and 200)
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(3.5)
    s.stop.set()  # the third's event never came from prefill (the decode one is not it): skipped
    th.join(3)
    assert not th.is_alive() and set(aborted) == {plans[0].rid, plans[1].rid}
    assert 1.5 <= aborted[plans[0].rid] < 3.5 and 1.0 <= aborted[plans[1].rid] < 3.5, aborted
    recs = [e for e in kit.log if isinstance(e, dict) and e.get("action") == "abort_request"]
    assert {(r["stage"], r["held"]) for r in recs} == {("transferring", False)}
    assert [r["what"] for r in s.records if r["op"] == 2] == ["skipped"]
    assert kit.agent.reads < 3.6 / 0.02 + 5  # three waits, one read of the agent per poll


class _Proc:
    def __init__(self, log):
        self.log = log

    def _h(self, kind, role):
        h = _Handle(self.log, f"{kind}-{role}")
        self.log.append((kind, role, time.monotonic()))
        return h

    def kill(self, role):
        return self._h("kill", role)

    def stop(self, role):
        return self._h("stop", role)


def test_a_kill_once_held_a_stop_on_a_transfer_healed_later_and_a_heal_once_a_fault_fired():
    """kill_when_held, freeze and unblacklist as data: a process op after a hold parked; a stop on another
    request's transfer_start, healed (SIGCONT) by an action 1 s later; a fail healed once it fired. Seconds
    apart, which a loaded machine keeps."""
    plans = _plans()
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="process", kind="kill", role="prefill", after=0),
           Op(at_s=0, injector="process", kind="stop", role="decode",
              on={"role": "prefill", "ev": "transfer_start", "rid": plans[1].rid}),
           Op(at_s=0, injector="action", kind="heal", after=2, delay_s=1.0),
           Op(at_s=0, injector="agent", role="prefill", kind="fail", target={"rid": plans[2].rid}),
           Op(at_s=0, injector="action", kind="heal", after=4, on={"role": "prefill", "ev": "fault_fired"})]
    kit = _Kit()
    kit.agent = _EventAgent(kit.log, parks={plans[0].rid: 0.5},
                            events=[{"role": "prefill", "ev": "transfer_start", "rid": plans[1].rid, "after_s": 0.1}])
    kit.proc = _Proc(kit.log)
    s = Schedule(ops, kit, cluster="c", wait_s=6.0)
    fail_id = None

    def fire():  # the fail fires 2 s in: an event naming its fault
        time.sleep(2.0)
        kit.agent.evs.append({"role": "prefill", "ev": "fault_fired", "fault": fail_id, "after_s": 2.0})
    s.start()
    fail_id = s.handles[4].id
    threading.Thread(target=fire, daemon=True).start()
    t0 = time.monotonic()
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(4.0)
    s.stop.set()
    th.join(3)
    assert not th.is_alive()
    (kill,) = [x for x in kit.log if x[0] == "kill"]
    (stop,) = [x for x in kit.log if x[0] == "stop"]
    assert kill[1] == "prefill" and 0.45 < kill[2] - t0 < 4.0 and stop[1] == "decode" and stop[2] - t0 < 1.5
    heals = {x[1]: x[2] - t0 for x in kit.log if x[0] == "heal"}
    assert 0.98 <= heals[s.handles[2].id] - (stop[2] - t0) < 4.0  # SIGCONT 1 s after the stop
    assert 1.95 < heals[s.handles[4].id] < 4.0  # the fail healed once it fired, not before
    assert s.handles[1].id not in heals  # the kill waits for the rollback (its heal restarts the role)
    assert s.heal() == [] and s.handles[1].healed


def test_an_abort_on_the_clients_first_byte_reads_the_experiments_log():
    plans = _plans()
    client = _Log()
    ops = [Op(at_s=0, injector="action", kind="abort", rids=[plans[0].rid],
              on={"role": "client", "ev": "first_byte", "rid": plans[0].rid})]
    kit = _Kit()
    kit.log = _Log()
    aborted = []
    s = Schedule(ops, kit, cluster="c", abort=lambda c, rid: aborted.append(rid) or 200,
                 client_log=SimpleNamespace(records=client))  # an EventLog's records
    th = threading.Thread(target=s.run)
    th.start()
    time.sleep(0.2)
    client.emit("first_byte", rid=plans[1].rid)
    time.sleep(0.1)
    assert not aborted  # another request's first byte
    client.emit("first_byte", rid=plans[0].rid)
    time.sleep(0.2)
    s.stop.set()
    th.join(2)
    assert aborted == [plans[0].rid]
    (rec,) = [e for e in kit.log if isinstance(e, dict) and e.get("action") == "abort_request"]
    assert rec["stage"] == "decoding" and rec["held"] is False


# ------------------------------------------------------------------ plans that wait for ops (traffic.gates)
def test_gates_round_trip_shift_with_the_live_ops_and_are_refused_by_name_where_wrong():
    plans = _plans()
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
           Op(at_s=0, injector="agent", role="decode", kind="double_alloc", params={"pages": 4}, count=1),
           Op(at_s=0, injector="action", kind="release", after=0, delay_s=0.5,
              on={"role": "decode", "ev": "fault_fired", "op": 1})]
    sc = _roundtrip(_scenario(traffic=Traffic([plan_dict(p) for p in plans], gates={plans[1].rid: 0, plans[2].rid: 2}),
                              deployment=Deployment({}, {"decode_reservation": 64}), nemesis=ops))
    assert sc.traffic.gates == {plans[1].rid: 0, plans[2].rid: 2} and sc.nemesis == ops
    # on the runner's indices, after the one live op: the gates and the event's op move with the ops
    assert sc.gates() == {plans[1].rid: 1, plans[2].rid: 3}
    assert sc.ops()[3].after == 1 and sc.ops()[3].on["op"] == 2
    # no gates: the key is not written (every scenario written before them keeps its digest)
    assert "gates" not in _scenario(traffic=Traffic([plan_dict(p) for p in plans])).to_dict()["traffic"]
    d = sc.to_dict()
    for gates, says in (({"nobody": 0}, "traffic.gates.nobody: no plan's rid"),
                        ({plans[1].rid: 3}, f"traffic.gates.{plans[1].rid}=3: no nemesis op 3 (3 ops)"),
                        ({plans[1].rid: -1}, "the index of a nemesis op"),
                        ({plans[1].rid: "0"}, "must be an integer")):
        bad = json.loads(json.dumps(d))
        bad["traffic"]["gates"] = gates
        with pytest.raises(ScenarioError) as e:
            Scenario.from_dict(bad)
        assert says in str(e.value)
    bad = json.loads(json.dumps(d))
    bad["nemesis"][2]["on"]["op"] = 2
    with pytest.raises(ScenarioError, match=r"nemesis\[2\].on.op=2: the index of an earlier op"):
        Scenario.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["nemesis"].append({"at_s": 0, "injector": "action", "kind": "heal", "after": 2})
    with pytest.raises(ScenarioError, match=r"nemesis\[3\]: a heal names a fault in 'after', not an action"):
        Scenario.from_dict(bad)


def test_dropping_an_op_drops_what_waits_on_it_and_the_gates_on_it():
    from kvchaos.fuzz.grammar import _drop
    plans = _plans()
    sc = _scenario(traffic=Traffic([plan_dict(p) for p in plans], gates={plans[1].rid: 0, plans[2].rid: 2, plans[3].rid: 3}),
                   nemesis=[Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": plans[0].rid}),
                            Op(at_s=0, injector="agent", role="decode", kind="double_alloc", count=1),
                            Op(at_s=0, injector="action", kind="release", after=0,
                               on={"role": "decode", "ev": "fault_fired", "op": 1}),
                            Op(at_s=1, injector="agent", role="prefill", kind="delay")]).validate()
    _drop(sc, 1)  # the release waited on its event: gone with it, and the gate on the release
    assert [o.kind for o in sc.nemesis] == ["hold", "delay"]
    assert sc.traffic.gates == {plans[1].rid: 0, plans[3].rid: 1}
    sc.validate()


def test_a_gated_plan_waits_for_the_park_or_the_action_it_names():
    """Windows seconds wide, which a loaded machine keeps (make test runs clusters beside)."""
    plans = _plans()
    a, b, c = plans[0].rid, plans[1].rid, plans[2].rid
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": a}),
           Op(at_s=0, injector="action", kind="release", after=0, delay_s=2.0)]
    kit = _Kit()
    kit.agent = _EventAgent(kit.log, parks={a: 2.0})
    s = Schedule(ops, kit, cluster="c", wait_s=10.0, gates={b: 0, c: 1})
    th = threading.Thread(target=s.run)
    th.start()
    t0 = kit.agent.t0
    s.gate(plans[3].rid)  # not gated: at once
    assert time.time() - t0 < 1.8
    s.gate(b)
    assert 2.0 <= time.time() - t0 < 3.8  # once A's write parked, not once it was released (4 s)
    s.gate(c)
    assert 4.0 <= time.time() - t0 < 8.0  # once the release was carried out
    th.join(10)
    assert s.heal() == []
    with pytest.raises(NemesisError, match="plan x waits for op 5: there are 2 ops"):
        Schedule(ops, kit, gates={"x": 5})


def test_an_op_waits_for_the_one_before_it_at_the_clusters_pace():
    """A like: probe on CPU reaches a transfer pace times later: an abort waiting for a hold to park
    waited 60 s and the DeepSeek-shaped probe (pace 30.5) parked its second victim after that."""
    slow = SimpleNamespace(spec=ClusterSpec.load("cpu", pace=30.5))
    assert Schedule([], None, cluster=slow).wait_s == 60 * 30.5
    assert Schedule([], None, cluster="c").wait_s == 60
    assert Schedule([], None, cluster=slow, wait_s=5.0).wait_s == 5.0
