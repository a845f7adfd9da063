"""Planted-leak self-test, run once per session right after the cluster is up, through the same
experiment runner as every suite.

Two requests get another tenant's prompt text planted into theirs (``faults.request.plant_leak``).
The isolation oracle must FAIL with witnesses naming exactly those victims and donors; the run must
also carry enough echo evidence (the sensitivity floor) that its other replies would have shown a leak.

What nothing planted explains is the engine's own doing — an **engine leak during self-test**: a
foreign canary in a reply nothing was planted in (or of an owner other than the planted donor), a reply
that is not what its prompt must give (integrity: a planted victim's prompt carries the donor's text, so
it must recite that too), a page held twice (page_ownership), a late write (kv_lifecycle). The self-test
experiment is then judged as any experiment — not as a planted one — on those verdicts alone: red,
FAIL, its witnesses named, recorded so in the run (the run's exit code follows: ``kvchaos.plugin``); the
planted leaks' catch is reported beside it (``planted_caught``).

Outcomes (``status``):

- ``caught``: a clean catch. Isolation verdicts of the session may PASS.
- ``engine_leak``: the engine leaked during the self-test (above). With the planted leaks caught the
  harness is not blind: the session's verdicts stand, and the run is red for the self-test's FAIL.
- ``unknown``: the served model cannot show a leak (not enough echo). The policy then makes every
  isolation verdict of the session UNKNOWN (red) unless a blind model was declared.
- ``missed``: the model echoes, the engine did nothing nothing planted explains, and the planted leak
  went unseen: the harness cannot be trusted; :class:`SelfTestFailed` errors every test.
"""

from __future__ import annotations

import json

from faults.request import expect_caught, plant_leak
from kvchaos import oracles
from kvchaos.experiment import Experiment
from kvchaos.policy import is_leak_checker
from kvchaos.workload import Workload

N_REQUESTS = 80  # the sensitivity floor needs >= 59 echoing replies for a 95 % lower bound of 0.95
ENGINE_LEAK = "engine leak during self-test"


class SelfTestFailed(RuntimeError):
    pass


def planted_leak_selftest(cluster, run_dir, policy=None, seed: int = 4242) -> dict:
    """The self-test's result (module doc); its experiment is ``cluster.selftest_experiment`` afterwards
    (``kvchaos fuzz`` triages an engine leak it saw like any run's)."""
    out, _ex = run_selftest(cluster, run_dir, policy, seed)
    return out


def run_selftest(cluster, run_dir, policy=None, seed: int = 4242) -> tuple[dict, Experiment]:
    wl = Workload(seed, n_tenants=8, prefix="selftest-")
    plans = [wl.request(wl.tenants[i % 8], n_tokens=160 + 5 * i) for i in range(N_REQUESTS)]
    ex = Experiment("selftest", plans, [oracles.Isolation(), oracles.Sensitivity()], cluster=cluster,
                    run_dir=run_dir, path=run_dir / "selftest.events.jsonl", test_id="session: planted-leak self-test",
                    seed=seed, policy=policy, settle_s=0, probe_before=False, faults=_evidence_kit(cluster),
                    timeout_s=cluster.spec.request_timeout_s)
    with ex:
        planted = [plant_leak(plans[1], plans[0], ex.log), plant_leak(plans[6], plans[3], ex.log)]
    ex.judge(planted="two leaks planted by faults.request.plant_leak", isolation=oracles.FAIL)
    v, sens = ex.by["isolation"], ex.by["sensitivity"]
    results = [expect_caught(v, f) for f in planted]
    engine = engine_leaks(ex.verdicts, planted)
    caught = all(r[0] for r in results)
    extra = [w for e in engine if e.oracle == "isolation" for w in e.witnesses]
    out = {"isolation": v.to_dict(), "sensitivity": sens.to_dict(), "faults": planted,
           "caught": [r[0] for r in results], "why": [r[1] for r in results], "planted_caught": caught,
           "unplanted_witnesses": extra[:10], "experiment": ex.id,
           "engine_leaks": [{"oracle": e.oracle, "summary": e.summary, "witnesses": [dict(w) for w in e.witnesses[:5]]}
                            for e in engine]}
    if engine:
        out["status"] = "engine_leak"
        out["why"].append(f"{ENGINE_LEAK}: " + "; ".join(f"{e.oracle}: {e.summary}" for e in engine)[:1500])
        # judged as the run's own experiment, on what the engine did alone: red, and recorded so
        ex.verdicts = engine + [x for x in ex.verdicts if not is_leak_checker(x.oracle)]
        ex.judge()
    elif sens.status != oracles.PASS:
        out["status"] = oracles.UNKNOWN
    elif caught:
        out["status"] = "caught"
    else:
        out["status"] = "missed"
    (run_dir / "selftest.json").write_text(json.dumps(out, indent=2, default=str))
    cluster.selftest_experiment = ex
    if out["status"] == "missed":
        raise SelfTestFailed("planted-leak self-test: the harness did not catch a leak it planted: "
                             + "; ".join(out["why"]) + f" (events: {ex.path})")
    return out, ex


def _evidence_kit(cluster):
    """A fault kit whose only use here is the engines' own events (the ownership ledger, transfers, releases)
    joining the self-test's log, so page_ownership and kv_lifecycle judge it too; None for a cluster without
    the in-engine agent. Nothing is armed through it."""
    if not (getattr(cluster, "agent_dir", None) or getattr(cluster, "agent_urls", None)):
        return None
    from faults import FaultKit  # on use: the fault layer, as the suites' kit
    from kvchaos.workload import EventLog

    return FaultKit(cluster, EventLog())


def engine_leaks(verdicts, planted: list[dict]) -> list:
    """The leak checkers' FAILs of a self-test that nothing planted explains, each a FAIL verdict of its
    own that says so: isolation's witnesses but those naming a planted victim and its donor's canary;
    every other leak checker's FAIL whole (a planted prompt changes only what its victim must recite)."""
    pairs = {(f["victim"], f["donor"]) for f in planted}
    donated = {(f["victim"], c) for f in planted for c in f["canaries"]}
    out = []
    for v in verdicts:
        if v.status != oracles.FAIL or not is_leak_checker(v.oracle):
            continue
        ws = list(v.witnesses)
        if v.oracle == "isolation":
            ws = [w for w in ws if not ((w.get("victim_rid"), w.get("owner_rid")) in pairs
                                        and (w.get("victim_rid"), w.get("canary")) in donated)]
        if not ws:
            continue
        first = ws[0].line() if hasattr(ws[0], "line") else str(ws[0])
        why = f"{ENGINE_LEAK}: {len(ws)} witness(es) nothing planted explains (first: {first})"
        out.append(oracles.Verdict(v.oracle, oracles.FAIL, why[:1200], ws, {**v.stats, "selftest": "engine leak"}))
    return out
