"""kvchaos.audit's checks on /server_info answers captured from the real 0.5.23 CPU cluster
(tests/data/server_info-0.5.23-*.json), varied one field at a time: each check must FAIL on the unsafe
value, PASS on the safe one and say UNKNOWN when it cannot know. Live: tests/test_audit_live.py."""

import copy
import json
from pathlib import Path

import pytest

from kvchaos import audit as A

DATA = Path(__file__).parent / "data"


@pytest.fixture
def infos():
    return {r: json.loads((DATA / f"server_info-0.5.23-{r}.json").read_text()) for r in ("prefill", "decode")}


def with_fields(info, **kw):
    """A copy with fields replaced wherever /server_info carries them (top level and internal_states)."""
    d = copy.deepcopy(info)
    for part in [d] + list(d.get("internal_states") or []):
        for k, v in kw.items():
            if k in part or part is d:
                part[k] = v
    return d


def test_captured_cluster_is_the_incident_configuration(infos):
    p, d = A.check_pool("prefill", infos["prefill"]), A.check_pool("decode", infos["decode"])
    assert (p.status, p.numbers["pool_tokens"], p.numbers["context_length"]) == (A.FAIL, 2048, 4096)
    assert (d.status, d.numbers["usable_for_prompt"], d.numbers["num_reserved_decode_tokens"]) == (A.FAIL, 1536, 512)
    assert "reject path" in p.detail and "<= 1536" in d.detail


def test_pool_at_or_above_context_passes(infos):
    assert A.check_pool("prefill", with_fields(infos["prefill"], context_length=2048)).status == A.PASS
    assert A.check_pool("decode", with_fields(infos["decode"], context_length=1537)).status == A.FAIL   # 1536 usable
    assert A.check_pool("decode", with_fields(infos["decode"], context_length=1536)).status == A.PASS
    assert A.check_pool("decode", {"version": "0.5.23"}).status == A.UNKNOWN


def measured(**verdicts):
    """A release table as kvchaos bisect writes it: 3 trials per release, leaking or clean."""
    from kvchaos import releases as R

    trials = [{"release": r.replace("_", "."), "trial": i, "leaked": v == "leaks", "hung": False, "rejected_4xx": False,
               "answered_200": 0, "experiment": "x", "first_witness": {"victim_rid": "g53-000081-t015", "owner_tenant": "t004",
                                                                       "matched": "KQ2ZVOPR7A"} if v == "leaks" else None}
              for r, v in verdicts.items() for i in (1, 2, 3)]
    return R.aggregate(trials)


TABLE = dict(_0_5_19="leaks", _0_5_20="leaks", _0_5_21="clean", _0_5_22="clean", _0_5_23="clean")


@pytest.mark.parametrize("versions,status,said", [
    (("0.5.23", "0.5.23"), A.PASS, ["measured clean", "#38704"]),   # still open upstream: said, not hidden
    (("0.5.19", "0.5.19"), A.FAIL, ["measured to leak: 3/3", "t004", "#36988", "#38935", "from 0.5.21"]),
    (("0.5.20", "0.5.23"), A.FAIL, ["prefill: sglang 0.5.20 was measured to leak"]),
    (("0.5.21", "0.5.21"), A.PASS, ["measured clean"]),
    (("0.5.18", "0.5.23"), A.FAIL, ["older than 0.5.19"]),            # older than the oldest, which leaks
    (("0.5.24", "0.5.24"), A.UNKNOWN, ["not measured", "kvchaos bisect --releases 0.5.24"]),
    (("main", "0.5.23"), A.UNKNOWN, ["no release version reported"]),
])
def test_version_judged_by_the_measured_table(infos, versions, status, said):
    t = measured(**{k[1:]: v for k, v in TABLE.items()})
    c = A.check_versions({"prefill": with_fields(infos["prefill"], version=versions[0]),
                          "decode": with_fields(infos["decode"], version=versions[1])}, t)
    assert c.status == status, c
    for x in said:
        assert x in c.detail, (x, c.detail)
    assert c.numbers["table"]["leaking"] == ["0.5.19", "0.5.20"] and c.numbers["table"]["first_clean"] == "0.5.21"


def test_version_without_a_table_is_unknown_not_pass(infos):
    c = A.check_versions(infos, None)
    assert c.status == A.UNKNOWN and "no release table" in c.detail


