"""The TCP side: a :class:`Proxy` listens, connects each client to its upstream (a :class:`_Link`) and
pipes both directions chunk by chunk through the toxics active on that connection."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import TYPE_CHECKING

from .toxics import STREAMS, ApiError, Toxic, _slice, _split_hostport

if TYPE_CHECKING:
    from .server import ProxyServer

CHUNK = 32 * 1024


TIMED = ("reset_peer", "timeout")  # toxics that act on a connection after a time, data or not


class _Toxics(dict):
    """A proxy's toxics by name: any change wakes the links' watches (``on_change``)."""

    def __init__(self, on_change):
        super().__init__()
        self._on_change = on_change

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._on_change()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._on_change()

    def pop(self, *a):
        out = super().pop(*a)
        self._on_change()
        return out

    def clear(self):
        super().clear()
        self._on_change()

    def update(self, *a, **k):
        super().update(*a, **k)
        self._on_change()


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
        self.toxics: dict[str, Toxic] = _Toxics(self.toxics_changed)
        self.links: set[_Link] = set()
        self._srv: asyncio.base_events.Server | None = None
        self._want_enabled = enabled
        self._changed: asyncio.Event | None = None  # set (and replaced) when the toxics change
        self.watch_wakeups = 0  # how often the links' watches woke (tests: an idle link must not poll)

    def toxics_changed(self) -> None:
        """Wake every link's :meth:`_watch` to read the toxics again (in the proxy's loop; adding,
        removing or clearing toxics calls it, and so does an API update of one's attributes)."""
        ev, self._changed = self._changed, None
        if ev is not None:
            ev.set()

    def _change_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

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
        """reset_peer / timeout (with a timeout) act on the connection even when no data flows: sleep
        until the earliest of them is due, or until the toxics change. No polling: a link with no
        such toxic costs nothing while it lives (the router's keep-alive links live all session; a
        5 ms poll of each took most of a core from the engines under load)."""
        while not link.closed:
            self.watch_wakeups += 1
            changed = self._change_event()  # taken before reading the toxics: a later change wakes us
            now = time.monotonic()
            due = None
            for stream in STREAMS:
                for t in link.active(stream):
                    if t.type not in TIMED:
                        continue
                    ms = t.attributes.get("timeout", 0)
                    if t.type == "timeout" and ms == 0:
                        continue  # data dropped from now on (_dropped); the link is never closed by it
                    start = max(link.t0, t.added_at)
                    left = start + ms / 1000.0 - now
                    if left <= 0:
                        self.server.event(t.type, proxy=self.name, toxic=t.name, stream=stream,
                                          after_ms=round((now - start) * 1000, 1))
                        link.close(reset=t.type == "reset_peer")
                        return
                    due = left if due is None else min(due, left)
            try:
                await asyncio.wait_for(changed.wait(), due)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- one direction of a link
    async def _pipe(self, link: _Link, stream: str, reader, writer):
        """Read chunks, pass each through the active toxics, write. Latency is pipelined via a queue:
        this reads and stamps each chunk's arrival, :meth:`_deliver` writes it when it is due."""
        q: asyncio.Queue = asyncio.Queue()
        dtask = asyncio.ensure_future(self._deliver(link, stream, q, writer))
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
        if not link.closed:
            await self._end_stream(link, stream, writer)

    async def _deliver(self, link: _Link, stream: str, q: asyncio.Queue, writer):
        """Take (arrival, data) chunks off ``q`` in order, apply the toxics, write what survives."""
        next_free = 0.0  # bandwidth: when the last piece's slot ends
        while True:
            item = await q.get()
            if item is None:
                break
            arrival, data = item
            toxics = link.active(stream)
            await self._delay(toxics, arrival, data)
            if link.closed:
                return
            if self._dropped(link, stream, data):
                continue
            if await self._limit_reached(link, stream, toxics, writer, data):
                return
            next_free = await self._send(link, stream, toxics, writer, data, next_free)

    async def _delay(self, toxics: list[Toxic], arrival: float, data: bytes):
        """latency: hold the chunk until ``arrival + latency ± jitter``."""
        for t in toxics:
            if t.type == "latency":
                lat = t.attributes["latency"] + t.rng.uniform(-1, 1) * t.attributes["jitter"]
                wait = arrival + max(lat, 0) / 1000.0 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._fire(t, data)

    def _dropped(self, link: _Link, stream: str, data: bytes) -> bool:
        """timeout: while one is active (looked up afresh, after the latency wait), data is dropped."""
        if not any(t.type == "timeout" for t in link.active(stream)):
            return False
        for t in link.active(stream):
            if t.type == "timeout":
                self._fire(t, data)
        return True

    async def _limit_reached(self, link: _Link, stream: str, toxics: list[Toxic], writer, data: bytes) -> bool:
        """limit_data: write what fits the byte budget and close the link once it is spent (True)."""
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
                    return True
        return False

    async def _send(self, link: _Link, stream: str, toxics: list[Toxic], writer, data: bytes,
                    next_free: float) -> float:
        """slicer and bandwidth: write ``data`` as pieces, each when its bandwidth slot ends; returns
        when the last slot ends (``next_free`` carried from chunk to chunk)."""
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
        return next_free

    async def _end_stream(self, link: _Link, stream: str, writer):
        """The reader hit EOF: slow_close delays passing it on; the link closes once both directions ended."""
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
