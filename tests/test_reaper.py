"""Nothing kvchaos starts outlives its owner: pass, failure, Ctrl-C, SIGKILL.

These use small stand-in process trees (a leader with a child in its group and a grandchild that
escapes with setsid), so every branch of the reaper is exercised in seconds. The same guarantee
against the real SGLang cluster is checked in tests/test_teardown_real.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvchaos.cluster.procs import ManagedProcess
from kvchaos.cluster.reaper import Reaper, pids_with_token, proc_table, related

TREE = textwrap.dedent("""
    import os, sys, time, signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)      # stubborn: needs SIGKILL
    if os.fork() == 0:                                  # child, same group
        if os.fork() == 0:                              # grandchild leaves the group and, like
            os.setsid()                                 # SGLang's scheduler, retitles itself,
            import setproctitle                         # which clobbers /proc/<pid>/environ
            setproctitle.setproctitle("kvchaos-escapee " + "x" * 4096)
            time.sleep(600)
        time.sleep(600)
    time.sleep(600)
""")

OWNER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from kvchaos.cluster.reaper import Reaper
    from kvchaos.cluster.procs import ManagedProcess
    out = Path(sys.argv[1]); token = sys.argv[2]
    r = Reaper(token, grace_s=1.0)
    p = ManagedProcess("tree", [sys.executable, "-c", sys.argv[3]], dict(os.environ), out.parent / "tree.log", r, token)
    time.sleep(1.0)
    tmp = out.with_name(out.name + ".tmp")  # whole or absent: the test reads it the moment it exists
    tmp.write_text(json.dumps({"owner": os.getpid(), "leader": p.pid}))
    tmp.rename(out)
    if sys.argv[4] == "crash":
        raise SystemExit(3)
    time.sleep(600)
""")


def _alive(tree: dict[int, int]) -> list[int]:
    t = proc_table()
    return [p for p, st in tree.items() if p in t and t[p][3] == st and t[p][4] != "Z"]


