"""Provoke sglang-router-drops-cache-salt against a running PD cluster (e.g. `kvchaos up`).

    python provoke.py ROUTER_URL PREFILL_URL DECODE_URL BOOTSTRAP_PORT [--out DIR]

Builds a scenario per path (``DIR/router.scenario.json``, ``DIR/direct.scenario.json``: five prompts that share the workload's public system
prompt, from tenants without a salt, under salt "A" and under salt "B", one at a time; it replays on a
kvchaos cluster with ``kvchaos fuzz --replay``, where ``cache_isolation`` judges it) and sends its plans
through the router and then straight to prefill + decode (the router's own PD dispatch, by hand: the
same body to both with bootstrap_host/port/room), each with kvchaos' driver; then one request with an
int salt each way. Prints HTTP status and meta_info.cached_tokens per request. A router that forwards
cache_salt shows what the direct path shows: 0 cached for the first request of each salt, hits only
within a salt, HTTP 400 for the int (not scenario data: a plan's salt is a string).
No agent is needed; the event logs are DIR/router.events.jsonl and DIR/direct.events.jsonl."""

import argparse
import concurrent.futures as cf
import os
import random
import time
from urllib.parse import urlsplit

import httpx

from kvchaos.workload import EventLog, Workload, run_plans
from kvchaos.workload.scenario import Deployment, Scenario, Traffic, plan_dict

SALTS = [None, None, "A", "B", "A"]  # tenant t000 unsalted twice, t001 "A", t002 "B", t001 again


def scenario(seed: int, via: str) -> Scenario:
    """The five salted requests as data: fresh prefixes per run (the seed names the public prompt)."""
    tag = f"{seed}"
    wl = Workload(seed, n_tenants=3, prefix="cs", salts={"t001": f"A{tag}", "t002": f"B{tag}"})
    tenants = ["t000", "t000", "t001", "t002", "t001"]
    plans = [wl.request(wl.tenant(t), n_tokens=wl.rng.randrange(560, 640), sharing="public") for t in tenants]
    return Scenario(name="salts", seed=seed, deployment=Deployment(),
                    traffic=Traffic([plan_dict(p) for p in plans], concurrency=1, timeout_s=60.0, via=via),
                    checks=[{"name": "cache_isolation"}, {"name": "isolation"}, {"name": "liveness", "bound_s": 65.0}],
                    origin={"by": "provoke sglang-router-drops-cache-salt"}).validate()


def send(sc: Scenario, out: str, name: str, router: str, pd: dict | None) -> None:
    log = EventLog(os.path.join(out, f"{name}.events.jsonl"))
    with log:
        run_plans(router, sc.traffic.request_plans(), log, concurrency=1, timeout_s=sc.traffic.timeout_s,
                  pd_direct=pd)
    status = {e["rid"]: e.get("status") for e in log.records if e.get("ev") == "status"}
    meta = {e["rid"]: e.get("meta") or {} for e in log.records if e.get("ev") == "body"}
    for p, salt in zip(sc.traffic.plans, SALTS):
        print(f"{name:6s} salt={salt!r:5s} HTTP {status.get(p['rid'])} "
              f"cached_tokens={meta.get(p['rid'], {}).get('cached_tokens')}")


def int_salt(url: str, pd: dict | None) -> int:
    body = {"text": "hello " * 20, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "cache_salt": 5}
    if pd is None:
        return httpx.post(url + "/generate", json=body, timeout=60).status_code
    b = {**body, "bootstrap_host": pd["bootstrap_host"], "bootstrap_port": pd["bootstrap_port"],
         "bootstrap_room": random.randrange(2**62)}
    with httpx.Client(timeout=60) as cl, cf.ThreadPoolExecutor(2) as pool:  # both at once, as the router does
        fp = pool.submit(cl.post, pd["prefill"] + "/generate", json=b)
        fd = pool.submit(cl.post, pd["decode"] + "/generate", json=b)
        fp.result()
        return fd.result().status_code


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for a in ("router_url", "prefill_url", "decode_url"):
        ap.add_argument(a)
    ap.add_argument("bootstrap_port", type=int)
    ap.add_argument("--out", default="/tmp/kvchaos-router-salt")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pd = {"prefill": a.prefill_url.rstrip("/"), "decode": a.decode_url.rstrip("/"), "bootstrap_port": a.bootstrap_port,
          "bootstrap_host": urlsplit(a.prefill_url).hostname}
    seed = int(time.time()) % 1_000_000  # a public prompt no earlier run cached
    for name, via, p in (("router", "router", None), ("direct", "pd", pd)):
        sc = scenario(seed + (name == "direct"), via)
        sc.save(os.path.join(a.out, f"{name}.scenario.json"))
        send(sc, a.out, name, a.router_url.rstrip("/"), p)
        print(f"{name:6s} salt=5     HTTP {int_salt(a.router_url.rstrip('/'), p)}")
    print(f"scenarios and event logs: {a.out}")


if __name__ == "__main__":
    main()
