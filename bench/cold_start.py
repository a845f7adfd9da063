"""Cold start, idle CPU and memory of the embedded CPU cluster — measured in one run.

Prints, for the real prefill+decode+router cluster:
  * cold start to healthy router (both workers healthy and one request round-tripped), and the
    same for one single (non-disaggregated) server, as a ratio;
  * idle CPU of all cluster processes over a window, as % of one core, and — unless --no-baseline —
    the same with --sleep-on-idle removed (the busy-polling schedulers), as a ratio;
  * resident memory of the cluster, and teardown time.

Usage: python bench/cold_start.py [--profile cpu] [--idle-window 10] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import AGENT_MODULE, open_network_proxy  # noqa: E402 - the fault layer's network proxy
from kvchaos.cluster import Cluster, ClusterSpec, SingleServer  # noqa: E402
from kvchaos.cluster.argv import resolve_model  # noqa: E402
from kvchaos.cluster.procs import tree_pids  # noqa: E402


def _procs(pids):
    out = []
    for p in pids:
        try:
            out.append(psutil.Process(p))
        except psutil.NoSuchProcess:
            pass
    return out


def idle_cpu(pids, window: float) -> float:
    """CPU used by ``pids`` over ``window`` seconds, as % of one core."""
    procs = _procs(pids)

    def total():
        t = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return t

    time.sleep(2.0)  # let the warmup request's tail settle
    a, t0 = total(), time.monotonic()
    time.sleep(window)
    return 100.0 * (total() - a) / (time.monotonic() - t0)


def rss_mb(pids) -> float:
    s = 0
    for p in _procs(pids):
        try:
            s += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return s / 2**20


def measure_cluster(spec, window):
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        c = Cluster(spec, d, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
        cold = time.monotonic() - t0
        try:
            pids = c.all_pids()
            cpu = idle_cpu(pids, window)
            mem = rss_mb(pids)
        finally:
            t1 = time.monotonic()
            left = c.stop()
            down = time.monotonic() - t1
    return {"cold_start_s": cold, "servers_healthy_s": c.timings.get("servers_healthy_s"),
            "idle_cpu_pct_of_core": cpu, "rss_mb": mem, "processes": len(pids), "teardown_s": down,
            "leftover": left}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--idle-window", type=float, default=10.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the busy-poll baseline cluster")
    args = ap.parse_args()
    spec = ClusterSpec.load(args.profile)
    resolve_model(spec)  # generate the tiny model outside the timed region

    pd = measure_cluster(spec, args.idle_window)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        s = SingleServer(spec, d).start()
        single_cold = time.monotonic() - t0
        try:
            time.sleep(2.0)
            single_rss = rss_mb(tree_pids([s.proc.pgid], s.token))
        finally:
            s.stop()
    res = {"pd": pd, "single_cold_start_s": single_cold, "single_rss_mb": single_rss}
    if not args.no_baseline:
        busy = ClusterSpec.load(args.profile, common_args=[a for a in spec.common_args if a != "--sleep-on-idle"])
        res["busy_poll"] = measure_cluster(busy, args.idle_window)

    print(json.dumps(res, indent=2))
    print(f"cold start to healthy router: {pd['cold_start_s']:.1f} s "
          f"(servers healthy {pd['servers_healthy_s']:.1f} s); single server {single_cold:.1f} s; "
          f"ratio PD/single = {pd['cold_start_s'] / single_cold:.2f}")
    print(f"idle cluster CPU: {pd['idle_cpu_pct_of_core']:.2f} % of one core over {args.idle_window:.0f} s "
          f"({pd['processes']} processes, RSS {pd['rss_mb']:.0f} MiB, teardown {pd['teardown_s']:.1f} s, "
          f"leftover {pd['leftover'] or 'none'})")
    print(f"memory of the CPU cluster: {pd['rss_mb']:.0f} MiB RSS (prefill + decode + router); single server "
          f"{single_rss:.0f} MiB; ratio PD/single = {pd['rss_mb'] / single_rss:.2f}")
    if "busy_poll" in res:
        b = res["busy_poll"]
        print(f"idle CPU without --sleep-on-idle: {b['idle_cpu_pct_of_core']:.1f} % of one core; "
              f"ratio sleep-on-idle/busy-poll = {pd['idle_cpu_pct_of_core'] / max(b['idle_cpu_pct_of_core'], 1e-9):.4f}")


if __name__ == "__main__":
    main()
