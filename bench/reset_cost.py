"""Per-test reset cost vs a fresh cluster — why suites share one session cluster.

In one run: start the real CPU cluster cold (and later stop it): that is what a fresh cluster per test
would cost. Between, N times, do what the ``faults`` fixture does after every test: arm an in-engine
fault and a proxy toxic, send one request through them, then ``FaultKit.heal_all()`` (heal every
injector, check nothing stays armed, wait until the cluster serves again). Prints the median reset,
the fresh start+stop, and their ratio.

Usage: python bench/reset_cost.py [--profile cpu] [-n 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import FaultKit  # noqa: E402
from faults import AGENT_MODULE, open_network_proxy  # noqa: E402 - the fault layer's network proxy
from kvchaos.cluster import Cluster, ClusterSpec  # noqa: E402
from kvchaos.cluster.argv import resolve_model  # noqa: E402
from kvchaos.workload import EventLog  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("-n", type=int, default=10)
    args = ap.parse_args()
    spec = ClusterSpec.load(args.profile)
    resolve_model(spec)
    resets = []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        c = Cluster(spec, d, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
        start_s = time.monotonic() - t0
        try:
            with EventLog(Path(d) / "reset.jsonl") as log:
                for i in range(args.n):
                    kit = FaultKit(c, log)
                    kit.agent.arm("prefill", "delay", target={"rid": f"reset-{i}"}, params={"ms": 50})
                    if kit.net is not None:
                        kit.net.toxic("client", "latency", latency=20)
                    r = c.generate(text=f"reset probe {i}", max_new_tokens=2, rid=f"reset-{i}", timeout=60)
                    assert r.status_code == 200, r.text
                    t1 = time.monotonic()
                    problems = kit.heal_all()
                    resets.append(time.monotonic() - t1)
                    assert not problems, problems
        finally:
            t2 = time.monotonic()
            left = c.stop()
            stop_s = time.monotonic() - t2
    fresh = start_s + stop_s
    med = statistics.median(resets)
    print(f"fresh cluster: start {start_s:.1f} s + stop {stop_s:.1f} s = {fresh:.1f} s (leftover {left or 'none'})")
    print(f"reset between tests (heal agent + proxy, armed check, serve again), n={args.n}: median {med:.3f} s, "
          f"max {max(resets):.3f} s")
    print(f"ratio reset/fresh = {med / fresh:.4f} ({fresh / med:.0f}x cheaper per test)")


if __name__ == "__main__":
    main()
