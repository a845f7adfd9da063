"""Which releases leak: the GLM-5.3 incident, unmodified, on each SGLang release (``kvchaos bisect``).

One test per (release, trial): the release in its own environment (``scripts/setup-engine.sh``),
deployed in the incident's shape (prefill pool < context), a fresh cluster, its own planted-leak
self-test, then the incident's traffic (``kvchaos.releases.glm53_plans``, seed per trial) with no
mutation and no fault armed. The test passes when the trial *measured* something (a leak, or a clean
run with the power to see one); the experiment's own judgement is recorded unplanted, so a release that
leaks is red in the run's report — the matrix never hides a leak. Each trial appends to
``<run dir>/releases/trials.jsonl``; the table is rebuilt beside it after every trial.

    kvchaos bisect --releases 0.5.19,0.5.23 --trials 3        (or: pytest -m bisect --kvchaos-releases ...)
"""

from __future__ import annotations


import pytest

from faults import FaultKit
from kvchaos import releases
from kvchaos.audit import audit
from kvchaos.cluster import ClusterSpec
from kvchaos.oracles import HttpSemantics, Isolation, Liveness, Sensitivity
from kvchaos.suite import own_cluster, server_field
from kvchaos.workload import EventLog

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.bisect]


def pytest_generate_tests(metafunc):
    if {"release", "trial"} <= set(metafunc.fixturenames):
        cfg = metafunc.config
        try:
            rels = releases.parse_releases(cfg.getoption("--kvchaos-releases"))
        except ValueError as e:
            raise pytest.UsageError(f"--kvchaos-releases: {e}") from None
        n = cfg.getoption("--kvchaos-trials")
        if n < 1:
            raise pytest.UsageError(f"--kvchaos-trials {n}: at least 1")
        cells = [(r, t) for r in rels for t in range(1, n + 1)]
        metafunc.parametrize(("release", "trial"), cells, ids=[f"sglang-{r}-t{t}" for r, t in cells])


@pytest.fixture
def deployment(pytestconfig):
    d = pytestconfig.getoption("--kvchaos-deployment")
    if d not in releases.DEPLOYMENTS:
        raise pytest.UsageError(f"--kvchaos-deployment {d!r}: one of {', '.join(releases.DEPLOYMENTS)}")
    return d


@pytest.fixture
def release_cluster(release, trial, deployment, kvchaos_spec, kvchaos_run_dir, kvchaos_reaper, kvchaos_policy):
    """A fresh cluster of ``release`` in the incident's shape, with a policy gated by its own self-test."""
    if kvchaos_spec.device != "cpu":
        pytest.skip("release environments are built for the CPU profile")
    try:
        py = releases.engine_python(release)
    except releases.ReleaseError as e:
        pytest.fail(str(e), pytrace=False)
    spec = ClusterSpec.from_dict({**releases.deployment_spec(kvchaos_spec.to_dict(), deployment),
                                  "name": f"cpu-sglang-{release}-{deployment}", "engine_python": py})
    with own_cluster(spec, kvchaos_run_dir / "releases" / cell(release, trial, deployment), kvchaos_reaper,
                     kvchaos_policy) as got:
        yield got


def cell(release, trial, deployment):
    return f"sglang-{release}-t{trial}" + ("" if deployment == "incident" else f"-{deployment}")


def test_incident_unmodified_on_release(experiment, seeds, release_cluster, release, trial, deployment, kvchaos_run_dir):
    c, policy = release_cluster
    pf, dc = (c.server_info(r) for r in ("prefill", "decode"))
    got = {r: server_field(i, "version") for r, i in (("prefill", pf), ("decode", dc))}
    assert got == {"prefill": release, "decode": release}, got
    # the incident's shape: prefill's pool below the context, the oversized prompts between its limit
    # and decode's admission edge (pool minus the reserved decode tokens)
    assert server_field(pf, "max_total_num_tokens") < server_field(pf, "context_length")
    assert server_field(pf, "max_req_input_len") < min(releases.OVERSIZED)
    assert max(releases.OVERSIZED) < server_field(dc, "max_total_num_tokens") - 512
    seed = seeds(releases.GLM53_SEED + trial - 1)
    plans, victim = releases.glm53_plans(seed)
    out, name = kvchaos_run_dir / "releases", cell(release, trial, deployment)
    checks = [Isolation(), Sensitivity(), HttpSemantics(), Liveness(bound_s=releases.BOUND_S)]
    with EventLog(out / name / "faults.jsonl") as flog:
        kit = FaultKit(c, flog)  # nothing armed: the agent only observes (KV pages sent per request)
        with experiment(f"release-{name}", plans, checks, cluster=c, faults=kit, policy=policy, seed=seed,
                        path=out / name / "events.jsonl", concurrency=8,
                        timeout_s=releases.BOUND_S, settle_s=0) as ex:
            pass
        assert not kit.heal_all()
    rec = releases.trial_record(ex, plans, victim, release, trial, seed, policy.selftest, deployment)
    # the operator's audit of this very cluster, judged by the committed table of its deployment: it
    # must never call a release PASS that this trial just saw leak (a stale table or a wrong audit)
    ver = {c["id"]: c for c in audit(c.endpoints.prefill, c.endpoints.decode)["checks"]}["engine_version"]
    rec["audit_engine_version"] = {"status": ver["status"], "detail": ver["detail"]}
    committed = (releases.load_table(releases.table_file(deployment)) or {}).get("releases", {}).get(release)
    if committed:  # the audit of a live release cluster says what the committed table measured
        rec["audit_engine_version"]["table_verdict"] = committed["verdict"]
        want = {releases.LEAKS: "fail", releases.CLEAN: "pass", releases.UNMEASURED: "unknown"}[committed["verdict"]]
        assert ver["status"] == want, f"audit of sglang {release}: {ver['status']}, table: {committed['verdict']}: {ver}"
    releases.record_trial(rec, out)
    ex.judge()  # unplanted: a release that leaks is red in this run's report
    assert not (rec["leaked"] and ver["status"] == "pass"), f"audit PASSed sglang {release}, which leaked: {ver}"
    assert rec["leaked"] is not None, (f"sglang {release} trial {trial} could not see a leak (isolation "
                                       f"{ex.by['isolation'].status}: {ex.by['isolation'].summary}): unmeasured")
