"""Decode retraction: requests taken off decode mid-generation and resumed, among other tenants' traffic.

The class (SGLang #39645: a retracted request resumed spliced with another generation and finished
as a success; #33385): when decode's KV pool cannot grow every running request, decode retracts one
— with ``--disaggregation-decode-retraction-backup cpu_tensor`` (the CPU profile's decode flag) its KV
(prompt + output − 1 tokens) is copied to host memory and its slots go back to the pool, where other
requests' KV is written — and later resumes it into *new* slots from that copy, without a re-prefill.
A resumed request that reads a stale slot, another request's row, or a copy taken from the wrong
slots answers fluently with another generation's context.

The nemesis is the in-engine agent's ``retract`` setting on the live decode process
(``faults/agent/retraction.py``): SGLang's own test trigger (``SGLANG_TEST_RETRACT``: one request
retracted every ``interval`` forward steps), or decode's per-request reservation
(``--num-reserved-decode-tokens``; the CPU profile sets 128) lowered so the pool itself runs out and the memory-pressure
path retracts. Judged by:

- ``retraction`` — decode's own evidence: every retracted request got its KV back bit-exact (the pool
  read back at the new slots equals the host copy), none was answered without being resumed; UNKNOWN
  when nothing was retracted;
- ``differential`` — every reply token-identical to the same prompt served by a clean single server,
  three at a time and none of them retracted there (a splice changes tokens even when no foreign canary
  is recited);
- ``isolation`` (no foreign canary in any reply) and ``liveness``.

Each test also checks that the path was exercised as often as the engine says: the agent's
retractions, decode's ``sglang:num_retracted_requests_total`` and the replies' ``num_retractions``
agree.
"""

from __future__ import annotations

import pytest

from kvchaos.cluster.metrics import Metrics
from kvchaos.experiment import PASS
from kvchaos.oracles import Differential, Isolation, Liveness, Retraction
from kvchaos.suite import single_server_reference
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60
RETRACTED = "sglang:num_retracted_requests_total"
# the reference serves 3 prompts at a time: 3 x (<= 450 prompt + <= 218 reply tokens) fits the single server's
# 2048-token pool, so none is retracted there (single_server_reference reads each reply's own count and serves a
# retracted one again, alone); one at a time it was ~5,400 engine steps of the suite's own time
REF_CONCURRENCY = 3


def _long_replies(seed, prefix, n):
    """``n`` requests of 8 tenants whose replies are long (12-16 canaries: 145-193 tokens), so
    several are decoding at once for many steps."""
    wl = Workload(seed, n_tenants=8, prefix=prefix)
    return wl, [wl.request(wl.tenants[i % 8], "plain", n_tokens=wl.rng.randrange(250, 450),
                           n_canaries=wl.rng.randint(12, 16)) for i in range(n)]


def _retractions_agree(ex, before, cluster):
    """The three counts of one run's retractions: the agent's, decode's counter, the replies'."""
    r = ex.by["retraction"].stats
    counter = Metrics.fetch(cluster.endpoints.decode).delta(before, RETRACTED)
    assert r["retractions"] == counter == r["reply_num_retractions"], (r, counter)
    return r["retractions"]


def test_retracted_requests_resume_with_their_own_tokens(experiment, seeds, faults, cluster, reference_server):
    wl, plans = _long_replies(seeds(801), "rt", 32)
    ref = single_server_reference(reference_server, plans, concurrency=REF_CONCURRENCY)
    checks = [Retraction(min_retractions=10), Differential(ref), Isolation(), Liveness(bound_s=BOUND_S)]
    with experiment("retract_every_3_steps", plans, checks, seed=wl.seed, concurrency=4, timeout_s=BOUND_S) as ex:
        before = Metrics.fetch(cluster.endpoints.decode)
        f = faults.agent.arm("decode", "retract", params={"interval": 3})
    n = _retractions_agree(ex, before, cluster)
    faults.log.emit("observed", retractions=n, stats=ex.by["retraction"].stats, fault=f.id)
    ex.require(retraction=PASS, differential=PASS, isolation=PASS, liveness=PASS)


@pytest.mark.slow
def test_memory_pressure_retraction_keeps_replies_their_own(experiment, seeds, faults, cluster, reference_server):
    """The engine's own trigger: decode reserves 16 tokens per request instead of its 128, admits more than
    its 2048-token pool can grow, and retracts when it runs out."""
    wl, plans = _long_replies(seeds(802), "rp", 32)
    ref = single_server_reference(reference_server, plans, concurrency=REF_CONCURRENCY)
    checks = [Retraction(min_retractions=3), Differential(ref), Isolation(), Liveness(bound_s=BOUND_S)]
    with experiment("retract_under_pressure", plans, checks, seed=wl.seed, concurrency=8, timeout_s=BOUND_S) as ex:
        before = Metrics.fetch(cluster.endpoints.decode)
        f = faults.agent.arm("decode", "retract", params={"interval": 0, "reserve": 16})
    n = _retractions_agree(ex, before, cluster)
    faults.log.emit("observed", retractions=n, stats=ex.by["retraction"].stats, fault=f.id)
    ex.require(retraction=PASS, differential=PASS, isolation=PASS, liveness=PASS)
