"""False-positive control: >= 1,000 clean requests across >= 32 tenants at high concurrency, over
/generate, /v1/completions and /v1/chat/completions, plain and streaming: zero foreign canaries,
the model demonstrably echoes (so the zero means something), and every reply is exactly what its prompt
must give (integrity: the probe's contract, measured per layout by ``bench/integrity_contract.py``, which
runs this test with ``KVCHAOS_CLEAN_REQUESTS=2000``)."""

import os

import pytest

from kvchaos.experiment import PASS
from kvchaos.oracles import Integrity, Isolation, Liveness, Sensitivity
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
SEED = 20261130
N_REQUESTS, N_TENANTS, CONCURRENCY = int(os.environ.get("KVCHAOS_CLEAN_REQUESTS", "1000")), 32, 64


def test_clean_control_has_no_foreign_canary(experiment, seeds, cluster):
    wl = Workload(seeds(SEED), n_tenants=N_TENANTS)
    plans = wl.mix(N_REQUESTS, weights={"plain": 3, "stream": 1}, lengths=(64, 500),
                   endpoints=("generate", "generate", "completions", "chat"))
    assert len({p.tenant for p in plans}) >= 32 and len(plans) >= 1000
    checks = [Isolation(), Integrity(), Sensitivity(), Liveness(bound_s=cluster.spec.request_timeout_s)]
    with experiment("clean_control", plans, checks, seed=wl.seed, concurrency=CONCURRENCY,
                    timeout_s=cluster.spec.request_timeout_s, settle_s=0) as ex:
        pass
    ex.require(isolation=PASS, integrity=PASS, sensitivity=PASS, liveness=PASS)
