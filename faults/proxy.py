"""A TCP fault proxy that speaks the toxiproxy HTTP API (asyncio, no dependencies).

No toxiproxy server can be installed on the CPU machines (it is a Go binary), so this module
implements the part of toxiproxy 2.x that chaos tests use, closely enough that the official
``toxiproxy-python`` client drives it unchanged. When a real ``toxiproxy-server`` is configured
(``KVCHAOS_TOXIPROXY=host:port``), :func:`connect` returns a client for it instead and nothing
here runs.

API (same paths, bodies and status codes as toxiproxy):

- ``GET /version``; ``POST /reset`` (enable every proxy, drop every toxic) → 204
- ``GET /proxies`` → ``{name: proxy}``; ``POST /proxies`` ``{name, listen, upstream, enabled}``
  → 201 (409 if the name exists, 400 on a bad body); ``POST /populate`` ``[proxy, ...]``
- ``GET|POST|DELETE /proxies/{name}`` (POST updates ``enabled``/``upstream``/``listen``)
- ``GET|POST /proxies/{name}/toxics``; ``GET|POST|DELETE /proxies/{name}/toxics/{toxic}``

Toxics (``stream`` = ``upstream`` client→server or ``downstream`` server→client, ``toxicity`` =
probability that the toxic applies to a connection, drawn once per connection):

========== ======================================== ==========================================
type       attributes                               effect
========== ======================================== ==========================================
latency    ``latency`` ms, ``jitter`` ms            every chunk delivered ``latency±jitter`` late
                                                    (pipelined: order kept, throughput kept)
bandwidth  ``rate`` KB/s                            chunks paced to the rate
slow_close ``delay`` ms                             the close is delayed
timeout    ``timeout`` ms                           data is dropped; the connection is closed
                                                    after ``timeout`` (0: never, until removed)
reset_peer ``timeout`` ms                           connection reset (RST) after ``timeout``
limit_data ``bytes``                                connection closed once that many bytes passed
slicer     ``average_size``, ``size_variation``      chunks cut into small writes, ``delay`` µs
           bytes, ``delay`` µs                      apart
========== ======================================== ==========================================

Toxics apply to connections that are already open (pooled router→server connections included):
each chunk looks the current toxic list up. Beyond toxiproxy, every toxic carries ``"fired"``
counters (connections, chunks, bytes it touched) and ``GET /events`` returns the log of what
fired — the proof a fault happened, which a test asserts on. Extra JSON fields are ignored by the
toxiproxy clients.

Every listener binds the address it is given; the API server binds 127.0.0.1 unless told otherwise.
Run standalone: ``python -m faults.proxy --port 8474``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

VERSION = "2.12.0-kvchaos"
TOXIC_TYPES = {
    "latency": {"latency": 0, "jitter": 0},
    "bandwidth": {"rate": 0},
    "slow_close": {"delay": 0},
    "timeout": {"timeout": 0},
    "reset_peer": {"timeout": 0},
    "limit_data": {"bytes": 0},
    "slicer": {"average_size": 0, "size_variation": 0, "delay": 0},
}
STREAMS = ("upstream", "downstream")
CHUNK = 32 * 1024


class ApiError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status, self.msg = status, msg


@dataclass
class Toxic:
    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict
    fired: dict = field(default_factory=lambda: {"connections": 0, "chunks": 0, "bytes": 0})
    added_at: float = field(default_factory=time.monotonic)
    # its draws (toxicity per connection, latency jitter, slice sizes): seeded by the ``seed``
    # attribute (kvchaos' extension; a run's seed reaches its network faults through it)
    rng: random.Random = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.rng is None:
            seed = self.attributes.get("seed")
            self.rng = random.Random(int(seed)) if seed is not None else random.Random()

    @classmethod
    def from_body(cls, body: dict) -> "Toxic":
        if not isinstance(body, dict):
            raise ApiError(400, "toxic: body must be a JSON object")
        ttype = body.get("type")
        if ttype not in TOXIC_TYPES:
            raise ApiError(400, f"toxic: unknown type {ttype!r}; one of {sorted(TOXIC_TYPES)}")
        stream = body.get("stream") or "downstream"
        if stream not in STREAMS:
            raise ApiError(400, f"toxic: stream must be one of {STREAMS}, got {stream!r}")
        tox = body.get("toxicity", 1.0)
        if not isinstance(tox, (int, float)) or not 0.0 <= tox <= 1.0:
            raise ApiError(400, f"toxic: toxicity must be a number in [0, 1], got {tox!r}")
        attrs = dict(TOXIC_TYPES[ttype])
        attrs.update(_check_attrs(ttype, body.get("attributes") or {}))
        name = body.get("name") or f"{ttype}_{stream}"
        return cls(name=name, type=ttype, stream=stream, toxicity=float(tox), attributes=attrs)

    def as_dict(self) -> dict:
        return {"name": self.name, "type": self.type, "stream": self.stream, "toxicity": self.toxicity,
                "attributes": self.attributes, "fired": dict(self.fired)}


def _check_attrs(ttype: str, attrs: dict) -> dict:
    if not isinstance(attrs, dict):
        raise ApiError(400, f"toxic {ttype}: attributes must be an object")
    allowed = {**TOXIC_TYPES[ttype], "seed": 0}  # seed: every type (its draws), kvchaos' extension
    out = {}
    for k, v in attrs.items():
        if k not in allowed:
            raise ApiError(400, f"toxic {ttype}: unknown attribute {k!r}; allowed {sorted(allowed)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ApiError(400, f"toxic {ttype}: attribute {k} must be a non-negative number, got {v!r}")
        out[k] = v
    return out


def _split_hostport(s: str, what: str) -> tuple[str, int]:
    if not isinstance(s, str) or ":" not in s:
        raise ApiError(400, f"{what} must be host:port, got {s!r}")
    host, _, port = s.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise ApiError(400, f"{what} port is not a number: {s!r}") from None
    if not 0 <= p < 65536:
        raise ApiError(400, f"{what} port out of range: {s!r}")
    return host or "127.0.0.1", p


class _Link:
    """One client connection: two pipes, the toxicity draws, the sockets."""

    def __init__(self, proxy: "Proxy", cr, cw, ur, uw):
        self.proxy, self.cr, self.cw, self.ur, self.uw = proxy, cr, cw, ur, uw
        self.draws: dict[tuple[str, int], bool] = {}
        self.sent = {"upstream": 0, "downstream": 0}
        self.closed = False
        self.t0 = time.monotonic()
        self.tasks: list[asyncio.Task] = []

    def active(self, stream: str) -> list[Toxic]:
        out = []
        for t in list(self.proxy.toxics.values()):
            if t.stream != stream:
                continue
            key = (t.name, id(t))
            if key not in self.draws:
                self.draws[key] = t.toxicity >= 1.0 or t.rng.random() < t.toxicity
                if self.draws[key]:
                    t.fired["connections"] += 1
            if self.draws[key]:
                out.append(t)
        return out

    def close(self, reset: bool = False):
        if self.closed:
            return
        self.closed = True
        for w in (self.cw, self.uw):
            try:
                if reset:
                    sock = w.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.close()
            except Exception:
                pass
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self.proxy.links.discard(self)


class Proxy:
    def __init__(self, server: "ProxyServer", name: str, listen: str, upstream: str, enabled: bool = True):
        self.server, self.name, self.upstream = server, name, upstream
        self.listen = listen
        self.enabled = False
        self.toxics: dict[str, Toxic] = {}
        self.links: set[_Link] = set()
        self._srv: asyncio.base_events.Server | None = None
        self._want_enabled = enabled

    def as_dict(self) -> dict:
        return {"name": self.name, "listen": self.listen, "upstream": self.upstream, "enabled": self.enabled,
                "toxics": [t.as_dict() for t in self.toxics.values()]}

    async def start(self):
        if self.enabled:
            return
        host, port = _split_hostport(self.listen, "listen")
        try:
            self._srv = await asyncio.start_server(self._accept, host, port, reuse_address=True)
        except OSError as e:
            raise ApiError(500, f"proxy {self.name}: cannot listen on {self.listen}: {e}") from None
        real = self._srv.sockets[0].getsockname()
        self.listen = f"{real[0]}:{real[1]}"
        self.enabled = True

    async def stop(self):
        if self._srv is not None:
            self._srv.close()
            self._srv = None
        for link in list(self.links):
            link.close()
        self.enabled = False

    async def _accept(self, cr, cw):
        host, port = _split_hostport(self.upstream, "upstream")
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection(host, port), 10.0)
        except Exception as e:
            self.server.event("upstream_unreachable", proxy=self.name, upstream=self.upstream, error=repr(e))
            cw.close()
            return
        if not self.enabled:  # disabled while we were connecting upstream: drop, like toxiproxy
            uw.close()
            cw.close()
            return
        link = _Link(self, cr, cw, ur, uw)
        self.links.add(link)
        link.tasks = [asyncio.ensure_future(self._pipe(link, "upstream", cr, uw)),
                      asyncio.ensure_future(self._pipe(link, "downstream", ur, cw))]
        # reset_peer / timeout toxics act on the connection even when no data flows
        link.tasks.append(asyncio.ensure_future(self._watch(link)))

    async def _watch(self, link: _Link):
        while not link.closed:
            now = time.monotonic()
            for stream in STREAMS:
                for t in link.active(stream):
                    if t.type in ("reset_peer", "timeout"):
                        ms = t.attributes.get("timeout", 0)
                        start = max(link.t0, t.added_at)
                        if t.type == "timeout" and ms == 0:
                            continue
                        if now - start >= ms / 1000.0:
                            t.fired["chunks"] += 0
                            self.server.event(t.type, proxy=self.name, toxic=t.name, stream=stream,
                                              after_ms=round((now - start) * 1000, 1))
                            link.close(reset=t.type == "reset_peer")
                            return
            await asyncio.sleep(0.005)

    async def _pipe(self, link: _Link, stream: str, reader, writer):
        """Read chunks, pass each through the active toxics, write. Latency is pipelined via a queue."""
        q: asyncio.Queue = asyncio.Queue()

        async def deliver():
            next_free = 0.0
            while True:
                item = await q.get()
                if item is None:
                    break
                arrival, data = item
                toxics = link.active(stream)
                for t in toxics:
                    if t.type == "latency":
                        lat = t.attributes["latency"] + t.rng.uniform(-1, 1) * t.attributes["jitter"]
                        wait = arrival + max(lat, 0) / 1000.0 - time.monotonic()
                        if wait > 0:
                            await asyncio.sleep(wait)
                        self._fire(t, data)
                if link.closed:
                    return
                if any(t.type == "timeout" for t in link.active(stream)):
                    for t in link.active(stream):
                        if t.type == "timeout":
                            self._fire(t, data)
                    continue  # dropped
                for t in toxics:
                    if t.type == "limit_data":
                        budget = t.attributes["bytes"] - link.sent[stream]
                        if len(data) >= budget:
                            data = data[:max(budget, 0)]
                            await self._write(writer, data)
                            link.sent[stream] += len(data)
                            self._fire(t, data)
                            self.server.event("limit_data", proxy=self.name, toxic=t.name, stream=stream,
                                              bytes=link.sent[stream])
                            link.close()
                            return
                slicer = next((t for t in toxics if t.type == "slicer"), None)
                pieces = [data]
                if slicer is not None:
                    pieces = _slice(data, slicer.attributes, slicer.rng)
                    self._fire(slicer, data)
                bw = next((t for t in toxics if t.type == "bandwidth"), None)
                for i, piece in enumerate(pieces):
                    if slicer is not None and i:
                        await asyncio.sleep(slicer.attributes["delay"] / 1e6)
                    if bw is not None and bw.attributes["rate"] > 0:
                        now = time.monotonic()
                        start = max(now, next_free)
                        next_free = start + len(piece) / (bw.attributes["rate"] * 1000.0)
                        await asyncio.sleep(next_free - now)  # a piece leaves when its slot ends
                        self._fire(bw, piece)
                    await self._write(writer, piece)
                    link.sent[stream] += len(piece)

        dtask = asyncio.ensure_future(deliver())
        link.tasks.append(dtask)
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                await q.put((time.monotonic(), data))
        except (ConnectionError, asyncio.CancelledError, OSError):
            pass
        finally:
            await q.put(None)
        try:
            await dtask
        except (ConnectionError, asyncio.CancelledError, OSError):
            pass
        if link.closed:
            return
        sc = next((t for t in link.active(stream) if t.type == "slow_close"), None)
        if sc is not None:
            self._fire(sc, b"")
            self.server.event("slow_close", proxy=self.name, toxic=sc.name, stream=stream,
                              delay_ms=sc.attributes["delay"])
            await asyncio.sleep(sc.attributes["delay"] / 1000.0)
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except Exception:
            pass
        # when both directions have finished, close
        if all(t.done() or t is asyncio.current_task() for t in link.tasks[:2]):
            link.close()

    @staticmethod
    async def _write(writer, data: bytes):
        if data:
            writer.write(data)
            await writer.drain()

    def _fire(self, t: Toxic, data: bytes):
        t.fired["chunks"] += 1
        t.fired["bytes"] += len(data)


def _slice(data: bytes, a: dict, rng: random.Random) -> list[bytes]:
    avg = int(a.get("average_size") or 0)
    var = int(a.get("size_variation") or 0)
    if avg <= 0:
        return [data]
    out, i = [], 0
    while i < len(data):
        n = max(1, avg + rng.randint(-var, var) if var else avg)
        out.append(data[i:i + n])
        i += n
    return out


class ProxyServer:
    """The API server and every proxy, on one asyncio loop (its own thread, or the caller's)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.proxies: dict[str, Proxy] = {}
        self.events: list[dict] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._api: asyncio.base_events.Server | None = None
        self._lock = asyncio.Lock

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 10.0) -> "ProxyServer":
        """Run in a daemon thread; returns once the API is listening."""
        ready = threading.Event()
        err: list[BaseException] = []

        def main():
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self._start_api())
            except BaseException as e:  # noqa: BLE001
                err.append(e)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._shutdown())
            self.loop.close()

        self._thread = threading.Thread(target=main, name="kvchaos-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"proxy API did not start within {timeout}s")
        if err:
            raise err[0]
        return self

    def stop(self, timeout: float = 10.0):
        if self.loop and self._thread and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start_api(self):
        self._api = await asyncio.start_server(self._http, self.host, self.port, reuse_address=True)
        self.port = self._api.sockets[0].getsockname()[1]

    async def _shutdown(self):
        for p in list(self.proxies.values()):
            await p.stop()
        if self._api:
            self._api.close()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def event(self, kind: str, **fields):
        self.events.append({"t": time.monotonic(), "wall": time.time(), "ev": "fault", "fault": kind,
                            "source": "proxy", **fields})

    # ---------------------------------------------------------------- HTTP
    async def _http(self, reader, writer):
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError,
                        asyncio.LimitOverrunError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _ = lines[0].split(" ", 2)
                except ValueError:
                    await self._respond(writer, 400, {"error": "bad request line", "status": 400}, close=True)
                    return
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length") or 0)
                if n > 1 << 20:
                    await self._respond(writer, 413, {"error": "body too large", "status": 413}, close=True)
                    return
                raw = await reader.readexactly(n) if n else b""
                try:
                    body = json.loads(raw) if raw.strip() else None
                except json.JSONDecodeError as e:
                    status, payload = 400, {"error": f"bad json: {e}", "status": 400}
                else:
                    try:
                        status, payload = await self._route(method, target.split("?")[0], body)
                    except ApiError as e:
                        status, payload = e.status, {"error": e.msg, "status": e.status}
                close = headers.get("connection", "").lower() == "close"
                await self._respond(writer, status, payload, close=close)
                if close:
                    return
        finally:
            try:
                writer.close()
            except Exception:
                pass

    @staticmethod
    async def _respond(writer, status: int, payload, close: bool = False):
        reason = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 404: "Not Found",
                  409: "Conflict", 405: "Method Not Allowed", 413: "Payload Too Large",
                  500: "Internal Server Error"}.get(status, "X")
        if status == 204:
            data, ctype = b"", "text/plain"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        hdr = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
               f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n")
        writer.write(hdr.encode() + data)
        await writer.drain()

    def _get(self, name: str) -> Proxy:
        if name not in self.proxies:
            raise ApiError(404, "proxy not found")
        return self.proxies[name]

    async def _create(self, body) -> Proxy:
        if not isinstance(body, dict):
            raise ApiError(400, "proxy: body must be a JSON object")
        name = body.get("name")
        if not name or not isinstance(name, str):
            raise ApiError(400, "proxy: missing name")
        if name in self.proxies:
            raise ApiError(409, "proxy already exists")
        upstream = body.get("upstream")
        _split_hostport(upstream, "upstream")
        listen = body.get("listen") or "127.0.0.1:0"
        _split_hostport(listen, "listen")
        p = Proxy(self, name, listen, upstream, body.get("enabled", True))
        if p._want_enabled is not False:
            await p.start()
        self.proxies[name] = p
        self.event("proxy_created", proxy=name, listen=p.listen, upstream=upstream)
        return p

    async def _route(self, method: str, path: str, body):
        parts = [x for x in path.split("/") if x]
        if parts == ["version"] and method == "GET":
            return 200, VERSION
        if parts == ["events"] and method == "GET":
            return 200, self.events
        if parts == ["reset"] and method == "POST":
            for p in self.proxies.values():
                p.toxics.clear()
                await p.start()
            self.event("reset")
            return 204, None
        if parts == ["populate"] and method == "POST":
            if not isinstance(body, list):
                raise ApiError(400, "populate: body must be a list of proxies")
            out = []
            for spec in body:
                existing = self.proxies.get(spec.get("name")) if isinstance(spec, dict) else None
                if existing is not None:
                    await existing.stop()
                    del self.proxies[existing.name]
                out.append((await self._create(spec)).as_dict())
            return 201, {"proxies": out}
        if parts == ["proxies"]:
            if method == "GET":
                return 200, {n: p.as_dict() for n, p in self.proxies.items()}
            if method == "POST":
                return 201, (await self._create(body)).as_dict()
        if len(parts) == 2 and parts[0] == "proxies":
            p = self._get(parts[1])
            if method == "GET":
                return 200, p.as_dict()
            if method == "DELETE":
                await p.stop()
                del self.proxies[p.name]
                self.event("proxy_deleted", proxy=p.name)
                return 204, None
            if method in ("POST", "PATCH"):
                body = body or {}
                if "upstream" in body:
                    _split_hostport(body["upstream"], "upstream")
                    p.upstream = body["upstream"]
                if "listen" in body and body["listen"] != p.listen:
                    _split_hostport(body["listen"], "listen")
                    await p.stop()
                    p.listen = body["listen"]
                    await p.start()
                if "enabled" in body:
                    if body["enabled"]:
                        await p.start()
                    else:
                        await p.stop()
                        self.event("proxy_disabled", proxy=p.name)
                return 200, p.as_dict()
        if len(parts) == 3 and parts[0] == "proxies" and parts[2] == "toxics":
            p = self._get(parts[1])
            if method == "GET":
                return 200, [t.as_dict() for t in p.toxics.values()]
            if method == "POST":
                t = Toxic.from_body(body)
                if t.name in p.toxics:
                    raise ApiError(409, "toxic already exists")
                p.toxics[t.name] = t
                self.event("toxic_added", proxy=p.name, toxic=t.name, type=t.type, stream=t.stream,
                           attributes=t.attributes, toxicity=t.toxicity)
                return 200, t.as_dict()
        if len(parts) == 4 and parts[0] == "proxies" and parts[2] == "toxics":
            p = self._get(parts[1])
            if parts[3] not in p.toxics:
                raise ApiError(404, "toxic not found")
            t = p.toxics[parts[3]]
            if method == "GET":
                return 200, t.as_dict()
            if method == "DELETE":
                del p.toxics[t.name]
                self.event("toxic_removed", proxy=p.name, toxic=t.name, fired=dict(t.fired))
                return 204, None
            if method in ("POST", "PATCH"):
                body = body or {}
                if "attributes" in body:
                    t.attributes.update(_check_attrs(t.type, body["attributes"]))
                if "toxicity" in body:
                    t.toxicity = float(body["toxicity"])
                return 200, t.as_dict()
        if parts and parts[0] in ("proxies", "reset", "populate", "version", "events"):
            raise ApiError(405, f"method {method} not allowed on {path}")
        raise ApiError(404, f"no route {path}")


# ------------------------------------------------------------------ harness-facing client
def toxiproxy_client(host: str, port: int):
    """The official toxiproxy-python client, pointed at ``host:port``.

    toxiproxy-python keeps host/port as class attributes of APIConsumer (one server per
    process); we set them here so every caller goes through one place."""
    from toxiproxy import Toxiproxy  # toxiproxy-python
    from toxiproxy.api import APIConsumer

    APIConsumer.host, APIConsumer.port = host, int(port)
    return Toxiproxy()


def main(argv=None):
    ap = argparse.ArgumentParser(description="kvchaos toxiproxy-compatible fault proxy")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8474)
    a = ap.parse_args(argv)
    srv = ProxyServer(a.host, a.port)
    loop = asyncio.new_event_loop()
    srv.loop = loop
    loop.run_until_complete(srv._start_api())
    print(f"kvchaos proxy API on http://{a.host}:{srv.port}", flush=True)
    try:
        loop.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        loop.run_until_complete(srv._shutdown())


if __name__ == "__main__":
    main()
