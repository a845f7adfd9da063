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

import os
import threading
import time
import types
from urllib.parse import urlsplit

from faults.client import AgentClient
from kvchaos.cluster import Cluster
from kvchaos.oracles import abort_semantics
from kvchaos.provoke import Summary, run_trials, session
from kvchaos.suite import abort_at_stages
from kvchaos.workload import EventLog, Workload, run_plans

STAGES = ("decode_prealloc", "prefill_waiting", "transferring")


def trial(c: Cluster, ctl: AgentClient, out: str, i: int, via_router: bool) -> dict:
    stage = STAGES[i % len(STAGES)]
    wl = Workload(3000 + i, n_tenants=4, prefix=f"ab{i:02d}")
    plans = wl.mix(12, lengths=(150, 400), sharing={"none": 1})
    victim = plans[2]
    t0 = time.time()
    log = EventLog(os.path.join(out, f"trial-{i:02d}.events.jsonl"))
    flog = EventLog(os.path.join(out, f"trial-{i:02d}.faults.jsonl"))
    kw = {"concurrency": 4, "timeout_s": 60}
    if not via_router:
        ep = c.endpoints
        kw["pd_direct"] = {"prefill": ep.prefill, "decode": ep.decode, "bootstrap_port": ep.bootstrap_port,
                           "bootstrap_host": urlsplit(ep.prefill).hostname}
    chor = abort_at_stages(types.SimpleNamespace(log=log), c, types.SimpleNamespace(agent=ctl, log=flog),
                           {stage: victim})
    driver = threading.Thread(target=run_plans, args=(c.endpoints.router, plans, log), kwargs=kw, daemon=True)
    driver.start()
    rec = {"trial": i, "stage": stage, "via": "router" if via_router else "pd", "victim": victim.rid}
    try:
        rec["choreography"] = chor()
    finally:
        for h in chor.holds.values():
            h.heal()
        driver.join(timeout=180)
        log.close()
        flog.close()
    time.sleep(1)
    evs = log.records + flog.records + [{"ev": "agent", "agent_ev": e["ev"], **{k: v for k, v in e.items() if k != "ev"}}
                                        for e in ctl.events() if e["wall"] >= t0]
    v = abort_semantics(evs)
    o = v.stats["outcomes"].get(stage, {})
    rec.update(abort_semantics=v.status, summary=v.summary, outcome=o, witnesses=v.witnesses,
               reproduced=any(w["rid"] == victim.rid and (w.get("attempts") or 0) >= 2 for w in v.witnesses))
    return rec


SUMMARY = Summary(lambda r: r["reproduced"], lambda r: r["abort_semantics"] == "fail", "control_failed",
                  "straight to the engines", "abort_semantics FAIL")


def line(r: dict) -> str:
    o = r["outcome"]
    return (f" via {r['via']:6s} abort at {r['stage']:15s}: HTTP {o.get('status')} {o.get('finish_reason')!s:6s} "
            f"attempts {o.get('attempts')}, abort_semantics {r['abort_semantics']}, reproduced {r['reproduced']}")


def main():
    with session(__doc__, "/tmp/kvchaos-router-retries-aborted", "trials driven straight to prefill and decode",
                 "provoke sglang-router-retries-aborted-requests", SUMMARY) as (a, c, results):
        ctl = AgentClient(c.agent_dir)
        ctl.wait_agents("decode", ("_update_handshake_waiters",), timeout=60)
        run_trials(a, results, lambda i, armed: trial(c, ctl, a.out, i, via_router=armed), line)


if __name__ == "__main__":
    main()
