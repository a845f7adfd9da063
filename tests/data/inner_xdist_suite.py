"""Run by tests/test_teardown_real.py under ``pytest -n 2 --dist each``: every xdist worker starts its
own cluster, says so, and holds it until the controller is killed."""

import json
import os
import time


def test_hold_a_cluster_per_worker_then_get_killed(cluster):
    out = f"{os.environ['KVCHAOS_INNER_OUT']}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    info = {"token": cluster.token, "pids": cluster.all_pids(), "pgids": [p.pgid for p in cluster.procs.values()],
            "pytest_pid": os.getpid(), "ports": cluster.ports, "router": cluster.endpoints.router}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(out + ".tmp", out)
    time.sleep(600)  # killed long before this
