"""Oversized prompts across the pool/context edges, while other tenants run.

The GLM-5.3 incident lived between two numbers: the KV pool (what an engine can hold) and the
declared context (what it advertises). This suite reads the edges from the running engines
(``/server_info``: pool ``max_total_num_tokens``, input limit ``max_req_input_len``, decode's
``num_reserved_decode_tokens``, ``context_length``) and sends one tenant's prompts at each edge
among 8 other tenants' traffic:

=========================  ==========================  ==========================================
edge                        length on the CPU profile   a correct engine
=========================  ==========================  ==========================================
below the pool              pool / 4 = 512              answers 200 with the requester's canaries
pool − decode reservation   2048 − 128 = 1920           answers 200 (decode can pre-allocate it)
(hang band)                 1921 … 2041                 answers, or rejects with 4xx — never hangs
at the input limit          2042                        400 with an error, no content (SGLang
                                                        rejects len >= max_req_input_len)
between pool and context    3072                        400
at the context              4096                        400
over the context            5000                        400
=========================  ==========================  ==========================================

Every test: isolation (no foreign canary in any response), HTTP semantics (rejected sizes get a
4xx with an error, never 200 with content) and liveness (every request ends within the bound, the
cluster answers afterwards, the KV pools return to their idle baseline).

The hang band is a known engine finding on SGLang 0.5.23 (decode cannot pre-allocate prompt + its
reserved decode tokens in a 2048 pool, and nothing rejects the request): it surfaces as a liveness
FAIL naming the stuck requests, KNOWN as ``sglang-pd-hang-band`` (kvchaos/findings.toml) only while
every witness is a timeout of a prompt tagged as inside the band and every band prompt hangs.
``-m slow`` adds a finer sweep (every 256 tokens plus each edge ± 1), and the auto-truncation test:
the GLM-5.3 deployment (prefill's pool below the context and below decode's) with
``--allow-auto-truncate`` on both roles. Prefill truncates the oversized prompt to its input limit
instead of rejecting it, so neither #36988 nor #38935 applies; decode pre-allocates the whole prompt
and receives only the truncated part's KV. On 0.5.23 that is a leak:
``sglang-auto-truncate-stale-pages`` (reports/findings/), KNOWN only while every victim is an
oversized prompt that prefill's own transfer events show sent truncated (more than one page, fewer
than the prompt). ``--kvchaos-trials N`` runs it N times on one cluster.
"""

from __future__ import annotations

import pytest

from faults import FaultKit
from kvchaos import canary, releases
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.layouts import parse
from kvchaos.experiment import PASS
from kvchaos.oracles import HttpSemantics, Isolation, Liveness, Sensitivity, kv_page_size, kv_pages_written, pages_for
from kvchaos.suite import own_cluster, server_field
from kvchaos.workload import EventLog
from kvchaos.workload import Workload
from kvchaos.workload.snapshots import wait_quiet

pytestmark = pytest.mark.cluster
BOUND_S = 30


@pytest.fixture(scope="module")
def edges(cluster):
    """The edges, read from the engines (not assumed from the profile)."""
    pf, dc = cluster.server_info("prefill"), cluster.server_info("decode")
    pool = min(server_field(pf, "max_total_num_tokens"), server_field(dc, "max_total_num_tokens"))
    limit = min(server_field(pf, "max_req_input_len"), server_field(dc, "max_req_input_len"))
    reserve = server_field(dc, "num_reserved_decode_tokens")
    context = server_field(dc, "context_length")
    assert None not in (pool, limit, reserve, context), (pool, limit, reserve, context)
    e = {"pool": pool, "limit": limit, "reserve": reserve, "context": context,
         "admit_edge": min(pool - reserve, limit)}
    assert pool < context, f"this suite needs a pool smaller than the context (the incident's shape): {e}"
    return e


def _expect(n: int, e: dict) -> str:
    if n <= e["admit_edge"]:
        return "answer"
    if n < e["limit"]:  # SGLang rejects len >= max_req_input_len ("2042 tokens exceeds ... 2042 tokens")
        return "band"  # admitted by the input limit, not by decode's pre-allocation
    return "reject"


