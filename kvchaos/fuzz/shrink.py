"""Shrink a find's scenario to a smaller one that still shows the same mechanism.

The steps, each kept only when the smaller scenario still shows the find in every one of
``runs_per_attempt`` runs (a leak that shows one run in three must not shrink into a repro that shows
one run in ten):

1. drop each nemesis op (with the ops that wait for it);
2. drop each live knob;
3. drop plans, in halves, then quarters, ... (ddmin's complement steps); plans an op names are kept, and
   a kept plan that waited for a dropped one waits for nothing. Earlier traffic that filled the pages
   a leak reads stays because dropping it loses the leak, not because anything knows it matters;
4. shorten prompts (the filler between canaries halved, canaries and trigger kept).

Bounded by ``max_attempts`` and ``budget_s``; what it reached is returned with the attempts it took.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

from kvchaos.shrink.scenario import shorten
from kvchaos.workload.scenario import Scenario

from .grammar import _drop


def _named_rids(sc: Scenario) -> set:
    """The plans an op names (kept whole by the plan steps), the request an ``on`` event waits for
    included: without it a step could drop the plan whose first byte an abort waits for, and the abort
    never came."""
    return {r for o in sc.nemesis for r in o.named_rids()}


def _without_plans(sc: Scenario, drop: set) -> Scenario:
    new = Scenario.from_dict(copy.deepcopy(sc.to_dict()))
    keep = [p for p in new.traffic.plans if p["rid"] not in drop]
    kept = {p["rid"] for p in keep}
    for p in keep:
        if p.get("after") is not None and p["after"] not in kept:
            p["after"] = None
    new.traffic.plans = keep
    new.checks = [c for c in new.checks if c["name"] != "differential" or
                  all(r in kept for r in c.get("reference_rids", []))]
    return new


def shrink(sc: Scenario, shows: Callable[[Scenario], bool], *, runs_per_attempt: int = 2, max_attempts: int = 40,
           budget_s: float = 600.0, clock=time.monotonic) -> tuple[Scenario, dict]:
    """``shows(scenario) -> bool``: one run showed the find. Returns the smallest scenario reached and
    what it took: attempts, accepted steps, and the sizes before and after."""
    t0 = clock()
    stats = {"attempts": 0, "accepted": [], "before": _size(sc)}

    def still(cand: Scenario) -> bool:
        for _ in range(runs_per_attempt):
            if stats["attempts"] >= max_attempts or clock() - t0 > budget_s:
                return False
            stats["attempts"] += 1
            if not shows(cand):
                return False
        return True

    cur = sc
    i = len(cur.nemesis) - 1
    while i >= 0:  # 1. ops, newest first (an op another waits for goes with it)
        cand = Scenario.from_dict(copy.deepcopy(cur.to_dict()))
        _drop(cand, i)
        if still(cand.validate()):
            cur = cand
            stats["accepted"].append(f"dropped op {i}")
        i = min(i - 1, len(cur.nemesis) - 1)
    for k in sorted(cur.deployment.live):  # 2. live knobs
        cand = Scenario.from_dict(copy.deepcopy(cur.to_dict()))
        del cand.deployment.live[k]
        if still(cand.validate()):
            cur = cand
            stats["accepted"].append(f"dropped live knob {k}")
    n = 2  # 3. plans: complements of n chunks, n doubling
    while True:
        free = [p["rid"] for p in cur.traffic.plans if p["rid"] not in _named_rids(cur)]
        if len(free) < 1 or n > 2 * len(free):
            break
        size = max(1, len(free) // n)
        chunks = [set(free[j:j + size]) for j in range(0, len(free), size)]
        progressed = False
        for ch in chunks:
            cand = _without_plans(cur, ch)
            if cand.traffic.plans and still(cand.validate()):
                cur = cand
                stats["accepted"].append(f"dropped {len(ch)} plan(s)")
                progressed = True
                break
        if not progressed:
            if size == 1:
                break
            n *= 2
    cand = Scenario.from_dict(copy.deepcopy(cur.to_dict()))  # 4. shorter prompts, all at once
    changed = False
    for p in cand.traffic.plans:
        if p.get("oversized") or (p.get("extra") or {}).get("probe") or p.get("sharing", "none") != "none":
            continue
        short = shorten(p["prompt"])
        if short is not None:
            p["prompt"], p["n_tokens"], changed = short, len(short), True
    if changed and still(cand.validate()):
        cur = cand
        stats["accepted"].append("shortened prompts")
    stats["after"] = _size(cur)
    stats["elapsed_s"] = round(clock() - t0, 1)
    cur.origin = {**cur.origin, "by": "shrink", "parent": sc.digest()}
    return cur, stats


def _size(sc: Scenario) -> dict:
    return {"plans": len(sc.traffic.plans), "ops": len(sc.nemesis), "live_knobs": len(sc.deployment.live),
            "prompt_chars": sum(len(p["prompt"]) for p in sc.traffic.plans)}
