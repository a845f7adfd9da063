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
trial: within the timeout, so prefill's drain ack arrives first), and lands. Each trial is a scenario
(``DIR/trial-NN.scenario.json``: the live timeout, the traffic, the hold, the abort and the release's delay
as data; it replays with ``kvchaos fuzz --replay``), run by kvchaos' experiment runner and judged by its
kv_lifecycle checker over the engines' own events: reproduced when a write ended in pages
decode had released, in a room SGLang's own outcome says it released on timeout.

Writes DIR/provoke.json and the cluster's logs under DIR/cluster/; prints a line per trial and
"reproduced K/N".
"""
from __future__ import annotations

from faults.client import AgentClient
from kvchaos.cluster import Cluster
from kvchaos.provoke import Summary, deployment, run_trials, scenario_trial, session
from kvchaos.workload import Workload
from kvchaos.workload.scenario import Op, Scenario, Traffic, plan_dict


def scenario(c: Cluster, i: int, timeout_s: float, release_after_s: float) -> tuple[Scenario, str]:
    """Trial ``i`` as data: decode's deferred-release timeout at ``timeout_s`` (a live knob), 12 requests
    of 4 tenants, the KV write of an early long one held in prefill's transfer worker, the request
    aborted on both roles once held, the write let go ``release_after_s`` after that."""
    wl = Workload(2000 + i, n_tenants=4, prefix=f"y{i:02d}")
    plans = wl.mix(12, lengths=(200, 500), sharing={"none": 1})
    victim = max(plans[:4], key=lambda p: p.n_tokens)  # early and long: many pages to hand on
    ops = [Op(at_s=0.0, injector="agent", role="prefill", kind="hold", target={"rid": victim.rid},
              params={"max_hold_s": 60}),
           Op(at_s=0.0, injector="action", kind="abort", rids=[victim.rid], after=0),
           Op(at_s=0.0, injector="action", kind="release", after=0, delay_s=release_after_s)]
    sc = Scenario(name=f"trial-{i:02d}", seed=wl.seed, deployment=deployment(c, deferred_release_timeout_s=timeout_s),
                  traffic=Traffic([plan_dict(p) for p in plans], concurrency=4, timeout_s=60.0), nemesis=ops,
                  checks=[{"name": "kv_lifecycle"}, {"name": "isolation"}, {"name": "liveness", "bound_s": 65.0}],
                  origin={"by": "provoke sglang-deferred-release-timeout-late-write", "trial": i})
    return sc.validate(), victim.rid


def trial(c: Cluster, out: str, i: int, timeout_s: float, release_after_s: float) -> dict:
    sc, victim = scenario(c, i, timeout_s, release_after_s)
    ex = scenario_trial(c, out, sc)
    agent = [e for e in ex.events if e.get("ev") == "agent"]
    held = next((e for e in agent if e.get("agent_ev") == "fault_fired" and e.get("kind") == "hold"
                 and e.get("phase") == "held" and e.get("rid") == victim), {})
    late = next((e for e in agent if e.get("agent_ev") == "fault_fired" and e.get("kind") == "hold"
                 and e.get("phase") == "late_write" and e.get("rid") == victim), {})
    room = held.get("room")
    v = ex.by["kv_lifecycle"]
    mine = [w for w in v.witnesses if w.get("room") == room]
    return {"trial": i, "hold_s": release_after_s, "victim": victim, "room": room,
            "room_status_at_write": late.get("room_status_at_write"), "scenario": str(ex.scenario_path),
            "kv_lifecycle": v.status, "summary": v.summary, "witnesses": v.witnesses,
            "release_outcomes": [e.get("outcome") for e in agent if e.get("agent_ev") == "deferred_release"
                                 and e.get("room") == room],
            "reproduced": room is not None and bool(mine) and all(w.get("release_outcome") == "timeout" for w in mine),
            **({} if held else {"error": f"the hold never parked {victim}'s write"})}


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
        AgentClient(c.agent_dir).wait_agents("decode", ("_defer_release",), timeout=60)
        run_trials(a, results, lambda i, armed: trial(c, a.out, i, a.timeout_s, a.timeout_s + 2 if armed else 0.3), line)


if __name__ == "__main__":
    main()
