"""The progress lines a long run shows (kvchaos/plugin/progress.py, ``--kvchaos-progress``): tests done and
left, the test running, an ETA from earlier runs' durations; each experiment as it opens and its
verdicts the moment they are judged, with ``experiment`` records in ``progress.jsonl``; and that none of
it can fail a session. Inner sessions run in-process (pytester) with the plugin as installed; the
experiments run through the real runner against tests/fake_engine.py."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest

import faults.request  # noqa: F401 - imported before the inner runs (pytester drops what they import)
import kvchaos.experiment
import kvchaos.oracles.base  # noqa: F401
import kvchaos.plugin.fixtures  # noqa: F401
import kvchaos.policy  # noqa: F401
import kvchaos.report  # noqa: F401
import tests.fake_engine  # noqa: F401
from kvchaos.oracles import PASS, Isolation, Sensitivity
from kvchaos.plugin import progress, rundir
from kvchaos.workload import Workload
from tests.test_experiment import StandIn

pytest_plugins = ["pytester"]

ARGS = ("-p", "no:cacheprovider", "-o", "testpaths=", "-o", "addopts=", "--kvchaos-reports", "reports")
THREE = """
def test_a():
    pass

def test_b():
    pass

def test_c():
    pass
"""


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    """The inner sessions are sessions of their own, also when this file runs on an xdist worker (whose
    environment names it a worker: kvchaos.plugin.rundir would take the inner session for one)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def _run(pytester, *extra):
    return pytester.runpytest_inprocess(*ARGS, *extra)


def _lines(result) -> list[str]:
    return [x for x in result.outlines if x.startswith("[kvchaos]")]


def _this_run(pytester):
    """The run directory the inner session wrote (the newest, not one a test wrote as an earlier run)."""
    return max((d for d in (pytester.path / "reports").iterdir() if (d / "run.json").exists()),
               key=lambda d: (d / "run.json").stat().st_mtime)


def _records(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines()]


def _earlier(pytester, name: str, durations: dict, mtime: float, extra: str = "") -> None:
    """A run directory ``reports/<name>/`` as an earlier session left it."""
    d = pytester.path / "reports" / name
    d.mkdir(parents=True)
    recs = [{"ev": "collected", "n": len(durations)}]
    for nodeid, t in durations.items():
        recs += [{"ev": "start", "nodeid": nodeid},
                 {"ev": "end", "nodeid": nodeid, "outcome": "passed", "duration": t, "wall_start": 0, "wall_end": t}]
    p = d / "progress.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + extra)
    os.utime(p, (mtime, mtime))


# --------------------------------------------------------------------------- the test lines
def test_each_test_start_shows_done_left_and_the_test_running(pytester):
    pytester.makepyfile(test_inner=THREE)
    r = _run(pytester, "--kvchaos-progress", "on")
    r.assert_outcomes(passed=3)
    lines = _lines(r)
    assert [re.sub(r" · ETA.*", "", x) for x in lines] == [
        "[kvchaos] 0/3 done, 3 left · now: test_inner.py::test_a",
        "[kvchaos] 1/3 done, 2 left · now: test_inner.py::test_b",
        "[kvchaos] 2/3 done, 1 left · now: test_inner.py::test_c",
    ]
    assert all(x.endswith("· ETA unknown (no earlier run of these tests in reports/)") for x in lines), lines
    # the line stands alone: the file's row of results starts again after it
    assert r.outlines[r.outlines.index(lines[1]) + 1].startswith("test_inner.py .")


def test_verbose_lines_precede_each_tests_own_line(pytester):
    pytester.makepyfile(test_inner=THREE)
    r = _run(pytester, "--kvchaos-progress", "on", "-v")
    out = r.outlines
    i = out.index(next(x for x in out if x.startswith("[kvchaos] 1/3 done")))
    assert out[i + 1].startswith("test_inner.py::test_b PASSED"), out[i - 2:i + 3]
    assert "" not in out[i - 1:i + 2]  # no blank line around it


