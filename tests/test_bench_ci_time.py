"""bench/ci_time.py leaves the shared venv's editable kvchaos where it found it: the fresh clone's
``make setup`` re-points it at the clone, which the bench deletes after the run."""

import json
import time
from pathlib import Path

import pytest

from tests.util import load_file

REPO = Path(__file__).resolve().parents[1]


def _bench():
    return load_file(REPO / "bench" / "ci_time.py", "ci_time_bench")


@pytest.mark.parametrize("fails", [False, True])
def test_the_venv_points_back_at_the_checkout_it_pointed_at_before_the_run(tmp_path, monkeypatch, fails):
    b = _bench()
    where = {"now": tmp_path}  # the checkout the venv points at
    reinstalled = []

    def run(repo, keep, i):
        where["now"] = tmp_path / "clone"  # what the clone's make setup does
        if fails:
            raise RuntimeError("make test crashed")
        return {"run": i}

    monkeypatch.setattr(b, "_one_run", run)
    monkeypatch.setattr(b, "installed_from", lambda: where["now"])
    monkeypatch.setattr(b, "reinstall", lambda p: (reinstalled.append(p), where.update(now=p)))
    if fails:
        with pytest.raises(RuntimeError):
            b.one_run(REPO, None, 1)
    else:
        assert b.one_run(REPO, None, 1) == {"run": 1}
    assert reinstalled == [tmp_path] and where["now"] == tmp_path


def test_a_venv_left_where_it_was_is_not_reinstalled(tmp_path, monkeypatch):
    b = _bench()
    reinstalled = []
    monkeypatch.setattr(b, "_one_run", lambda repo, keep, i: {"run": i})
    monkeypatch.setattr(b, "installed_from", lambda: tmp_path)
    monkeypatch.setattr(b, "reinstall", reinstalled.append)
    b.one_run(REPO, None, 1)
    assert reinstalled == []


def test_busy_share_is_the_cpu_used_between_the_samples_inside_a_window():
    b = _bench()
    samples = [(0.0, 100, 1000), (2.0, 150, 1200), (4.0, 350, 1400), (6.0, 360, 1600)]
    assert b.busy_share(samples, 0.0, 4.0) == (350 - 100) / (1400 - 1000)  # 62.5 %
    assert b.busy_share(samples, 2.0, 4.0) == 1.0  # both cores busy
    assert b.busy_share(samples, 4.0, 6.0) == 10 / 200
    assert b.busy_share(samples, 4.5, 5.5) is None  # no two samples inside: unknown, not 0 %


def test_the_sampler_reads_until_it_is_stopped_and_once_more_at_the_end():
    b = _bench()
    reads = iter([(i * 10, i * 100) for i in range(1, 1000)])
    with b.CpuSampler(period_s=0.01, read=lambda: next(reads)) as cpu:
        time.sleep(0.1)
    n = len(cpu.samples)
    assert n >= 3 and [s[1] for s in cpu.samples] == [i * 10 for i in range(1, n + 1)]
    assert b.cpu_jiffies() is None or b.cpu_jiffies()[1] > 0  # /proc/stat where there is one