def _sweep(experiment, name, lengths, e, seed, checks, at=8, bound_s=BOUND_S):
    """``at``: how many background requests go first (a prompt that hangs decode makes the router
    answer 503 to what follows: the hang band goes late so the run keeps its echo evidence).
    ``bound_s``: the client's timeout, which must match the Liveness checker's bound in ``checks``."""
    wl = Workload(seed, n_tenants=9, prefix=name[:2])
    probe_tenant, others = wl.tenants[-1], wl.tenants[:-1]
    background = [wl.request(others[i % len(others)], "plain", n_tokens=others[i % len(others)].rng.randrange(100, 500))
                  for i in range(72)]
    sized = []
    for n in lengths:
        p = wl.request(probe_tenant, "oversized" if _expect(n, e) == "reject" else "plain", n_tokens=n, n_canaries=2)
        p.extra["probe"] = _expect(n, e) if _expect(n, e) != "band" else "hang_band"
        sized.append(p)
    # interleave: the sized prompts arrive while the other tenants' requests are in flight
    rest = background[at:]
    plans = background[:at]
    for i in range(max(len(sized), len(rest))):
        plans += sized[i:i + 1] + rest[i:i + 1]
    assert len(plans) == len(background) + len(sized)
    with experiment(name, plans, checks, seed=seed, concurrency=8, timeout_s=bound_s) as ex:
        pass
    run = ex.run
    table = [{"n_tokens": p.n_tokens, "expect": _expect(p.n_tokens, e), "status": run.statuses.get(p.rid),
              "outcome": (run.ends.get(p.rid) or {}).get("outcome"), "rid": p.rid} for p in sized]
    for row in table:
        print(row)
    return ex, table


def _check_answer_and_reject(ex, table, rejects=True):
    run = ex.run
    for row in table:
        if row["expect"] == "answer":
            assert row["status"] == 200, row
            text = run.response_text(row["rid"])
            missing = [c for c in run.plans[row["rid"]]["canaries"] if canary.payload(c) not in text]
            assert not missing, f"{row}: answered without its own canaries {missing}: {text[:120]!r}"
        elif row["expect"] == "reject":
            assert row["status"] is not None and 400 <= row["status"] < 500, row
    ex.require(isolation=PASS, liveness=PASS, **({"http_semantics": PASS} if rejects else {}))


def test_edges_answered_or_rejected_with_other_tenants_running(experiment, seeds, faults, edges):
    e = edges
    lengths = [e["pool"] // 4, e["admit_edge"], e["limit"], (e["pool"] + e["context"]) // 2,
               e["context"], e["context"] + 904]
    ex, table = _sweep(experiment, "oversized_edges", lengths, e, seeds(601),
                       [Isolation(), HttpSemantics(), Liveness(bound_s=BOUND_S)])
    faults.log.emit("observed", edges=e, table=table)
    assert [r["expect"] for r in table] == ["answer", "answer"] + ["reject"] * 4, table
    _check_answer_and_reject(ex, table)


@pytest.mark.every_layout(own=False)  # CI: on the profile's paged layout (mla-p64-bf16); page 1 has no page edge
def test_page_edges_answered_with_whole_pages(experiment, seeds, faults, cluster, kvchaos_layout):
    """Prompts one token either side of KV page boundaries — the first page, the second, and the
    last page below decode's admit edge, up to the edge itself — among 8 other tenants' traffic on a
    paged pool. Each must be answered with its own canaries, and prefill must have written exactly
    the pages its prompt fills (the last one partly: the rest of that page holds whatever an earlier
    request left there, which attention must not read)."""
    page = parse(kvchaos_layout).page_size
    if page == 1:
        pytest.skip(f"{kvchaos_layout}: page size 1 has no page edge (test_edges covers its pool edges)")
    pf, dc = cluster.server_info("prefill"), cluster.server_info("decode")
    pool = min(server_field(pf, "max_total_num_tokens"), server_field(dc, "max_total_num_tokens"))
    limit = min(server_field(pf, "max_req_input_len"), server_field(dc, "max_req_input_len"))
    e = {"pool": pool, "limit": limit, "reserve": server_field(dc, "num_reserved_decode_tokens"), "page": page}
    e["admit_edge"] = min(pool - e["reserve"], limit)
    last = (e["admit_edge"] - 1) // page * page  # the last page boundary below the admit edge
    lengths = sorted({page - 1, page, page + 1, 2 * page + 1, last - 1, last, last + 1, e["admit_edge"]})
    # Each prompt longer than half of decode's admit edge needs the pool to itself, and decode's
    # pre-allocation is first in, first out (its loop stops at the first reservation that does not
    # fit): they run one at a time, the last waiting for the others (20-26 s on a quiet CPU run, over
    # 30 s under make test's load). So the bound is BOUND_S per such prompt — still far below the
    # 300 s a hang in this family takes (decode's waiting timeout).
    bound = BOUND_S * max(1, sum(2 * n > e["admit_edge"] for n in lengths))
    ex, table = _sweep(experiment, "page_edges", lengths, e, seeds(604), [Isolation(), Liveness(bound_s=bound)],
                       bound_s=bound)
    sent, ps = kv_pages_written(ex.events), kv_page_size(ex.events)
    for row in table:
        meta = (ex.run.bodies.get(row["rid"]) or {}).get("meta") or {}
        row["prompt_tokens"], row["pages_sent"] = meta.get("prompt_tokens"), sent.get(row["rid"])
    faults.log.emit("observed", edges=e, table=table)
    assert ps == page, f"the agent's transfer events report page size {ps}, the layout says {page}"
    assert all(r["expect"] == "answer" for r in table), table
    _check_answer_and_reject(ex, table, rejects=False)  # every edge is admitted: nothing to reject
    # the path really ran at the edges: whole pages for the prompt the engine saw, no more, no fewer
    bad = [r for r in table if r["prompt_tokens"] is None or r["pages_sent"] != pages_for(r["prompt_tokens"], page)]
    assert not bad, f"pages written != pages the prompt fills: {bad}"