def test_the_eta_comes_from_the_newest_earlier_run_of_each_test(pytester):
    pytester.makepyfile(test_inner=THREE)
    a, b, c = (f"test_inner.py::test_{x}" for x in "abc")
    _earlier(pytester, "20260101-000000-1", {a: 999.0, b: 999.0}, mtime=1_000)  # older: the newer run's stand
    _earlier(pytester, "20260102-000000-2", {a: 100.0, b: 200.0}, mtime=2_000)  # c is new since
    _earlier(pytester, "20260102-000000-2-gw0", {a: 5.0, b: 5.0}, mtime=2_500)  # a worker's: its controller's
    _earlier(pytester, "20260103-000000-3", {"test_other.py::test_x": 7.0}, mtime=3_000)  # another session's
    r = _run(pytester, "--kvchaos-progress", "on")
    r.assert_outcomes(passed=3)
    first, second, third = _lines(r)
    # a 100 + b 200 + c at the mean of the known (a, b: 150 s) = 450 s; then b + c = 350 s; then c
    note = "(from run 20260102-000000-2; 1 new test counted at the mean 150.0 s)"
    assert re.search(r"· ETA ~7m (29|30)s " + re.escape(note) + "$", first), first
    assert re.search(r"· ETA ~5m (49|50)s " + re.escape(note) + "$", second), second
    assert re.search(r"· ETA ~2m (29|30)s ", third), third


def test_new_tests_count_at_the_mean_of_the_known_not_the_median(pytester):
    """The ETA is a sum and test times are skewed: known 1 s, 2 s and 297 s (median 2 s, mean 100 s), the
    new test counts 100 s — at the median, a run of many quick tests and a few long ones said seconds left
    where minutes were."""
    pytester.makepyfile(test_inner=THREE + "\ndef test_d():\n    pass\n")
    a, b, c = (f"test_inner.py::test_{x}" for x in "abc")
    _earlier(pytester, "20260102-000000-2", {a: 1.0, b: 2.0, c: 297.0}, mtime=2_000)
    r = _run(pytester, "--kvchaos-progress", "on")
    r.assert_outcomes(passed=4)
    first = _lines(r)[0]
    # 1 + 2 + 297 + d at the mean 100 = 400 s
    assert re.search(r"· ETA ~6m (39|40)s \(from run 20260102-000000-2; 1 new test counted at the mean 100\.0 s\)$",
                     first), first


def test_a_test_the_newest_run_lacks_takes_its_time_from_an_older_one(pytester):
    pytester.makepyfile(test_inner=THREE)
    a, b, c = (f"test_inner.py::test_{x}" for x in "abc")
    _earlier(pytester, "20260101-000000-1", {a: 999.0, c: 60.0}, mtime=1_000)
    _earlier(pytester, "20260102-000000-2", {a: 60.0, b: 60.0}, mtime=2_000)
    r = _run(pytester, "--kvchaos-progress", "on")
    assert re.search(r"· ETA (2m 59s|3m 00s) \(from run 20260102-000000-2 \+1 older\)$", _lines(r)[0]), _lines(r)


def test_a_corrupt_earlier_run_is_skipped_and_said_once(pytester):
    pytester.makepyfile(test_inner=THREE)
    a, b, c = (f"test_inner.py::test_{x}" for x in "abc")
    cut = ('["not", "a", "record"]\n{"ev": "end", "nodeid": "test_inner.py::test_c", "duration": NaN}\n'
           '{"ev": "end", "nodeid": "test_inner.py::test_c"}\n{"ev": "end", "nodeid": "test_inner.py::te')
    _earlier(pytester, "20260102-000000-2", {a: 100.0, b: 200.0, c: 300.0}, mtime=2_000, extra=cut)
    (pytester.path / "reports" / "20260103-000000-3" / "progress.jsonl").mkdir(parents=True)  # unreadable
    os.utime(pytester.path / "reports" / "20260103-000000-3" / "progress.jsonl", (3_000, 3_000))
    r = _run(pytester, "--kvchaos-progress", "on")
    r.assert_outcomes(passed=3)
    assert r.ret == 0
    warned = [x for x in _lines(r) if x.startswith("[kvchaos] progress:")]
    assert len(warned) == 1, warned  # one line, naming the first and counting the others
    assert "ETA: reports/20260103-000000-3/progress.jsonl: " in warned[0] and warned[0].endswith("(and 1 more)")
    first = next(x for x in _lines(r) if "now: " in x)
    assert re.search(r"· ETA (9m 59s|10m 00s) \(from run 20260102-000000-2\)$", first), first
    _found, used, warns = progress.earlier_durations(pytester.path / "reports", [a, b, c],
                                                  exclude=_this_run(pytester))
    assert used == ["20260102-000000-2"] and warns[1].endswith("20260102-000000-2/progress.jsonl: 4 unreadable "
                                                                "lines skipped"), warns


