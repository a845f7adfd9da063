"""Detection matrix: does each suite catch the engine bug it exists for?

For every engine mutation the in-engine agent provides (``faults/agent.py``: re-opened bugs, not
faults a correct engine should survive), the scenario of the matching suite runs with the mutation
armed and must FAIL — with the right oracle and a witness that names the bug's victim. Without a
mutation the same scenarios must PASS every oracle (no false alarm). Each class runs ``TRIALS``
times (``KVCHAOS_MATRIX_TRIALS``, default 2; the unmutated arm half as often; nightly runs use more);
the per-class per-trial detection
rate and time to first detection are printed and written to ``<run dir>/detection_matrix.json``.

============== ================================== =============== =================================
mutation        scenario (suite)                   oracle          witness
============== ================================== =============== =================================
reject_admitted oversized prompts among 8 tenants  isolation       the oversized request got another
(GLM-5.3 class) (test_oversized_prompt, glm53)                     tenant's canary, HTTP 200 — on
                                                                   the FIRST oversized request
early_free      write held in flight, request      kv_lifecycle    the aborted request's room: its
                aborted (test_mid_transfer_abort)                  write landed after decode freed
                                                                   the pages
double_alloc    A's write parked; B (other tenant) isolation /     A's reply holds B's canaries (or
                pre-allocated meanwhile and handed differential    differs from A served alone): the
                390 of A's live pages                              A/B pair named
============== ================================== =============== =================================
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import httpx
import pytest

from kvchaos import oracles
from kvchaos.suite import abort_in_flight, run_judged
from kvchaos.workload import Workload

pytestmark = pytest.mark.cluster
TRIALS = int(os.environ.get("KVCHAOS_MATRIX_TRIALS", "2"))
CLEAN_TRIALS = max(1, TRIALS // 2)  # the false-alarm arm; every other suite of the run is a clean control too
PREFILL_LIMIT = 512
RESULTS: dict[tuple[str, str], list[dict]] = {}


def _judges(*extra):
    return [oracles.isolation, oracles.http_semantics, oracles.kv_lifecycle,
            lambda ev: oracles.liveness(ev, bound_s=60), *extra]


def _by(verdicts):
    return {v.oracle: v for v in verdicts}


# ------------------------------------------------------------------ scenarios
def scenario_oversized(cluster, faults, run_dir, trial, mutate):
    wl = Workload(700 + trial, n_tenants=9, prefix=f"xo{trial}")
    victim, others = wl.tenants[-1], wl.tenants[:-1]
    bg = [wl.request(others[i % 8], "plain", n_tokens=others[i % 8].rng.randrange(200, 480)) for i in range(20)]
    big = [wl.request(victim, "oversized", n_tokens=n, n_canaries=3) for n in (700, 1100)]
    plans = bg[:12] + [big[0], bg[12], big[1]] + bg[13:]
    if mutate:
        faults.agent.arm("prefill", "reject_admitted", target={"tenant": victim.name},
                         params={"prefill_max_input_len": PREFILL_LIMIT}, count=len(big))
    t0 = time.time()
    ev, verdicts = run_judged(cluster, faults, run_dir, f"matrix_oversized_{'mut' if mutate else 'clean'}_{trial}",
                              plans, _judges(), concurrency=8, timeout_s=60, settle_s=45)
    v = _by(verdicts)
    # the engine's own oversized handling: on the unmutated engine these prompts are under its real
    # limit (2042) and are answered — they are "oversized" only for the mutation's lowered limit
    if not mutate:
        v.pop("http_semantics")
    v.pop("kv_lifecycle")  # no failed or aborted transfer in this scenario: nothing for it to judge
    first = big[0].rid
    wit = v["isolation"].witnesses
    detected = v["isolation"].status == oracles.FAIL
    ok_witness = bool(wit) and all(w["victim_tenant"] == victim.name and w["owner_tenant"] != victim.name
                                   and w["status"] == 200 for w in wit)
    ends = {e["rid"]: e["wall"] for e in ev if e.get("ev") == "end"}
    return {"detected": detected, "oracle": "isolation", "witness_ok": ok_witness,
            "first_request_caught": first in {w["victim_rid"] for w in wit},
            "time_to_detection_s": (min(ends[w["victim_rid"]] for w in wit) - t0) if wit else None,
            "verdicts": {k: x.status for k, x in v.items()}, "witness": wit[:1]}


def scenario_abort_in_flight(cluster, faults, run_dir, trial, mutate):
    wl = Workload(720 + trial, n_tenants=8, prefix=f"xa{trial}")
    plans = wl.mix(24, lengths=(200, 500))
    victims = [p for p in plans if p.tenant == "t003"][:2]
    if mutate:
        faults.agent.arm("decode", "early_free", hooks=("_release_request",))
    chor = abort_in_flight(cluster, faults, victims)
    t0 = time.time()
    ev, verdicts = run_judged(cluster, faults, run_dir, f"matrix_abort_{'mut' if mutate else 'clean'}_{trial}",
                              plans, _judges(), concurrency=6, timeout_s=60, settle_s=45)
    chor.join(timeout=120)
    v = _by(verdicts)
    v.pop("http_semantics")  # no oversized prompt here
    life = v["kv_lifecycle"]
    vic = {p.rid for p in victims}
    ok_witness = bool(life.witnesses) and all(w["rid"] in vic for w in life.witnesses)
    return {"detected": life.status == oracles.FAIL, "oracle": "kv_lifecycle", "witness_ok": ok_witness,
            "time_to_detection_s": (min(w["write_end"] for w in life.witnesses) - t0) if life.witnesses else None,
            "choreography": [{k: r.get(k) for k in ("rid", "room_status_at_write", "error")} for r in chor.result],
            "verdicts": {k: x.status for k, x in v.items()}, "witness": life.witnesses[:1]}


def scenario_shared_pages(cluster, faults, run_dir, trial, mutate, reference):
    """A's KV write is parked in prefill (hold) after decode pre-allocated A's pages; B (another
    tenant, same prompt length) is pre-allocated meanwhile — with the mutation, 390 of A's pages are
    handed to B too. A's write lands, then B's lands on the shared pages; A decodes over B's KV."""
    from kvchaos.workload import EventLog, run_plans
    from kvchaos.workload.probes import snapshot

    wl = Workload(740 + trial, n_tenants=8, prefix=f"xs{trial}")
    a = wl.request(wl.tenants[0], "plain", n_tokens=400, n_canaries=3)
    b = wl.request(wl.tenants[1], "plain", n_tokens=400, n_canaries=3)
    tail = [wl.request(wl.tenants[2 + i % 6], "plain", n_tokens=300) for i in range(6)]
    f = faults.agent.arm("decode", "double_alloc", params={"pages": 390}, count=1) if mutate else None
    h = faults.agent.arm("prefill", "hold", target={"rid": a.rid}, params={"max_hold_s": 30})
    path = run_dir / "suites" / f"matrix_shared_{'mut' if mutate else 'clean'}_{trial}.events.jsonl"
    t0 = time.time()
    with EventLog(path) as log:
        snapshot(cluster, log, "before", answer=False, settle_s=45)
        with cf.ThreadPoolExecutor(2) as ex:
            fa = ex.submit(run_plans, cluster.endpoints.router, [a], log, concurrency=1, timeout_s=60)
            faults.agent.wait_event("prefill", "fault_fired", fault=h.id, phase="held", timeout=60)
            fb = ex.submit(run_plans, cluster.endpoints.router, [b], log, concurrency=1, timeout_s=60)
            time.sleep(0.5)  # B reaches decode's pre-allocation
            if f is not None:
                faults.agent.wait_event("decode", "fault_fired", fault=f.id, timeout=30)
            h.release()
            fa.result(), fb.result()
        run_plans(cluster.endpoints.router, tail, log, concurrency=6, timeout_s=60)
        faults.heal_all()
        snapshot(cluster, log, "after", settle_s=45)
        faults.copy_agent_events(log, since=t0)
    ev = log.records
    ref = {}
    for p in (a, b, *tail):
        r = httpx.post(reference.endpoints.router + "/generate", timeout=120,
                       json={"text": p.prompt, "sampling_params": {"max_new_tokens": p.max_new_tokens, "temperature": 0}})
        ref[p.rid] = r.json()
    verdicts = [oracles.isolation(ev), oracles.liveness(ev, bound_s=60), oracles.differential(ev, ref)]
    (path.parent / (path.name.replace(".events.jsonl", ".verdicts.json"))).write_text(
        json.dumps([x.to_dict() for x in verdicts], indent=2, default=str))
    v = _by(verdicts)
    iso, diff = v["isolation"], v["differential"]
    detected = iso.status == oracles.FAIL or diff.status == oracles.FAIL
    pair = {a.rid, b.rid}
    ok_witness = (all({w["victim_rid"], w["owner_rid"]} == pair for w in iso.witnesses) if iso.witnesses
                  else bool(diff.witnesses) and all(w.get("rid") in pair for w in diff.witnesses))
    ends = {e["rid"]: e["wall"] for e in ev if e.get("ev") == "end"}
    first = min((ends[w["victim_rid"]] for w in iso.witnesses), default=None) if iso.witnesses else \
        (ends.get(a.rid) if diff.witnesses else None)
    return {"detected": detected, "oracle": "isolation" if iso.witnesses else "differential",
            "witness_ok": ok_witness, "time_to_detection_s": (first - t0) if first else None,
            "verdicts": {k: x.status for k, x in v.items()}, "witness": (iso.witnesses or diff.witnesses)[:1]}


