"""What every finding's provoke.py shares: its command line (trials, control trials, layout, output
folder) and its own PD cluster (the CPU profile, with the kvchaos agent and the network fault proxy)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repo root

from faults import AGENT_MODULE, open_network_proxy  # noqa: E402
from kvchaos.cluster import Cluster, ClusterSpec  # noqa: E402
from kvchaos.cluster.layouts import apply, parse  # noqa: E402


def parser(doc: str, out: str, control_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--control", type=int, default=3, help=control_help)
    ap.add_argument("--layout", default=None, help="a KV layout name (default: the CPU profile's own)")
    ap.add_argument("--out", default=out)
    return ap


def check(ap: argparse.ArgumentParser, a) -> None:
    if a.trials < 1 or a.control < 0:
        ap.error("--trials >= 1, --control >= 0")


def start_cluster(a, source: str) -> Cluster:
    """A fresh ``a.out`` and a cluster of the CPU profile (``a.layout`` applied) with its logs under
    ``a.out/cluster``; prints how long it took to come up."""
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    base = ClusterSpec.load("cpu")
    data = apply(base.to_dict(), parse(a.layout)) if a.layout else base.to_dict()
    spec = ClusterSpec.from_dict(data, source=source)
    t0 = time.monotonic()
    c = Cluster(spec, os.path.join(a.out, "cluster"), proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
    print(f"cluster up in {time.monotonic() - t0:.0f} s; router {c.endpoints.router}", flush=True)
    return c
