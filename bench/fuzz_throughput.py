"""Scenarios per minute of ``kvchaos fuzz`` on this machine, without and with deployment changes.

Two random-strategy searches of the same budget and seed (the same generator with and without restart
knobs), one after the other, on the real CPU cluster:

- **live knobs only**: restart knobs never drawn, so one cluster serves every scenario;
- **with deployment changes**: restart knobs drawn at 30 % each, every scenario drawn fresh (the random
  strategy: a guided search's corpus mutations keep their parent's deployment, and a first 4-minute run
  of this arm so made no change at all), and a differing scenario switches the cluster at once (no
  queueing), the worst case a search can schedule.

Prints, for each: scenarios run, scenarios per minute, cluster starts and the time they took; then the
ratio of the two rates. Cluster start-up is counted inside each budget (what a search pays). Only a NEW
leak is confirmed (``--confirm leaks``, as CI's smoke search): a first run confirmed a non-leak find and
its 5-minute arm took 627 s for 3 scenarios.

Usage: python bench/fuzz_throughput.py [--budget 5m] [--seed 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvchaos.commands.fuzz import launch, parse_budget  # noqa: E402
from kvchaos.fuzz import grammar, loop  # noqa: E402
from kvchaos.fuzz.corpus import Corpus  # noqa: E402
from kvchaos.fuzz.grammar import Base  # noqa: E402
from kvchaos.policy import Registry  # noqa: E402
from kvchaos.workload.scenario import Deployment  # noqa: E402


def one(label: str, budget: float, seed: int, out: Path, restart_p: float, switch_after: int,
        strategy: str = "guided") -> dict:
    grammar.WEIGHTS["restart_knob"] = restart_p
    loop.SWITCH_AFTER = switch_after
    starts = []
    start, stop = launch("cpu", None, out / "clusters")

    def timed_start(dep):
        t0 = time.monotonic()
        cur = start(dep)
        starts.append(time.monotonic() - t0)
        return cur
    clusters = loop.Clusters(timed_start, stop)
    t0 = time.monotonic()
    (cluster, _kit, _policy), _ = clusters.get(Deployment())
    base = Base.of_cluster(cluster)
    fz = loop.Fuzzer(clusters=clusters, base=base, registry=Registry.load(), out=out, corpus=Corpus(out / "corpus"),
                     seed=seed, budget_s=budget - (time.monotonic() - t0), strategy=strategy, say=lambda m: None,
                     confirm_all=False)
    s = fz.run()
    wall = time.monotonic() - t0
    r = {"label": label, "execs": s["execs"], "wall_s": round(wall, 1), "per_min": round(60 * s["execs"] / wall, 2),
         "cluster_starts": len(starts), "start_s": round(sum(starts), 1), "errors": s["errors"]}
    print(f"{label:28s} {r['execs']:4d} scenarios in {r['wall_s']:6.1f} s = {r['per_min']:5.2f}/min; "
          f"{r['cluster_starts']} cluster start(s), {r['start_s']:.0f} s of them; {r['errors']} not run", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="5m")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    budget = parse_budget(a.budget)
    out = Path(a.out or tempfile.mkdtemp(prefix="kvchaos-fuzz-bench-"))
    live = one("live knobs only", budget, a.seed, out / "live", 0.0, 10**9, strategy="random")
    dep = one("with deployment changes", budget, a.seed, out / "deploy", 0.3, 1, strategy="random")
    ratio = dep["per_min"] / live["per_min"] if live["per_min"] else float("nan")
    print(f"ratio with-deployment-changes / live-only: {ratio:.2f} (scenarios per minute); out {out}")


if __name__ == "__main__":
    main()