CLASSES = {
    "reject_admitted": scenario_oversized,
    "early_free": scenario_abort_in_flight,
    "double_alloc": scenario_shared_pages,
}


def _run(request, cluster, faults, run_dir, cls, mutate, trials):
    fn = CLASSES[cls]
    out = []
    for trial in range(trials):
        extra = (request.getfixturevalue("reference_server"),) if fn is scenario_shared_pages else ()
        r = fn(cluster, faults, run_dir, trial, mutate, *extra)
        faults.log.emit("matrix_trial", cls=cls, mutate=mutate, trial=trial, **r)
        print(cls, "mutated" if mutate else "clean", trial, json.dumps(r, default=str)[:400])
        out.append(r)
    RESULTS[(cls, "mutated" if mutate else "clean")] = out
    _write(run_dir)
    return out


def _write(run_dir):
    rows = []
    for (cls, arm), trials in sorted(RESULTS.items()):
        det = [t for t in trials if t["detected"]]
        ttd = [t["time_to_detection_s"] for t in det if t["time_to_detection_s"] is not None]
        rows.append({"class": cls, "arm": arm, "trials": len(trials), "detected": len(det),
                     "rate": len(det) / len(trials), "time_to_first_detection_s": min(ttd) if ttd else None,
                     "per_trial": [t["detected"] for t in trials]})
    (run_dir / "detection_matrix.json").write_text(json.dumps(rows, indent=2, default=str))
    print("\nclass            arm      detected  rate   first detection")
    for r in rows:
        t = f"{r['time_to_first_detection_s']:.1f} s" if r["time_to_first_detection_s"] is not None else "-"
        print(f"{r['class']:16s} {r['arm']:8s} {r['detected']}/{r['trials']}       {r['rate']:.2f}   {t}")


