"""kvchaos.provoke, what every finding's provoke.py shares: control trials first, then armed ones, each
recorded and said; on any exit the cluster is stopped and the counts written (provoke.json)."""

import json
import sys

import pytest

from kvchaos import provoke

SUMMARY = provoke.Summary(lambda r: r["hit"], lambda r: r["hit"], "control_hit", "nothing armed", "hit")


class Stopped:
    stopped = False

    def stop(self):
        self.stopped = True


def _session(monkeypatch, tmp_path, argv):
    c = Stopped()
    monkeypatch.setattr(sys, "argv", ["provoke.py", "--out", str(tmp_path / "out"), *argv])
    def start(a, source, spec=None):
        c.spec = spec
        (tmp_path / "out").mkdir()
        return c

    monkeypatch.setattr(provoke, "start_cluster", start)
    return c


def test_control_then_armed_trials_counted_and_written(monkeypatch, tmp_path, capsys):
    c = _session(monkeypatch, tmp_path, ["--trials", "3", "--control", "2", "--ms", "5"])
    with provoke.session("doc", "/unused", "help", "src", SUMMARY, knob=("ms", 300.0)) as (a, cl, results):
        provoke.run_trials(a, results, lambda i, armed: {"hit": armed and i != 3}, lambda r: f": hit {r['hit']}")
    assert c.stopped
    out = json.loads((tmp_path / "out" / "provoke.json").read_text())
    assert [t["armed"] for t in out["trials"]] == [False, False, True, True, True]
    assert (out["reproduced"], out["control_hit"], out["ms"]) == (2, 0, 5.0)
    said = capsys.readouterr().out
    assert "trial  0 control: hit False" in said and "trial  2 armed  : hit True" in said
    assert "reproduced 2/3 (control, nothing armed: 0/2 hit)" in said


def test_the_cluster_is_stopped_and_the_counts_written_when_a_trial_raises(monkeypatch, tmp_path):
    c = _session(monkeypatch, tmp_path, ["--trials", "1", "--control", "0"])
    with pytest.raises(RuntimeError):
        with provoke.session("doc", "/unused", "help", "src", SUMMARY) as (a, cl, results):
            provoke.run_trials(a, results, lambda i, armed: (_ for _ in ()).throw(RuntimeError("engine died")), str)
    assert c.stopped and json.loads((tmp_path / "out" / "provoke.json").read_text())["reproduced"] == 0


def test_a_scripts_own_options_reach_the_engines_environment(monkeypatch, tmp_path):
    """``options`` adds a script's flags; ``env(args)`` lands on top of the profile's engine environment;
    control trials alone (``--trials 0``) are a run: a natural-rate measurement arms nothing."""
    c = _session(monkeypatch, tmp_path, ["--trials", "0", "--control", "1", "--gil", "0.001"])
    with provoke.session("doc", "/unused", "help", "src", SUMMARY,
                         options=lambda ap: ap.add_argument("--gil", type=float),
                         env=lambda a: {"KVCHAOS_SWITCH_INTERVAL": repr(a.gil)}) as (a, cl, results):
        provoke.run_trials(a, results, lambda i, armed: {"hit": False}, str)
    base = provoke.spec_for(None, "src")
    assert c.spec.env == {**base.env, "KVCHAOS_SWITCH_INTERVAL": "0.001"}
    assert [t["armed"] for t in results["trials"]] == [False]


@pytest.mark.parametrize("argv,msg", [(["--trials", "0", "--control", "0"], "at least one trial"),
                                      (["--trials", "-1"], "--trials >= 0"), (["--ms", "0"], "--ms > 0")])
def test_bad_input_is_named(monkeypatch, tmp_path, capsys, argv, msg):
    _session(monkeypatch, tmp_path, argv)
    with pytest.raises(SystemExit):
        with provoke.session("doc", "/unused", "help", "src", SUMMARY, knob=("ms", 300.0)):
            pass
    assert msg in capsys.readouterr().err


