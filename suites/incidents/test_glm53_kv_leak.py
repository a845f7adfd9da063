"""GLM-5.3 KV leak, reproduced on the CPU cluster two ways.

The incident: prefill's KV pool (681,280 tokens) was smaller than the declared context (1,048,576).
A prompt in between hit prefill's reject path (``Req.set_finish_with_abort``: prompt swapped for a
one-token placeholder, verdict parked in ``to_finish``, ``req.finished()`` still False); the PD queues
let it through, decode reserved pages for the full prompt, received one page, and attended over stale
pages holding other tenants' prompts: HTTP 200, fluent, with other tenants' data.

Traffic (all modes): one tenant sends only oversized prompts (600–1400 tokens: over prefill's limit,
under decode's admission edge: pool − reservation, 1920 tokens on the CPU profile) among 15 other tenants'
requests.

- ``prefix``: the pinned pre-fix release **SGLang 0.5.19** — the newest on PyPI without PR #36988
  (prefill retires an aborted result before sending KV; first shipped in 0.5.20; #38935's
  ``is_unadmitted_reject`` arrives in 0.5.21: reports/releases/code-reading.md) —
  in its own environment (``scripts/setup-engine.sh 0.5.19``), deployed like the incident: prefill's
  KV pool (576 tokens, input limit 570) smaller than the context (4096) and than decode's pool (2048).
  No mutation, no agent fault. Expected: isolation FAIL naming the foreign tenant, HTTP 200.
- ``replay``: 0.5.23 with the ``reject_admitted`` mutation re-opening the pre-fix path; prefill's
  input limit lowered to 512 at run time. Expected: the same leak.
- ``fixed``: the same deployment and traffic on the unmodified 0.5.23 (``input_limit`` only).
  Expected: no leak. Observed besides: the oversized prompts are never answered and requests queued
  behind them time out (liveness FAIL): the registry's ``sglang-intake-reject-hang``, KNOWN only
  with its witness signature, never hiding isolation.

Traffic: ``fixed`` sends 80 background requests of 15 tenants with the victim tenant's 4 oversized
prompts mixed in after the first 72 (enough echoing replies for the sensitivity floor); the leaking
modes send the first ``LEAD`` background requests, then the 4 oversized prompts each followed by one
more, and stop (``kvchaos.releases.glm53_plans``): the leak is the first verdict a reproduction gives. Each run is one
experiment writing ``<run dir>/incidents/glm53-<mode>/`` (events.jsonl with the engines' events,
verdicts.json, summary.json).
"""

from __future__ import annotations

import json
import time

import pytest

from faults import FaultKit
from kvchaos import releases
from kvchaos.cluster import ClusterSpec
from kvchaos.cluster.layouts import DEFAULT_LAYOUT
from kvchaos.experiment import FAIL, PASS
from kvchaos.oracles import HttpSemantics, Isolation, Liveness, kv_pages_written
from kvchaos.suite import own_cluster, server_field
from kvchaos.workload import EventLog
from kvchaos.workload.snapshots import wait_quiet

# a default run (CI) puts it on the profile's other layouts — MLA, paged, bf16 — and not again on the
# profile's own (committed results: reports/); --kvchaos-layouts / make test-layouts run it on any layout
pytestmark = [pytest.mark.cluster, pytest.mark.every_layout(own=False)]
SEED = releases.GLM53_SEED
PREFILL_LIMIT = 512
PREFIX_VERSION = "0.5.19"  # newest release without PR #36988
PREFIX_PREFILL_POOL = releases.PREFILL_POOL  # prefill's --max-total-tokens in the pre-fix deployment (input limit 570)
OVERSIZED = releases.OVERSIZED  # between prefill's limit and decode's admission edge (pool − reservation)


LEAD = 8  # background requests before the oversized prompts in the modes that expect the leak


def _plans(seeds, mode: str):
    """``fixed`` sends the full traffic (its PASS needs the echo floor, and the hang leaves it the
    replies before it); the leaking modes stop after the oversized prompts: the leak shows seconds in,
    and a run of them without a witness is UNKNOWN (too few requests for the floor), never PASS."""
    return releases.glm53_plans(seeds(SEED), lead=None if mode == "fixed" else LEAD)


def _out(kvchaos_run_dir, mode: str, layout: str):
    """``incidents/glm53-<mode>``, ``...@<layout>`` on a layout other than the profile's own."""
    return kvchaos_run_dir / "incidents" / (f"glm53-{mode}" if layout == DEFAULT_LAYOUT else f"glm53-{mode}@{layout}")


