"""Reproduce sglang-deferred-release-timeout-late-write: decode gives an aborted transfer's pages back on
its drain-ack timeout while prefill's KV write into them is still in flight; the write lands late, in
pages decode has since handed to other requests.

    python reports/findings/sglang-deferred-release-timeout-late-write/provoke.py [--trials 10]
        [--control 3] [--timeout-s 3] [--layout LAYOUT] [--out DIR]

Starts its own PD cluster (the CPU profile, with the kvchaos agent), sets decode's deferred-release
timeout (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, 30 s by default) to --timeout-s on
the live queues, then per trial: 12 requests of 4 tenants through the router; the first one's KV write
is held inside prefill's transfer worker (agent ``hold``), the request is aborted on prefill and
decode, the write is released --timeout-s + 2 s later (an armed trial) or 0.3 s later (a control
trial: within the timeout, so prefill's drain ack arrives first), and lands. Each trial is judged by
kvchaos' kv_lifecycle checker over the engines' own events: reproduced when a write ended in pages
decode had released, in a room SGLang's own outcome says it released on timeout.

Writes DIR/provoke.json and the cluster's logs under DIR/cluster/; prints a line per trial and
"reproduced K/N".
"""
from __future__ import annotations

import os
import threading
import time

import httpx

from faults.client import AgentClient
from kvchaos.cluster import Cluster
from kvchaos.oracles import kv_lifecycle
from kvchaos.provoke import Summary, run_trials, session
from kvchaos.workload import EventLog, Workload, run_plans


def trial(c: Cluster, ctl: AgentClient, out: str, i: int, hold_s: float) -> dict:
    plans = Workload(2000 + i, n_tenants=4, prefix=f"y{i:02d}").mix(12, lengths=(200, 500), sharing={"none": 1})
    victim = max(plans[:4], key=lambda p: p.n_tokens)  # early and long: many pages to hand on
    t0 = time.time()
    hold = ctl.arm("prefill", "hold", target={"rid": victim.rid}, params={"max_hold_s": 60})
    log = EventLog(os.path.join(out, f"trial-{i:02d}.events.jsonl"))
    driver = threading.Thread(target=run_plans, args=(c.endpoints.router, plans, log),
                              kwargs={"concurrency": 4, "timeout_s": 60}, daemon=True)
    driver.start()
    rec = {"trial": i, "hold_s": hold_s, "victim": victim.rid}
    try:
        held = ctl.wait_event("prefill", "fault_fired", fault=hold.id, phase="held", timeout=90)
        for url in (c.endpoints.prefill, c.endpoints.decode):
            httpx.post(f"{url}/abort_request", json={"rid": victim.rid}, timeout=10)
        time.sleep(hold_s)
        hold.release()
        late = ctl.wait_event("prefill", "fault_fired", fault=hold.id, phase="late_write", timeout=30)
        rec.update(room=held.get("room"), room_status_at_write=late.get("room_status_at_write"))
    except TimeoutError as e:
        rec["error"] = str(e)
    finally:
        hold.heal()
        driver.join(timeout=180)
        log.close()
    time.sleep(1)
    evs = [{"ev": "agent", "agent_ev": e["ev"], **{k: v for k, v in e.items() if k != "ev"}}
           for e in ctl.events() if e["wall"] >= t0]
    v = kv_lifecycle(evs)
    mine = [w for w in v.witnesses if w["room"] == rec.get("room")]
    rec.update(kv_lifecycle=v.status, summary=v.summary, witnesses=v.witnesses,
               release_outcomes=[e.get("outcome") for e in evs if e.get("agent_ev") == "deferred_release"
                                 and e.get("room") == rec.get("room")],
               reproduced=bool(mine) and all(w.get("release_outcome") == "timeout" for w in mine))
    return rec


SUMMARY = Summary(lambda r: r["reproduced"], lambda r: r["kv_lifecycle"] == "fail", "control_failed",
                  "released within the timeout", "kv_lifecycle FAIL")


def line(r: dict) -> str:
    reuse = [(x["rid"], x["pages"]) for w in r["witnesses"] for x in w.get("reused_by", [])][:3]
    return (f" (write released after {r['hold_s']} s): kv_lifecycle {r['kv_lifecycle']}, release "
            f"{r['release_outcomes']}, reproduced {r['reproduced']}; pages then given to {reuse}"
            + (f" ERROR {r['error']}" if r.get("error") else ""))


def main():
    with session(__doc__, "/tmp/kvchaos-deferred-release-timeout", "trials whose write is released within the timeout",
                 "provoke sglang-deferred-release-timeout-late-write", SUMMARY, knob=("timeout-s", 3.0)) as (a, c, results):
        ctl = AgentClient(c.agent_dir)
        ctl.wait_agents("decode", ("_defer_release",), timeout=60)
        setting = ctl.arm("decode", "deferred_release_timeout", params={"s": a.timeout_s}, hooks=("_defer_release",))
        try:
            run_trials(a, results, lambda i, armed: trial(c, ctl, a.out, i, a.timeout_s + 2 if armed else 0.3), line)
        finally:
            setting.heal()


if __name__ == "__main__":
    main()
