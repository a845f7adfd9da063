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
