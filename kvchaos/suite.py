"""Shared steps of a chaos suite: run a workload under armed faults, then judge the event log.

    ev, verdicts = run_judged(cluster, faults, kvchaos_run_dir, "transfer_delay", plans,
                              [oracles.isolation, lambda ev: oracles.liveness(ev, bound_s=60)])

writes ``<run dir>/suites/<name>.events.jsonl`` and ``<name>.verdicts.json``. The KV pools are probed
before (settled) and after (faults healed first, then given ``settle_s`` to drain: SGLang holds a failed
or aborted transfer's decode pages up to SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, 30 s).
"""

from __future__ import annotations

import json

from kvchaos.workload import EventLog, run_plans
from kvchaos.workload.probes import snapshot

SETTLE_S = 45.0


def run_judged(cluster, faults, run_dir, name: str, plans, judges, concurrency: int = 8,
               timeout_s: float = 60.0, settle_s: float = SETTLE_S):
    path = run_dir / "suites" / f"{name}.events.jsonl"
    with EventLog(path) as log:
        log.emit("run", name=name, n=len(plans))
        snapshot(cluster, log, "before", answer=False, settle_s=settle_s)
        run_plans(cluster.endpoints.router, plans, log, concurrency=concurrency, timeout_s=timeout_s,
                  abort_urls=(cluster.endpoints.prefill, cluster.endpoints.decode))
        faults.heal_all()  # heal before the "after" probe: the pool must be back at baseline
        snapshot(cluster, log, "after", settle_s=settle_s)
    ev = log.records
    verdicts = [judge(ev) for judge in judges]
    (path.parent / f"{name}.verdicts.json").write_text(
        json.dumps([v.to_dict() for v in verdicts], indent=2, default=str))
    for v in verdicts:
        print(v)
    return ev, verdicts
