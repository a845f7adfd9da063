"""False-positive control: >= 1,000 clean requests across >= 32 tenants at high concurrency, over
/generate, /v1/completions and /v1/chat/completions, plain and streaming: zero foreign canaries,
and the model demonstrably echoes (so the zero means something)."""

import json

import pytest

from kvchaos import oracles
from kvchaos.suite import engine_failures, xfail_on_known_engine_failure
from kvchaos.workload import EventLog, Workload, run_plans
from kvchaos.workload.probes import snapshot

pytestmark = pytest.mark.cluster
SEED = 20261130
N_REQUESTS, N_TENANTS, CONCURRENCY = 1000, 32, 64


def test_clean_control_has_no_foreign_canary(cluster, kvchaos_run_dir):
    wl = Workload(SEED, n_tenants=N_TENANTS)
    plans = wl.mix(N_REQUESTS, weights={"plain": 3, "stream": 1}, lengths=(64, 500),
                   endpoints=("generate", "generate", "completions", "chat"))
    path = kvchaos_run_dir / "clean_control.events.jsonl"
    print(f"clean control: seed {SEED}, {N_REQUESTS} requests, {N_TENANTS} tenants, events in {path}")
    engine_failures(cluster)  # earlier tests' are not this run's
    with EventLog(path) as log:
        log.emit("run", name="clean_control", seed=SEED, n=N_REQUESTS, tenants=N_TENANTS, concurrency=CONCURRENCY)
        snapshot(cluster, log, "before", answer=False)
        run_plans(cluster.endpoints.router, plans, log, concurrency=CONCURRENCY,
                  timeout_s=cluster.spec.request_timeout_s, model_name=cluster.server_info("decode")["served_model_name"])
        snapshot(cluster, log, "after")
    ev = log.records
    verdicts = [oracles.isolation(ev), oracles.sensitivity(ev),
                oracles.liveness(ev, bound_s=cluster.spec.request_timeout_s)]
    (kvchaos_run_dir / "clean_control.verdicts.json").write_text(json.dumps([v.to_dict() for v in verdicts], indent=2))
    for v in verdicts:
        print(v)
    iso, sens, live = verdicts
    assert len({p.tenant for p in plans}) >= 32 and len(plans) >= 1000
    assert iso.status == oracles.PASS, iso
    xfail_on_known_engine_failure(engine_failures(cluster), verdicts)
    assert sens.stats["eligible"] >= 0.95 * N_REQUESTS
    assert live.status == oracles.PASS, live.witnesses[:3]
