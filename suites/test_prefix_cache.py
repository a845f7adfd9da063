"""Prefix-cache isolation: shared-prefix traffic, ``cache_salt``, and the timing side channel.

Tenants send what a prefix cache is built to reuse — a public system prompt, their own system prompt
(with a canary of theirs), multi-turn conversations that resend their history, pairs that share a
long prefix and part right at a canary (on a KV page boundary and mid-page), identical prompts — each
tenant under its own ``cache_salt``. A correct engine reuses a tenant's own prefixes (the same-salt
control must show hits), never another salt's (``cache_isolation``: every reported cached token
explained by the request's own salt's earlier prefixes), never serves one tenant's canary to another
(``isolation``), and does not answer faster because another salt cached the prefix
(``timing_isolation``: two-sample KS on time to first token, with the same-salt hit-vs-miss control
as its power check).

Decode's own radix cache (``--disaggregation-decode-enable-radix-cache``) is off on the session cluster
and on in ``test_decode_radix_cache_keeps_salts_apart`` (a cluster of its own).

``via="pd"`` drives prefill and decode directly (the body as the client sent it, as SGLang's mini
load balancer does): the engines' behaviour. Through sglang-router 0.3.2 the salt never reaches the
engines (``test_router_keeps_salts_apart``: the registry's ``sglang-router-drops-cache-salt``).
"""

from __future__ import annotations

import os

import pytest

from faults import FaultKit
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.layouts import parse
from kvchaos.cluster.metrics import Metrics
from kvchaos.experiment import PASS
from kvchaos.oracles import CacheIsolation, Isolation, Liveness, Sensitivity, TimingIsolation, agent_kind
from kvchaos.suite import own_cluster
from kvchaos.workload import SHARED_MIX, EventLog, Workload

pytestmark = pytest.mark.cluster
BOUND_S = 60
EVICTIONS = "sglang:eviction_duration_seconds_count"


def checks():
    return [Isolation(), Sensitivity(), CacheIsolation(), Liveness(bound_s=BOUND_S)]


def workload(seed, layout, prefix):
    return Workload(seed, n_tenants=8, prefix=prefix, salts="tenant", page_size=parse(layout).page_size)


def test_salted_tenants_reuse_only_their_own_prefixes(experiment, seeds, kvchaos_layout):
    wl = workload(seeds(201), kvchaos_layout, "pc")
    plans = wl.mix(96, lengths=(200, 600), sharing=SHARED_MIX) + [p for i in range(4) for p in _pair(wl, i)]
    with experiment("prefix_cache", plans, checks(), seed=wl.seed, concurrency=4, timeout_s=BOUND_S, via="pd") as ex:
        pass
    ex.require(isolation=PASS, cache_isolation=PASS, liveness=PASS)


# Alone on the machine under xdist, and 40 samples per arm: at 20 the hit/miss arms' KS test sat on the
# edge of alpha (D=0.60, p=0.0011 > 0.001, both under -n 2 and in a serial fresh-clone run, medians
# 84/119 ms), so the power check made the test UNKNOWN one run in a few: more samples, never a looser alpha.
@pytest.mark.exclusive
def test_timing_does_not_tell_another_salts_prefix(experiment, seeds, kvchaos_layout, faults):
    wl = workload(seeds(202), kvchaos_layout, "pt")
    n = 40
    plans = wl.timing_probe("t000", "t001", n_per_arm=n, prefix=800, suffix=100)
    with experiment("prefix_timing", plans, [TimingIsolation(), Isolation(), CacheIsolation()], seed=wl.seed,
                    timeout_s=BOUND_S, via="pd") as ex:
        pass
    t = ex.by["timing_isolation"]
    faults.log.emit("observed", ks=t.stats)  # the power check and the cross-salt test, on record
    print("timing_isolation:", t.summary)
    ex.require(timing_isolation=PASS, isolation=PASS, cache_isolation=PASS)


def test_router_keeps_salts_apart(experiment, seeds, kvchaos_layout):
    """The same traffic through the router: salts must still separate the tenants' caches. (Its
    timing arm, measured: reports/findings/sglang-router-drops-cache-salt/; KVCHAOS_ROUTER_TIMING=1
    adds it here.)"""
    wl = workload(seeds(203), kvchaos_layout, "pr")
    plans = wl.mix(48, lengths=(200, 600), sharing=SHARED_MIX)
    checks = [Isolation(), CacheIsolation()]
    if os.environ.get("KVCHAOS_ROUTER_TIMING") == "1":
        plans += wl.timing_probe("t000", "t001", n_per_arm=20, prefix=800, suffix=100)
        checks.append(TimingIsolation())
    with experiment("prefix_cache_router", plans, checks, seed=wl.seed, timeout_s=BOUND_S) as ex:
        pass
    ex.require(isolation=PASS, cache_isolation=PASS, **({"timing_isolation": PASS} if len(checks) > 2 else {}))


