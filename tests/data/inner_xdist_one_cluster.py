"""Run by tests/test_teardown_real.py under ``pytest -n 2 --dist each``: worker gw0 starts a cluster,
gw1 only holds the run's machine lock; each says what it holds, then both wait to be killed.

The cluster is launched as the ``cluster`` fixture launches it (the session's reaper, the profile's
spec, the agent and proxy the plugin installed), without the fixture's planted-leak self-test: this
run judges nothing, and the self-test's 80 requests only cost CI time."""

import json
import os
import time

from kvchaos.cluster import Cluster
from kvchaos.plugin.xdist import lock_path


def test_hold_the_machine_then_get_killed(request):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    uid = request.config.workerinput["testrunuid"]
    info = {"pytest_pid": os.getpid(), "lock": str(lock_path(uid))}
    if worker == "gw0":
        c = Cluster(request.getfixturevalue("kvchaos_spec"), request.getfixturevalue("kvchaos_run_dir") / "held",
                    reaper=request.getfixturevalue("kvchaos_reaper")).start()
        info.update(token=c.token, pids=c.all_pids(), pgids=[p.pgid for p in c.procs.values()], ports=c.ports,
                    router=c.endpoints.router, agent_dir=c.agent_dir,
                    spaces=[f"{kind} {name}" for kind, name in (c.hosts.created if c.hosts else [])])
    out = f"{os.environ['KVCHAOS_INNER_OUT']}.{worker}"
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(out + ".tmp", out)
    time.sleep(600)  # killed long before this