def test_read_durations_counts_each_unreadable_line(tmp_path):
    p = tmp_path / "progress.jsonl"
    p.write_text('{"ev": "end", "nodeid": "t::a", "duration": 2.5}\n{"ev": "end", "nodeid": "t::a", '
                 '"duration": 1.5}\n\n{"ev": "start", "nodeid": "t::b"}\n{"ev": "end", "nodeid": "t::b", '
                 '"duration": -1}\n7\n{"ev": "en')
    assert progress.read_durations(p) == ({"t::a": 4.0}, 3)  # a test run twice: its attempts summed


def test_auto_shows_a_test_when_it_is_long_or_quiet_has_lasted(pytester):
    pytester.makepyfile(test_inner=THREE)
    _earlier(pytester, "20260102-000000-2", {"test_inner.py::test_a": 1.0, "test_inner.py::test_b": 1.0,
                                             "test_inner.py::test_c": progress.QUIET_S + 5}, mtime=2_000)
    r = _run(pytester)  # auto is the default
    r.assert_outcomes(passed=3)
    shown = [re.search(r"now: (\S+)", x).group(1) for x in _lines(r)]
    assert shown == ["test_inner.py::test_a", "test_inner.py::test_c"], _lines(r)  # the first, and the long one


def test_off_shows_nothing(pytester):
    pytester.makepyfile(test_inner=THREE)
    r = _run(pytester, "--kvchaos-progress", "off")
    r.assert_outcomes(passed=3)
    assert _lines(r) == []
    assert [e["ev"] for e in _records(_this_run(pytester))].count("end") == 3  # the file is written all the same


def test_an_unknown_mode_is_a_usage_error(pytester, monkeypatch):
    pytester.makepyfile(test_inner=THREE)
    monkeypatch.setenv("KVCHAOS_PROGRESS", "loud")
    r = _run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--kvchaos-progress / KVCHAOS_PROGRESS 'loud': one of auto, on, off" in "\n".join(r.errlines)


def test_an_error_in_the_lines_never_fails_the_session(pytester, monkeypatch):
    def boom(self, nodeid, now=None):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(progress.ProgressLines, "line", boom)
    pytester.makepyfile(test_inner=THREE)
    r = _run(pytester, "--kvchaos-progress", "on")
    monkeypatch.undo()
    r.assert_outcomes(passed=3)
    assert _lines(r) == ["[kvchaos] progress: progress lines off after ZeroDivisionError in _started: division by "
                         "zero"]
    assert [e["ev"] for e in _records(_this_run(pytester))].count("end") == 3


def test_under_xdist_the_controller_counts_every_workers_tests(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_inner=THREE + "\ndef test_d():\n    pass\n")
    ids = {f"test_inner.py::test_{x}": 100.0 for x in "abcd"}
    _earlier(pytester, "20260102-000000-2", ids, mtime=2_000)
    r = pytester.runpytest_subprocess(*ARGS, "-n", "2", "--kvchaos-progress", "on")
    r.assert_outcomes(passed=4)
    lines = _lines(r)
    assert len(lines) == 4 and all(" · now: test_inner.py::test_" in x for x in lines), lines
    assert re.search(r"^\[kvchaos\] 0/4 done, 4 left · .*· ETA 3m (19|20)s \(from run 20260102-000000-2; 2 workers\)$",
                     lines[0]), lines
    # the controller collects nothing itself: its progress.jsonl has the workers' count
    assert next(e for e in _records(_this_run(pytester)) if e["ev"] == "collected")["n"] == 4


# --------------------------------------------------------------------------- experiments
EXPERIMENTS = """
import pytest

from faults.request import plant_leak
from kvchaos.experiment import Experiment
from kvchaos.oracles import FAIL, PASS, Isolation, Sensitivity
from kvchaos.workload import Workload
from tests.fake_engine import FakeEngine
from tests.test_experiment import StandIn


@pytest.fixture
def fake():
    with FakeEngine() as eng:
        yield StandIn(eng.url)


def test_leak(experiment, fake):
    wl = Workload(5, n_tenants=4, prefix="lk")
    plans = [wl.request(wl.tenants[i % 4], n_canaries=2) for i in range(24)]
    plant_leak(plans[7], plans[2])
    with experiment("planted", plans, [Isolation()], cluster=fake, faults=None, settle_s=0, timeout_s=10) as ex:
        pass
    ex.require(planted="a leak planted by the test", isolation=FAIL)


def test_clean(experiment, fake):
    with experiment("clean", Workload(9, n_tenants=4, prefix="cl").mix(30), [Isolation(), Sensitivity()],
                    cluster=fake, faults=None, settle_s=0, timeout_s=10) as ex:
        pass
    ex.require(isolation=PASS, sensitivity=PASS)


def test_aborted(experiment, fake):
    with pytest.raises(RuntimeError, match="the method broke"):
        with experiment("broken", Workload(3, n_tenants=2, prefix="br").mix(4), [Isolation()],
                        cluster=fake, faults=None, settle_s=0, timeout_s=10):
            raise RuntimeError("the method broke")


def test_elsewhere(fake, tmp_path):
    # an experiment writing into another run directory (another session's) is not this run's
    with Experiment("elsewhere", Workload(4, n_tenants=2, prefix="el").mix(4), [Isolation()], cluster=fake,
                    run_dir=tmp_path, settle_s=0, timeout_s=10) as ex:
        pass
    ex.judge()
"""


