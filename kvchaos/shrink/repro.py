"""What a shrink's ``repro.py`` runs: the recorded cluster, faults and minimal plans, judged again."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from faults import FaultKit, install
from kvchaos import httpclient, oracles
from kvchaos.cluster import Cluster, ClusterSpec, SingleServer
from kvchaos.cluster.reaper import Reaper
from kvchaos.experiment import Experiment
from kvchaos.workload import EventLog, RequestPlan
from kvchaos.workload.scenario import Op

from .scenario import arm
from .target import still_fails


def reproduce(minimal_dir, times: int = 1) -> int:
    """What a shrink's ``repro.py`` runs, ``times`` times, each on a fresh cluster of the one recorded in
    ``minimal_dir/minimal.json`` (and one single reference server for a differential target): arm the
    recorded faults, send the minimal plans, print the verdicts. Returns how many failed the same way."""
    res = json.loads((Path(minimal_dir) / "minimal.json").read_text())
    sc = res["scenario"]
    spec = ClusterSpec.from_dict(res["cluster"]["spec"])
    plans = [RequestPlan(**{k: v for k, v in p.items() if k != "prompt_chars"}) for p in sc["plans"]]
    checks = [oracles.Isolation(), oracles.Sensitivity(), oracles.HttpSemantics(), oracles.KVLifecycle(),
              oracles.CacheIsolation(), oracles.Liveness(bound_s=sc["timeout_s"])]
    target = (res["target"]["oracle"], {tuple(k) for k in res["target"]["witness_kinds"]})
    work = Path(tempfile.mkdtemp(prefix="kvchaos-repro-"))
    install()  # the cluster's embedded network proxy and its engines' agent
    reaper = Reaper("kvc-repro")
    ref = None
    hits = 0
    try:
        if target[0] == "differential":  # the same prompts served alone by a clean single server
            ref = SingleServer(spec, work / "reference", reaper=reaper).start()
            body = lambda p: {"text": p.prompt, "sampling_params": {"max_new_tokens": p.max_new_tokens,  # noqa: E731
                                                                     "temperature": 0}}
            checks.append(oracles.Differential(lambda _ev: {
                p.rid: httpclient.post(ref.endpoints.router + "/generate", json=body(p), timeout=120).json() for p in plans}))
        for i in range(1, times + 1):
            c = Cluster(spec, work / f"cluster-{i}", reaper=reaper).start()
            try:
                with EventLog(work / f"faults-{i}.jsonl") as flog:
                    kit = FaultKit(c, flog)
                    ex = Experiment(f"repro-{i}", plans, checks, cluster=c, faults=kit, run_dir=work,
                                    concurrency=sc["concurrency"], timeout_s=sc["timeout_s"], via=sc["via"])
                    with ex:
                        if sc.get("nemesis"):  # the experiment's own ops (ex.nemesis), as the shrink kept them
                            ex.nemesis([Op.from_dict(d, f"faults[{j}]", j) for j, d in enumerate(sc["faults"])],
                                       sc.get("gates") or {})
                        else:
                            for f in sc["faults"]:
                                arm(kit, f)
            finally:
                c.stop()
            hit = still_fails(ex.verdicts, target)
            hits += hit
            print(f"repro {i} (fresh cluster): " + ", ".join(f"{v.oracle} {v.status}" for v in ex.verdicts)
                  + (" — REPRODUCED" if hit else ""), flush=True)
    finally:
        if ref is not None:
            ref.stop()
        reaper.close()
    print(f"reproduced {hits}/{times}, each on a fresh cluster (logs: {work})")
    return hits
