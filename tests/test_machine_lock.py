"""``kvchaos.machine_lock``: under pytest-xdist an ``exclusive`` test runs with no other test running,
the others still run side by side, an exclusive waiter is not starved, and waits are bounded."""

import glob
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvchaos.machine_lock import MachineLock, MachineLockTimeout
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]


def _overlap(a, b):
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_under_xdist_an_exclusive_test_overlaps_no_other_and_the_others_run_side_by_side(tmp_path):
    out = tmp_path / "inner"
    uid = os.urandom(8).hex()  # the inner run's: other runs on this machine make and remove lock files of their own
    r = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "tests/data/inner_exclusive_suite.py"), "-q",
                        "-p", "no:cacheprovider", "-n", "2", "--testrunuid", uid,
                        "--kvchaos-reports", str(tmp_path / "reports"),
                        "-o", "testpaths="], cwd=REPO, env=child_env(KVCHAOS_INNER_OUT=str(out)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "7 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [json.loads(ln) for f in tmp_path.glob("inner.gw*") for ln in f.read_text().splitlines()]
    assert len(recs) == 7 and len({x["name"] for x in recs}) == 7
    ex = next(x for x in recs if x["exclusive"])
    others = [x for x in recs if not x["exclusive"]]
    assert not [x["name"] for x in others if _overlap(ex, x)], "a test ran while the exclusive one did"
    # without the marker tests do run in parallel: the check above could have failed
    assert any(_overlap(a, b) for i, a in enumerate(others) for b in others[i + 1:]), recs
    # the controller removes the run's lock files
    assert {x["testrunuid"] for x in recs} == {uid}  # the run's lock was kvchaos-xdist-<uid>.lock
    assert glob.glob(str(Path(tempfile.gettempdir()) / f"kvchaos-xdist-{uid}.lock*")) == []


def _hold(path, exclusive, seconds, q):
    with MachineLock(path).hold(exclusive):
        q.put(("in", exclusive, time.monotonic()))
        time.sleep(seconds)
        q.put(("out", exclusive, time.monotonic()))


def test_runs_sharing_a_machine_lock_keep_each_exclusive_test_alone_across_both(tmp_path):
    """``make test``'s shape: a serial session and an xdist run at once, both given one lock file by
    KVCHAOS_MACHINE_LOCK. Each exclusive test overlaps no test of either run; the rest run side by side;
    no test sees the variable (a pytest it starts must not take the lock); the lock file is its owner's."""
    lock = tmp_path / "shared.lock"
    runs = {}
    for name, extra in (("serial", []), ("xdist", ["-n", "2"])):
        runs[name] = subprocess.Popen(
            [sys.executable, "-m", "pytest", str(REPO / "tests/data/inner_exclusive_suite.py"), "-q",
             "-p", "no:cacheprovider", *extra, "--kvchaos-reports", str(tmp_path / f"reports-{name}"), "-o", "testpaths="],
            # the serial run's tests last 5 s each: 30 s for the xdist run to start beside its last six (a
            # CI run under three sessions took longer than the 12 s that 2 s tests left)
            cwd=REPO, env=child_env(KVCHAOS_INNER_OUT=str(tmp_path / name), KVCHAOS_MACHINE_LOCK=str(lock),
                                    KVCHAOS_INNER_SLEEP_S="5.0" if name == "serial" else "2.0"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while name == "serial" and not (tmp_path / "serial.main").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the xdist run starts once the serial one is inside its tests: they overlap
            # even on a loaded machine (make test runs this beside the cluster session), where its
            # startup alone could outlast the serial run's 7 tests
    outs = {name: p.communicate(timeout=300)[0] for name, p in runs.items()}
    assert all(p.returncode == 0 and "7 passed" in outs[n] for n, p in runs.items()), outs
    recs = [dict(json.loads(ln), run=f.name.split(".")[0]) for f in tmp_path.glob("*.*")
            if f.name.startswith(("serial.", "xdist.")) for ln in f.read_text().splitlines()]
    assert sorted(x["run"] for x in recs) == ["serial"] * 7 + ["xdist"] * 7, recs
    for ex in (x for x in recs if x["exclusive"]):
        beside = [(x["run"], x["name"]) for x in recs if x is not ex and _overlap(ex, x)]
        assert not beside, f"{ex['run']}'s exclusive test ran beside {beside}"
    shared = [x for x in recs if not x["exclusive"]]
    assert any(_overlap(a, b) for a in shared for b in shared if a["run"] != b["run"]), "the runs never overlapped"
    assert {x["lock_env"] for x in recs} == {None}
    assert lock.exists()  # neither session removes what it did not create


def _churn(path, until):
    while time.monotonic() < until:  # shared holders back to back: an exclusive waiter must still get in
        with MachineLock(path).hold():
            time.sleep(0.05)


def test_an_exclusive_waiter_is_not_starved_and_waits_are_bounded(tmp_path):
    lock = tmp_path / "m.lock"
    ctx = multiprocessing.get_context("spawn")
    churners = [ctx.Process(target=_churn, args=(lock, time.monotonic() + 20)) for _ in range(2)]
    for p in churners:
        p.start()
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        with MachineLock(lock, timeout_s=10).hold(exclusive=True) as waited:
            got = time.monotonic() - t0
        assert got < 5 and waited < 5, f"exclusive waited {got:.1f} s behind back-to-back shared holders"
    finally:
        for p in churners:
            p.terminate()
            p.join(10)
    q = ctx.Queue()
    holder = ctx.Process(target=_hold, args=(lock, False, 3.0, q))
    holder.start()
    try:
        assert q.get(timeout=30)[0] == "in"
        t0 = time.monotonic()
        with pytest.raises(MachineLockTimeout, match="m.lock"):
            with MachineLock(lock, timeout_s=0.5).hold(exclusive=True):
                pass
        assert time.monotonic() - t0 < 2
        with MachineLock(lock, timeout_s=1).hold():  # shared beside shared: no wait
            pass
    finally:
        holder.join(30)
