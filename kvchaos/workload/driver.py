"""Async request driver: thousands of concurrent requests over one kept HTTP client (aiohttp: httpx's
connection pool slows down with the number of requests in flight — bench/driver_throughput.py measured
88 req/s at 256 in flight against aiohttp's 3,648 on the same loopback server).

Each :class:`RequestPlan` runs as planned — plain or streaming ``/generate``, OpenAI
``/v1/completions`` or ``/v1/chat/completions``, cancelled after *t* ms (client disconnect, plus
``POST /abort_request`` to the given servers), or disconnected as soon as the response headers
arrive, before the first token. Every step is an event in the :class:`EventLog`; every request
ends with exactly one ``end`` event (outcome ``ok``, ``http_error``, ``aborted``,
``disconnected``, ``timeout``, ``cut`` (the connection broke after the headers: a stream or body
cut short), ``error``, or ``not_sent``) within ``timeout_s`` — nothing waits unbounded.

With ``stall_s`` set, a run stops sending once the cluster is seen wedged: a request timed out while no
request anywhere had received a reply byte or ended with a reply for ``stall_s``. Every plan not yet sent
then ends ``not_sent`` (never sent: no evidence either way), after one ``stall`` event saying when and
why; the requests in flight still run to their own bounds, so the timeouts that showed the wedge are in
the log (liveness FAILs on them). A wedged 0.5.19 cluster otherwise cost a search every plan's 30 s
timeout in turn: 4-7 minutes of a 10-minute budget (reports/fuzz/20261205-0.5.19/).

Whatever the outcome, a request that got a response (its headers) logs exactly one ``body`` event
before its ``end``: ``text`` (the reply as parsed so far), ``raw`` (every body byte received,
utf-8 with replacement, partial last line included — what the isolation oracle must scan),
``complete`` (read to its end normally), ``output_ids``, ``meta``, ``error``, ``chunks``. Every
``end`` carries ``bytes_received`` (0: no response at all, and then no ``body``).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from .events import EventLog
from .plan import RequestPlan


class Driver:
    """``pd_direct``: ``{"prefill": url, "decode": url, "bootstrap_host": h, "bootstrap_port": p}`` —
    drive prefill and decode directly, as SGLang's own mini load balancer does (the same body to
    both, plus the bootstrap address and a room; the reply is decode's), bypassing the router:
    the engines' behaviour without whatever the router adds or drops. ``/generate`` only."""

    def __init__(self, base_url: str, log: EventLog, concurrency: int = 64, timeout_s: float = 60.0,
                 abort_urls: tuple[str, ...] = (), model_name: str = "default", pd_direct: dict | None = None,
                 stall_s: float | None = None, gate=None, gated=(), incremental: bool = False):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall_s must be > 0 (or None: never stop sending), got {stall_s}")
        if pd_direct is not None:
            missing = {"prefill", "decode", "bootstrap_host", "bootstrap_port"} - set(pd_direct)
            if missing:
                raise ValueError(f"pd_direct needs {sorted(missing)} too (got {sorted(pd_direct)})")
        self.base_url = base_url.rstrip("/")
        self.log = log
        self.incremental = incremental  # decode's --incremental-streaming-output: /generate chunks are pieces
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.abort_urls = abort_urls
        self.model_name = model_name
        self.pd_direct = pd_direct
        self.stall_s = stall_s
        # the plans (rids) that wait, before they are sent, until ``gate(rid)`` returns (blocking, bounded by
        # its owner: a nemesis schedule's op they wait for, kvchaos.schedule.Schedule.gate)
        self.gate, self.gated = gate, set(gated)
        if self.gated and gate is None:
            raise ValueError(f"plans {sorted(self.gated)[:3]} wait for a gate, and there is none")
        self.stalled: dict | None = None  # the stall event, once the run stopped sending
        self._progress = time.monotonic()  # the last reply byte, or reply end, of any request

    async def run(self, plans: list[RequestPlan]) -> list[dict]:
        sem = _Slots(self.concurrency)
        conn = aiohttp.TCPConnector(limit=self.concurrency + 8, enable_cleanup_closed=True)
        # per read: no answer byte for timeout_s is a timeout (the whole request is bounded in _run_one)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.timeout_s)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout, read_bufsize=2**20) as client:
            self.client = client
            rids = {p.rid for p in plans}
            for p in plans:
                if p.after is not None and p.after not in rids:
                    raise ValueError(f"plan {p.rid} is to be sent after {p.after}, which is not in this run")
                if self.pd_direct is not None and p.endpoint != "generate":
                    raise ValueError(f"plan {p.rid}: pd_direct drives /generate only, not {p.endpoint}")
            for p in plans:
                self.log.emit("plan", rid=p.rid, **{k: v for k, v in p.to_dict().items() if k != "rid"})
            done = {p.rid: asyncio.Event() for p in plans}

            order = {p.rid: i for i, p in enumerate(plans)}

            async def one(p):
                try:
                    if p.after is not None:  # a conversation's next turn: once the previous one ended
                        await done[p.after].wait()
                    if p.rid in self.gated:  # once what it waits for in the nemesis has happened
                        await asyncio.get_running_loop().run_in_executor(gates, self.gate, p.rid)
                    # a plan that waited for another goes next (a user answering a reply, a resend): its
                    # prefix was just cached; the rest go in plan order
                    waited = p.after is not None or p.rid in self.gated
                    await sem.acquire((0 if waited else 1, order[p.rid]))
                    try:
                        if self.stalled is not None:
                            return self.log.emit("end", rid=p.rid, outcome="not_sent", latency_s=0.0,
                                                 bytes_received=0, reason="the run stopped sending: cluster wedged")
                        return await self._run_one(p)
                    finally:
                        sem.release()
                finally:
                    leg = self._legs_by_rid.pop(p.rid, None)
                    if leg is not None:  # pd_direct: ended means both halves (prefill caches the prompt last)
                        await asyncio.wait({leg}, timeout=self.timeout_s + 5)
                    done[p.rid].set()

            self._legs: set = set()
            self._legs_by_rid: dict = {}
            self._progress = time.monotonic()
            # a thread for each gated plan: in the loop's shared pool (6 threads on 2 cores) plans waiting for an
            # op that a later plan sets off (its first byte, its transfer) held every thread, and that plan's
            # own gate never ran
            gates = ThreadPoolExecutor(len(self.gated), thread_name_prefix="kvchaos-gate") if self.gated else None
            try:
                return await asyncio.gather(*(one(p) for p in plans))
            finally:
                if gates is not None:
                    gates.shutdown(wait=False)
                if self._legs:  # pd_direct: prefill's halves still running (bounded: timeout_s each)
                    await asyncio.wait(self._legs, timeout=self.timeout_s + 5)

    # ------------------------------------------------------------------ one request
    def _request(self, p: RequestPlan) -> tuple[str, dict, bool]:
        stream = p.kind in ("stream", "abort_after", "disconnect_before_first_token")
        salt = {} if p.cache_salt is None else {"cache_salt": p.cache_salt}
        if p.endpoint == "generate":
            body = {"text": p.prompt, "rid": p.rid, "stream": stream,
                    "sampling_params": {"max_new_tokens": p.max_new_tokens, "temperature": 0.0}, **salt}
            return "/generate", body, stream
        common = {"model": self.model_name, "max_tokens": p.max_new_tokens, "temperature": 0.0, "stream": stream,
                  "rid": p.rid, **salt}
        if p.endpoint == "completions":
            return "/v1/completions", {**common, "prompt": p.prompt}, stream
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": p.prompt}]}, stream

    async def _run_one(self, p: RequestPlan) -> dict:
        path, body, stream = self._request(p)
        t0 = time.monotonic()
        reply = _Reply(stream)
        url = (self.pd_direct["decode"].rstrip("/") if self.pd_direct else self.base_url) + path
        self.log.emit("send", rid=p.rid, url=url, stream=stream, **({"pd_direct": True} if self.pd_direct else {}))
        task = asyncio.ensure_future(self._exchange(p, path, body, reply))
        try:
            if p.kind == "abort_after":
                done, _ = await asyncio.wait({task}, timeout=p.abort_after_ms / 1000.0)
                if not done:
                    task.cancel()
                    # let the exchange unwind (its finally collects the buffered bytes and drops the
                    # connection) before the reply is logged and the servers are told
                    await asyncio.wait({task}, timeout=self.timeout_s)
                    await self._abort(p, "client_disconnect_after_ms")
                    return self._leave(p, t0, reply, "aborted", after_ms=p.abort_after_ms)
            # on timeout wait_for cancels the task and waits for it: its finally has run here too
            return await asyncio.wait_for(task, timeout=self.timeout_s + 5)
        except asyncio.TimeoutError as e:  # the overall bound, or no byte for timeout_s (aiohttp's read timeout)
            task.cancel()
            extra = {} if type(e) in (asyncio.TimeoutError, TimeoutError) else {"error": repr(e)}
            quiet = time.monotonic() - self._progress
            if self.stall_s is not None and self.stalled is None and quiet >= self.stall_s:
                self.stalled = self.log.emit("stall", timed_out=p.rid, quiet_s=round(quiet, 2), stall_s=self.stall_s,
                                             reason=f"{p.rid} timed out and no request received a reply byte "
                                                    f"for {quiet:.0f} s: plans not yet sent end not_sent")
            return self._leave(p, t0, reply, "timeout", bound_s=self.timeout_s, **extra)
        except _Disconnected:
            await self._abort(p, "disconnect_before_first_token")
            return self._leave(p, t0, reply, "disconnected")
        except (aiohttp.ClientError, _Malformed) as e:
            self.log.emit("error", rid=p.rid, error=repr(e))
            # a connection failing once the headers are in cuts the reply short; a line the client
            # cannot parse, or a failure before any response, is an error
            cut = reply.status is not None and isinstance(e, aiohttp.ClientError)
            return self._leave(p, t0, reply, "cut" if cut else "error", error=repr(e))

    async def _exchange(self, p: RequestPlan, path: str, body: dict, reply: _Reply) -> dict:
        t0 = time.monotonic()
        url = self.base_url + path
        if self.pd_direct is not None:
            d = self.pd_direct
            body = {**body, "bootstrap_host": d["bootstrap_host"], "bootstrap_port": d["bootstrap_port"],
                    "bootstrap_room": _room(p.rid)}
            url = d["decode"].rstrip("/") + path
            leg = asyncio.ensure_future(self._prefill_leg(p, d["prefill"].rstrip("/") + path, body))
            self._legs.add(leg)
            self._legs_by_rid[p.rid] = leg
            leg.add_done_callback(self._legs.discard)
        r = await self.client.post(url, json=body)  # returns once the headers are in
        reply.status = r.status
        try:
            if reply.stream:
                self.log.emit("status", rid=p.rid, status=r.status, headers_only=True)
                if p.kind == "disconnect_before_first_token":
                    raise _Disconnected()
            if reply.sse:
                await self._read_sse(p, r.content, reply)
            else:
                async for data in r.content.iter_any():
                    reply.raw.append(data)
                    self._progress = time.monotonic()
                if not reply.stream:
                    self.log.emit("first_byte", rid=p.rid)
            reply.complete = True
        finally:
            # bytes already received but not read (a cut, a cancelled read, a disconnect at the headers)
            # are part of what the client saw
            unread = _unread(r.content)
            if unread:
                reply.raw.append(unread)
            # a stream left early (disconnect, abort, [DONE] before the last chunk) or any error: drop the
            # connection, as a client going away does; a fully read answer goes back to the pool
            if r.content.at_eof() and not reply.stream:
                r.release()
            else:
                r.close()
        return self._finish(p, t0, reply)

    async def _read_sse(self, p: RequestPlan, content: aiohttp.StreamReader, reply: _Reply) -> None:
        """Read server-sent events into ``reply`` until ``[DONE]`` or EOF. Chunks are kept as received
        (``raw``) and split into lines here, so a line cut short stays in ``raw``."""
        pending = b""  # the line being received: its end is in a later chunk
        async for data in content.iter_any():
            reply.raw.append(data)
            self._progress = time.monotonic()
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if self._sse_line(p, line, reply):
                    return
        if pending.strip():  # a clean EOF in the middle of a line: the stream was cut
            raise aiohttp.ClientPayloadError(f"stream ended mid-line: {pending[:200]!r}")

    def _sse_line(self, p: RequestPlan, line: bytes, reply: _Reply) -> bool:
        """Merge one SSE line into ``reply``; True at ``[DONE]``."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        if not reply.chunks:
            self.log.emit("first_byte", rid=p.rid)
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            raise _Malformed(f"stream line is not a JSON object: {line[:200]!r}")
        reply.chunks += 1
        reply.merged = _merge_stream(reply.merged, chunk, p.endpoint, self.incremental)
        return False

    def _finish(self, p: RequestPlan, t0: float, reply: _Reply) -> dict:
        self._progress = time.monotonic()  # a reply ended (a header-only reply has no body byte)
        self.log.emit("status", rid=p.rid, status=reply.status)
        n = self._body(p, reply)
        return self._end(p, t0, "ok" if reply.status == 200 else "http_error", status=reply.status, bytes_received=n)

    def _leave(self, p: RequestPlan, t0: float, reply: _Reply, outcome: str, **extra) -> dict:
        """End a request that did not finish normally, logging what it received, if anything."""
        if reply.status is None:
            return self._end(p, t0, outcome, bytes_received=0, **extra)
        if not reply.stream:  # a stream logged its headers' status when they arrived
            self.log.emit("status", rid=p.rid, status=reply.status, headers_only=True)
        n = self._body(p, reply)
        return self._end(p, t0, outcome, status=reply.status, bytes_received=n, **extra)

    def _body(self, p: RequestPlan, reply: _Reply) -> int:
        """Log the one ``body`` event of a request; returns the number of body bytes received."""
        data = b"".join(reply.raw)
        raw = data.decode("utf-8", "replace")
        if reply.sse:
            parsed = reply.merged
        elif reply.complete:
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = {"raw": raw[:2000]}
        else:
            parsed = None  # part of one JSON document: nothing to parse (raw has it)
        text, ids, meta, error = _extract(parsed, p.endpoint)
        self.log.emit("body", rid=p.rid, text=text, output_ids=ids, meta=meta, error=error,
                      chunks=reply.chunks if reply.sse else None, raw=raw, complete=reply.complete)
        return len(data)

    async def _prefill_leg(self, p: RequestPlan, url: str, body: dict) -> None:
        """pd_direct: prefill's half of the request (its reply says nothing to the client; how it
        ended is logged as a ``prefill_leg`` event)."""
        try:
            async with self.client.post(url, json={**body, "stream": False},
                                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                data = await r.read()
                self.log.emit("prefill_leg", rid=p.rid, status=r.status,
                              error=None if r.status == 200 else data[:500].decode("utf-8", "replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.log.emit("prefill_leg", rid=p.rid, status=None, error=repr(e))

    async def _abort(self, p: RequestPlan, method: str) -> None:
        self.log.emit("abort", rid=p.rid, method=method)
        for url in self.abort_urls:
            try:
                async with self.client.post(f"{url}/abort_request", json={"rid": p.rid},
                                            timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    self.log.emit("abort", rid=p.rid, method="abort_request", url=url, status=r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.log.emit("abort", rid=p.rid, method="abort_request", url=url, error=repr(e))

    def _end(self, p, t0, outcome, **extra) -> dict:
        rec = self.log.emit("end", rid=p.rid, outcome=outcome, latency_s=time.monotonic() - t0, **extra)
        return rec


class _Slots:
    """A semaphore whose waiters are served by priority (lowest first), not by arrival."""

    def __init__(self, n: int):
        self.free, self.waiters, self.seq = n, [], 0

    async def acquire(self, priority) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.seq += 1
        heapq.heappush(self.waiters, (priority, self.seq, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            raise

    def release(self) -> None:
        while self.waiters:
            _p, _s, fut = heapq.heappop(self.waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


@dataclass(eq=False, slots=True)
class _Reply:
    """What the client has seen of one reply so far. Shared by ``_run_one`` and the ``_exchange``
    task, so that a reply left early (cancelled, timed out, cut) still logs the bytes it got."""
    stream: bool
    status: int | None = None     # from the headers; None: no response (yet)
    raw: list[bytes] = field(default_factory=list)  # body bytes as received, joined once at the end
    merged: dict | None = None    # streamed events merged so far (see _merge_stream)
    chunks: int = 0               # stream events parsed
    complete: bool = False        # read to its end ([DONE] or EOF) without error

    @property
    def sse(self) -> bool:
        """Read as server-sent events (an error status on a stream request is one JSON body)."""
        return self.stream and self.status == 200


class _Disconnected(Exception):
    pass


class _Malformed(ValueError):
    """A stream line the client cannot parse."""


def _unread(content: aiohttp.StreamReader) -> bytes:
    """The bytes aiohttp has received for a body but not handed out. Once the payload has failed (a
    cut), ``readany()`` raises before returning them, and a read abandoned at the headers never asks;
    no public call returns them, so they are taken from the reader's buffer (absent from
    ``EmptyStreamReader``: no body)."""
    buf = getattr(content, "_buffer", None)
    if not buf:
        return b""
    return b"".join(buf)[getattr(content, "_buffer_offset", 0):]


def _merge_stream(prev, chunk, endpoint, incremental: bool = False):
    """SGLang /generate streams cumulative text (each chunk the reply so far), or with
    ``--incremental-streaming-output`` (``incremental``) each chunk's new text only, appended here.
    OpenAI endpoints stream deltas."""
    if endpoint == "generate":
        before, now = (prev or {}).get("text"), chunk.get("text") if isinstance(chunk, dict) else None
        if incremental and isinstance(before, str) and isinstance(now, str):
            return {**chunk, "text": before + now}
        return chunk
    prev = prev or {"text": ""}
    for ch in chunk.get("choices", []):
        prev["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        if ch.get("finish_reason") is not None:  # on the last chunk (an abort's too)
            prev["finish_reason"] = ch["finish_reason"]
    return prev


def _extract(parsed, endpoint):
    if not isinstance(parsed, dict):
        return "", None, None, None
    if "error" in parsed or "raw" in parsed:
        err = parsed.get("error") or parsed.get("raw")
        return "", None, None, err if isinstance(err, str) else json.dumps(err)[:2000]
    if parsed.get("object") == "error":  # SGLang's ErrorResponse: {"object": "error", "message", "code"}
        return "", None, None, str(parsed.get("message") or json.dumps(parsed))[:2000]
    if endpoint == "generate" or "meta_info" in parsed:
        return parsed.get("text", ""), parsed.get("output_ids"), parsed.get("meta_info"), None
    if "choices" in parsed:  # OpenAI: usage, plus the choice's finish_reason (what /generate has in meta_info)
        ch = parsed["choices"][0] if parsed["choices"] else {}
        text = ch.get("text") if "text" in ch else (ch.get("message") or {}).get("content", "")
        return text or "", None, {**(parsed.get("usage") or {}), "finish_reason": ch.get("finish_reason")}, None
    if "finish_reason" in parsed:  # a merged OpenAI stream
        return parsed.get("text", ""), None, {"finish_reason": parsed["finish_reason"]}, None
    return parsed.get("text", ""), None, None, None


def _room(rid: str) -> int:
    """A bootstrap room per request (pd_direct), stable for a rid (a replay uses the same)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big") >> 1


def run_plans(base_url: str, plans, log: EventLog, **kw) -> list[dict]:
    return asyncio.run(Driver(base_url, log, **kw).run(plans))
