"""The API server: one asyncio loop (its own thread, or the caller's) holding every proxy, the event
log, and the HTTP/1.1 framing of the toxiproxy API (:mod:`faults.proxy.api` answers each request)."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from .api import route
from .pipe import Proxy
from .toxics import ApiError


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

    async def _route(self, method: str, path: str, body):
        return await route(self, method, path, body)


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
