"""Aborts at every stage of a PD request, among other tenants' traffic: what comes back.

An abort (``/abort_request``, a client or load balancer gone) can reach a PD request anywhere: after
decode's handshake but before it pre-allocated the request's pages (prefill waits in its bootstrap
queue), in prefill's waiting queue, while its KV is being written into decode's pages, with its KV
received but not yet decoding, or mid-generation. SGLang reports (#33507/#33508: an abort answered
HTTP 200 with ``finish_reason`` ``length``; #24527, #27372) show aborts coming back as successes. A
client must never get a 200 that passes for a complete answer to a request that was aborted in time,
nor one whose content is not its own.

One victim per stage, held there by the in-engine agent (``park`` at a queue stage, ``hold`` on the
KV write; the decoding one is a long streamed reply aborted at its first byte), each aborted with its
exact rid on prefill and on decode while held (``kvchaos.suite.abort_at_stages``), then let go.
Judged by ``abort_semantics`` (every aborted request answered as aborted: an error with a message,
or 200 with finish reason ``abort``), isolation and liveness; what each stage returned is recorded.

Measured on SGLang 0.5.23 (CPU profile, through sglang-router 0.3.2): see the table in the test's
``observed`` record and README "Hunting engine bugs".
"""

from __future__ import annotations

import pytest

from kvchaos.experiment import PASS
from kvchaos.oracles import AbortSemantics, Isolation, Liveness
from kvchaos.suite import ABORT_STAGES, abort_at_stages
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60


@pytest.mark.parametrize("via", ["pd", "router"])
def test_abort_at_every_stage_comes_back_as_an_abort(experiment, seeds, faults, cluster, via):
    """``pd``: prefill and decode driven directly (the engines' own semantics); ``router``: through
    sglang-router, what a client of the deployment gets."""
    wl = Workload(seeds(901 if via == "pd" else 902), n_tenants=8, prefix=f"a{via[0]}")
    plans = wl.mix(40, lengths=(150, 500))
    victims = {st: wl.request(wl.tenants[i], "stream" if st == "decoding" else "plain", n_tokens=300,
                              n_canaries=16 if st == "decoding" else 3) for i, st in enumerate(ABORT_STAGES)}
    plans = plans[:4] + list(victims.values()) + plans[4:]
    checks = [AbortSemantics(), Isolation(), Liveness(bound_s=BOUND_S)]
    with experiment(f"abort_stages_{via}", plans, checks, seed=wl.seed, concurrency=6, timeout_s=BOUND_S,
                    via=via) as ex:
        chor = ex.during(abort_at_stages(ex, cluster, faults, victims))
    faults.log.emit("observed", choreography=chor.result, outcomes=ex.by["abort_semantics"].stats["outcomes"])
    print(ex.by["abort_semantics"].summary)
    assert [r.get("error") for r in chor.result] == [None] * len(victims), chor.result
    assert all(r["held"] for r in chor.result if r["stage"] != "decoding"), chor.result
    ex.require(abort_semantics=PASS, isolation=PASS, liveness=PASS)
