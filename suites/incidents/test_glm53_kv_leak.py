"""GLM-5.3 KV leak, reproduced on the CPU cluster by bug replay on SGLang 0.5.23.

The incident: prefill's KV pool (681,280 tokens) was smaller than the declared context (1,048,576).
A prompt in between hit prefill's reject path (``Req.set_finish_with_abort``: prompt swapped for a
one-token placeholder, verdict parked in ``to_finish``, ``req.finished()`` still False); the PD queues
let it through, decode reserved pages for the full prompt, received one page, and attended over stale
pages holding other tenants' prompts: HTTP 200, fluent, with other tenants' data.

Here: prefill's input limit is lowered to 512 tokens at run time (decode keeps its 2048-token pool,
the context stays 4096) and one tenant sends 600–1400-token prompts among 15 other tenants' traffic.

- ``replay``: the ``reject_admitted`` mutation re-opens the pre-fix path (PRs #36988 / #38935).
  Expected: isolation FAIL naming the foreign tenant, the victim got HTTP 200.
- ``fixed``: the same deployment and traffic on the unmodified 0.5.23 (``input_limit`` only).
  Expected: no leak. Observed besides: the oversized prompts are never answered and requests queued
  behind them time out (liveness FAIL) — kept visible as an xfail with the witness, not tuned away.

Each run writes ``<run dir>/incidents/glm53-<mode>/`` (events, verdicts.json, summary.json).
(The pinned pre-fix SGLang release, the other half of the reproduction, is not built yet.)
"""

from __future__ import annotations

import json
import time

import pytest

from kvchaos import oracles
from kvchaos.workload import EventLog, Workload, run_plans
from kvchaos.workload.probes import snapshot, wait_quiet

pytestmark = pytest.mark.cluster
SEED = 53
PREFILL_LIMIT = 512
OVERSIZED = (600, 900, 1200, 1400)  # between prefill's limit and decode's 1536-token admission edge


def _plans():
    wl = Workload(SEED, n_tenants=16, prefix="g")
    victim = wl.tenants[-1]
    others = wl.tenants[:-1]  # the victim sends only the oversized prompts: every leak is cross-tenant
    background = [wl.request(others[i % len(others)], "plain", n_tokens=others[i % len(others)].rng.randrange(200, 480))
                  for i in range(48)]
    big = [wl.request(victim, "oversized", n_tokens=n, n_canaries=3) for n in OVERSIZED]
    # other tenants go first so decode's free pages hold their KV, then the oversized ones mixed in
    plans = background[:24] + [x for pair in zip(big, background[24:28]) for x in pair] + background[28:]
    return plans, victim.name


def _run(cluster, faults, kvchaos_run_dir, mode: str):
    plans, victim = _plans()
    out = kvchaos_run_dir / "incidents" / f"glm53-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    if mode == "replay":
        f = faults.agent.arm("prefill", "reject_admitted", target={"tenant": victim},
                             params={"prefill_max_input_len": PREFILL_LIMIT}, count=len(OVERSIZED))
    else:
        f = faults.agent.arm("prefill", "input_limit", params={"max_input_len": PREFILL_LIMIT})
    t0 = time.monotonic()
    with EventLog(out / "events.jsonl") as log:
        log.emit("run", name=f"glm53-{mode}", seed=SEED, victim=victim, prefill_limit=PREFILL_LIMIT,
                 oversized=list(OVERSIZED), fault=f.id)
        snapshot(cluster, log, "before", answer=False)
        run_plans(cluster.endpoints.router, plans, log, concurrency=8, timeout_s=30)
        f.heal()
        snapshot(cluster, log, "after")
    ev = log.records + faults.collect_agent_events()
    verdicts = [oracles.isolation(ev), oracles.http_semantics(ev), oracles.liveness(ev, bound_s=30)]
    first_leak = None
    leaks = verdicts[0].witnesses
    if leaks:
        ends = {e["rid"]: e["t"] for e in log.records if e["ev"] == "end"}
        first_leak = min(ends.get(w["victim_rid"], float("inf")) for w in leaks) - t0
    summary = {"mode": mode, "victim_tenant": victim, "requests": len(plans),
               "oversized": len(OVERSIZED), "verdicts": {v.oracle: v.status for v in verdicts},
               "time_to_first_detection_s": first_leak, "wall_s": round(time.monotonic() - t0, 2)}
    (out / "verdicts.json").write_text(json.dumps([v.to_dict() for v in verdicts], indent=2, default=str))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for v in verdicts:
        print(v)
    return verdicts, summary, victim, plans


def test_replay_leaks_another_tenants_data_with_http_200(cluster, faults, kvchaos_run_dir):
    (iso, http, live), summary, victim, plans = _run(cluster, faults, kvchaos_run_dir, "replay")
    assert iso.status == oracles.FAIL, iso
    assert all(w["victim_tenant"] == victim and w["owner_tenant"] != victim and w["status"] == 200
               for w in iso.witnesses), iso.witnesses[:3]
    assert http.status == oracles.FAIL  # oversized prompts answered 200
    big = {p.rid for p in plans if p.oversized}
    victims = {x["victim_rid"] for x in iso.witnesses}
    assert victims <= big
    # the class is caught on the first oversized request
    first_big = next(p.rid for p in plans if p.oversized)
    assert first_big in victims, (first_big, sorted(victims))


KNOWN_HANG = (
    "known engine finding (sglang 0.5.23, PD, prefill input limit < decode's): a prompt prefill rejects at "
    "intake while decode admits it is never answered — decode waits for KV that will not come, the router "
    "retries the request, and other tenants' requests queued behind it time out as well. The leak fixes "
    "(PRs #36988/#38935) hold: no foreign data is served. See README 'What the faults showed' and "
    "shared/notes/sglang-on-cpu.md (same class as the 1537-2042-token hang).")


@pytest.mark.disruptive
def test_fixed_engine_does_not_leak(cluster, faults, kvchaos_run_dir):
    (iso, http, live), summary, victim, plans = _run(cluster, faults, kvchaos_run_dir, "fixed")
    # the router keeps retrying the hung requests after their clients gave up: wait until the
    # engines are quiet so the next test does not see stray work (bounded)
    q = wait_quiet(cluster, timeout_s=120, stable_s=10)
    faults.log.emit("observed", quiesce=q)
    assert iso.status == oracles.PASS, iso  # the fix holds: no foreign canary anywhere
    if live.status == oracles.FAIL:
        hung = {w["rid"] for w in live.witnesses}
        big = {p.rid for p in plans if p.oversized}
        assert big <= hung, (sorted(big - hung), live.witnesses[:3])  # it is the oversized ones that hang
        pytest.xfail(f"{KNOWN_HANG} Witness: {live.summary}")
    assert http.status == oracles.PASS, http  # once fixed: 400 with an error
    assert live.status == oracles.PASS, live.witnesses[:3]
