"""``kvchaos audit`` against real SGLang clusters: the session's CPU cluster (deployed unsafely on
purpose: pool below the context, unbounded Mooncake batches) and a second one configured safely
(context within the pool minus decode's reservation, bounded batches, deferred release explicit, no
proxy between router and servers). The pre-fix 0.5.19 cluster is audited in
suites/incidents/test_glm53_kv_leak.py. Run through the CLI, as an operator would."""

import json
import subprocess
import sys

import pytest

from kvchaos.cluster import Cluster, ClusterSpec

pytestmark = pytest.mark.cluster


def run_audit(*args):
    p = subprocess.run([sys.executable, "-m", "kvchaos", "audit", "--json", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    res = json.loads(p.stdout)
    return p.returncode, {(c["id"], c["role"]): c for c in res["checks"]}, res


def test_audit_flags_the_unsafe_cpu_cluster(cluster):
    e = cluster.endpoints
    rc, checks, res = run_audit("--prefill", e.prefill, "--decode", e.decode, "--router", e.router_direct or e.router)
    assert rc == 1
    st = {k: c["status"] for k, c in checks.items()}
    pool_p, pool_d = checks[("pool_vs_context", "prefill")], checks[("pool_vs_context", "decode")]
    assert st[("pool_vs_context", "prefill")] == "fail" and pool_p["numbers"]["pool_tokens"] == cluster.spec.pool_tokens
    assert pool_p["numbers"]["context_length"] == cluster.spec.context_length
    assert st[("pool_vs_context", "decode")] == "fail"
    assert pool_d["numbers"]["usable_for_prompt"] == cluster.spec.pool_tokens - 512
    assert st[("engine_version", "both")] == "pass"
    for role in ("prefill", "decode"):
        # read from the live server process on this host, not guessed
        assert res["environment_source"][role].startswith("pid "), res["environment_source"]
        assert st[("deferred_kv_release", role)] == "pass"
        assert st[("mooncake_batch_bound", role)] == "fail"
    assert st[("kv_integrity", "both")] == "fail"
    if cluster.proxy is not None:  # the router talks to the fault proxies, not to the audited ports
        assert st[("router_workers", "router")] == "unknown"


@pytest.fixture
def safe_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    if kvchaos_spec.device != "cpu":
        pytest.skip("the safe/unsafe pair is sized for the CPU profile")
    ctx = kvchaos_spec.pool_tokens - 512  # what decode can pre-allocate next to its reserved tokens
    d = kvchaos_spec.to_dict()
    spec = ClusterSpec.from_dict({**d, "name": "cpu-audit-safe", "context_length": ctx, "network_proxy": "",
                                  "env": {**d["env"], "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "256",
                                          "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}})
    c = Cluster(spec, kvchaos_run_dir / "audit-safe", reaper=kvchaos_reaper).start()
    try:
        yield c
    finally:
        left = c.stop()
        assert not left, f"processes left after the safe cluster's teardown: {left}"


@pytest.mark.backends("mooncake_tcp")
def test_audit_passes_the_safe_cluster(safe_cluster):
    e = safe_cluster.endpoints
    rc, checks, res = run_audit("--prefill", e.prefill, "--decode", e.decode, "--router", e.router)
    st = {k: c["status"] for k, c in checks.items()}
    want_pass = [("pool_vs_context", "prefill"), ("pool_vs_context", "decode"), ("engine_version", "both"),
                 ("deferred_kv_release", "prefill"), ("deferred_kv_release", "decode"),
                 ("mooncake_batch_bound", "prefill"), ("mooncake_batch_bound", "decode"), ("router_workers", "router")]
    assert {k: st[k] for k in want_pass} == {k: "pass" for k in want_pass}, res
    assert checks[("mooncake_batch_bound", "prefill")]["numbers"]["source"] == "process environment"
    assert checks[("deferred_kv_release", "decode")]["numbers"]["source"] == "process environment"
    # the one check a CPU deployment cannot pass: the KV checksum and --kv-canary are CUDA-only
    assert st[("kv_integrity", "both")] == "fail" and "CUDA-only" in checks[("kv_integrity", "both")]["detail"]
    assert rc == 1
