"""The two-hosts topology on real SGLang (kvchaos/cluster/netns.py): prefill and decode in network
namespaces of their own, every agent fault over TCP while the engine-side files are out of the harness's
sight, and nothing left behind after a SIGKILL of pytest (namespaces, links, processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from faults import AGENT_MODULE
from faults.client import AgentClient
from kvchaos import canary
from kvchaos.cluster import Cluster, ClusterSpec, netns
from kvchaos.workload import Workload

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]
REPO = Path(__file__).resolve().parents[1]


def test_the_session_cluster_keeps_engine_files_out_of_sight(cluster, faults):
    """Under ``--kvchaos-topology two-hosts`` (make test's two-host session): the session's servers run
    in their namespaces, every agent request goes over TCP, and the engines' control directories are
    empty from the harness's side while the agents answer."""
    hosts = getattr(cluster, "hosts", None)
    if hosts is None:
        pytest.skip("the session cluster is one-host (run with --kvchaos-topology two-hosts)")
    ctl = faults.agent
    assert ctl.dir is None and sorted(ctl.remote) == ["decode", "prefill"]
    for role in ("prefill", "decode"):
        assert hosts.ip(role) in cluster.endpoints.__dict__[role]
        assert ctl.wait_agents(role, (), timeout=30)
        assert os.listdir(hosts.mounts[role]) == [], role
    pids = subprocess.run(["ip", "netns", "pids", hosts.ns("decode")], capture_output=True, text=True).stdout.split()
    assert str(cluster.procs["decode"].pid) in pids  # decode really runs in its namespace


@pytest.mark.slow  # its own cluster; make test's two-host session covers the same on the session cluster
def test_agents_answer_over_tcp_while_their_files_are_out_of_sight(tmp_path, kvchaos_reaper):
    spec = ClusterSpec.load("cpu", network_proxy="", topology="two-hosts")
    with Cluster(spec, tmp_path / "c", reaper=kvchaos_reaper, agent_module=AGENT_MODULE).start() as c:
        hosts = c.describe()["topology"]
        assert hosts["addresses"]["prefill"] in c.endpoints.prefill and c.agent_urls["decode"].startswith(
            f"tcp://{hosts['addresses']['decode']}:")
        ctl = AgentClient.for_cluster(c)
        assert ctl.dir is None
        for role in ("prefill", "decode"):
            assert ctl.wait_agents(role, ("send_kvcache",) if role == "prefill" else ("_defer_release",), timeout=60)
            # the same directory, from the harness's side: the engine's private tmpfs is not here
            assert os.listdir(c.hosts.mounts[role]) == [], role
        p = Workload(5, n_tenants=2).request(n_tokens=300, n_canaries=2)
        f = ctl.arm("prefill", "delay", target={"rid": p.rid}, params={"ms": 200})
        r = httpx.post(c.endpoints.router + "/generate", timeout=60, json={
            "text": p.prompt, "rid": p.rid, "sampling_params": {"max_new_tokens": p.max_new_tokens, "temperature": 0}})
        assert r.status_code == 200 and all(canary.payload(x) in r.json()["text"] for x in p.canaries), r.text[:200]
        (ev,) = f.verify()  # the firing came back over TCP
        assert ev["rid"] == p.rid and ev["ms"] == 200
        starts = [e for e in ctl.events("prefill") if e["ev"] == "transfer_start" and e.get("rid") == p.rid]
        assert starts and starts[0]["pages"] > 0
        f.heal()
        assert ctl.armed() == []
        k = c.hosts.k
    assert netns.of_subnet(k) == []


@pytest.mark.slow  # a pytest of its own on a two-host cluster (minutes); the record: README "Beyond one host"
def test_sigkill_of_pytest_leaves_no_namespace_link_or_process(tmp_path):
    """pytest on the two-hosts topology, SIGKILLed once its cluster serves (its self-test ran): the
    reaper removes the engines, the namespaces and the links."""
    before = set(netns.leftovers())
    pt = subprocess.Popen([sys.executable, "-m", "pytest", "suites/test_smoke.py", "-k", "token_identical",
                           "--kvchaos-topology", "two-hosts", "--kvchaos-layouts", "mha-p1-fp32", "-p", "no:cacheprovider",
                           "--kvchaos-reports", str(tmp_path / "reports"), "-q"],
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, mine = time.monotonic() + 300, []
        while time.monotonic() < deadline and pt.poll() is None:
            mine = sorted(set(netns.leftovers()) - before)
            # the cluster serves: its planted-leak self-test (right after the start) has written its log
            if mine and list((tmp_path / "reports").glob("*/selftest.events.jsonl")):
                break
            time.sleep(1)
        assert pt.poll() is None and mine, f"the run ended (rc {pt.poll()}) or made no namespace: {mine}"
        pids = _ns_pids(mine)
        os.killpg(pt.pid, signal.SIGKILL)  # pytest and anything in its session; the reaper has its own
        pt.wait(10)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            left_ns = sorted(set(netns.leftovers()) & set(mine))
            left_pids = [p for p in pids if Path(f"/proc/{p}").exists()]
            if not left_ns and not left_pids:
                break
            time.sleep(1)
        assert (left_ns, left_pids) == ([], []), (left_ns, left_pids)
    finally:
        if pt.poll() is None:
            os.killpg(pt.pid, signal.SIGKILL)


def _ns_pids(found: list[str]) -> list[int]:
    out = []
    for x in found:
        kind, name = x.split()
        if kind == "netns":
            r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            out += [int(p) for p in r.stdout.split()]
    return out