def test_the_committed_table_and_the_audit_agree(infos):
    """Each release of the committed table (kvchaos bisect --out reports/releases) audits as measured."""
    from kvchaos import releases as R

    t = R.load_table()
    if t is None:
        pytest.skip("no committed release table")
    want = {R.LEAKS: A.FAIL, R.CLEAN: A.PASS, R.UNMEASURED: A.UNKNOWN}
    for rel, row in t["releases"].items():
        c = A.check_versions({r: with_fields(i, version=rel) for r, i in infos.items()}, t)
        assert c.status == want[row["verdict"]], (rel, row["verdict"], c.detail)


def test_a_bad_release_table_is_bad_input(tmp_path):
    with pytest.raises(A.AuditError, match="no such file"):
        A.release_evidence(tmp_path / "nope.json")
    (tmp_path / "t.json").write_text('{"releases": {"0.5.19": {"verdict": "maybe"}}}')
    with pytest.raises(A.AuditError, match="verdict 'maybe'"):
        A.release_evidence(tmp_path / "t.json")


def test_deferred_release_from_environment_then_release_default(infos):
    pf = infos["prefill"]
    var = A.ENV_DEFERRED
    assert A.check_deferred("prefill", pf, {var: "0"}).status == A.FAIL
    assert A.check_deferred("prefill", pf, {var: "1"}).status == A.PASS
    on = A.check_deferred("prefill", pf, {})                        # unset: 0.5.23's default is on
    assert on.status == A.PASS and "default of sglang 0.5.23" in on.numbers["source"]
    off = A.check_deferred("decode", with_fields(infos["decode"], version="0.5.19"), None)
    assert off.status == A.FAIL and "not readable" in off.numbers["source"]
    assert A.check_deferred("decode", with_fields(infos["decode"], version="0.5.20"), None).status == A.FAIL
    assert A.check_deferred("decode", with_fields(infos["decode"], version="0.5.21"), None).status == A.PASS
    assert A.check_deferred("decode", with_fields(infos["decode"], version="0.6.0"), None).status == A.UNKNOWN


def test_mooncake_batch_bound(infos):
    pf, var = infos["prefill"], A.ENV_BATCH
    assert A.check_batch_bound("prefill", pf, {}).status == A.FAIL             # 0 = unbounded by default
    assert A.check_batch_bound("prefill", pf, {var: "1024"}).status == A.PASS
    assert A.check_batch_bound("prefill", pf, {var: "lots"}).status == A.FAIL
    assert A.check_batch_bound("prefill", with_fields(pf, version="0.5.19"), {var: "64"}).status == A.FAIL
    nixl = A.check_batch_bound("prefill", with_fields(pf, disaggregation_transfer_backend="nixl"), {})
    assert nixl.status == A.UNKNOWN and "not applicable" in nixl.detail
    assert A.check_batch_bound("prefill", with_fields(pf, version="0.6.0"), None).status == A.UNKNOWN


def test_kv_integrity(infos):
    off = A.check_integrity(infos)
    assert off.status == A.FAIL and "CUDA-only" in off.detail                  # the CPU cluster cannot enable it
    on = {r: with_fields(i, disaggregation_enable_kv_checksum=True) for r, i in infos.items()}
    assert A.check_integrity(on).status == A.PASS
    half = {"prefill": on["prefill"], "decode": infos["decode"]}
    assert A.check_integrity(half).status == A.FAIL
    canary = {r: with_fields(i, kv_canary="log") for r, i in infos.items()}
    assert A.check_integrity(canary).status == A.PASS
    assert A.check_integrity({"prefill": {"version": "0.5.19"}, "decode": {"version": "0.5.19"}}).status == A.UNKNOWN


def test_router_workers():
    ws = [{"url": "http://127.0.0.1:1000", "worker_type": "prefill", "is_healthy": True},
          {"url": "http://127.0.0.1:2000", "worker_type": "decode", "is_healthy": True}]
    assert A.check_router(ws, "http://127.0.0.1:1000", "http://localhost:2000").status == A.PASS  # same host
    assert A.check_router(ws, "http://127.0.0.1:1000", "http://127.0.0.1:2000").status == A.PASS
    sick = [dict(ws[0]), dict(ws[1], is_healthy=False)]
    assert A.check_router(sick, "http://127.0.0.1:1000", "http://127.0.0.1:2000").status == A.FAIL
    proxied = A.check_router(ws, "http://127.0.0.1:1000", "http://127.0.0.1:3000")
    assert proxied.status == A.UNKNOWN and "not one of the router's workers" in proxied.detail
    assert A.check_router(None, "a", "b", "HTTP 404").status == A.UNKNOWN


