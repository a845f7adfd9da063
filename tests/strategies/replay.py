"""The driver, replayed on bytes: :func:`exchange` is the driver's reading of one HTTP reply. What the
server sent (status, body bytes) and how the exchange ended (EOF, connection cut, client abort,
disconnect at the headers, timeout) give exactly the records the driver logs — the SSE parsing
(``data:`` lines, ``[DONE]``, a line that is not a JSON object, a line cut mid-way), the merging of
streamed chunks (cumulative ``text`` on ``/generate``, deltas on the OpenAI endpoints) and the
extraction of text / output_ids / meta / error are the driver's own functions
(``test_generated_records_are_the_drivers`` checks the whole exchange against the real driver)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvchaos.workload.driver import Driver, _extract, _Malformed  # the driver's own reading of a reply
from kvchaos.workload.plan import RequestPlan

from .replies import DECODE, PATHS, PREFILL, ROUTER, TIMEOUT_S

STREAM_KINDS = ("stream", "abort_after", "disconnect_before_first_token")
# what aiohttp says when nothing listens on the router's port
REFUSED = ("ClientConnectorError(ConnectionKey(host='127.0.0.1', port=30000, is_ssl=False, ssl=True, "
           "proxy=None, proxy_auth=None, proxy_headers_hash=None), ConnectionRefusedError(111, "
           "\"Connect call failed ('127.0.0.1', 30000)\"))")
NOT_COMPLETED = ("ClientPayloadError(\"Response payload is not completed: <TransferEncodingError: 400, "
                 "message='Not enough data to satisfy transfer length header.'>\")")


@dataclass
class Wire:
    """What the server sent for one request and how the exchange ended.

    ``status``: None = no response at all. ``end``: ``eof`` (the server closed the body normally),
    ``cut`` (the connection broke after ``body``), ``abort`` (the client aborted after ``after_ms``),
    ``disconnect`` (the client left at the headers; ``body`` is what was already buffered),
    ``timeout`` (nothing more came for the read timeout). ``leg``: pd_direct prefill leg (status,
    error, "early" | "late")."""
    status: int | None
    body: bytes = b""
    end: str = "eof"
    latency_s: float = 0.4
    after_ms: float | None = None
    leg: tuple | None = None


class _Cut(Exception):
    pass


def send(log, p: RequestPlan, pd: bool = False) -> dict:
    """The ``send`` record of ``p``."""
    stream = p.kind in STREAM_KINDS
    url = (DECODE if pd else ROUTER) + PATHS[p.endpoint]
    return log.emit("send", rid=p.rid, url=url, stream=stream, **({"pd_direct": True} if pd else {}))


class _Exchange:
    """One request's records after its ``send``, in the order ``Driver._run_one`` writes them."""

    def __init__(self, log, p: RequestPlan, w: Wire, pd: bool):
        self.log, self.p, self.w, self.pd, self.rid = log, p, w, pd, p.rid
        self.stream = p.kind in STREAM_KINDS
        self.sse = self.stream and w.status == 200
        self.merged, self.chunks, self.complete = None, 0, False
        self.raw = w.body.decode("utf-8", "replace")
        self.incremental = False  # as Driver: the stand-in engine streams /generate cumulatively

    def run(self) -> None:
        self.leg("early")
        if self.w.status is None:
            return self.no_response()
        if self.stream:
            self.log.emit("status", rid=self.rid, status=self.w.status, headers_only=True)
            if self.p.kind == "disconnect_before_first_token":
                self.aborts("disconnect_before_first_token")
                return self.leave("disconnected")
        try:
            self.read()
        except _Malformed as e:
            err = f"_Malformed({str(e)!r})"
            self.log.emit("error", rid=self.rid, error=err)
            return self.leave("error", error=err)
        except _Cut as e:
            return self.ended_early(str(e))
        self.log.emit("status", rid=self.rid, status=self.w.status)
        self.body()
        self.end("ok" if self.w.status == 200 else "http_error", status=self.w.status,
                 bytes_received=len(self.w.body))

    def leg(self, when: str) -> None:
        """The pd_direct prefill leg's record, when it ends ``when`` ("early" | "late")."""
        if self.pd and self.w.leg is not None and self.w.leg[2] == when:
            self.log.emit("prefill_leg", rid=self.rid, status=self.w.leg[0], error=self.w.leg[1])

    def end(self, outcome: str, **extra) -> None:
        self.log.emit("end", rid=self.rid, outcome=outcome, latency_s=self.w.latency_s, **extra)
        self.leg("late")

    def aborts(self, method: str) -> None:
        """The client's abort, then ``/abort_request`` to prefill and decode."""
        self.log.emit("abort", rid=self.rid, method=method)
        for u in (PREFILL, DECODE):
            self.log.emit("abort", rid=self.rid, method="abort_request", url=u, status=200)

    def no_response(self) -> None:
        """No response at all: a timeout, an abort before the headers, or the connection refused."""
        if self.w.end == "timeout":
            return self.end("timeout", bytes_received=0, bound_s=TIMEOUT_S)
        if self.w.end == "abort":
            self.aborts("client_disconnect_after_ms")
            return self.end("aborted", bytes_received=0, after_ms=self.w.after_ms)
        self.log.emit("error", rid=self.rid, error=REFUSED)
        return self.end("error", bytes_received=0, error=REFUSED)

    def body(self) -> None:
        """The ``body`` record: what the driver extracted from what it read."""
        if self.sse:
            parsed = self.merged
        elif self.complete:
            try:
                parsed = json.loads(self.raw)
            except json.JSONDecodeError:
                parsed = {"raw": self.raw[:2000]}
        else:
            parsed = None
        text, ids, meta, error = _extract(parsed, self.p.endpoint)
        self.log.emit("body", rid=self.rid, text=text, output_ids=ids, meta=meta, error=error,
                      chunks=self.chunks if self.sse else None, raw=self.raw, complete=self.complete)

    def leave(self, outcome: str, **extra) -> None:
        """A reply that did not end normally: its status (if not yet logged), its body, its end."""
        if not self.stream:
            self.log.emit("status", rid=self.rid, status=self.w.status, headers_only=True)
        self.body()
        self.end(outcome, status=self.w.status, bytes_received=len(self.w.body), **extra)

    def read(self) -> None:
        """Read the reply to its end (raises :class:`_Malformed` or :class:`_Cut`)."""
        if self.sse:
            self.read_sse()
        else:
            if self.w.end != "eof":
                raise _Cut(self.w.end)
            if not self.stream:
                self.log.emit("first_byte", rid=self.rid)
        self.complete = True

    def read_sse(self) -> None:
        """The stream's ``data:`` lines up to ``[DONE]``, each a JSON object merged into the reply."""
        lines = self.w.body.split(b"\n")
        pending = lines.pop()
        for line in lines:
            # the driver's own Driver._sse_line: it needs only a ``log`` (here self) and a reply's
            # ``chunks`` / ``merged`` (here self's too); it raises the driver's _Malformed
            if Driver._sse_line(self, self.p, line, self):  # [DONE]
                return
        if self.w.end == "eof" and pending.strip():
            raise _Cut(f"ClientPayloadError({f'stream ended mid-line: {pending[:200]!r}'!r})")
        if self.w.end != "eof":
            raise _Cut(self.w.end)

    def ended_early(self, how: str) -> None:
        """The client aborted, timed out, or the connection was cut (``how``)."""
        if how == "abort":
            self.aborts("client_disconnect_after_ms")
            return self.leave("aborted", after_ms=self.w.after_ms)
        if how == "timeout":  # no byte for timeout_s: aiohttp's read timeout
            return self.leave("timeout", bound_s=TIMEOUT_S,
                              error="SocketTimeoutError('Timeout on reading data from socket')")
        err = how if how.startswith("ClientPayloadError") else NOT_COMPLETED
        self.log.emit("error", rid=self.rid, error=err)
        return self.leave("cut", error=err)


def exchange(log, p: RequestPlan, w: Wire, pd: bool = False, sent: bool = False) -> None:
    """Log one request's records exactly as ``Driver._run_one`` does for a server that sent ``w``
    (``sent``: its ``send`` record is already written)."""
    if not sent:
        send(log, p, pd)
    _Exchange(log, p, w, pd).run()
