"""Added latency of the toxiproxy-compatible fault proxy (faults/proxy/), as ratios measured in one run.

1. Loopback HTTP micro-benchmark: a tiny keep-alive HTTP server answered directly and through the
   proxy (no toxics), sequential (interleaved, so drift hits both arms) and at concurrency 32. The
   proxy runs in the benchmark's own process, as it does in the pytest process (embedded mode):
   the concurrency figure includes that GIL sharing with the client.
2. The real CPU cluster (unless --no-cluster): /generate (8 new tokens) through the client-side
   proxy vs straight to the router, on the same cluster in the same run. The router→server hops
   are proxied in both arms (the router is launched with proxy URLs); --full adds a second cluster
   with no proxy at all for the end-to-end ratio.

Usage: python bench/proxy_overhead.py [-n 300] [--no-cluster] [--full]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults.proxy import ProxyServer, toxiproxy_client  # noqa: E402


class _H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else Nagle + delayed ACK adds 40 ms to every reply

    def do_GET(self):  # noqa: N802
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def paired(url_a: str, url_b: str, n: int, method="GET", json=None) -> tuple[list[float], list[float]]:
    """Latency of ``n`` requests to each URL, interleaved a, b, a, b ... so drift hits both arms."""
    a, b = [], []
    with httpx.Client(timeout=60) as c:
        for _ in range(3):
            c.request(method, url_a, json=json)
            c.request(method, url_b, json=json)
        for _ in range(n):
            for url, acc in ((url_a, a), (url_b, b)):
                t = time.perf_counter()
                r = c.request(method, url, json=json)
                acc.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text[:200]
    return a, b


async def _conc(url: str, n: int, conc: int) -> float:
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conc)) as c:
        async def one():
            async with sem:
                r = await c.get(url)
                assert r.status_code == 200
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t)


def row(name, direct, proxied):
    d50, p50 = statistics.median(direct), statistics.median(proxied)
    d99, p99 = _pct(direct, 0.99), _pct(proxied, 0.99)
    print(f"{name}: direct p50 {d50 * 1e3:.3f} ms p99 {d99 * 1e3:.3f} ms | proxied p50 {p50 * 1e3:.3f} ms "
          f"p99 {p99 * 1e3:.3f} ms | added p50 {(p50 - d50) * 1e3:.3f} ms | ratio p50 {p50 / d50:.3f}, p99 {p99 / d99:.3f}")


def micro(n: int):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    px = ProxyServer().start()
    tp = toxiproxy_client("127.0.0.1", px.port)
    p = tp.create(upstream=f"127.0.0.1:{srv.server_address[1]}", name="bench")
    direct_url, proxy_url = f"http://127.0.0.1:{srv.server_address[1]}/", f"http://{p.listen}/"
    row(f"loopback HTTP, sequential, n={n}", *paired(direct_url, proxy_url, n))
    d = asyncio.run(_conc(direct_url, n * 4, 32))
    q = asyncio.run(_conc(proxy_url, n * 4, 32))
    print(f"loopback HTTP, concurrency 32, n={n * 4}: direct {d:.0f} req/s | proxied {q:.0f} req/s | ratio {q / d:.3f}")
    px.stop()
    srv.shutdown()


def cluster(n: int, full: bool):
    from faults import AGENT_MODULE, open_network_proxy
    from kvchaos.cluster import Cluster, ClusterSpec

    body = {"text": "kvchaos proxy bench " * 10 + "[", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    with tempfile.TemporaryDirectory() as d:
        spec = ClusterSpec.load("cpu", network_proxy="embedded")
        with Cluster(spec, d, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE) as c:
            e = c.endpoints
            direct, proxied = paired(e.router_direct + "/generate", e.router + "/generate", n, "POST", body)
            row(f"CPU PD cluster /generate, client->router hop, n={n}", direct, proxied)
        if full:
            spec0 = ClusterSpec.load("cpu", network_proxy="")
            with Cluster(spec0, d + "/noproxy", agent_module=AGENT_MODULE) as c0:
                none, _ = paired(c0.endpoints.router + "/generate", c0.endpoints.router + "/generate", n, "POST", body)
            row(f"CPU PD cluster /generate, no proxy vs all three hops proxied, n={n}", none, proxied)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--no-cluster", action="store_true")
    ap.add_argument("--full", action="store_true")
    a = ap.parse_args()
    micro(a.n)
    if not a.no_cluster:
        cluster(a.n, a.full)


if __name__ == "__main__":
    main()
