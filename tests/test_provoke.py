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
    monkeypatch.setattr(provoke, "start_cluster", lambda a, source: (tmp_path / "out").mkdir() or c)
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


@pytest.mark.parametrize("argv,msg", [(["--trials", "0"], "--trials >= 1"), (["--ms", "0"], "--ms > 0")])
def test_bad_input_is_named(monkeypatch, tmp_path, capsys, argv, msg):
    _session(monkeypatch, tmp_path, argv)
    with pytest.raises(SystemExit):
        with provoke.session("doc", "/unused", "help", "src", SUMMARY, knob=("ms", 300.0)):
            pass
    assert msg in capsys.readouterr().err