def test_experiments_show_as_they_open_and_close_and_are_recorded(pytester):
    pytester.makepyfile(test_inner=EXPERIMENTS)
    r = _run(pytester, "-v")
    r.assert_outcomes(passed=4)
    out = r.outlines
    opened = out.index("[kvchaos]   experiment planted: 24 requests")
    closed = next(i for i, x in enumerate(out) if x.startswith("[kvchaos]   experiment planted: isolation FAIL ("))
    result = next(i for i, x in enumerate(out) if x.startswith("test_inner.py::test_leak PASSED"))
    assert opened < closed < result  # the verdict shows before the test ends
    assert re.fullmatch(r"\[kvchaos\]   experiment planted: isolation FAIL \(\d+\.\d s; isolation was red \d+\.\d s in\)",
                        out[closed]), out[closed]
    assert any(re.fullmatch(r"\[kvchaos\]   experiment clean: isolation PASS · sensitivity PASS \(\d+\.\d s\)", x)
               for x in out), _lines(r)
    assert "[kvchaos]   experiment broken: 4 requests" in out
    assert any(x.startswith("[kvchaos]   experiment broken: aborted: RuntimeError('the method broke')") for x in out)
    # (the progress line may name the test test_elsewhere; the experiment's own lines must not show)
    assert not any("experiment elsewhere" in x for x in _lines(r)), _lines(r)

    recs = _records(_this_run(pytester))
    exp = [e for e in recs if e["ev"] == "experiment"]
    assert [(e["name"], e["phase"]) for e in exp] == [("planted", "open"), ("planted", "leak"), ("planted", "close"),
                                                      ("clean", "open"), ("clean", "close"), ("broken", "open"),
                                                      ("broken", "close")]
    op, seen, cl = exp[0], exp[1], exp.pop(2)
    # the live watch's word: isolation FAIL, when, naming the planted victim's count, before the verdicts
    assert seen["oracle"] == "isolation" and seen["status"] == "fail" and seen["victims"] == 1
    assert op["wall"] <= seen["wall"] <= cl["wall"] and 0 <= seen["after_s"] <= cl["duration"]
    assert "LEAK" in seen["summary"] and seen["id"] == op["id"]
    assert op["test"] == cl["test"] == "test_inner.py::test_leak" and op["n"] == 24 and op["id"] == cl["id"]
    assert cl["verdicts"]["isolation"] == "fail" and cl["leaks"] == ["isolation"] and cl["status"] == "fail"
    assert cl["wall_open"] == pytest.approx(op["wall"], abs=0.5) and cl["wall"] >= op["wall"]
    assert cl["duration"] == pytest.approx(cl["wall"] - cl["wall_open"], abs=0.1)
    end = next(e for e in recs if e["ev"] == "end" and e["nodeid"] == "test_inner.py::test_leak")
    assert recs.index(cl) < recs.index(end) and cl["wall"] <= end["wall_end"]  # judged before the test's end
    assert exp[3]["leaks"] == [] and exp[3]["status"] == "pass"
    assert exp[5]["status"] == "aborted" and "the method broke" in exp[5]["error"]


def test_default_mode_restarts_the_files_row_after_an_experiment_line(pytester):
    pytester.makepyfile(test_inner=EXPERIMENTS)
    r = _run(pytester, "-k", "clean")
    r.assert_outcomes(passed=1)
    out = r.outlines
    i = next(i for i, x in enumerate(out) if x.startswith("[kvchaos]   experiment clean: isolation PASS"))
    assert out[i + 1].startswith("test_inner.py ."), out[i - 2:i + 3]