@pytest.mark.slow  # CI time; the intake-reject hang (same router join) is exercised by the incident's fixed arm
@pytest.mark.disruptive
def test_hang_band(experiment, seeds, faults, cluster, edges):
    """Whatever happens to the band prompts, nobody gets foreign data (isolation is always held to
    PASS); each band prompt must be served or rejected with a 4xx — on 0.5.23 they hang (KNOWN)."""
    e = edges
    if e["admit_edge"] + 1 >= e["limit"]:
        pytest.skip(f"no hang band on this deployment: decode admits everything the input limit admits ({e})")
    lengths = [e["admit_edge"] + 1, (e["admit_edge"] + e["limit"]) // 2, e["limit"] - 1]
    ex, table = _sweep(experiment, "oversized_band", lengths, e, seeds(602), [Isolation(), Liveness(bound_s=BOUND_S)], at=64)
    q = wait_quiet(cluster, timeout_s=120, stable_s=10)  # the router retries abandoned requests
    faults.log.emit("observed", edges=e, table=table, quiesce=q)
    for row in table:
        body = ex.run.bodies.get(row["rid"]) or {}
        assert row["status"] in (None, 200) or (400 <= row["status"] < 500 and body.get("error")), row
    ex.require(isolation=PASS, liveness=PASS)


@pytest.mark.slow
def test_fine_sweep_outside_the_band(experiment, seeds, faults, edges):
    e = edges
    pts = set(range(256, e["context"] + 512, 256))
    for edge in (e["admit_edge"], e["limit"], e["context"]):
        pts |= {edge - 1, edge, edge + 1}
    lengths = sorted(n for n in pts if n > 64 and _expect(n, e) != "band")
    ex, table = _sweep(experiment, "oversized_fine", lengths, e, seeds(603),
                       [Isolation(), HttpSemantics(), Liveness(bound_s=BOUND_S)])
    faults.log.emit("observed", edges=e, table=table)
    _check_answer_and_reject(ex, table)


def pytest_generate_tests(metafunc):
    if "trial" in metafunc.fixturenames:
        n = metafunc.config.getoption("--kvchaos-trials")
        metafunc.parametrize("trial", range(1, n + 1), ids=[f"t{t}" for t in range(1, n + 1)])


@pytest.fixture(scope="module")
def truncating_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper, kvchaos_policy):
    """The incident's deployment (prefill pool 576 < context 4096 < decode's pool) with
    --allow-auto-truncate on both roles; its own self-test gates the policy."""
    if kvchaos_spec.device != "cpu":
        pytest.skip("sized for the CPU profile")
    spec = ClusterSpec.from_dict({**releases.deployment_spec(kvchaos_spec.to_dict(), "auto-truncate"),
                                  "name": "cpu-auto-truncate"})
    with own_cluster(spec, kvchaos_run_dir / "auto-truncate", kvchaos_reaper, kvchaos_policy) as got:
        yield got


@pytest.mark.slow
def test_auto_truncated_prompt_is_not_decoded_over_stale_pages(experiment, seeds, truncating_cluster, trial, kvchaos_run_dir):
    c, policy = truncating_cluster
    plans, victim = releases.glm53_plans(seeds(700 + trial))
    out = kvchaos_run_dir / "auto-truncate" / f"t{trial}"
    with EventLog(out / "faults.jsonl") as flog:
        kit = FaultKit(c, flog)  # nothing armed: the agent records the KV pages prefill sends
        with experiment(f"auto_truncate-t{trial}", plans, [Isolation(), Sensitivity(), Liveness(bound_s=BOUND_S)],
                        cluster=c, faults=kit, policy=policy, seed=seeds(700 + trial), path=out / "events.jsonl",
                        concurrency=8, timeout_s=BOUND_S, settle_s=0) as ex:
            pass
        assert not kit.heal_all()
    sent, ps = kv_pages_written(ex.events), kv_page_size(ex.events)
    limit = server_field(c.server_info("prefill"), "max_req_input_len")
    # the path really ran: prefill wrote every oversized prompt truncated to its limit, not rejected
    assert all(sent.get(p.rid) == pages_for(limit, ps) for p in plans if p.oversized), (
        limit, ps, {p.rid: sent.get(p.rid) for p in plans if p.oversized})
    ex.require(isolation=PASS, liveness=PASS)
