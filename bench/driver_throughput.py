"""Workload driver throughput and overhead, and how many requests one process keeps in flight.

A loopback aiohttp server in its own process answers ``/generate`` after ``--delay`` seconds with the
prompt's canaries (like the probe model). The same N requests are sent twice, interleaved per round:
  * by kvchaos' driver (``run_plans``: plans, events to a JSONL file, every reply parsed), and
  * by a bare ``aiohttp`` loop (the driver's transport) with the same semaphore and connection limit
    (no events), and by a bare ``httpx.AsyncClient`` loop (the transport the driver used before),
and the driver's throughput is printed as a ratio to each bare loop, with the per-request overhead and
the peak number of requests in flight (from the driver's own send/end events). Then the isolation
oracle's pass over the log is timed against the wall time of the run.

Usage: python bench/driver_throughput.py [-n 2000] [--concurrency 512] [--delay 0.5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httpx  # noqa: E402

from kvchaos import canary, oracles  # noqa: E402
from kvchaos.workload import EventLog, Workload, run_plans  # noqa: E402


def _serve(port: int, delay: float, ready):
    from aiohttp import web

    async def generate(request):
        body = await request.json()
        await asyncio.sleep(delay)
        reply = "".join(canary.payload(c) + "][" for _, c in canary.find(body.get("text", "")))
        return web.json_response({"text": reply, "output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)

    async def main():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def _bare_aiohttp(url: str, plans, concurrency: int, timeout: float) -> float:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout)) as c:
        async def one(p):
            async with sem:
                async with c.post(url + "/generate", json={"text": p.prompt, "rid": p.rid, "stream": False,
                                                           "sampling_params": {"max_new_tokens": p.max_new_tokens}}) as r:
                    await r.json()
                    assert r.status == 200
        await asyncio.gather(*(one(p) for p in plans))
    return time.monotonic() - t0


async def _bare_httpx(url: str, plans, concurrency: int, timeout: float) -> float:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)) as c:
        async def one(p):
            async with sem:
                r = await c.post(url + "/generate", json={"text": p.prompt, "rid": p.rid, "stream": False,
                                                          "sampling_params": {"max_new_tokens": p.max_new_tokens}})
                r.json()
                assert r.status_code == 200
        await asyncio.gather(*(one(p) for p in plans))
    return time.monotonic() - t0


def peak_in_flight(records) -> int:
    pts = sorted([(e["t"], 1) for e in records if e["ev"] == "send"] + [(e["t"], -1) for e in records if e["ev"] == "end"],
                 key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, d in pts:
        cur += d
        peak = max(peak, cur)
    return peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--delay", type=float, default=0.5, help="server think time per request, s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-httpx", action="store_true", help="skip the (slow) httpx baseline")
    args = ap.parse_args()
    port = _free_port()
    ready = mp.Event()
    srv = mp.Process(target=_serve, args=(port, args.delay, ready), daemon=True)
    srv.start()
    try:
        if not ready.wait(30):
            raise SystemExit("loopback server did not start")
        url = f"http://127.0.0.1:{port}"
        wl = Workload(seed=11, n_tenants=32, prefix="bench-")
        plans = [wl.request(wl.tenants[i % 32], n_tokens=200) for i in range(args.n)]
        drv, bare, bare_hx, peaks, scan = [], [], [], [], []
        with tempfile.TemporaryDirectory() as d:
            for rnd in range(args.rounds):
                bare.append(asyncio.run(_bare_aiohttp(url, plans, args.concurrency, 60)))
                if not args.no_httpx:
                    bare_hx.append(asyncio.run(_bare_httpx(url, plans, args.concurrency, 60)))
                with EventLog(Path(d) / f"r{rnd}.jsonl") as log:
                    t0 = time.monotonic()
                    run_plans(url, plans, log, concurrency=args.concurrency, timeout_s=60)
                    drv.append(time.monotonic() - t0)
                ends = [e for e in log.records if e["ev"] == "end"]
                assert len(ends) == args.n and all(e["outcome"] == "ok" for e in ends), "driver lost or failed requests"
                peaks.append(peak_in_flight(log.records))
                t1 = time.monotonic()
                v = oracles.isolation(log.records)
                scan.append(time.monotonic() - t1)
                assert v.status == oracles.PASS, v
    finally:
        srv.terminate()
        srv.join(10)
    md, mb = statistics.median(drv), statistics.median(bare)
    ideal = args.n / args.concurrency * args.delay
    print(f"{args.n} requests, concurrency {args.concurrency}, server delay {args.delay} s, {args.rounds} rounds "
          f"(ideal wall {ideal:.2f} s)")
    print(f"kvchaos driver: {md:.2f} s = {args.n / md:.0f} req/s | bare aiohttp loop: {mb:.2f} s = {args.n / mb:.0f} "
          f"req/s | throughput ratio driver/bare = {mb / md:.3f}; overhead {1000 * (md - mb) / args.n:.3f} ms/request")
    if bare_hx:
        mh = statistics.median(bare_hx)
        print(f"bare httpx loop (the driver's transport before): {mh:.2f} s = {args.n / mh:.0f} req/s | "
              f"ratio driver/httpx = {mh / md:.2f}")
    print(f"peak requests in flight from one process: {max(peaks)} of {args.concurrency} allowed "
          f"(ratio {max(peaks) / args.concurrency:.3f})")
    print(f"isolation oracle over the log: {statistics.median(scan):.3f} s = {statistics.median(scan) / md:.3f} "
          f"of the run's wall time")


if __name__ == "__main__":
    main()
