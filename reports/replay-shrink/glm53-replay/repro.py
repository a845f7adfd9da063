"""Self-contained repro written by ``kvchaos shrink``: start the recorded cluster, arm the recorded
faults, send the minimal plans, print the verdicts. Needs kvchaos and the engine; run it from the
kvchaos checkout: ``python repro.py [--times N]``."""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from faults import FaultKit, install_network_proxy
from kvchaos import oracles
from kvchaos.cluster import Cluster, ClusterSpec
from kvchaos.cluster.reaper import Reaper
from kvchaos.experiment import Experiment
from kvchaos.shrink import arm, still_fails
from kvchaos.workload import EventLog, RequestPlan

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--times", type=int, default=1)
    args = ap.parse_args()
    res = json.loads((HERE / "minimal.json").read_text())
    sc = res["scenario"]
    spec = ClusterSpec.from_dict(res["cluster"]["spec"])
    plans = [RequestPlan(**{k: v for k, v in p.items() if k != "prompt_chars"}) for p in sc["plans"]]
    checks = [oracles.Isolation(), oracles.Sensitivity(), oracles.HttpSemantics(), oracles.KVLifecycle(),
              oracles.CacheIsolation(), oracles.Liveness(bound_s=sc["timeout_s"])]
    target = (res["target"]["oracle"], {tuple(k) for k in res["target"]["witness_kinds"]})
    work = Path(tempfile.mkdtemp(prefix="kvchaos-repro-"))
    from kvchaos import canary

    canary.SESSION.add_plans({p.rid: {"canaries": p.canaries, "tenant": p.tenant} for p in plans}, "repro")
    install_network_proxy()  # network faults: the cluster's embedded proxy
    reaper = Reaper("kvc-repro")
    c = Cluster(spec, work, reaper=reaper).start()
    ref = None
    hits = 0
    try:
        if target[0] == "differential":  # the same prompts served alone by a clean single server
            import httpx

            from kvchaos.cluster import SingleServer

            ref = SingleServer(spec, work / "reference", reaper=reaper).start()
            body = lambda p: {"text": p.prompt, "sampling_params": {"max_new_tokens": p.max_new_tokens,  # noqa: E731
                                                                     "temperature": 0}}
            checks.append(oracles.Differential(lambda _ev: {
                p.rid: httpx.post(ref.endpoints.router + "/generate", json=body(p), timeout=120).json() for p in plans}))
        for i in range(1, args.times + 1):
            with EventLog(work / f"faults-{i}.jsonl") as flog:
                kit = FaultKit(c, flog)
                ex = Experiment(f"repro-{i}", plans, checks, cluster=c, faults=kit, run_dir=work,
                                concurrency=sc["concurrency"], timeout_s=sc["timeout_s"], via=sc["via"])
                with ex:
                    for f in sc["faults"]:
                        arm(kit, f)
            hit = still_fails(ex.verdicts, target)
            hits += hit
            print(f"repro {i}: " + ", ".join(f"{v.oracle} {v.status}" for v in ex.verdicts)
                  + (" — REPRODUCED" if hit else ""))
    finally:
        if ref is not None:
            ref.stop()
        c.stop()
        reaper.close()
    print(f"reproduced {hits}/{args.times} (logs: {work})")
    return 0 if hits else 1


if __name__ == "__main__":
    sys.exit(main())
