"""Provoke the 'plain request hangs at the start of a burst' failure and measure its rate.

Hypothesis: the router reuses a pooled router->prefill keep-alive connection just as prefill's
uvicorn closes it (SGLANG_TIMEOUT_KEEP_ALIVE = 5 s); the prefill leg fails at transport level,
sglang-router's PD dispatch `tokio::join!`s prefill+decode, decode waits for KV forever.

Usage: provoke.py LAYOUT LABEL [--no-proxy] [--keepalive N] [--trials N] [--k K]
Writes $OUT/LABEL.json and keeps the cluster logs in $OUT/LABEL/ (OUT defaults to /tmp/boot-hang/out).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import threading
import time
import urllib.parse

import faults.proxy as fproxy
from faults import open_network_proxy
from kvchaos.cluster import Cluster
from kvchaos.provoke import spec_for

OUT = os.environ.get("OUT", "/tmp/boot-hang/out")
LINKS: list[dict] = []
_orig_pipe = fproxy.Proxy._pipe


async def _pipe(self, link, stream, reader, writer):
    if self.name.endswith("-prefill"):
        rec = getattr(link, "_rec", None)
        if rec is None:
            try:
                up_port = link.uw.get_extra_info("sockname")[1]
            except Exception:
                up_port = None
            rec = link._rec = {"created": time.time(), "up_port": up_port,
                               "upstream": [], "downstream": [], "eof": {}, "err": {}}
            LINKS.append(rec)
        orig_read = reader.read

        async def read(n=-1):
            try:
                d = await orig_read(n)
            except BaseException as e:  # noqa: BLE001
                rec["err"][stream] = (time.time(), repr(e))
                raise
            if d:
                rec[stream].append((time.time(), len(d), bytes(d[:60])))
            else:
                rec["eof"][stream] = time.time()
            return d

        reader.read = read
    return await _orig_pipe(self, link, stream, reader, writer)


fproxy.Proxy._pipe = _pipe

ALPHA = "abcdefghijklmnopqrstuvwxyz "


def one(url: str, rid: str, n_chars: int, timeout: float, out: list):
    u = urllib.parse.urlparse(url)
    prompt = "".join(random.choice(ALPHA) for _ in range(n_chars))
    body = json.dumps({"text": prompt, "rid": rid,
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).encode()
    t0 = time.time()
    rec = {"rid": rid, "sent": t0, "n": n_chars}
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        c.request("POST", "/generate", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        rec.update(status=r.status, outcome="ok" if r.status == 200 else f"http{r.status}")
        c.close()
    except TimeoutError:
        rec.update(outcome="timeout")
    except Exception as e:  # noqa: BLE001
        rec.update(outcome="error", error=repr(e))
    rec["end"] = time.time()
    rec["latency"] = rec["end"] - t0
    out.append(rec)


def burst(url: str, tag: str, k: int, timeout: float) -> list:
    out: list = []
    ths = [threading.Thread(target=one, args=(url, f"{tag}-{i:02d}", random.randint(200, 450), timeout, out))
           for i in range(k)]
    for t in ths:
        t.start()
        time.sleep(0.01)
    for t in ths:
        t.join()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("layout")
    ap.add_argument("label")
    ap.add_argument("--no-proxy", action="store_true")
    ap.add_argument("--keepalive", type=int, default=None)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hang-s", type=float, default=20.0)
    ap.add_argument("--gaps", default="3.0,3.5,4.0,4.5,4.75,5.0")
    ap.add_argument("--precise", type=int, default=0, help="N single-request trials at idle X~U(lo,hi) after the prefill leg")
    ap.add_argument("--lo", type=float, default=4.985)
    ap.add_argument("--hi", type=float, default=5.02)
    a = ap.parse_args()
    random.seed(a.label)
    gaps = [float(x) for x in a.gaps.split(",")]
    over = {"agent": False}  # no agent: the hang is the engines' and the router's alone
    if a.no_proxy:
        over["network_proxy"] = ""
    spec = spec_for(a.layout, f"boot-hang {a.label}", **over)
    if a.keepalive is not None:
        spec.env = {**spec.env, "SGLANG_TIMEOUT_KEEP_ALIVE": str(a.keepalive)}
    outdir = os.path.join(OUT, a.label)
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir)
    t0 = time.monotonic()
    c = Cluster(spec, outdir, proxy_factory=None if a.no_proxy else open_network_proxy).start()
    print(f"[{a.label}] cluster up in {time.monotonic() - t0:.0f}s router={c.endpoints.router}", flush=True)
    results = {"label": a.label, "layout": a.layout, "proxy": not a.no_proxy, "keepalive": a.keepalive,
               "k": a.k, "trials": []}
    try:
        url = c.endpoints.router
        burst(url, f"{a.label}-warm0", a.k, a.hang_s)
        last_end = time.time()
        results["precise"] = []
        for i in range(a.precise):
            time.sleep(0.3)
            tds = [x[0] for L in LINKS for x in L["downstream"]]
            x = random.uniform(a.lo, a.hi)
            if a.no_proxy or not tds:
                target = last_end + x
            else:
                target = max(tds) + x
            time.sleep(max(0.0, target - time.time()))
            out: list = []
            one(url, f"{a.label}-p{i:03d}", random.randint(200, 450), a.hang_s, out)
            r = out[0]
            r["x"] = x
            results["precise"].append(r)
            print(f"[{a.label}] precise {i} x={x:.4f}: {r['outcome']} {r['latency']:.2f}s", flush=True)
            last_end = r["end"]
            if r["outcome"] != "ok":
                time.sleep(1.0)
        for i in range(a.trials):
            gap = gaps[i % len(gaps)]
            time.sleep(max(0.0, last_end + gap - time.time()))
            t_b = time.time()
            rs = burst(url, f"{a.label}-b{i:02d}", a.k, a.hang_s)
            hung = [r for r in rs if r["outcome"] != "ok"]
            results["trials"].append({"i": i, "gap": gap, "t": t_b, "reqs": rs})
            print(f"[{a.label}] trial {i} gap {gap}s: {len(rs) - len(hung)}/{len(rs)} ok, "
                  f"not ok: {[(r['rid'], r['outcome'], round(r['latency'], 1)) for r in hung]}", flush=True)
            if hung:  # decode pages of hung ones are released at client disconnect; rewarm the pool
                time.sleep(1.0)
                burst(url, f"{a.label}-rewarm{i:02d}", a.k, a.hang_s)
            last_end = max(r["end"] for r in rs) if not hung else time.time()
    finally:
        results["links"] = LINKS
        c.stop()
        with open(os.path.join(OUT, a.label + ".json"), "w") as f:
            json.dump(results, f, default=lambda o: o.decode("latin1") if isinstance(o, bytes) else str(o))
        n = sum(len(t["reqs"]) for t in results["trials"])
        h = sum(1 for t in results["trials"] for r in t["reqs"] if r["outcome"] != "ok")
        pn = len(results.get("precise", []))
        ph = sum(1 for r in results.get("precise", []) if r["outcome"] != "ok")
        print(f"[{a.label}] precise: {ph}/{pn} not ok", flush=True)
        print(f"[{a.label}] DONE: {h}/{n} requests not ok in {len(results['trials'])} bursts", flush=True)


if __name__ == "__main__":
    main()
