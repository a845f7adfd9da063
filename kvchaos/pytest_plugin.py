"""pytest plugin (entry point ``kvchaos``): a session-scoped real cluster for chaos suites.

Options
  --kvchaos-profile NAME|PATH   cluster profile (default: cpu)
  --kvchaos-attach  router=URL,prefill=URL,decode=URL   use running servers instead of launching
  --kvchaos-reference URL       reference single server for differential checks in attach mode
  --kvchaos-model   tiny:SEED|DIR   override the profile's model
  --kvchaos-reports DIR         where run directories go (default: ./reports)

Fixtures
  kvchaos_spec      the ClusterSpec in force
  cluster           session-scoped launched (or attached) prefill/decode/router cluster
  reference_server  session-scoped single (non-disaggregated) server of the same model
  kvchaos_run_dir   reports/<run-id>/ for this session
  faults            per-test FaultKit (agent / net / proc injectors) writing
                    reports/<run-id>/events/<test>.jsonl; healed after the test even on failure,
                    and the test errors if anything is still armed afterwards

The cluster fixture runs the planted-leak self-test (kvchaos.selftest) once per session: a
cluster on which a planted leak goes unseen errors every test that uses it.

Markers
  gpu   needs CUDA; skipped with the reason when no CUDA device is visible
  slow  long sweeps; deselected by the default ``make test`` (run with ``-m slow``)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvchaos.cluster import AttachedCluster, Cluster, ClusterSpec, SingleServer
from kvchaos.cluster.launcher import Endpoints
from kvchaos.cluster.reaper import Reaper


def pytest_addoption(parser):
    g = parser.getgroup("kvchaos")
    g.addoption("--kvchaos-profile", default=os.environ.get("KVCHAOS_PROFILE", "cpu"),
                help="cluster profile name (kvchaos/profiles) or TOML path [cpu]")
    g.addoption("--kvchaos-attach", default=os.environ.get("KVCHAOS_ATTACH"),
                help="attach to running servers: router=URL,prefill=URL,decode=URL")
    g.addoption("--kvchaos-reference", default=os.environ.get("KVCHAOS_REFERENCE"),
                help="URL of a single (non-disaggregated) reference server, for attach mode")
    g.addoption("--kvchaos-model", default=os.environ.get("KVCHAOS_MODEL"),
                help="model override: tiny:SEED or a model directory")
    g.addoption("--kvchaos-reports", default=os.environ.get("KVCHAOS_REPORTS", "reports"),
                help="directory for run reports [reports]")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with the reason when none is visible)")
    config.addinivalue_line("markers", "slow: long sweeps, deselected by default (-m slow)")
    config.addinivalue_line("markers", "cluster: uses the real cluster")
    config.addinivalue_line("markers", "disruptive: leaves the engine busy on purpose; run at the end of the session")
    run_id = os.environ.get("KVCHAOS_RUN_ID") or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        run_id += f"-{worker}"
    config._kvchaos_run_id = run_id


def cuda_available() -> tuple[bool, str]:
    if shutil.which("nvidia-smi") is None:
        return False, "no CUDA: nvidia-smi not found on this machine"
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"no CUDA: nvidia-smi failed ({e})"
    if r.returncode != 0 or "GPU" not in r.stdout:
        return False, f"no CUDA: nvidia-smi -L listed no GPU ({r.stdout.strip() or r.stderr.strip()})"
    return True, r.stdout.strip()


def pytest_collection_modifyitems(config, items):
    # tests that leave the engine busy on purpose (hung requests the router keeps retrying) run last,
    # so no other test's exact counters or pool baselines see their stray work
    items.sort(key=lambda it: it.get_closest_marker("disruptive") is not None)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, why = cuda_available()
    if not ok:
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(pytest.mark.skip(reason=why))


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvchaos_run_dir(pytestconfig) -> Path:
    d = Path(pytestconfig.getoption("--kvchaos-reports")) / pytestconfig._kvchaos_run_id
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def kvchaos_spec(pytestconfig) -> ClusterSpec:
    return ClusterSpec.load(pytestconfig.getoption("--kvchaos-profile"),
                            model=pytestconfig.getoption("--kvchaos-model"))


@pytest.fixture(scope="session")
def kvchaos_reaper():
    r = Reaper(f"kvc-session-{os.getpid()}")
    yield r
    r.close()


@pytest.fixture(scope="session")
def cluster(pytestconfig, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    attach = pytestconfig.getoption("--kvchaos-attach")
    if attach:
        c = AttachedCluster.parse(attach, kvchaos_spec).start()
    else:
        c = Cluster(kvchaos_spec, kvchaos_run_dir, reaper=kvchaos_reaper).start()
    (kvchaos_run_dir / "cluster.json").write_text(json.dumps(c.describe(), indent=2, default=str))
    try:
        # every session proves the harness can see a leak on this cluster before trusting a PASS
        from kvchaos.selftest import planted_leak_selftest

        c.selftest = planted_leak_selftest(c, kvchaos_run_dir)
        c.leak_sensitive = c.selftest["status"] == "caught"
        yield c
    finally:
        armed = _still_armed(c)
        left = c.stop()
        if armed:
            raise RuntimeError(f"kvchaos: faults still armed at session end: {armed}")
        if left:
            raise RuntimeError(f"kvchaos: processes left after cluster teardown: {left}")


@pytest.fixture(scope="session")
def reference_server(pytestconfig, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    ref = pytestconfig.getoption("--kvchaos-reference")
    if ref:
        s = AttachedCluster(Endpoints(router=ref, prefill=ref, decode=ref), kvchaos_spec)
        yield s
        return
    if pytestconfig.getoption("--kvchaos-attach"):
        pytest.skip("attach mode without --kvchaos-reference: no reference server to compare against")
    s = SingleServer(kvchaos_spec, kvchaos_run_dir, reaper=kvchaos_reaper).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def _kvchaos_cluster_still_alive(request):
    """After any test that used the cluster: fail loudly if an engine process died under it."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").check_alive()


def _still_armed(c) -> list:
    out = []
    if getattr(c, "agent_dir", None):
        from faults.engine import AgentClient

        try:
            out += AgentClient(c.agent_dir).armed()
        except Exception as e:  # noqa: BLE001
            out.append(f"agent query failed: {e!r}")
    if getattr(c, "proxy", None) is not None:
        out += c.proxy.armed()
    return out


@pytest.fixture
def faults(request, cluster, kvchaos_run_dir):
    from faults import FaultKit
    from kvchaos.workload.events import EventLog

    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in request.node.nodeid)[-150:]
    log = EventLog(kvchaos_run_dir / "events" / f"{name}.jsonl")
    kit = FaultKit(cluster, log)
    try:
        yield kit
    finally:
        problems = kit.heal_all()
        log.close()
        if problems:
            raise RuntimeError("kvchaos: fault heal check failed: " + "; ".join(problems))
