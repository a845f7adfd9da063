"""Against the real SGLang cluster: no process survives a pytest run killed mid-suite, and a server
that dies at start is reported with its log instead of hanging."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from faults import AGENT_MODULE, open_network_proxy
from kvchaos.cluster import Cluster, ClusterSpec, ProcessDied
from kvchaos.cluster.reaper import proc_table, related

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


def _alive(pids: dict) -> list[int]:
    t = proc_table()
    return [int(p) for p, st in pids.items() if int(p) in t and t[int(p)][3] == st and t[int(p)][4] != "Z"]


# SIGINT (Ctrl-C) behind -m slow for CI's 30 minutes: SIGKILL, the harder case (no handler runs), stays
@pytest.mark.parametrize("sig", ["SIGKILL", pytest.param("SIGINT", marks=pytest.mark.slow)])
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


@pytest.mark.slow  # two clusters side by side: ~3 min of CI's 30
def test_xdist_workers_each_run_a_cluster_and_none_survives_a_sigkill_of_pytest(tmp_path):
    """``-n 2``: one cluster per worker, no port shared; SIGKILL of the controlling pytest leaves no
    worker, engine, router or reaper behind."""
    out = tmp_path / "inner.json"
    env = {**os.environ, "KVCHAOS_INNER_OUT": str(out)}
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(REPO / "tests/data/inner_xdist_suite.py"), "-q", "-p", "no:cacheprovider",
         "-n", "2", "--dist", "each", "--kvchaos-reports", str(tmp_path / "reports"), "-o", "testpaths="],
        env=env, cwd=REPO, stdout=open(tmp_path / "inner.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    files = [Path(f"{out}.gw0"), Path(f"{out}.gw1")]
    try:
        deadline = time.monotonic() + 600
        while not all(f.exists() for f in files):
            assert inner.poll() is None, f"inner pytest exited early:\n{(tmp_path / 'inner.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the workers' clusters never came up"
            time.sleep(0.5)
        infos = [json.loads(f.read_text()) for f in files]
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