def test_exit_code():
    assert A.exit_code({"counts": {"pass": 3, "fail": 0, "unknown": 1}}) == 0
    assert A.exit_code({"counts": {"pass": 3, "fail": 0, "unknown": 1}}, strict=True) == 1
    assert A.exit_code({"counts": {"pass": 3, "fail": 1, "unknown": 0}}) == 1


def test_bad_targets_name_the_problem():
    with pytest.raises(A.AuditError, match="expected an http"):
        A.audit("localhost:3000", "http://127.0.0.1:1")
    with pytest.raises(A.AuditError, match="127.0.0.1:9: not reachable"):
        A.audit("http://127.0.0.1:9", "http://127.0.0.1:9", timeout=2)


def probe(mode="stream", aborts=None, token=False, why=None):
    return {"rid": f"kvchaos-audit-lb-{mode}-1", "mode": mode, "disconnect_ms": 50, "bytes_before_close": 0,
            "token_before_close": token, "aborts": aborts, **({"why": why} if why else {})}


def test_lb_first_token_fails_on_an_abort_before_the_first_token():
    c = A.check_lb_first_token([probe("stream", {"prefill": 1, "decode": 1}), probe("nonstream", {"prefill": 0, "decode": 0})])
    assert c.status == A.FAIL and "prefill +1, decode +1" in c.detail and "kvchaos-audit-lb-stream-1" in c.detail
    c = A.check_lb_first_token([probe("nonstream", {"prefill": 0, "decode": 1})])
    assert c.status == A.FAIL and "decode +1" in c.detail and "prefill +" not in c.detail


def test_lb_first_token_passes_only_with_conclusive_probes():
    assert A.check_lb_first_token([probe("nonstream", {"prefill": 0, "decode": 0})]).status == A.PASS
    # a token before the disconnect, or no metrics: not evidence either way
    c = A.check_lb_first_token([probe("nonstream", {"prefill": 0, "decode": 0}), probe("stream", {"prefill": 0, "decode": 0}, token=True)])
    assert c.status == A.UNKNOWN and "token arrived before" in c.detail
    c = A.check_lb_first_token([probe("stream", None, why="decode /metrics unreadable")])
    assert c.status == A.UNKNOWN and "unreadable" in c.detail
    assert A.check_lb_first_token([]).status == A.UNKNOWN


def test_lb_probe_bad_mode_is_bad_input():
    with pytest.raises(A.AuditError, match="lb trial mode 'sse'"):
        A.lb_trial("http://127.0.0.1:9", "http://127.0.0.1:9", "http://127.0.0.1:9", "sse")
    r = A.lb_trial("http://127.0.0.1:9", "http://127.0.0.1:9", "http://127.0.0.1:9", "stream", timeout=2)
    assert r["aborts"] is None and "/metrics unreadable" in r["why"]


def test_a_labelled_counter_is_declared_only_once_incremented():
    """SGLang's multiprocess /metrics shows a labelled counter only after its first increment: the
    probe then needs the collector's sibling (num_requests) to tell 'no abort' from 'no metric'."""
    from kvchaos.cluster.metrics import Metrics

    fresh = Metrics.parse("# HELP sglang:num_requests_total n\n# TYPE sglang:num_requests_total counter\n"
                          'sglang:num_requests_total{model_name="m"} 3.0\n')
    assert fresh.declares(A.REQUESTS) and not fresh.declares(A.ABORTS) and fresh.value(A.ABORTS) == 0.0
    assert Metrics.parse('sglang:num_aborted_requests_total{model_name="m"} 1.0\n').declares(A.ABORTS)


def test_auto_truncating_servers_are_judged_by_that_deployments_table(infos):
    assert A.deployment_of(infos) == "incident"  # the captured 0.5.23 servers: allow_auto_truncate false
    on = {"prefill": with_fields(infos["prefill"], allow_auto_truncate=True), "decode": infos["decode"]}
    assert A.deployment_of(on) == "auto-truncate"