def _run(experiment, seeds, faults, kvchaos_run_dir, mode: str, layout: str, **kw):
    plans, victim = _plans(seeds, mode)
    out = _out(kvchaos_run_dir, mode, layout)
    checks = [Isolation(), HttpSemantics(), Liveness(bound_s=30)]
    t0 = time.monotonic()
    with experiment(f"glm53-{mode}", plans, checks, faults=faults, path=out / "events.jsonl", seed=seeds(SEED),
                    concurrency=8, timeout_s=30, settle_s=0, **kw) as ex:
        if mode == "replay":
            faults.agent.arm("prefill", "reject_admitted", target={"tenant": victim},
                             params={"prefill_max_input_len": PREFILL_LIMIT}, count=len(OVERSIZED))
        elif mode == "fixed":
            faults.agent.arm("prefill", "input_limit", params={"max_input_len": PREFILL_LIMIT})
    ev = ex.events
    sizes = {p.rid: p.n_tokens for p in plans if p.oversized}
    sent = kv_pages_written(ev)  # every chunk of each request's transfer
    leaks = ex.by["isolation"].witnesses
    first_leak = None
    if leaks:
        ends = {e["rid"]: e["t"] for e in ev if e["ev"] == "end"}
        first_leak = min(ends.get(w["victim_rid"], float("inf")) for w in leaks) - t0
    head = next(e for e in ev if e["ev"] == "experiment")
    summary = {"mode": mode, "experiment": ex.id, "engines": {r: _version(ex.cluster, r) for r in ("prefill", "decode")},
               "engine": head["engine"], "victim_tenant": victim, "requests": len(plans), "oversized": len(OVERSIZED),
               "oversized_kv_pages_sent": {rid: {"prompt_tokens": sizes[rid], "pages_sent": sent.get(rid)} for rid in sizes},
               "verdicts": {v.oracle: v.status for v in ex.verdicts},
               "time_to_first_detection_s": first_leak, "wall_s": round(time.monotonic() - t0, 2)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return ex, summary, victim, plans


def _assert_one_page_handoff(summary):
    """The mechanism, from prefill's side: each rejected prompt went to decode as the one-token
    placeholder's single KV page while decode had reserved the whole prompt."""
    got = summary["oversized_kv_pages_sent"]
    assert all(v["pages_sent"] == 1 for v in got.values()), got


def _version(cluster, role):
    si = cluster.server_info(role)
    return {k: server_field(si, k) for k in ("version", "max_total_num_tokens", "max_req_input_len", "context_length",
                                            "num_reserved_decode_tokens")}


PLANTED = {"prefix": f"pre-fix release sglang {PREFIX_VERSION} deployed like the incident (prefill pool < context)",
           "replay": "reject_admitted mutation replays the pre-fix reject path in sglang 0.5.23"}


def _assert_leak(ex, mode, victim, plans):
    """The leak reproduced: every witness is the victim tenant getting another tenant's data with
    HTTP 200, only oversized requests are victims, at least half of them are, and at least one holds a
    canary another tenant owns (a reply decoded over stale pages that happen to hold no whole canary is
    HTTP 200 without a witness: it happened to the first oversized prompt in one CI run of 0.5.19, and
    to one of four in the committed replay)."""
    iso = ex.by["isolation"]
    assert iso.status == FAIL, iso
    # a garbled recital over stale pages ('[WCZAFREN]' for another tenant's '[WCZAFREC2A]', a fresh
    # clone's 0.5.23 replay) is a canary of unknown origin: a leak too, but it names no owner. A victim
    # may hold only such canaries (one of three in CI's replay at ef8709f), so owned canaries are asked
    # of the run, not of each victim
    assert all(w["victim_tenant"] == victim and w["status"] == 200 and w["owner_tenant"] != victim
               for w in iso.witnesses), iso.witnesses[:3]
    owned = {w["victim_rid"] for w in iso.witnesses if w["owner_tenant"] is not None}
    victims = {x["victim_rid"] for x in iso.witnesses}
    big = {p.rid for p in plans if p.oversized}
    assert victims <= big, sorted(victims - big)  # a foreign canary outside the reject path is no replay
    assert owned, iso.witnesses[:3]
    assert 2 * len(victims) >= len(big), (sorted(victims), sorted(big))
    # a reproduction: the bug is there on purpose, and the leak and the 200s are what is required
    ex.require(planted=PLANTED[mode], isolation=FAIL, http_semantics=FAIL)


@pytest.fixture  # one test uses it: stop its engines before the rest of the session runs
def prefix_cluster(kvchaos_spec, kvchaos_run_dir, kvchaos_reaper):
    """The pre-fix release in its own environment, deployed with prefill's pool below the context."""
    if kvchaos_spec.device != "cpu":
        pytest.skip("the pinned pre-fix environment is built for the CPU profile")
    py = releases.engine_python(PREFIX_VERSION)
    spec = ClusterSpec.from_dict({**releases.deployment_spec(kvchaos_spec.to_dict(), "incident"),
                                  "name": f"{kvchaos_spec.name}-sglang-{PREFIX_VERSION}", "engine_python": py})
    with own_cluster(spec, kvchaos_run_dir / spec.name, kvchaos_reaper) as (c, _):
        yield c


@pytest.mark.backends("mooncake_tcp")  # the incident's transport; 0.5.19's NIXL path is not checked on CPU
def test_prefix_release_leaks_another_tenants_data_with_http_200(experiment, seeds, prefix_cluster, kvchaos_run_dir):
    c = prefix_cluster
    pf, dc = _version(c, "prefill"), _version(c, "decode")
    assert pf["version"] == dc["version"] == PREFIX_VERSION, (pf, dc)
    # the incident's deployment: prefill pool < context, and prefill's limit < decode's admission edge
    assert pf["max_total_num_tokens"] < pf["context_length"], pf
    assert pf["max_req_input_len"] < min(OVERSIZED) and max(OVERSIZED) <= dc["max_total_num_tokens"] - dc["num_reserved_decode_tokens"], (pf, dc)
    with EventLog(kvchaos_run_dir / "events" / "glm53-prefix-faults.jsonl") as flog:
        kit = FaultKit(c, flog)
        try:
            ex, summary, victim, plans = _run(experiment, seeds, kit, kvchaos_run_dir, "prefix", c.spec.layout, cluster=c)
        finally:
            problems = kit.heal_all()
    assert not problems, problems
    _assert_one_page_handoff(summary)
    # the operator checklist would have flagged this deployment before it served anyone
    from kvchaos.audit import audit

    res = audit(c.endpoints.prefill, c.endpoints.decode)
    (_out(kvchaos_run_dir, "prefix", c.spec.layout) / "audit.json").write_text(json.dumps(res, indent=2, default=str))
    st = {(x["id"], x["role"]): x for x in res["checks"]}
    ver = st[("engine_version", "both")]
    assert ver["status"] == "fail" and "#36988" in ver["detail"] and "#38935" in ver["detail"], ver
    assert st[("pool_vs_context", "prefill")]["status"] == "fail", st[("pool_vs_context", "prefill")]
    assert st[("pool_vs_context", "prefill")]["numbers"]["pool_tokens"] == PREFIX_PREFILL_POOL
    for role in ("prefill", "decode"):  # off by default in 0.5.19, read from the live processes
        assert st[("deferred_kv_release", role)]["status"] == "fail", st[("deferred_kv_release", role)]
        assert st[("mooncake_batch_bound", role)]["status"] == "fail"
    _assert_leak(ex, "prefix", victim, plans)


def test_replay_leaks_another_tenants_data_with_http_200(experiment, seeds, faults, kvchaos_run_dir, kvchaos_spec):
    ex, summary, victim, plans = _run(experiment, seeds, faults, kvchaos_run_dir, "replay", kvchaos_spec.layout)
    _assert_one_page_handoff(summary)
    _assert_leak(ex, "replay", victim, plans)


@pytest.mark.disruptive
def test_fixed_engine_does_not_leak(experiment, seeds, cluster, faults, kvchaos_run_dir, kvchaos_spec):
    """The fix holds: no foreign canary anywhere, and (once fixed) each oversized prompt gets a 400.
    On 0.5.23 they hang instead: the registry's ``sglang-intake-reject-hang`` (KNOWN with its
    witness signature; it covers liveness and http_semantics, never isolation)."""
    ex, summary, victim, plans = _run(experiment, seeds, faults, kvchaos_run_dir, "fixed", kvchaos_spec.layout)
    # the router keeps retrying the hung requests after their clients gave up: wait until the
    # engines are quiet so the next test does not see stray work (bounded)
    q = wait_quiet(cluster, timeout_s=120, stable_s=10)
    faults.log.emit("observed", quiesce=q)
    ex.require(isolation=PASS, http_semantics=PASS, liveness=PASS)
