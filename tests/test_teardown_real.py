"""Against the real SGLang cluster: no process survives a pytest run killed mid-suite, and a server
that dies at start is reported with its log instead of hanging."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from faults import AGENT_MODULE, open_network_proxy
from kvchaos.cluster import Cluster, ClusterSpec, ProcessDied
from kvchaos.cluster.netns import leftovers
from kvchaos.cluster.reaper import proc_table, related

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


def _alive(pids: dict) -> list[int]:
    t = proc_table()
    return [int(p) for p, st in pids.items() if int(p) in t and t[int(p)][3] == st and t[int(p)][4] != "Z"]


# behind -m slow for CI's time: CI kills pytest -n 2 (below), whose cluster-owning worker is SIGKILLed
# with no handler run, as a serial pytest's would be
@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_no_leftover_processes_after_pytest_is_killed_mid_suite(tmp_path, sig):
    out = tmp_path / "inner.json"
    env = {**os.environ, "KVCHAOS_INNER_OUT": str(out)}
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(REPO / "tests/data/inner_suite.py"), "-q", "-p", "no:cacheprovider",
         "--kvchaos-reports", str(tmp_path / "reports"), "-o", "testpaths="],
        env=env, cwd=REPO, stdout=open(tmp_path / "inner.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while not out.exists():
            assert inner.poll() is None, f"inner pytest exited early:\n{(tmp_path / 'inner.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "inner cluster never came up"
            time.sleep(0.5)
        info = json.loads(out.read_text())
        pids = info["pids"]
        # the real cluster: launch_server x2 + scheduler/detokenizer each + router (>= 7 processes)
        assert len(pids) >= 7, pids
        assert httpx.get(info["router"] + "/health", timeout=5).status_code == 200
        tree = related(set(info["pgids"]), info["token"])
        assert set(tree) == set(pids)
        os.kill(inner.pid, getattr(signal, sig))
        inner.wait(timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(tree):
            time.sleep(0.5)
        assert _alive(tree) == [], f"after {sig} of pytest, still alive: {_alive(tree)}"
        assert related(set(info["pgids"]), info["token"]) == {}
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)


def _inner_xdist(tmp_path, suite: str, wait_s: float):
    """``pytest -n 2 --dist each`` of ``tests/data/<suite>`` in a session of its own, once both workers
    wrote what they hold: (the process, [gw0's, gw1's] info)."""
    out = tmp_path / "inner.json"
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(REPO / "tests/data" / suite), "-q", "-p", "no:cacheprovider",
         "-n", "2", "--dist", "each", "--kvchaos-reports", str(tmp_path / "reports"), "-o", "testpaths="],
        env={**os.environ, "KVCHAOS_INNER_OUT": str(out)}, cwd=REPO, stdout=open(tmp_path / "inner.log", "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    files = [Path(f"{out}.gw0"), Path(f"{out}.gw1")]
    try:
        deadline = time.monotonic() + wait_s
        while not all(f.exists() for f in files):
            assert inner.poll() is None, f"inner pytest exited early:\n{(tmp_path / 'inner.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the workers' clusters never came up"
            time.sleep(0.5)
    except BaseException:
        os.killpg(inner.pid, signal.SIGKILL)
        raise
    return inner, [json.loads(f.read_text()) for f in files]


@pytest.mark.slow  # two clusters side by side: ~3 min of CI's 30
def test_xdist_workers_each_run_a_cluster_and_none_survives_a_sigkill_of_pytest(tmp_path):
    """``-n 2``: one cluster per worker, no port shared; SIGKILL of the controlling pytest leaves no
    worker, engine, router or reaper behind."""
    inner, infos = _inner_xdist(tmp_path, "inner_xdist_suite.py", 600)
    try:
        assert infos[0]["pytest_pid"] != infos[1]["pytest_pid"] and infos[0]["token"] != infos[1]["token"]
        assert not set(infos[0]["ports"]) & set(infos[1]["ports"]), "two workers' clusters share a port"
        for i in infos:
            assert httpx.get(i["router"] + "/health", timeout=5).status_code == 200
        trees = {}
        for i in infos:
            trees.update(related(set(i["pgids"]), i["token"]))
        workers = {str(i["pytest_pid"]): proc_table()[i["pytest_pid"]][3] for i in infos}
        os.kill(inner.pid, signal.SIGKILL)  # the controller only: its workers must not outlive it
        inner.wait(timeout=60)
        watch = {**trees, **workers}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _alive(watch):
            time.sleep(0.5)
        assert _alive(watch) == [], f"after SIGKILL of pytest -n 2, still alive: {_alive(watch)}"
        for i in infos:
            assert related(set(i["pgids"]), i["token"]) == {}
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)


def _ports_of(pids) -> list[str]:
    d = Path(os.environ.get("KVCHAOS_PORT_DIR", Path(tempfile.gettempdir()) / "kvchaos-ports"))
    out = []
    for f in d.glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if int(f.read_text().strip() or 0) in pids:
                out.append(f.name)
    return out


# "group": the whole process group, as a CI timeout kills it — no handler runs in the controller or in
# the worker that owns the cluster; "controller": its workers must notice and go (slow: same paths)
@pytest.mark.parametrize("kill", ["group", pytest.param("controller", marks=pytest.mark.slow)])
def test_sigkill_of_pytest_under_xdist_leaves_no_process_lock_file_port_or_namespace(tmp_path, kill):
    inner, (owner, other) = _inner_xdist(tmp_path, "inner_xdist_one_cluster.py", 420)
    try:
        lock = Path(owner["lock"])
        held = [lock, lock.with_name(lock.name + ".turnstile"), Path(owner["agent_dir"])]
        assert all(p.exists() for p in held), held
        assert lock.read_text().strip() == str(inner.pid)  # the controller owns the lock files
        assert httpx.get(owner["router"] + "/health", timeout=5).status_code == 200
        pytests = {inner.pid, owner["pytest_pid"], other["pytest_pid"]}
        assert set(owner["ports"]) <= {int(p) for p in _ports_of(pytests)}
        tree = related(set(owner["pgids"]), owner["token"])
        t = proc_table()
        watch = {**tree, **{str(p): t[p][3] for p in pytests}}
        if kill == "group":
            os.killpg(inner.pid, signal.SIGKILL)
        else:
            os.kill(inner.pid, signal.SIGKILL)
        inner.wait(timeout=60)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (_alive(watch) or any(p.exists() for p in held) or _ports_of(pytests)):
            time.sleep(0.5)
        assert _alive(watch) == [], f"after SIGKILL of pytest -n 2 ({kill}), still alive: {_alive(watch)}"
        assert related(set(owner["pgids"]), owner["token"]) == {}
        assert [str(p) for p in held if p.exists()] == [], "lock files / agent directory left"
        assert _ports_of(pytests) == [], "port reservations left"
        # the inner run's own (its cluster's topology: none on one host, its bridge, namespaces and veths on
        # two). Not every kvc* of the machine: make test's two-host session creates and removes its own beside
        assert set(owner["spaces"]) & set(leftovers()) == set(), "a namespace or link left"
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)


def test_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    spec = ClusterSpec.load("cpu", prefill_args=["--no-such-flag-kvchaos"], startup_timeout_s=240)
    c = Cluster(spec, tmp_path, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE)
    t0 = time.monotonic()
    with pytest.raises(ProcessDied) as e:
        c.start()
    msg = str(e.value)
    assert "prefill" in msg and "died during startup" in msg
    assert "--no-such-flag-kvchaos" in msg  # argparse's complaint, from the log tail
    assert time.monotonic() - t0 < 120
    assert related({p.pgid for p in c.procs.values()}, c.token) == {}