def _wait_gone(tree, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(tree):
        time.sleep(0.2)
    return _alive(tree)


def _tree(leader, token, want=3, timeout=10.0) -> dict[int, int]:
    """The stand-in tree once all three processes run, the escapee already untagged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = related({leader}, token)
        if len(tree) >= want and len(pids_with_token(token)) == want - 1:
            return tree
        time.sleep(0.1)
    raise AssertionError(f"stand-in tree did not come up: {related({leader}, token)}, tagged {pids_with_token(token)}")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM", "crash"])
def test_owner_death_kills_whole_tree(tmp_path, how):
    token = f"kvc-test-{os.getpid()}-{how}"
    info = tmp_path / "info.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # SIGINT at its default, as from a terminal, even when this test runs under a shell that ignores it (a
    # non-interactive shell's background job inherits SIGINT ignored; Python then never raises KeyboardInterrupt)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(info), token, TREE, how], env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info.exists(), "owner never started its tree"
        tree = _tree(json.loads(info.read_text())["leader"], token)
        if how != "crash":
            owner.send_signal(getattr(signal, how))
        owner.wait(timeout=20)
        assert _wait_gone(tree) == [], f"processes left after owner {how}"
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in _alive(tree) if "tree" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def test_stop_kills_stubborn_group_and_reports_no_leftovers(tmp_path):
    token = f"kvc-test-{os.getpid()}-stop"
    r = Reaper(token, grace_s=1.0)
    try:
        p = ManagedProcess("tree", [sys.executable, "-c", TREE], dict(os.environ), tmp_path / "t.log", r, token)
        tree = _tree(p.pid, token)
        time.sleep(0.7)  # one reaper snapshot
        p.stop(grace_s=0.5)
        escapee = _alive(tree)
        assert len(escapee) == 1  # left its group and lost its tag: only the reaper's snapshot knows it
        assert r.close() == 0
        assert _alive(tree) == []
    finally:
        for pid in _alive(tree) if "tree" in locals() else []:
            os.kill(pid, signal.SIGKILL)


def test_process_that_dies_at_start_reports_its_log_tail(tmp_path):
    p = ManagedProcess("bad", [sys.executable, "-c", "import sys; print('boom: no such model'); sys.exit(7)"],
                       dict(os.environ), tmp_path / "bad.log", None, "kvc-test-bad")
    p.popen.wait(10)
    err = p.died_error("died during startup")
    assert "code 7" in str(err) and "boom: no such model" in str(err) and str(tmp_path / "bad.log") in str(err)


def test_a_start_that_times_out_says_how_long_and_how_starved_the_machine_was(tmp_path, monkeypatch):
    """A bound hit by a process that never answers names the wait, and how much of it the machine's CPUs
    were oversubscribed (PSI): what tells a starved start from a hung one (CI once read only an empty log)."""
    import kvchaos.cluster.api as api
    p = ManagedProcess("quiet", [sys.executable, "-c", "import time; print('loading'); time.sleep(30)"],
                       dict(os.environ), tmp_path / "quiet.log", None, "kvc-test-quiet")
    psi = iter([10_000_000, 10_000_000 + 900_000])  # 0.9 s of CPU wait by the time it gives up
    monkeypatch.setattr(api, "cpu_pressure_us", lambda: next(psi))
    monkeypatch.setattr(api, "_http_ok", lambda url: None)
    try:
        with pytest.raises(api.ClusterStartError) as e:
            api.wait_healthy({"quiet": p}, {"quiet": "http://127.0.0.1:9/health"}, time.monotonic() + 1.0)
    finally:
        p.popen.kill()
        p.popen.wait(10)
    msg = str(e.value)
    assert "timed out waiting for ['quiet'] to become healthy: waited " in msg, msg
    share = re.search(r"waited for a CPU (\d+)% of those (\d+) s", msg)
    assert share and 40 <= int(share[1]) <= 90, msg  # 0.9 s of the 1-2 s it waited
    assert "quiet.log" in msg and "loading" in msg, msg  # the log's tail, as before


def test_without_pressure_figures_the_timeout_says_only_the_wait(monkeypatch):
    import kvchaos.cluster.api as api
    monkeypatch.setattr(api, "cpu_pressure_us", lambda: None)
    assert api.starved_share(time.monotonic() - 5, None) == ""
    monkeypatch.setattr(api, "cpu_pressure_us", lambda: 5_000_000)
    assert "100%" in api.starved_share(time.monotonic() - 2, 0)  # capped: PSI counts any task's wait


def test_snapshots_skip_settled_environments_and_a_kill_reads_them_all(monkeypatch):
    """The periodic snapshots read a settled process's environment once (most of the reaper's CPU was
    re-reading every process's every 0.5-2.5 s); a token holder is never set aside, and a kill (no
    ``unrelated`` set) reads every environment again."""
    from kvchaos.cluster import reaper

    token = f"kvc-settled-{os.getpid()}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, "KVCHAOS_OWNER": token})
    other = subprocess.Popen(sleeper, env={k: v for k, v in os.environ.items() if k != "KVCHAOS_OWNER"})
    try:
        deadline = time.monotonic() + 20
        while token.encode() not in Path(f"/proc/{ours.pid}/environ").read_bytes():
            assert time.monotonic() < deadline, "the token holder never exec'd"
            time.sleep(0.05)
        time.sleep(0.1)
        st = {p.pid: proc_table()[p.pid][3] for p in (ours, other)}
        unrelated: set = set()
        assert ours.pid in related(set(), token, unrelated=unrelated)
        assert unrelated.isdisjoint({(p, s) for p, s in st.items()})  # young: read, not set aside
        monkeypatch.setattr(reaper, "SETTLED_AGE_S", 0.0)  # now everything counts as settled
        assert ours.pid in related(set(), token, unrelated=unrelated)
        assert (other.pid, st[other.pid]) in unrelated and (ours.pid, st[ours.pid]) not in unrelated
        unrelated.add((ours.pid, st[ours.pid]))  # set aside, the snapshots skip it ...
        assert ours.pid not in related(set(), token, unrelated=unrelated)
        assert ours.pid in related(set(), token)  # ... and a kill reads it again
        assert ours.pid in pids_with_token(token) and other.pid not in pids_with_token(token)
    finally:
        for p in (ours, other):
            p.kill()
            p.wait(10)
