"""``kvchaos replay``: a recorded scenario re-run from its run's seed, end to end against
tests/fake_engine.py (tests/data/replay_suite), and its bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos.replay import ReplayError, compare, load_run, scenarios, select
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]
INNER = REPO / "tests" / "data" / "replay_suite" / "test_replay_inner.py"


def _original(tmp_path, **env):
    r = subprocess.run([sys.executable, "-m", "pytest", f"{INNER}::test_scenario", "-p", "no:cacheprovider", "-o", "testpaths=", "-q",
                        "--kvchaos-seed", "41", "--kvchaos-reports", str(tmp_path / "reports")],
                       cwd=REPO, env=child_env(KVCHAOS_RUN_ID="orig", **env), capture_output=True, text=True, timeout=300)
    return r, tmp_path / "reports" / "orig"


def _replay(run_dir, *args, **env):
    return subprocess.run([sys.executable, "-m", "kvchaos", "replay", str(run_dir), *args], cwd=REPO,
                          env=child_env(**env), capture_output=True, text=True, timeout=600)


def test_a_leak_replays_from_its_seed_and_a_changed_scenario_does_not(tmp_path):
    r, run = _original(tmp_path, INNER_LEAK="1")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-2000:]
    (orig,) = scenarios(run)  # the last record of the experiment stands (judged)
    assert orig["status"] == "fail" and orig["verdicts"]["isolation"] == "fail" and orig["run_seed"] == 41
    assert 'id="seed">41</code>' in (run / "report.html").read_text()  # the report says how to run it again

    # no scenario named: every experiment that was not PASS; twice, each its own pytest session
    rp = _replay(run, "--times", "2", INNER_LEAK="1")
    assert rp.returncode == 0, rp.stdout[-3000:] + rp.stderr[-2000:]
    assert "reproduced 2/2 (seed 41)" in rp.stdout
    res = json.loads(Path(rp.stdout.strip().splitlines()[-1].split(": ", 1)[1]).read_text())
    (sc,) = res["scenarios"]
    assert [x["reproduced"] for x in sc["repetitions"]] == [True, True]
    assert all(x["experiments"][0]["plans_digest"] == orig["plans_digest"] for x in sc["repetitions"])

    # the engine no longer leaks: same plans, verdicts differ -> not reproduced (exit 1)
    rp = _replay(run, "replayable", INNER_LEAK="0")
    assert rp.returncode == 1 and "reproduced 0/1" in rp.stdout, rp.stdout[-2000:]
    assert "verdicts differ" in rp.stdout
    # the scenario's plans are not the recorded ones: never counted as a reproduction
    rp = _replay(run, "replayable", INNER_LEAK="1", INNER_N="31")
    assert rp.returncode == 1 and "plans differ" in rp.stdout, rp.stdout[-2000:]


def test_replay_bad_input_is_named(tmp_path):
    with pytest.raises(ReplayError, match="not a directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(ReplayError, match="no run.json"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x"}))
    with pytest.raises(ReplayError, match="recorded no seed"):
        load_run(tmp_path)
    recs = [{"id": "a", "name": "x", "test": "t::a", "status": "pass"},
            {"id": "b", "name": "y", "test": "t::b", "status": "fail"}]
    assert select(recs, None) == [recs[1]]
    assert select(recs, "x") == [recs[0]] and select(recs, "t::b") == [recs[1]]
    with pytest.raises(ReplayError, match="no scenario 'z'"):
        select(recs, "z")
    with pytest.raises(ReplayError, match="2 tests"):
        select(recs, "t::")
    with pytest.raises(ReplayError, match="every experiment of this run passed"):
        select(recs[:1], None)
    r = subprocess.run([sys.executable, "-m", "kvchaos", "replay", str(tmp_path / "nope")], cwd=REPO,
                       env=child_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "not a directory" in r.stderr


def test_compare_needs_the_same_plans_and_the_original_non_pass_verdicts():
    o = {"plans_digest": "d1", "verdicts": {"isolation": "fail", "liveness": "pass"}}
    assert compare(o, {"plans_digest": "d1", "verdicts": {"isolation": "fail", "liveness": "fail"}})["reproduced"]
    assert not compare(o, {"plans_digest": "d1", "verdicts": {"isolation": "pass", "liveness": "pass"}})["reproduced"]
    assert not compare(o, {"plans_digest": "d2", "verdicts": {"isolation": "fail"}})["reproduced"]
    assert not compare(o, None)["reproduced"]
    clean = {"plans_digest": "d1", "verdicts": {"isolation": "pass"}}  # a PASS scenario: PASS again
    assert compare(clean, {"plans_digest": "d1", "verdicts": {"isolation": "pass"}})["reproduced"]
    assert not compare(clean, {"plans_digest": "d1", "verdicts": {"isolation": "unknown"}})["reproduced"]
