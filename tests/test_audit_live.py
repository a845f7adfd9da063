"""``kvchaos audit`` against real SGLang clusters: the session's CPU cluster (deployed unsafely on
purpose: pool below the context, unbounded Mooncake batches) and a second one configured safely
(context within the pool minus decode's reservation, bounded batches, deferred release explicit, no
proxy between router and servers). The pre-fix 0.5.19 cluster is audited in
suites/incidents/test_glm53_kv_leak.py. Run through the CLI, as an operator would."""

import json
import subprocess
import sys

import pytest

from faults import FaultKit
from kvchaos import audit as A
from kvchaos.cluster import ClusterSpec
from kvchaos.suite import own_cluster
from kvchaos.workload import EventLog

pytestmark = pytest.mark.cluster


def run_audit(*args):
    p = subprocess.run([sys.executable, "-m", "kvchaos", "audit", "--json", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    res = json.loads(p.stdout)
    return p.returncode, {(c["id"], c["role"]): c for c in res["checks"]}, res


@pytest.mark.slow  # CI's 30 minutes (a cluster of its own); the audit's checks are unit-tested in test_audit.py
def test_audit_flags_the_unsafe_cpu_cluster(cluster):
    e = cluster.endpoints
    rc, checks, res = run_audit("--prefill", e.prefill, "--decode", e.decode, "--router", e.router_direct or e.router)
    assert rc == 1
    st = {k: c["status"] for k, c in checks.items()}
    pool_p, pool_d = checks[("pool_vs_context", "prefill")], checks[("pool_vs_context", "decode")]
    assert st[("pool_vs_context", "prefill")] == "fail" and pool_p["numbers"]["pool_tokens"] == cluster.spec.pool_tokens
    assert pool_p["numbers"]["context_length"] == cluster.spec.context_length
    assert st[("pool_vs_context", "decode")] == "fail"
    assert pool_d["numbers"]["num_reserved_decode_tokens"] == cluster.spec.decode_reservation
    assert pool_d["numbers"]["usable_for_prompt"] == cluster.spec.pool_tokens - cluster.spec.decode_reservation
    assert st[("engine_version", "both")] == "pass"
    for role in ("prefill", "decode"):
        # read from the live server process on this host, not guessed
        assert res["environment_source"][role].startswith("pid "), res["environment_source"]
        assert st[("deferred_kv_release", role)] == "pass"
        assert st[("mooncake_batch_bound", role)] == "fail"
    assert st[("kv_integrity", "both")] == "fail"
    # checklist item 5: sglang-router 0.3.2 cancels a streaming request upstream when its client leaves
    # before the first token, and both engines count the abort
    lb = checks[("lb_first_token", "router")]
    assert lb["status"] == "fail", lb
    stream = next(p for p in lb["numbers"]["probes"] if p["mode"] == "stream")
    assert not stream["token_before_close"] and stream["aborts"]["decode"] >= 1, stream
    if cluster.proxy is not None:  # the router talks to the fault proxies, not to the audited ports
        assert st[("router_workers", "router")] == "unknown"


@pytest.fixture
def safe_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    if kvchaos_spec.device != "cpu":
        pytest.skip("the safe/unsafe pair is sized for the CPU profile")
    ctx = kvchaos_spec.pool_tokens - kvchaos_spec.decode_reservation  # what decode can pre-allocate next to them
    d = kvchaos_spec.to_dict()
    spec = ClusterSpec.from_dict({**d, "name": "cpu-audit-safe", "context_length": ctx, "network_proxy": "",
                                  "env": {**d["env"], "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "256",
                                          "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}})
    with own_cluster(spec, kvchaos_run_dir / "audit-safe", kvchaos_reaper) as (c, _):
        yield c


@pytest.mark.slow  # CI time (its own cluster); the audit's checks are unit-tested in test_audit.py
@pytest.mark.backends("mooncake_tcp")
def test_audit_passes_the_safe_cluster(safe_cluster):
    e = safe_cluster.endpoints
    # a short non-streaming request runs to completion (SGLang notices a dropped connection only at its
    # 4 s poll): item 5 PASSes for this traffic; the delayed case is test_lb_first_token_*
    rc, checks, res = run_audit("--prefill", e.prefill, "--decode", e.decode, "--router", e.router, "--lb-probe", "nonstream")
    st = {k: c["status"] for k, c in checks.items()}
    want_pass = [("pool_vs_context", "prefill"), ("pool_vs_context", "decode"), ("engine_version", "both"),
                 ("deferred_kv_release", "prefill"), ("deferred_kv_release", "decode"),
                 ("mooncake_batch_bound", "prefill"), ("mooncake_batch_bound", "decode"), ("router_workers", "router"),
                 ("lb_first_token", "router")]
    assert {k: st[k] for k in want_pass} == {k: "pass" for k in want_pass}, res
    assert checks[("mooncake_batch_bound", "prefill")]["numbers"]["source"] == "process environment"
    assert checks[("deferred_kv_release", "decode")]["numbers"]["source"] == "process environment"
    # the one check a CPU deployment cannot pass: the KV checksum and --kv-canary are CUDA-only
    assert st[("kv_integrity", "both")] == "fail" and "CUDA-only" in checks[("kv_integrity", "both")]["detail"]
    assert rc == 1


@pytest.fixture
def minilb_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    if kvchaos_spec.device != "cpu":
        pytest.skip("sized for the CPU profile")
    spec = ClusterSpec.from_dict({**kvchaos_spec.to_dict(), "name": "cpu-mini-lb", "router": "mini-lb",
                                  "router_args": [], "network_proxy": ""})
    with own_cluster(spec, kvchaos_run_dir / "audit-mini-lb", kvchaos_reaper) as (c, _):
        yield c


def delayed_nonstream_probe(c, kit):
    """Item 5's probe, non-streaming, with the probe's KV transfer held 10 s in prefill (the agent's
    delay on its rid) so the client's departure lands mid-transfer, before the first token."""
    armed = []

    def arm(rid):
        armed.append(kit.agent.arm("prefill", "delay", target={"rid": rid}, params={"ms": 10000}, count=1))

    e = c.endpoints
    p = A.lb_trial(e.router_direct or e.router, e.prefill, e.decode, "nonstream", prompt_tokens=800,
                   before_send=arm, settle_s=13)
    assert armed and armed[0].fired_events(), "the delay never fired: the probe was not mid-transfer"
    return p, A.check_lb_first_token([p])


@pytest.mark.slow  # CI time (a mini-lb cluster of its own)
@pytest.mark.backends("mooncake_tcp")
def test_lb_first_token_sglang_router_fails_and_mini_lb_passes(cluster, faults, minilb_cluster, kvchaos_run_dir):
    """The same probe on two load balancers: sglang-router 0.3.2 drops both upstream connections when
    the client leaves, and SGLang aborts the request mid-transfer (FAIL); mini-lb keeps them open until
    the request completes (PASS)."""
    p, rust = delayed_nonstream_probe(cluster, faults)
    assert rust.status == A.FAIL and p["aborts"]["decode"] >= 1, rust
    with EventLog(kvchaos_run_dir / "events" / "audit-mini-lb-faults.jsonl") as log:
        kit = FaultKit(minilb_cluster, log)
        try:
            p2, mini = delayed_nonstream_probe(minilb_cluster, kit)
        finally:
            assert not kit.heal_all()
    assert mini.status == A.PASS and p2["aborts"] == {"prefill": 0, "decode": 0}, mini
    (kvchaos_run_dir / "audit-lb-first-token.json").write_text(json.dumps(
        {"sglang-router": rust.to_dict(), "mini-lb": mini.to_dict()}, indent=2, default=str))
