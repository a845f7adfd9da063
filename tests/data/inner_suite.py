"""Run by tests/test_teardown_real.py in a child pytest that is then killed mid-suite."""

import json
import os
import time


def test_hold_cluster_then_get_killed(cluster):
    out = os.environ["KVCHAOS_INNER_OUT"]
    info = {"token": cluster.token, "pids": cluster.all_pids(),
            "pgids": [p.pgid for p in cluster.procs.values()], "pytest_pid": os.getpid(),
            "router": cluster.endpoints.router}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(out + ".tmp", out)
    time.sleep(600)  # killed long before this
