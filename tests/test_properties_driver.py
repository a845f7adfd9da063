"""The generators' records are the driver's (property 5 of ``tests/test_properties.py``): every clean
and noise shape and every leak variant's victim, sent as bytes by a local server to the real
``kvchaos.workload.driver.Driver``, is logged exactly as ``tests/strategies``' :func:`exchange` logs it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from kvchaos.workload.driver import Driver
from kvchaos.workload.events import EventLog

from tests import strategies as S
from tests.property_harness import canonical


# ------------------------------------------------------------------------------ 5. the driver's records
def _driver_cases() -> list:
    """(plan, wire) of every clean and noise shape and of every leak variant's victim (router mode)."""
    m = S.Mint("xdrv", 1)
    cases = []
    for ep in S.PATHS:
        for d in S.DELIVERIES:
            r = S.clean_request(m, ep, d, 2)
            cases.append((r.plan, r.wire))
        for what in S.NOISE:
            if what != "leg_error":
                r = S.noise_request(m, what, ep, False)
                cases.append((r.plan, r.wire))
    for cls in sorted(S.VARIANTS):
        for v in sorted(S.VARIANTS[cls]):
            for spec in canonical(cls, v).build(True):
                if spec.pd or type(spec) is not S.LogSpec:
                    continue
                for r in spec.reqs:
                    if r.special is None and r.plan.rid in (spec.meta.get("victims") or ()):
                        cases.append((dataclasses.replace(r.plan, rid=f"{cls}.{v}.{r.plan.rid}"), r.wire))
    # an abort must come after the bytes were sent (the generator's 5-200 ms can race a local server)
    return [(dataclasses.replace(p, abort_after_ms=150.0) if p.kind == "abort_after" else p, w) for p, w in cases]


async def _drive(cases, timeout_s: float) -> list[dict]:
    """The real driver against a server that sends each plan's wire: its body bytes, then EOF, a
    connection cut short of its Content-Length, or silence (abort, disconnect, timeout)."""
    wires = {p.rid: w for p, w in cases}
    handlers = set()

    async def serve(reader, writer):
        handlers.add(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            req = json.loads(await reader.readexactly(n))
            if head.split(b" ")[1] == b"/abort_request":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                await writer.drain()
                return
            w = wires[req["rid"]]
            if w.status is not None:
                sse = req.get("stream") and w.status == 200
                framing = b"Content-Length: %d\r\n" % (len(w.body) + 100) if w.end == "cut" else b""
                writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\n%sConnection: close\r\n\r\n"
                             % (w.status, b"text/event-stream" if sse else b"application/json", framing) + w.body)
                await writer.drain()
            if w.status is None or w.end in ("abort", "timeout", "disconnect"):
                await asyncio.sleep(30)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            handlers.discard(asyncio.current_task())

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    log = EventLog()
    try:
        d = Driver(url, log, concurrency=1, timeout_s=timeout_s, abort_urls=(url, url))
        for p, _w in cases:
            await d.run([p])
    finally:
        srv.close()
        for t in list(handlers):
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
    return log.records


def _comparable(records) -> dict:
    """Per rid, its records without what differs by run: times, URLs, the bounds, a cut's framing."""
    out = {}
    for r in records:
        if r["ev"] == "plan":
            continue
        r = {k: v for k, v in r.items() if k not in ("t", "wall", "latency_s", "url", "after_ms", "bound_s")}
        if "Response payload is not completed" in str(r.get("error")):
            r["error"] = "ClientPayloadError(payload not completed)"  # chunked vs Content-Length wording
        out.setdefault(r["rid"], []).append(r)
    return out


def test_generated_records_are_the_drivers():
    cases = _driver_cases()
    real = _comparable(asyncio.run(_drive(cases, timeout_s=0.5)))
    mem = S.EventLog()
    for p, w in cases:
        S.exchange(mem, p, w)
    model = _comparable(mem.records)
    differ = [rid for rid in model if model[rid] != real.get(rid)]
    detail = "\n".join(f"{rid}:\n  driver:    {json.dumps(real.get(rid))[:700]}\n"
                       f"  generator: {json.dumps(model[rid])[:700]}" for rid in differ[:3])
    assert not differ, f"{len(differ)} of {len(cases)} replies logged differently by the driver\n{detail}"
