"""Reproduce sglang-router-retries-aborted-requests: a request aborted before it started decoding comes
back to the client as a complete HTTP 200 — decode answers the abort with a 500, sglang-router takes it
for a worker failure and sends the whole request again.

    python reports/findings/sglang-router-retries-aborted-requests/provoke.py [--trials 10]
        [--control 3] [--layout LAYOUT] [--out DIR]

Starts its own PD cluster (the CPU profile, with the kvchaos agent), then per trial: 12 requests of 4
tenants; one of them is held at a stage before decoding — in turn after decode's handshake before its
page pre-allocation, in prefill's waiting queue, and with its KV write held in prefill's transfer — by
the in-engine agent (``park`` / ``hold``), aborted with its exact rid on prefill and on decode
(``/abort_request``; sglang-router 0.3.2 has no abort endpoint of its own) while held, and let go.
Armed trials send the traffic through sglang-router; control trials drive prefill and decode directly
(as SGLang's mini load balancer does). Each trial is judged by kvchaos' abort_semantics checker:
reproduced when the client got HTTP 200 finished as a success for the aborted request and prefill saw
it again under a new bootstrap room (a second attempt).

Writes DIR/provoke.json and the cluster's logs under DIR/cluster/; prints a line per trial and
"reproduced K/N".
"""
from __future__ import annotations

from faults.client import AgentClient
from kvchaos.cluster import Cluster
from kvchaos.provoke import Summary, deployment, run_trials, scenario_trial, session
from kvchaos.suite import abort_at_stage_ops
from kvchaos.workload import Workload
from kvchaos.workload.scenario import Scenario, Traffic, plan_dict

STAGES = ("decode_prealloc", "prefill_waiting", "transferring")


def scenario(c: Cluster, i: int, via_router: bool) -> tuple[Scenario, str, str]:
    """Trial ``i`` as data: 12 requests of 4 tenants, the third held at the trial's stage, aborted there
    and let go 0.5 s later (:func:`kvchaos.suite.abort_at_stage_ops`)."""
    stage = STAGES[i % len(STAGES)]
    wl = Workload(3000 + i, n_tenants=4, prefix=f"ab{i:02d}")
    plans = wl.mix(12, lengths=(150, 400), sharing={"none": 1})
    victim = plans[2]
    sc = Scenario(name=f"trial-{i:02d}", seed=wl.seed, deployment=deployment(c),
                  traffic=Traffic([plan_dict(p) for p in plans], concurrency=4, timeout_s=60.0,
                                  via="router" if via_router else "pd"),
                  nemesis=abort_at_stage_ops(stage, victim.rid),
                  checks=[{"name": "abort_semantics"}, {"name": "isolation"}, {"name": "liveness", "bound_s": 65.0}],
                  origin={"by": "provoke sglang-router-retries-aborted-requests", "trial": i})
    return sc.validate(), stage, victim.rid


def trial(c: Cluster, out: str, i: int, via_router: bool) -> dict:
    sc, stage, victim = scenario(c, i, via_router)
    ex = scenario_trial(c, out, sc)
    v = ex.by["abort_semantics"]
    held = [e.get("held") for e in ex.events if e.get("ev") == "fault" and e.get("action") == "abort_request"]
    return {"trial": i, "stage": stage, "via": sc.traffic.via, "victim": victim, "held": held,
            "scenario": str(ex.scenario_path), "abort_semantics": v.status, "summary": v.summary,
            "outcome": v.stats.get("outcomes", {}).get(stage, {}), "witnesses": v.witnesses,
            "reproduced": any(w["rid"] == victim and (w.get("attempts") or 0) >= 2 for w in v.witnesses)}


SUMMARY = Summary(lambda r: r["reproduced"], lambda r: r["abort_semantics"] == "fail", "control_failed",
                  "straight to the engines", "abort_semantics FAIL")


def line(r: dict) -> str:
    o = r["outcome"]
    return (f" via {r['via']:6s} abort at {r['stage']:15s} (held {r['held']}): HTTP {o.get('status')} "
            f"{o.get('finish_reason')!s:6s} attempts {o.get('attempts')}, abort_semantics {r['abort_semantics']}, "
            f"reproduced {r['reproduced']}")


def main():
    with session(__doc__, "/tmp/kvchaos-router-retries-aborted", "trials driven straight to prefill and decode",
                 "provoke sglang-router-retries-aborted-requests", SUMMARY) as (a, c, results):
        AgentClient(c.agent_dir).wait_agents("decode", ("_update_handshake_waiters",), timeout=60)
        run_trials(a, results, lambda i, armed: trial(c, a.out, i, via_router=armed), line)


if __name__ == "__main__":
    main()
