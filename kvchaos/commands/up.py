"""``kvchaos up``: stand up a cluster, print its URLs (and write them to ``--urls-file``), keep it
serving until Ctrl-C or SIGTERM."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from kvchaos.commands._common import common, subparser

NAME = "up"
HELP = "stand up a cluster and print its URLs until Ctrl-C"


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    common(sp, cfg)
    sp.add_argument("--urls-file", help="also write the URLs as JSON to this file once the cluster serves")
    return sp


def run(args) -> int:
    # imported here: the cluster and the fault proxy (aiohttp) are heavy, and ``kvchaos --help`` imports
    # every command module
    from faults import AGENT_MODULE, open_network_proxy
    from kvchaos.cluster import Cluster, ClusterSpec

    spec = ClusterSpec.load(args.profile, model=args.model)
    run_dir = Path(args.reports) / ("up-" + time.strftime("%Y%m%d-%H%M%S"))
    c = Cluster(spec, run_dir, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE)
    print(f"kvchaos: starting {spec.name} cluster (logs in {run_dir}/logs) ...", flush=True)
    stop = {"now": False}

    def on_term(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        c.start()
        e = c.endpoints
        urls = {"router": e.router, "prefill": e.prefill, "decode": e.decode, "router_direct": e.router_direct,
                "bootstrap_port": e.bootstrap_port, "timings_s": c.timings, "logs": str(run_dir / "logs")}
        print(json.dumps(urls, indent=2), flush=True)
        if args.urls_file:
            tmp = Path(args.urls_file).with_suffix(".tmp")
            tmp.write_text(json.dumps(urls, indent=2))
            tmp.rename(args.urls_file)  # appears whole: a script may poll for it
        print("kvchaos: attach with --kvchaos-attach "
              f"router={e.router},prefill={e.prefill},decode={e.decode}  (Ctrl-C to stop)", flush=True)
        while not stop["now"]:
            time.sleep(1.0)
            c.check_alive()
    except KeyboardInterrupt:
        pass
    finally:
        left = c.stop()
        print(f"kvchaos: cluster stopped; leftover processes: {left or 'none'}", flush=True)
    return 0