# ------------------------------------------------------------------ the findings' trials, as scenario data
def _script(finding):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "reports" / "findings" / finding / "provoke.py"
    spec = importlib.util.spec_from_file_location(f"provoke_{finding.replace('-', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Cluster:
    """What a trial's scenario reads off its cluster: the spec and the engines' version."""
    def __init__(self):
        from kvchaos.cluster import ClusterSpec
        self.spec = ClusterSpec.load("cpu")

    def server_info(self, role):
        return {"version": "0.5.23"}


def _same_after_a_round_trip(sc, version="0.5.23"):
    from kvchaos.workload.scenario import Scenario
    back = Scenario.from_dict(json.loads(json.dumps(sc.to_dict())))
    assert back.digest() == sc.digest() and back.deployment.restart.get("engine_version") == version
    return back


def test_the_router_retry_trials_are_scenarios_whose_abort_waits_for_the_hold():
    mod = _script("sglang-router-retries-aborted-requests")
    seen = set()
    for i, via_router in ((0, True), (1, True), (2, True), (3, False)):
        sc, stage, victim = mod.scenario(_Cluster(), i, via_router)
        sc = _same_after_a_round_trip(sc)
        hold, abort, release = sc.nemesis
        assert hold.target == {"rid": victim} and hold.kind == ("hold" if stage == "transferring" else "park")
        assert (abort.kind, abort.rids, abort.after) == ("abort", [victim], 0)
        assert (release.kind, release.after, release.delay_s) == ("release", 0, 0.5)
        assert sc.traffic.via == ("router" if via_router else "pd") and len(sc.traffic.plans) == 12
        assert {c["name"] for c in sc.checks} >= {"abort_semantics", "isolation"}
        seen.add(stage)
    assert seen == set(mod.STAGES)


def test_the_late_write_trials_carry_the_timeout_as_a_knob_and_the_release_as_a_delay():
    mod = _script("sglang-deferred-release-timeout-late-write")
    armed, _ = mod.scenario(_Cluster(), 3, 3.0, 5.0)
    control, _ = mod.scenario(_Cluster(), 0, 3.0, 0.3)
    for sc, delay in ((armed, 5.0), (control, 0.3)):
        sc = _same_after_a_round_trip(sc)
        assert sc.deployment.live == {"deferred_release_timeout_s": 3.0}
        assert [(o.kind, o.after, o.delay_s) for o in sc.nemesis] == [("hold", None, None), ("abort", 0, None),
                                                                      ("release", 0, delay)]
        assert any(o.kind == "deferred_release_timeout" for o in sc.ops())  # the knob is armed with the rest


def test_the_transfer_worker_trials_stall_only_when_armed():
    mod = _script("sglang-mooncake-transfer-worker-dies")
    armed, victim = mod.scenario(_Cluster(), 5, 300.0)
    control, _ = mod.scenario(_Cluster(), 0, None, plain=200)
    (op,) = _same_after_a_round_trip(armed).nemesis
    assert (op.kind, op.target, op.params) == ("stall_status_read", {"rid": victim}, {"ms": 300.0})
    control = _same_after_a_round_trip(control)
    assert not control.nemesis and len(control.traffic.plans) == 200 and control.traffic.concurrency == 64


def test_the_salt_trials_send_salted_tenants_one_at_a_time_over_one_shared_prefix():
    mod = _script("sglang-router-drops-cache-salt")
    sc = _same_after_a_round_trip(mod.scenario(41, "router"), version=None)  # run against any deployment
    assert [p.get("cache_salt") for p in sc.traffic.plans] == [None, None, "A41", "B41", "A41"]
    assert sc.traffic.concurrency == 1 and {c["name"] for c in sc.checks} >= {"cache_isolation"}
    head = sc.traffic.plans[0]["prompt"][:sc.traffic.plans[0]["shared_chars"]]
    assert head and all(p["prompt"].startswith(head) for p in sc.traffic.plans)
    assert mod.scenario(42, "pd").traffic.via == "pd"