def test_a_line_left_open_in_verbose_mode_never_runs_into_the_next(pytester):
    """An experiment in a fixture's teardown, in the last test, in ``-v``: nothing of pytest's follows on
    the test's line, and the session's closing lines still start on lines of their own."""
    pytester.makepyfile(test_inner=EXPERIMENTS.replace("def test_leak(", "def _unused(") + """

@pytest.fixture
def late(experiment, fake):
    yield
    with experiment("late", Workload(9, n_tenants=4, prefix="cl").mix(30), [Isolation(), Sensitivity()],
                    cluster=fake, faults=None, settle_s=0, timeout_s=10) as ex:
        pass
    ex.judge()


def test_zz_last(late):
    pass
""")
    r = _run(pytester, "-v", "-k", "zz_last")
    r.assert_outcomes(passed=1)
    assert any(re.fullmatch(r"\[kvchaos\]   experiment late: isolation PASS · sensitivity PASS \(\d+\.\d s\)", x)
               for x in r.outlines), _lines(r)


def test_a_first_attempt_run_again_is_not_done(tmp_path):
    """The rerun rule (kvchaos/plugin/known.py): a ``rerun`` report and its teardown leave the test to do."""
    from types import SimpleNamespace

    config = SimpleNamespace(option=SimpleNamespace(), pluginmanager=SimpleNamespace(
        has_plugin=lambda name: False, get_plugin=lambda name: None))
    lines = progress.ProgressLines(config, rundir.Progress(tmp_path / "r" / "progress.jsonl"), "on")
    lines.pytest_collection_finish(SimpleNamespace(items=[SimpleNamespace(nodeid="t.py::a"),
                                                          SimpleNamespace(nodeid="t.py::b")]))

    def report(when, outcome="passed"):
        return SimpleNamespace(nodeid="t.py::a", when=when, outcome=outcome)

    lines.pytest_runtest_logstart("t.py::a", ("t.py", 1, "a"))
    for rep in (report("setup"), report("call", "rerun"), report("teardown")):
        lines.pytest_runtest_logreport(rep)
    assert lines.line("t.py::a").startswith("[kvchaos] 0/2 done, 2 left · now: t.py::a ·")
    lines.pytest_runtest_logstart("t.py::a", ("t.py", 1, "a"))
    for rep in (report("setup"), report("call"), report("teardown")):
        lines.pytest_runtest_logreport(rep)
    assert lines.line("t.py::b").startswith("[kvchaos] 1/2 done, 1 left · now: t.py::b ·")


def test_experiment_lines_off_still_records_them(pytester):
    pytester.makepyfile(test_inner=EXPERIMENTS)
    r = _run(pytester, "--kvchaos-progress", "off", "-k", "clean")
    r.assert_outcomes(passed=1)
    assert _lines(r) == []
    phases = [e["phase"] for e in _records(_this_run(pytester)) if e["ev"] == "experiment"]
    assert phases == ["open", "close"]


# --------------------------------------------------------------------------- the runner's listeners
def test_the_runner_tells_its_listeners_and_a_broken_one_only_warns(tmp_path):
    heard = []

    def listen(event, ex, **info):
        heard.append((event, ex.name, ex.judgement.status if ex.judgement else None, info))

    def broken(event, ex, **info):
        raise ValueError("listener bug")

    kvchaos.experiment.OBSERVERS.extend([broken, listen])
    try:
        with tests.fake_engine.FakeEngine() as eng, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cluster = StandIn(eng.url)
            with kvchaos.experiment.Experiment("told", Workload(9, n_tenants=4, prefix="cl").mix(30),
                                               [Isolation(), Sensitivity()], cluster=cluster, run_dir=tmp_path,
                                               settle_s=0, timeout_s=10) as ex:
                assert heard == [("open", "told", None, {})]
            assert heard[-1] == ("close", "told", "pass", {})
            ex.require(isolation=PASS, sensitivity=PASS)  # the outcome is the runner's alone
            with pytest.raises(KeyError):
                with kvchaos.experiment.Experiment("aborted", [], [Isolation()], cluster=cluster, run_dir=tmp_path,
                                                   settle_s=0, timeout_s=10):
                    raise KeyError("x")
    finally:
        kvchaos.experiment.OBSERVERS.remove(broken)
        kvchaos.experiment.OBSERVERS.remove(listen)
    assert heard[-1] == ("close", "aborted", None, {"error": "KeyError('x')"})
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 4 and all("listener" in s and "listener bug" in s for s in said), said
