"""Planted-leak self-test, run once per suite session right after the cluster is up.

Two requests get another tenant's prompt text planted into theirs (``faults.request.plant_leak``).
The isolation oracle must FAIL with witnesses naming exactly those victims and donors. If the
served model cannot echo canaries at all, the result is ``unknown`` and every isolation verdict
of the session is ``unknown`` too; if the model echoes but the leak is not caught, the harness is
blind and the session errors out.
"""

from __future__ import annotations

import json

from faults.request import expect_caught, plant_leak
from kvchaos import oracles
from kvchaos.workload import EventLog, Workload, run_plans


class SelfTestFailed(RuntimeError):
    pass


def planted_leak_selftest(cluster, run_dir, seed: int = 4242) -> dict:
    wl = Workload(seed, n_tenants=4, prefix="selftest-")
    plans = [wl.request(wl.tenants[i % 4], n_tokens=160 + 40 * i) for i in range(8)]
    path = run_dir / "selftest.events.jsonl"
    with EventLog(path) as log:
        log.emit("run", name="planted-leak self-test", seed=seed)
        faults = [plant_leak(plans[1], plans[0], log), plant_leak(plans[6], plans[3], log)]
        run_plans(cluster.endpoints.router, plans, log, concurrency=8, timeout_s=cluster.spec.request_timeout_s)
    v = oracles.isolation(log.records)
    sens = oracles.sensitivity(log.records)
    results = [expect_caught(v, f) for f in faults]
    out = {"isolation": v.to_dict(), "sensitivity": sens.to_dict(), "faults": faults,
           "caught": [r[0] for r in results], "why": [r[1] for r in results]}
    if sens.status != oracles.PASS and v.status != oracles.FAIL:
        out["status"] = oracles.UNKNOWN
    elif all(r[0] for r in results):
        out["status"] = "caught"
    else:
        out["status"] = "missed"
    (run_dir / "selftest.json").write_text(json.dumps(out, indent=2, default=str))
    if out["status"] == "missed":
        raise SelfTestFailed("planted-leak self-test: the harness did not catch a leak it planted: "
                             + "; ".join(out["why"]) + f" (events: {path})")
    return out
