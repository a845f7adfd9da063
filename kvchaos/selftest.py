"""Planted-leak self-test, run once per session right after the cluster is up, through the same
experiment runner as every suite.

Two requests get another tenant's prompt text planted into theirs (``faults.request.plant_leak``).
The isolation oracle must FAIL with witnesses naming exactly those victims and donors, and nothing
else; the run must also carry enough echo evidence (the sensitivity floor) that its other replies
would have shown a leak. Outcomes:

- ``caught``: a clean catch. Isolation verdicts of the session may PASS.
- ``unknown``: the served model cannot show a leak (not enough echo). The policy then makes every
  isolation verdict of the session UNKNOWN (red) unless a blind model was declared.
- ``missed``: the model echoes but the planted leak went unseen, or a witness names a request that
  was not planted: the harness cannot be trusted; :class:`SelfTestFailed` errors every test.
"""

from __future__ import annotations

import json

from faults.request import expect_caught, plant_leak
from kvchaos import oracles
from kvchaos.experiment import Experiment
from kvchaos.workload import Workload

N_REQUESTS = 80  # the sensitivity floor needs >= 59 echoing replies for a 95 % lower bound of 0.95


class SelfTestFailed(RuntimeError):
    pass


def planted_leak_selftest(cluster, run_dir, policy=None, seed: int = 4242) -> dict:
    wl = Workload(seed, n_tenants=8, prefix="selftest-")
    plans = [wl.request(wl.tenants[i % 8], n_tokens=160 + 5 * i) for i in range(N_REQUESTS)]
    ex = Experiment("selftest", plans, [oracles.Isolation(), oracles.Sensitivity()], cluster=cluster,
                    run_dir=run_dir, path=run_dir / "selftest.events.jsonl", test_id="session: planted-leak self-test",
                    seed=seed, policy=policy, settle_s=0, probe_before=False,
                    timeout_s=cluster.spec.request_timeout_s)
    with ex:
        planted = [plant_leak(plans[1], plans[0], ex.log), plant_leak(plans[6], plans[3], ex.log)]
    ex.judge(planted="two leaks planted by faults.request.plant_leak", isolation=oracles.FAIL)
    v, sens = ex.by["isolation"], ex.by["sensitivity"]
    results = [expect_caught(v, f) for f in planted]
    victims = {f["victim"] for f in planted}
    extra = [w for w in v.witnesses if w["victim_rid"] not in victims]
    out = {"isolation": v.to_dict(), "sensitivity": sens.to_dict(), "faults": planted,
           "caught": [r[0] for r in results], "why": [r[1] for r in results],
           "unplanted_witnesses": extra[:10], "experiment": ex.id}
    if extra:
        out["status"] = "missed"
        out["why"].append(f"{len(extra)} witness(es) name requests nothing was planted in "
                          f"(first: {extra[0]['victim_rid']} got {extra[0]['matched']!r}): a real leak or a false alarm")
    elif sens.status != oracles.PASS:
        out["status"] = oracles.UNKNOWN
    elif all(r[0] for r in results):
        out["status"] = "caught"
    else:
        out["status"] = "missed"
    (run_dir / "selftest.json").write_text(json.dumps(out, indent=2, default=str))
    if out["status"] == "missed":
        raise SelfTestFailed("planted-leak self-test: the harness did not catch a leak it planted: "
                             + "; ".join(out["why"]) + f" (events: {ex.path})")
    return out