@pytest.mark.parametrize("cls", list(CLASSES))
def test_mutation_is_detected(request, cluster, faults, kvchaos_run_dir, cls):
    trials = _run(request, cluster, faults, kvchaos_run_dir, cls, True, TRIALS)
    for t in trials:
        assert t["detected"], f"{cls}: trial missed by every oracle: {t}"
        assert t["witness_ok"], f"{cls}: detected, but the witness does not name the bug's victim: {t['witness']}"
    if cls == "reject_admitted":
        # the GLM-5.3 class: caught on the first oversized request. The hard per-run check is the incident
        # suite's (test_glm53_kv_leak); here the first request's stale pages may hold only pages of
        # requests outside this scenario's log (CI saw 1 of 2 trials), so it is measured and must hold
        # in at least one trial
        rate = sum(t["first_request_caught"] for t in trials) / len(trials)
        faults.log.emit("observed", first_request_caught_rate=rate)
        assert rate > 0, trials


@pytest.mark.parametrize("cls", list(CLASSES))
def test_no_mutation_no_alarm(request, cluster, faults, kvchaos_run_dir, cls):
    trials = _run(request, cluster, faults, kvchaos_run_dir, cls, False, CLEAN_TRIALS)
    for t in trials:
        assert not t["detected"], f"{cls}: false alarm on the unmutated engine: {t}"
        bad = {k: s for k, s in t["verdicts"].items() if s != oracles.PASS}
        assert not bad, f"{cls}: unmutated scenario not PASS on every oracle: {bad}"
