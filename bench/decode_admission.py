"""What decode's per-request reservation costs the CPU cluster's throughput — measured on one cluster.

The CPU profile's decode pool holds 2048 tokens and SGLang reserves ``num_reserved_decode_tokens`` (512 by
default) for every request it holds, so decode admits two or three requests at a time (the clean
control's mean decode batch: 1.5). The suites are bound by that admission, not by the harness
(bench/RESULTS.md, "Where the cluster session's time goes"). This bench runs the clean control's
traffic (``suites/test_clean_control.py``: N requests, 32 tenants, concurrency 64, the four endpoints)
on one cluster at SGLang's default reservation, then with the reservation lowered on the live decode
process (the in-engine agent's ``retract`` switch with ``interval`` 0 and ``reserve``: only
``DecodePreallocQueue.num_reserved_decode_tokens`` changes; healed afterwards), and prints each run's
wall time, the verdicts, and the ratio. Each arm must stay clean (isolation and liveness PASS): a
faster arm that leaks or hangs is no option.

``--order lowered,default,lowered`` (any sequence of the two) runs the arms in that order on the same cluster,
so a warm-up of the freshly started cluster cannot pass for the reservation's effect; the ratio is the mean
wall of the lowered arms over the mean of the default ones.

Usage: python bench/decode_admission.py [--profile cpu] [-n 300] [--reserve 128] [--order default,lowered]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import AGENT_MODULE, FaultKit, open_network_proxy  # noqa: E402
from kvchaos.cluster import Cluster, ClusterSpec  # noqa: E402
from kvchaos.cluster.argv import resolve_model  # noqa: E402
from kvchaos.experiment import Experiment  # noqa: E402
from kvchaos.oracles import Isolation, Liveness  # noqa: E402
from kvchaos.policy import Policy  # noqa: E402
from kvchaos.workload import EventLog, Workload  # noqa: E402

SEED, N_TENANTS, CONCURRENCY = 20261130, 32, 64  # the clean control's


def run_arm(cluster, run_dir: Path, n: int, reserve: int | None, i: int = 0) -> dict:
    wl = Workload(SEED, n_tenants=N_TENANTS, prefix=f"adm{reserve or 'd'}{i}-")
    plans = wl.mix(n, weights={"plain": 3, "stream": 1}, lengths=(64, 500),
                   endpoints=("generate", "generate", "completions", "chat"))
    log = EventLog(run_dir / f"faults-{i}-{reserve or 'default'}.jsonl")
    kit = FaultKit(cluster, log)
    if reserve is not None:
        kit.agent.arm("decode", "retract", params={"interval": 0, "reserve": reserve})
    ex = Experiment(f"admission-{i}-{reserve or 'default'}", plans, [Isolation(), Liveness(bound_s=cluster.spec.request_timeout_s)],
                    cluster=cluster, run_dir=run_dir, faults=kit, seed=SEED, concurrency=CONCURRENCY,
                    timeout_s=cluster.spec.request_timeout_s, settle_s=0, policy=Policy())
    t0 = time.monotonic()
    try:
        with ex:
            pass
    finally:
        left = kit.heal_all()
    wall = time.monotonic() - t0
    return {"reserve": reserve or "default (512)", "requests": len(plans), "wall_s": round(wall, 1),
            "verdicts": {v.oracle: v.status for v in ex.verdicts}, "left_armed": left}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("-n", type=int, default=300, help="requests per arm [300]")
    ap.add_argument("--reserve", type=int, default=128, help="the lowered reservation, tokens [128]")
    ap.add_argument("--order", default="default,lowered",
                    help="the arms in the order they run, comma-separated: default, lowered [default,lowered]")
    args = ap.parse_args(argv)
    if args.n < 20 or args.reserve < 1:
        ap.error("-n must be >= 20 (the sensitivity floor) and --reserve >= 1")
    order = [a.strip() for a in args.order.split(",")]
    if set(order) != {"default", "lowered"}:
        ap.error(f"--order {args.order!r}: a comma-separated sequence of 'default' and 'lowered', each at least once")
    spec = ClusterSpec.load(args.profile)
    resolve_model(spec)
    with tempfile.TemporaryDirectory() as d:
        cluster = Cluster(spec, d, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
        try:
            # every arm sends the same prompts and canaries (one seed); its rids carry its place in the order
            rows = [run_arm(cluster, Path(d), args.n, None if a == "default" else args.reserve, i)
                    for i, a in enumerate(order)]
        finally:
            cluster.stop()
    for r in rows:
        print(f"reserve {str(r['reserve']):14s} {r['requests']} requests in {r['wall_s']:7.1f} s   "
              f"verdicts {r['verdicts']}" + (f"   LEFT ARMED {r['left_armed']}" if r["left_armed"] else ""))
    walls = {a: [r["wall_s"] for r, o in zip(rows, order) if o == a] for a in ("default", "lowered")}
    mean = {a: sum(w) / len(w) for a, w in walls.items()}
    print(f"order {','.join(order)}; ratio mean wall(reserve {args.reserve}) / mean wall(default) = "
          f"{mean['lowered'] / mean['default']:.2f}")
    clean = all(v == "pass" for r in rows for k, v in r["verdicts"].items() if k in ("isolation", "liveness"))
    print("both arms clean (isolation and liveness PASS)" if clean else "NOT CLEAN: an arm failed isolation or liveness")
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