def test_each_phase_has_its_window_and_show_prints_the_busy_share(capsys):
    b = _bench()
    sess = [{"name": "cluster session", "started": 10.0, "finished": 50.0, "tests": 3, "exitstatus": 0},
            {"name": "two-host session", "started": 55.0, "finished": 90.0, "tests": 2, "exitstatus": 0}]
    w = b.windows(0.0, 100.0, sess)
    assert [(a, c) for _, a, c in w] == [(0.0, 10.0), (10.0, 50.0), (50.0, 55.0), (55.0, 90.0), (90.0, 100.0)]
    assert b.phases(0.0, 100.0, sess)[1] == ("cluster session (3 tests, exit 0)", 40.0)
    # make test's shape: the unit tests beside the cluster session, outliving it; no gap is made up
    sess = [{"name": "cluster session", "started": 10.0, "finished": 50.0, "tests": 3, "exitstatus": 0},
            {"name": "unit tests (-n 2)", "started": 11.0, "finished": 70.0, "tests": 9, "exitstatus": 0},
            {"name": "two-host session", "started": 52.0, "finished": 90.0, "tests": 2, "exitstatus": 1}]
    w = b.windows(0.0, 100.0, sess)
    assert [(n, a, c) for n, a, c in w] == [
        ("setup + workflow lint", 0.0, 10.0), ("cluster session (3 tests, exit 0)", 10.0, 50.0),
        ("unit tests (-n 2) (9 tests, exit 0, beside the cluster session)", 11.0, 70.0),
        ("two-host session (2 tests, exit 1, beside the unit tests (-n 2))", 52.0, 90.0),
        ("  teardown, report and docs build", 90.0, 100.0)]
    b.show({"run": 1, "commit": "abc", "exit": 0, "total_s": 100.0, "cold_start_s": 50.0, "ratio": 2.0,
            "phases": [("setup", 10.0, 37.5), ("unit", 40.0, None)], "cpu_busy": 80.0})
    out = capsys.readouterr().out
    assert "CPU busy  37.5 %" in out and "CPU busy  80.0 %" in out and "unit" in out


def test_the_tests_that_left_the_cores_idle_come_first(tmp_path, capsys):
    b = _bench()
    prog = tmp_path / "progress.jsonl"
    prog.write_text("\n".join(json.dumps(e) for e in [
        {"ev": "start", "nodeid": "a"},
        {"ev": "end", "nodeid": "busy", "wall_start": 0.0, "wall_end": 4.0},
        {"ev": "end", "nodeid": "idle", "wall_start": 4.0, "wall_end": 8.0},
        {"ev": "end", "nodeid": "short", "wall_start": 8.0, "wall_end": 8.5}]) + "\nnot json\n")
    tests = b.ended_tests(prog)
    assert [t[0] for t in tests] == ["busy", "idle", "short"]
    # two cores: 'busy' uses both all along, 'idle' a quarter of them; 'short' has no two samples inside
    samples = [(0.0, 0, 0), (4.0, 800, 800), (8.0, 1000, 1600)]
    rows = b.idle_by_test(samples, tests, cores=2)
    assert rows == [("idle", 4.0, 25.0, 6.0), ("busy", 4.0, 100.0, 0.0)]
    b.show({"run": 1, "commit": "abc", "exit": 0, "total_s": 10.0, "cold_start_s": 5.0, "ratio": 2.0,
            "phases": [], "idle_tests": rows})
    assert "25.0 %      6.0  idle" in capsys.readouterr().out


def test_sessions_fold_every_xdist_worker_into_its_controller(tmp_path):
    b = _bench()
    for name, started in [("20261206-1-1", 1.0), ("20261206-1-1-gw2", 1.5), ("20261206-2-2", 2.0)]:
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"started": started, "args": ["-m", "not cluster and not slow"]}))
        (d / "progress.jsonl").write_text(json.dumps({"ev": "end"}) + "\ntorn {\n"
                                          + json.dumps({"ev": "finished", "wall": started + 1, "exitstatus": 0}))
    got = b.sessions(tmp_path)
    assert [s["run_id"] for s in got] == ["20261206-1-1", "20261206-2-2"]  # a third worker too (-n 3)
    assert got[0]["tests"] == 1 and got[0]["finished"] == 2.0 and got[0]["exitstatus"] == 0
    assert got[0]["name"] == "unit tests"


def test_each_session_is_named_by_its_command_line():
    b = _bench()
    assert b.session_name(["-m", "not cluster and not slow and not gpu", "-n", "2", "-p", "no:cacheprovider"]) \
        == "unit tests (-n 2)"
    assert b.session_name(["-m", "cluster and not slow and not gpu", "--kvchaos-seed", "0"]) == "cluster session"
    assert b.session_name(["tests/x.py", "-m", "cluster and not slow", "--kvchaos-topology", "two-hosts"]) \
        == "two-host session"
    assert b.session_name(None) == "session"