# the fault families on cache hits and the eviction pressure: behind -m slow for CI's 30 minutes
@pytest.mark.slow
def test_aborts_and_transfer_delays_on_cache_hits(experiment, seeds, kvchaos_layout, faults):
    wl = workload(seeds(204), kvchaos_layout, "pa")
    plans = wl.mix(90, weights={"plain": 3, "abort_after": 1}, lengths=(200, 600), sharing=SHARED_MIX)
    hitters = sorted({p.tenant for p in plans if p.sharing in ("conversation", "tenant") and p.kind == "plain"})[:2]
    with experiment("prefix_cache_faults", plans, checks(), seed=wl.seed, concurrency=4, timeout_s=BOUND_S,
                    via="pd") as ex:
        fs = [faults.agent.arm("prefill", "delay", target={"tenant": t}, params={"ms": 300, "jitter_ms": 200})
              for t in hitters]
    assert all(f.fired_events() for f in fs), "the delays never fired"
    assert sum(p.kind == "abort_after" for p in plans) >= 10
    ex.require(isolation=PASS, cache_isolation=PASS, liveness=PASS)


@pytest.mark.slow
def test_eviction_pressure_keeps_isolation(experiment, seeds, kvchaos_layout, cluster):
    """Prompts of 300-900 tokens, 6 in flight, against a 2048-token prefill pool: cached prefixes are
    evicted and rebuilt while other tenants' requests run (12 in flight queued requests in decode's
    pool past the 60 s bound)."""
    wl = workload(seeds(205), kvchaos_layout, "pe")
    plans = wl.mix(96, lengths=(300, 900), sharing={"tenant": 3, "conversation": 2, "diverge": 1, "identical": 1})
    with experiment("prefix_cache_eviction", plans, checks(), seed=wl.seed, concurrency=6, timeout_s=BOUND_S,
                    via="pd") as ex:
        before = Metrics.fetch(cluster.endpoints.prefill)  # pools settled: the method has not run yet
    evictions = Metrics.fetch(cluster.endpoints.prefill).delta(before, EVICTIONS)
    assert evictions > 0, "no prefix was evicted: the pressure this test exists for did not happen"
    ex.require(isolation=PASS, cache_isolation=PASS, liveness=PASS)


@pytest.fixture(scope="module")  # a cluster of its own: behind -m slow for CI's 30 minutes
def decode_radix_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper, kvchaos_policy):
    """The profile's cluster with decode's own radix cache on (decode matches a prefix itself and
    prefill sends only the rest); its own self-test gates the policy."""
    spec = ClusterSpec.from_dict({**kvchaos_spec.to_dict(), "name": f"{kvchaos_spec.name}-decode-radix",
                                  "decode_args": [*kvchaos_spec.decode_args, "--disaggregation-decode-enable-radix-cache"]})
    with own_cluster(spec, kvchaos_run_dir / spec.name, kvchaos_reaper, kvchaos_policy) as got:
        yield got


@pytest.mark.slow
def test_decode_radix_cache_keeps_salts_apart(experiment, seeds, decode_radix_cluster, kvchaos_layout, kvchaos_run_dir):
    c, policy = decode_radix_cluster
    wl = workload(seeds(206), kvchaos_layout, "pd")
    plans = wl.mix(96, lengths=(200, 600), sharing=SHARED_MIX) + [p for i in range(4) for p in _pair(wl, i)]
    with EventLog(kvchaos_run_dir / c.spec.name / "faults.jsonl") as flog:
        kit = FaultKit(c, flog)  # nothing armed: the agent reports what each side's tree matched
        with experiment("prefix_cache_decode_radix", plans, checks(), cluster=c, faults=kit, policy=policy, seed=wl.seed,
                        concurrency=4, timeout_s=BOUND_S, via="pd") as ex:
            pass
    matched = [e for e in ex.events if agent_kind(e) == "prefix_match" and e.get("where") == "decode_match"
               and (e.get("cached_tokens") or 0) > 0]
    assert matched, "decode's radix cache never matched a prefix: the path this test exists for did not run"
    ex.require(isolation=PASS, cache_isolation=PASS, liveness=PASS)


def _pair(wl, i):
    """Two tenants' prompts parting at a canary (page boundary, then mid-page); the second is sent
    once the first ended (its prefix is cached by then)."""
    a, b = wl.diverging(wl.tenants[i], wl.tenants[i + 4], shared=300, at=("page", "mid")[i % 2])
    b.after = a.rid
    return [a, b]
