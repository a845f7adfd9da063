"""Load-balancer / client disconnects: before the first token (while the KV is in flight) and
mid-stream (the connection cut by the proxy between client and router). Other tenants must get only
their own data, every request must end, and the KV pools must drain."""

from __future__ import annotations

import pytest

from kvchaos import oracles
from kvchaos.suite import run_judged
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60


def _run(cluster, faults, kvchaos_run_dir, name, plans):
    return run_judged(cluster, faults, kvchaos_run_dir, name, plans,
                      [oracles.isolation, lambda ev: oracles.liveness(ev, bound_s=BOUND_S)], timeout_s=BOUND_S)


def test_disconnect_before_first_token_while_kv_in_flight(cluster, faults, kvchaos_run_dir):
    wl = Workload(201, n_tenants=8, prefix="b")
    plans = wl.mix(48, weights={"plain": 2, "disconnect_before_first_token": 1}, lengths=(150, 500))
    leavers = sorted({p.tenant for p in plans if p.kind == "disconnect_before_first_token"})
    # slow the leavers' transfers so the disconnect lands while their KV is still moving
    fs = [faults.agent.arm("prefill", "delay", target={"tenant": t}, params={"ms": 300}) for t in leavers]
    ev, (iso, live) = _run(cluster, faults, kvchaos_run_dir, "disconnect_before_first_token", plans)
    assert sum(len(f.fired_events()) for f in fs) >= 1
    outcomes = {e["rid"]: e["outcome"] for e in ev if e["ev"] == "end"}
    assert any(outcomes[p.rid] == "disconnected" for p in plans if p.kind == "disconnect_before_first_token")
    assert iso.status == oracles.PASS, iso
    assert live.status == oracles.PASS, live.witnesses[:3]


def test_lb_cuts_streams_mid_way(cluster, faults, kvchaos_run_dir):
    net = faults.need("net")
    wl = Workload(202, n_tenants=8, prefix="m")
    plans = wl.mix(40, weights={"stream": 1}, lengths=(150, 500))
    # the "load balancer" (client-side proxy) closes about half the connections after 700 bytes
    t = net.toxic("client", "limit_data", stream="downstream", toxicity=0.5, bytes=700)
    ev, (iso, live) = _run(cluster, faults, kvchaos_run_dir, "lb_cut_mid_stream", plans)
    healed = [e for e in faults.log.records if e["ev"] == "fault" and e.get("action") == "healed"
              and e.get("fault") == t.name]
    assert healed and healed[0]["evidence"]["fired"]["connections"] >= 1
    outcomes = [e["outcome"] for e in ev if e["ev"] == "end"]
    assert any(o != "ok" for o in outcomes), outcomes  # some streams really were cut
    assert iso.status == oracles.PASS, iso
    assert live.status == oracles.PASS, live.witnesses[:3]
