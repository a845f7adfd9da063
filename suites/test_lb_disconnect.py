"""Load-balancer / client disconnects: before the first token (while the KV is in flight) and
mid-stream (the connection cut by the proxy between client and router). Other tenants must get only
their own data — and the bytes a cut or disconnected client did receive are scanned too — every
request must end, and the KV pools must drain."""

from __future__ import annotations

import pytest

from kvchaos.experiment import PASS
from kvchaos.oracles import Isolation, Liveness
from kvchaos.suite import delay_tenants_of_kind, mix_with
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60


def checks():
    return [Isolation(), Liveness(bound_s=BOUND_S)]


def test_disconnect_before_first_token_while_kv_in_flight(experiment, seeds, faults):
    wl, plans = mix_with(seeds(201), "b", 96, "disconnect_before_first_token")
    with experiment("disconnect_before_first_token", plans, checks(), seed=wl.seed, timeout_s=BOUND_S) as ex:
        # slow the leavers' transfers so the disconnect lands while their KV is still moving
        fs = delay_tenants_of_kind(faults, plans, "disconnect_before_first_token", ms=300)
    assert sum(len(f.fired_events()) for f in fs) >= 1
    outcomes = {e["rid"]: e["outcome"] for e in ex.events if e["ev"] == "end"}
    assert any(outcomes[p.rid] == "disconnected" for p in plans if p.kind == "disconnect_before_first_token")
    ex.require(isolation=PASS, liveness=PASS)


def test_lb_cuts_streams_mid_way(experiment, seeds, faults):
    net = faults.need("net")
    wl = Workload(seeds(202), n_tenants=8, prefix="m")
    plans = wl.mix(120, weights={"stream": 1}, lengths=(150, 500))
    with experiment("lb_cut_mid_stream", plans, checks(), seed=wl.seed, timeout_s=BOUND_S) as ex:
        # the "load balancer" (client-side proxy) closes a third of the connections after 700 bytes
        t = net.toxic("client", "limit_data", stream="downstream", toxicity=0.33, bytes=700)
    healed = [e for e in faults.log.records if e["ev"] == "fault" and e.get("action") == "healed"
              and e.get("fault") == t.name]
    assert healed and healed[0]["evidence"]["fired"]["connections"] >= 1
    outcomes = [e["outcome"] for e in ex.events if e["ev"] == "end"]
    assert any(o != "ok" for o in outcomes), outcomes  # some streams really were cut
    cut = [e for e in ex.events if e["ev"] == "body" and e.get("complete") is False]
    assert cut, "no partial reply was logged: the cut streams' bytes would go unscanned"
    ex.require(isolation=PASS, liveness=PASS)
