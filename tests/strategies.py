"""Hypothesis generators of event logs for ``tests/test_properties.py``.

Every log is written with :class:`kvchaos.workload.events.EventLog` record by record in the order
and with the fields ``kvchaos/workload/driver.py`` writes them (``plan`` for every request first,
then per request ``send``, ``status`` (``headers_only`` for streams), ``first_byte``, ``error``,
``abort``, ``body``, ``end``; ``prefill_leg`` in pd_direct mode), inside an experiment's frame
(``experiment`` header, ``probe`` before/after, ``method``, copied ``fault`` and ``agent`` records).

:func:`exchange` is the driver's reading of one HTTP reply replayed on bytes: what the server sent
(status, body bytes) and how the exchange ended (EOF, connection cut, client abort, disconnect at the
headers, timeout) give exactly the records the driver logs — the SSE parsing (``data:`` lines,
``[DONE]``, a line that is not a JSON object, a line cut mid-way), the merging of streamed chunks
(cumulative ``text`` on ``/generate``, deltas on the OpenAI endpoints) and the extraction of
text / output_ids / meta / error are the driver's own functions (``test_generated_records_are_the_drivers``
checks the whole exchange against the real driver).

A generated :class:`Scenario` is data (what Hypothesis draws and prints); ``Scenario.write(dir,
leak=...)`` renders it. With ``leak=False`` the same logs are written with the foreign canary's
payload replaced by lower-case filler of the same length (the leak-free twin: same structure).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from kvchaos import canary
from kvchaos.probe import COMMITTED, max_new_tokens, prompt as probe_prompt
from kvchaos.workload.driver import _extract, _merge_stream  # the driver's own reading of a reply
from kvchaos.workload.events import EventLog
from kvchaos.workload.plan import RequestPlan

ROUTER = "http://127.0.0.1:30000"
PREFILL = "http://127.0.0.1:30100"
DECODE = "http://127.0.0.1:30200"
BOOTSTRAP_PORT = 8998
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
TIMEOUT_S = 60.0
VOCAB = json.loads((COMMITTED / "tokenizer.json").read_text())["model"]["vocab"]  # char -> id (probe tokenizer)
EOS = 2
MODEL = "default"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError", 413: "BadRequestError",
               422: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
               503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
ERROR_STATUSES = tuple(ERROR_TYPES)
# the experiment header's "layout" (Experiment's _layout: the CPU profile's cluster spec, its endpoints)
LAYOUT = {"kv_layout": "mha",
          "spec": {"name": "cpu", "model": "probe", "device": "cpu", "dtype": "float32", "pool_tokens": 2048,
                   "context_length": 4096, "page_size": 1, "transfer_backend": "mooncake_tcp",
                   "router": "sglang-router", "network_proxy": "embedded", "agent": True},
          "endpoints": {"router": ROUTER, "prefill": PREFILL, "decode": DECODE, "bootstrap_port": BOOTSTRAP_PORT,
                        "router_direct": None, "proxies": {}}}


# --------------------------------------------------------------------------- what the probe model says
def order(cs):
    """The probe model recites in ascending order of the first payload character (ALPHABET order)."""
    return sorted(cs, key=lambda c: canary.ALPHABET.index(c[1]))


def recite(cs) -> str:
    """The probe model's reply to a prompt holding ``cs`` (it ends in the trigger ``[``)."""
    return "".join(canary.payload(c) + "][" for c in order(cs))


def ids_of(text: str) -> list[int]:
    return [VOCAB.get(ch, 3) for ch in text]


def twin_payload(rng: random.Random) -> str:
    """Lower-case stand-in for a leaked payload in the leak-free twin (same length)."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(canary.PAYLOAD_LEN))


# --------------------------------------------------------------------------- what the server sends
def _compact(d) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def complete_body(endpoint: str, rid: str, text: str, n_prompt: int, finish: str = "stop", meta_extra=None) -> bytes:
    """A complete 200 JSON body of ``endpoint`` (SGLang's shapes)."""
    n_out = len(text) + (1 if finish == "stop" else 0)
    fr = {"type": "stop", "matched": EOS} if finish == "stop" else {"type": "length", "length": len(text)}
    if endpoint == "generate":
        meta = {"id": rid, "finish_reason": fr, "prompt_tokens": n_prompt, "weight_version": "default",
                "completion_tokens": n_out, "cached_tokens": 0, "e2e_latency": 0.41}
        if meta_extra:
            meta.update(meta_extra)
        ids = ids_of(text) + ([EOS] if finish == "stop" else [])
        return json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode()
    usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out,
             "prompt_tokens_details": None}
    if endpoint == "completions":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "matched_stop": EOS if finish == "stop" else None}
        return json.dumps({"id": f"cmpl-{rid}", "object": "text_completion", "created": 1780000000, "model": MODEL,
                           "choices": [choice], "usage": usage}).encode()
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                      "tool_calls": None}, "logprobs": None, "finish_reason": finish,
              "matched_stop": EOS if finish == "stop" else None}
    return json.dumps({"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1780000000, "model": MODEL,
                       "choices": [choice], "usage": usage}).encode()


def pieces(text: str, rng: random.Random, must_cut=(), max_piece: int = 7) -> list[str]:
    """``text`` in stream chunks of 1..max_piece characters, with a chunk boundary at every offset in
    ``must_cut``."""
    cuts, at = set(x for x in must_cut if 0 < x < len(text)), 0
    while at < len(text):
        at += rng.randint(1, max_piece)
        if at < len(text):
            cuts.add(at)
    bounds = [0] + sorted(cuts) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [""]


def sse_events(endpoint: str, rid: str, parts: list[str], n_prompt: int, finish: str | None = "stop",
               done: bool = True) -> list[bytes]:
    """The SSE events (each ``data: ...\\n\\n``) of a 200 stream whose reply comes in ``parts``:
    ``/generate`` streams the cumulative text (and output ids); the OpenAI endpoints stream deltas
    (``choices[0].text``; chat: a role chunk, then ``choices[0].delta.content``). ``finish`` None:
    the stream ends without a finish reason (cut, aborted); ``done``: ``data: [DONE]`` at the end."""
    out, sofar = [], ""
    for i, p in enumerate(parts):
        sofar += p
        last = i == len(parts) - 1 and finish is not None
        if endpoint == "generate":
            fr = ({"type": "stop", "matched": EOS} if finish == "stop" else {"type": "length", "length": len(sofar)}) \
                if last else None
            ev = {"text": sofar, "output_ids": ids_of(sofar), "meta_info": {
                "id": rid, "finish_reason": fr, "prompt_tokens": n_prompt, "weight_version": "default",
                "completion_tokens": len(sofar), "cached_tokens": 0}, "index": 0}
        elif endpoint == "completions":
            ev = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1780000000, "model": MODEL,
                  "choices": [{"index": 0, "text": p, "logprobs": None, "finish_reason": finish if last else None,
                               "matched_stop": (EOS if finish == "stop" else None) if last else None}], "usage": None}
        else:
            if i == 0:
                out.append(b"data: " + _compact({
                    "id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1780000000, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "usage": None}) + b"\n\n")
            ev = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1780000000, "model": MODEL,
                  "choices": [{"index": 0, "delta": {"role": None, "content": p, "reasoning_content": None,
                                                     "tool_calls": None}, "logprobs": None,
                               "finish_reason": finish if last else None,
                               "matched_stop": (EOS if finish == "stop" else None) if last else None}], "usage": None}
        out.append(b"data: " + _compact(ev) + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def error_body(shape: str, status: int, message: str) -> bytes:
    """An error reply body: SGLang's ErrorResponse, the router's / OpenAI's nested error, FastAPI's
    validation detail, a proxy's plain text or HTML page."""
    if shape == "sglang":
        return json.dumps({"object": "error", "message": message, "type": ERROR_TYPES.get(status, "Error"),
                           "param": None, "code": status}).encode()
    if shape == "nested":
        return json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                                     "code": status}}).encode()
    if shape == "detail":
        return json.dumps({"detail": [{"type": "value_error", "loc": ["body"], "msg": message,
                                       "input": None}]}).encode()
    if shape == "html":
        return (f"<html><head><title>{status}</title></head><body><h1>{status}</h1><p>{message}</p>"
                "</body></html>").encode()
    return message.encode()  # plain


ERROR_SHAPES = ("sglang", "nested", "detail", "html", "plain")


# --------------------------------------------------------------------------- the driver, replayed on bytes
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


class _Malformed(ValueError):
    pass


class _Cut(Exception):
    pass


def send(log, p: RequestPlan, pd: bool = False) -> dict:
    """The ``send`` record of ``p``."""
    stream = p.kind in ("stream", "abort_after", "disconnect_before_first_token")
    url = (DECODE if pd else ROUTER) + PATHS[p.endpoint]
    return log.emit("send", rid=p.rid, url=url, stream=stream, **({"pd_direct": True} if pd else {}))


def exchange(log, p: RequestPlan, w: Wire, pd: bool = False, sent: bool = False) -> None:
    """Log one request's records exactly as ``Driver._run_one`` does for a server that sent ``w``
    (``sent``: its ``send`` record is already written)."""
    stream = p.kind in ("stream", "abort_after", "disconnect_before_first_token")
    rid = p.rid
    if not sent:
        send(log, p, pd)

    def leg(when):
        if pd and w.leg is not None and w.leg[2] == when:
            log.emit("prefill_leg", rid=rid, status=w.leg[0], error=w.leg[1])

    leg("early")

    def end(outcome, **extra):
        log.emit("end", rid=rid, outcome=outcome, latency_s=w.latency_s, **extra)
        leg("late")

    def aborts(method):
        log.emit("abort", rid=rid, method=method)
        for u in (PREFILL, DECODE):
            log.emit("abort", rid=rid, method="abort_request", url=u, status=200)

    if w.status is None:  # no response at all
        if w.end == "timeout":
            return end("timeout", bytes_received=0, bound_s=TIMEOUT_S)
        if w.end == "abort":
            aborts("client_disconnect_after_ms")
            return end("aborted", bytes_received=0, after_ms=w.after_ms)
        err = ("ClientConnectorError(ConnectionKey(host='127.0.0.1', port=30000, is_ssl=False, ssl=True, "
               "proxy=None, proxy_auth=None, proxy_headers_hash=None), ConnectionRefusedError(111, "
               "\"Connect call failed ('127.0.0.1', 30000)\"))")
        log.emit("error", rid=rid, error=err)
        return end("error", bytes_received=0, error=err)

    sse = stream and w.status == 200
    st = {"merged": None, "chunks": 0, "complete": False}
    raw = w.body.decode("utf-8", "replace")

    def body():
        if sse:
            parsed = st["merged"]
        elif st["complete"]:
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = {"raw": raw[:2000]}
        else:
            parsed = None
        text, ids, meta, error = _extract(parsed, p.endpoint)
        log.emit("body", rid=rid, text=text, output_ids=ids, meta=meta, error=error,
                 chunks=st["chunks"] if sse else None, raw=raw, complete=st["complete"])

    def leave(outcome, **extra):
        if not stream:
            log.emit("status", rid=rid, status=w.status, headers_only=True)
        body()
        end(outcome, status=w.status, bytes_received=len(w.body), **extra)

    if stream:
        log.emit("status", rid=rid, status=w.status, headers_only=True)
        if p.kind == "disconnect_before_first_token":
            aborts("disconnect_before_first_token")
            return leave("disconnected")
    try:
        if sse:
            lines = w.body.split(b"\n")
            pending = lines.pop()
            done = False
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if not st["chunks"]:
                    log.emit("first_byte", rid=rid)
                try:
                    chunk = json.loads(data)
                except ValueError:
                    chunk = None
                if not isinstance(chunk, dict):
                    raise _Malformed(f"stream line is not a JSON object: {line[:200]!r}")
                st["chunks"] += 1
                st["merged"] = _merge_stream(st["merged"], chunk, p.endpoint)
            if not done:
                if w.end == "eof" and pending.strip():
                    raise _Cut(f"ClientPayloadError({f'stream ended mid-line: {pending[:200]!r}'!r})")
                if w.end != "eof":
                    raise _Cut(w.end)
        else:
            if w.end != "eof":
                raise _Cut(w.end)
            if not stream:
                log.emit("first_byte", rid=rid)
        st["complete"] = True
    except _Malformed as e:
        err = f"_Malformed({str(e)!r})"
        log.emit("error", rid=rid, error=err)
        return leave("error", error=err)
    except _Cut as e:
        how = str(e)
        if how == "abort":
            aborts("client_disconnect_after_ms")
            return leave("aborted", after_ms=w.after_ms)
        if how == "timeout":  # no byte for timeout_s: aiohttp's read timeout
            return leave("timeout", bound_s=TIMEOUT_S,
                         error="SocketTimeoutError('Timeout on reading data from socket')")
        err = how if how.startswith("ClientPayloadError") else (
            "ClientPayloadError(\"Response payload is not completed: <TransferEncodingError: 400, "
            "message='Not enough data to satisfy transfer length header.'>\")")
        log.emit("error", rid=rid, error=err)
        return leave("cut", error=err)
    log.emit("status", rid=rid, status=w.status)
    body()
    end("ok" if w.status == 200 else "http_error", status=w.status, bytes_received=len(w.body))


# --------------------------------------------------------------------------- writing logs
class _Tap:
    """An EventLog stand-in that hands ``body`` records of one rid to ``on_body`` (the duplicate-record
    and hand-written-line shapes) and stops writing after a record when asked (a crash)."""

    def __init__(self, log: EventLog, rid: str, on_body):
        self.log, self.rid, self.on_body = log, rid, on_body

    def emit(self, ev, **fields):
        if ev == "body" and fields.get("rid") == self.rid:
            return self.on_body(self.log, fields)
        return self.log.emit(ev, **fields)


class _Crashed(Exception):
    pass


@dataclass
class Req:
    plan: RequestPlan
    wire: Wire
    special: str | None = None   # dup_body | dup_key | cut_last
    clean_wire: Wire | None = None  # for dup_body / dup_key: what the later (clean) record says
    dup_keys: str = "text,raw"      # dup_key: which keys the hand-written line repeats


@dataclass
class LogSpec:
    name: str
    reqs: list                           # Req, in send order
    version: str | None = "0.5.23"
    pd: bool = False
    probes: bool = True
    faults: list = field(default_factory=list)   # fault records (copied at the end, as Experiment does)
    agents: list = field(default_factory=list)   # agent events (copied as ev "agent")
    # requests in flight together: the driver sends a wave of them, then each one's reply is logged (so
    # a request's window overlaps those of its wave, as at the driver's concurrency)
    concurrency: int = 16
    judged: bool = True                  # given to ``kvchaos judge`` / in the session registry
    meta: dict = field(default_factory=dict)  # what was planted: {"foreign": canary, "victims": [rid], "owner": ...}

    def write(self, path: Path) -> Path:
        log = EventLog(path)
        try:
            self._write(log, path)
        except _Crashed:
            pass
        finally:
            log.close()
        return path

    def _write(self, log: EventLog, path: Path) -> None:
        if self.version is not None:
            log.emit("experiment", id=f"{self.name}-0001", name=self.name, test=f"suites/test_x.py::{self.name}",
                     seed=7, run_seed=7, plans_digest="0" * 12, n=len(self.reqs), concurrency=64,
                     timeout_s=TIMEOUT_S, engine={"name": "sglang", "version": self.version,
                                                  "roles": {"prefill": self.version, "decode": self.version}},
                     layout=LAYOUT, via="pd" if self.pd else "router",
                     checkers=["Isolation()", "Sensitivity()", "Liveness(bound_s=60)"])
        if self.probes:
            for role in ("prefill", "decode"):
                log.emit("probe", phase="before", role=role, kv_used=0, ok=True, waited_s=0.0)
        log.emit("method", faults=sorted({f["fault"] for f in self.faults if f.get("fault")}), during=False)
        for r in self.reqs:
            log.emit("plan", rid=r.plan.rid, **{k: v for k, v in r.plan.to_dict().items() if k != "rid"})
        sends = {}
        for i, r in enumerate(self.reqs):
            if i % self.concurrency == 0:  # the next wave goes out
                for q in self.reqs[i:i + self.concurrency]:
                    sends[q.plan.rid] = send(log, q.plan, self.pd)["wall"]
            if r.special is None:
                exchange(log, r.plan, r.wire, self.pd, sent=True)
                continue
            clean = _body_fields(r.plan, r.clean_wire, self.pd) if r.clean_wire is not None else None

            def on_body(lg, fields, r=r, clean=clean):
                if r.special == "dup_body":  # the leaky record, then a second, clean one for the same rid
                    lg.emit("body", **fields)
                    return lg.emit("body", **clean)
                if r.special == "dup_key":  # one line, written by hand: every key again with clean values
                    rec = {"t": 0.0, "wall": 0.0, "ev": "body", **fields}
                    import time as _time
                    rec["t"], rec["wall"] = _time.monotonic(), _time.time()
                    head = json.dumps(rec)[:-1]
                    keys = ("text", "raw") if r.dup_keys == "text,raw" else tuple(clean)
                    tail = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in clean.items() if k in keys)
                    with open(path, "a") as f:  # EventLog writes whole lines (line-buffered, append mode)
                        f.write(head + ", " + tail + "}\n")
                    return rec
                if r.special == "cut_last":  # the process dies while writing this line
                    import time as _time
                    line = json.dumps({"t": _time.monotonic(), "wall": _time.time(), "ev": "body", **fields})
                    with open(path, "a") as f:  # no newline: the line was never finished
                        f.write(line[:-5])
                    raise _Crashed()
                raise AssertionError(r.special)

            exchange(_Tap(log, r.plan.rid, on_body), r.plan, r.wire, self.pd, sent=True)
        if self.probes:
            for role in ("prefill", "decode"):
                log.emit("probe", phase="after", role=role, kv_used=0, ok=True, waited_s=0.0)
            log.emit("probe", phase="after", role="router", ok=True, detail="HTTP 200")
        def when(v):  # ("sent", rid): when that request was sent (a fault acting on it)
            return sends[v[1]] if isinstance(v, tuple) and v[0] == "sent" else v

        for f in self.faults:
            log.emit("fault", **{k: when(v) for k, v in f.items()})
        for a in self.agents:
            log.emit("agent", **{k: when(v) for k, v in a.items()})


def _body_fields(p: RequestPlan, w: Wire, pd: bool) -> dict:
    """The fields of the ``body`` record the driver logs for ``w``."""
    mem = EventLog()
    exchange(mem, p, w, pd)
    rec = next(r for r in mem.records if r["ev"] == "body")
    return {k: v for k, v in rec.items() if k not in ("t", "wall", "ev")}


# --------------------------------------------------------------------------- building plans and clean replies
class Mint:
    """Plans of one log: rids ``<prefix>7-<n>-<tenant>``, probe prompts with the plan's canaries."""

    def __init__(self, name: str, seed: int):
        self.rng = random.Random(f"{name}/{seed}")
        self.prefix = name[:3]
        self.n = 0

    def plan(self, endpoint="generate", kind="plain", ncan=3, canaries=None, expect_echo=True, tenant=None,
             oversized=False, n_tokens=None) -> RequestPlan:
        self.n += 1
        tenant = tenant or f"t{self.rng.randrange(8):03d}"
        cs = list(canaries) if canaries is not None else canary.mint(self.rng, ncan)
        need = sum(len(c) + 2 for c in cs) + 1 + 24
        n = max(n_tokens or self.rng.randrange(64, 160), need)
        text = probe_prompt(self.rng, n, cs)
        return RequestPlan(rid=f"{self.prefix}7-{self.n:06d}-{tenant}", tenant=tenant, kind=kind, endpoint=endpoint,
                           prompt=text, canaries=cs, n_tokens=len(text), max_new_tokens=max_new_tokens(len(cs)),
                           abort_after_ms=(self.rng.uniform(5, 200) if kind == "abort_after" else None),
                           expect_echo=expect_echo, oversized=oversized)

    def lat(self) -> float:
        return round(self.rng.uniform(0.05, 2.5), 4)


def reply_wire(m: Mint, p: RequestPlan, text: str, delivery: str, finish: str = "stop", must_cut=(),
               meta_extra=None) -> Wire:
    """A complete 200 reply with ``text``: one JSON body, or an SSE stream to ``[DONE]``."""
    if delivery == "complete":
        return Wire(200, complete_body(p.endpoint, p.rid, text, p.n_tokens, finish, meta_extra), "eof", m.lat())
    evs = sse_events(p.endpoint, p.rid, pieces(text, m.rng, must_cut), p.n_tokens, finish)
    return Wire(200, b"".join(evs), "eof", m.lat())


DELIVERIES = ("complete", "stream")


def clean_request(m: Mint, endpoint: str, delivery: str, ncan: int) -> Req:
    p = m.plan(endpoint, "stream" if delivery == "stream" else "plain", ncan)
    return Req(p, reply_wire(m, p, recite(p.canaries), delivery))


NOISE = ("http_error", "cut", "aborted", "disconnected", "malformed", "after_done", "oversized", "leg_error")


def noise_request(m: Mint, what: str, endpoint: str, pd: bool) -> Req:
    """A request that did not complete normally, or was rejected — with nothing foreign in it."""
    rng = m.rng
    if pd:
        endpoint = "generate"
    if what == "http_error":
        status = rng.choice(ERROR_STATUSES)
        p = m.plan(endpoint, rng.choice(("plain", "stream")))
        msg = rng.choice(("Service Unavailable: the server is overloaded", "upstream request timeout",
                          "Internal server error: KV transfer failed", "Too many requests in the queue"))
        return Req(p, Wire(status, error_body(rng.choice(ERROR_SHAPES), status, msg), "eof", m.lat(),
                           leg=(status, msg, "early") if pd else None))
    if what == "oversized":
        p = m.plan(endpoint, "oversized", n_tokens=2100, oversized=True)
        msg = "The input (2100 tokens) is longer than the model's context length (2048 tokens)."
        return Req(p, Wire(400, error_body("sglang", 400, msg), "eof", m.lat(),
                           leg=(400, msg, "early") if pd else None))
    if what == "leg_error":  # pd_direct only: prefill's half failed, decode answered an error
        p = m.plan(endpoint, "plain")
        return Req(p, Wire(500, error_body("sglang", 500, "Decode transfer failed"), "eof", m.lat(),
                           leg=(500, "Internal Server Error", rng.choice(("early", "late")))))
    if what in ("cut", "aborted"):
        kind = "abort_after" if what == "aborted" else rng.choice(("plain", "stream"))
        p = m.plan(endpoint, kind)
        text = recite(p.canaries)
        stop = rng.randrange(1, len(text))
        if kind == "plain":
            body = complete_body(p.endpoint, p.rid, text, p.n_tokens)
            body = body[:rng.randrange(1, len(body))]
        else:
            evs = sse_events(p.endpoint, p.rid, pieces(text[:stop], rng), p.n_tokens, finish=None, done=False)
            body = b"".join(evs)
            if what == "cut" and rng.random() < 0.5:
                body = body[:-rng.randrange(3, 12)]  # cut mid-line
        return Req(p, Wire(200, body, "cut" if what == "cut" else "abort", m.lat(),
                           after_ms=p.abort_after_ms, leg=(200, None, "late") if pd else None))
    if what == "disconnected":
        p = m.plan(endpoint, "disconnect_before_first_token")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        body = b"".join(evs[:rng.randrange(0, 2)])
        return Req(p, Wire(200, body, "disconnect", m.lat(), leg=(200, None, "late") if pd else None))
    if what == "malformed":
        p = m.plan(endpoint, "stream")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        k = rng.randrange(0, len(evs))
        bad = rng.choice((b"data: <html>502 bad gateway</html>\n\n", b"data: 42\n\n", b'data: {"text": "ab\n\n'))
        return Req(p, Wire(200, b"".join(evs[:k] + [bad] + evs[k:]), "eof", m.lat(),
                           leg=(200, None, "late") if pd else None))
    if what == "after_done":  # a complete stream, then bytes after [DONE] (its own last event again)
        p = m.plan(endpoint, "stream")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        return Req(p, Wire(200, b"".join(evs + [evs[-2], b": keep-alive\n\n"]), "eof", m.lat(),
                           leg=(200, None, "late") if pd else None))
    raise AssertionError(what)


# --------------------------------------------------------------------------- scenarios
@dataclass
class Scenario:
    """What a property draws: a class of shape, its variant and the drawn parameters (``params``,
    primitive values: this is what Hypothesis prints). ``build(leak)`` makes the logs."""
    cls: str
    variant: str
    params: dict
    malformed: bool = False          # the shape is malformed input: exit 2 (bad input) is acceptable
    accept_known: bool = False       # the scenario is about an accepted known finding
    twin_green: bool = True          # its leak-free twin is a clean, powered log (judge 0, suite green)

    def __repr__(self):
        if self.cls == "mirror":
            return f"Scenario(cls='mirror', {mirror_summary(self)})"
        p = dict(self.params)
        return f"Scenario(cls={self.cls!r}, variant={self.variant!r}, params={p!r})"

    def _repr_pretty_(self, p, cycle):  # what Hypothesis prints for a falsifying example
        p.text(repr(self))

    def build(self, leak: bool = True) -> list[LogSpec]:
        return BUILDERS[self.cls](self, leak)

    def write(self, d: Path, leak: bool = True) -> dict:
        """Write the logs under ``d``; returns {"judged": [paths], "all": [paths], "specs": [LogSpec],
        "main": the path of the log holding the leak, "meta": what was planted there}."""
        d.mkdir(parents=True, exist_ok=True)
        specs = self.build(leak)
        paths = [s.write(d / f"{i}-{s.name}.events.jsonl") for i, s in enumerate(specs)]
        main = next((i for i, s in enumerate(specs) if s.meta), 0)  # the log holding the planted leak
        return {"judged": [p for p, s in zip(paths, specs) if s.judged], "all": paths, "specs": specs,
                "main": paths[main], "meta": specs[main].meta}


BUILDERS = {}


def builder(cls):
    def deco(fn):
        BUILDERS[cls] = fn
        return fn
    return deco


# ----------------------------------------------------------------- shared parts of the leak scenarios
EP = {"g": "generate", "c": "completions", "h": "chat"}
COMBOS = tuple((e, d) for e in "gch" for d in DELIVERIES)
# the clean requests around a leak: 35 of 3 canaries, >= 100 canaries echoed (one own canary a leak
# displaced cannot take the run below the power floor); "plain": all /generate complete, "mixed": every
# endpoint, complete and streamed, drawn from the seed (few dimensions: quick to shrink)
LEAK_BASE_N = 35
leak_base = st.sampled_from(("plain", "mixed"))
owner_kinds = st.sampled_from(("log", "other-log", "nobody"))
# where a split canary's payload is cut between two stream events: 1..9, shrinking towards 5 (two halves
# of 5: neither holds the 8 characters a partial match needs)
splits = st.integers(-4, 4).map(lambda d: 5 + d)


class _Ctx:
    """Building one leak scenario: the main log's plans, the owner of the leaked canary, the victim."""

    def __init__(self, sc: Scenario, leak: bool, pd: bool = False):
        self.sc, self.leak, self.pd = sc, leak, pd
        seed = sc.params.get("seed", 0)
        self.m = Mint("main", seed)
        self.other = Mint("other", seed)
        self.nobody = random.Random(f"nobody/{seed}")
        self.reqs: list[Req] = []
        if "base" in sc.params:
            brng = random.Random(f"base/{seed}")
            for _ in range(LEAK_BASE_N):
                ep, delivery = ("g", "complete") if sc.params["base"] == "plain" else brng.choice(COMBOS)
                self.reqs.append(clean_request(self.m, "generate" if pd else EP[ep], delivery, 3))
        self.other_reqs: list[Req] = []
        self.twin_rng = random.Random(f"twin/{seed}")
        self._shown: dict = {}
        self.planted: str | None = None
        self.victims: list = []

    def foreign(self, owner: str, avoid_first=()) -> str:
        """The foreign canary (minted for the owner: a request of this log, of another log, or nobody)."""
        while True:
            if owner == "log":
                pool = [c for r in self.reqs for c in r.plan.canaries]
                c = self.m.rng.choice(pool)
            elif owner in ("other-log", "unjudged-log"):
                if not self.other_reqs:  # another experiment's log: powered and clean on its own
                    self.other_reqs = [clean_request(self.other, "generate", "complete", 3) for _ in range(35)]
                p = self.other.plan("generate", "plain", 3)
                self.other_reqs.append(Req(p, reply_wire(self.other, p, recite(p.canaries), "complete")))
                c = self.other.rng.choice(p.canaries)
            else:
                c = canary.mint(self.nobody, 1)[0]
            if c[1] not in avoid_first and c[1] != canary.ALPHABET[-1]:
                self.planted = c
                return c

    def show(self, c: str) -> str:
        """The canary as it appears in the client's bytes: itself, or the twin's lower-case stand-in."""
        if c not in self._shown:
            self._shown[c] = c if self.leak else "[" + twin_payload(self.twin_rng) + "]"
        return self._shown[c]

    def victim_plan(self, endpoint, kind, foreign, ncan=None, expect_echo=True):
        """A victim whose own canaries avoid the foreign canary's first character and one of which
        recites after it (so a displaced recitation shows the whole foreign canary)."""
        rng = self.m.rng
        n = ncan or rng.randint(1, 3)
        while True:
            cs = canary.mint(rng, n, avoid_first=[foreign[1]])
            if max(canary.ALPHABET.index(c[1]) for c in cs) > canary.ALPHABET.index(foreign[1]):
                break
        return self.m.plan(endpoint, kind, canaries=cs, expect_echo=expect_echo)

    def displaced(self, p: RequestPlan, foreign: str) -> str:
        """The victim's reply: its context held the foreign canary where one of its own was (stale KV):
        the probe recites the foreign one in its place, in ascending order."""
        own = list(p.canaries)
        later = [c for c in own if canary.ALPHABET.index(c[1]) > canary.ALPHABET.index(foreign[1])]
        own.remove(later[-1])
        shown = self.show(foreign)
        return "".join((canary.payload(c) + "][") if c != foreign else shown[1:-1] + "]["
                       for c in order(own + [foreign]))

    def insert(self, i: int, req: Req) -> None:
        self.reqs.insert(min(i, len(self.reqs)), req)
        self.victims.append(req.plan.rid)

    def logs(self, owner: str, **kw) -> list[LogSpec]:
        out = [LogSpec("main", self.reqs, pd=self.pd, meta=self.meta(owner), **kw)]
        if self.other_reqs:
            out.append(LogSpec("other", self.other_reqs, judged=(owner != "unjudged-log")))
        return out

    def meta(self, owner: str) -> dict:
        return {"foreign": self.planted, "shown": self._shown.get(self.planted), "owner": owner,
                "victims": list(self.victims)}


def _leak_common(draw):
    return {"seed": draw(st.integers(0, 2**16)), "base": draw(leak_base), "at": draw(st.integers(0, 40))}


def _label(draw, cls, variant):
    """The variant of ``cls`` to build: ``variant`` when given, else one of :data:`VARIANTS` drawn."""
    if variant is not None:
        assert variant in VARIANTS[cls], (cls, variant)
        return variant
    return draw(st.sampled_from(sorted(VARIANTS[cls])))


# ----------------------------------------------------------------- the classes
@st.composite
def complete_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params["endpoint"], params["owner"] = label.split("/")
    return Scenario(cls, label, params)


@builder("complete-generate")
@builder("complete-openai")
@builder("checkers-liveness")
def _b_complete(sc, leak):
    cx = _Ctx(sc, leak)
    f = cx.foreign(sc.params["owner"])
    p = cx.victim_plan(sc.params["endpoint"], "plain", f)
    cx.insert(sc.params["at"], Req(p, reply_wire(cx.m, p, cx.displaced(p, f), "complete")))
    return cx.logs(sc.params["owner"])


@st.composite
def stream_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params["endpoint"], params["owner"] = label.split("/")
    params["split"] = draw(splits)
    return Scenario(cls, label, params)


@builder("stream-generate")
@builder("stream-openai-split")
def _b_stream(sc, leak):
    cx = _Ctx(sc, leak)
    f = cx.foreign(sc.params["owner"])
    p = cx.victim_plan(sc.params["endpoint"], "stream", f)
    text = cx.displaced(p, f)
    at = text.index(cx.show(f)[1:-1]) + sc.params["split"]  # a chunk boundary inside the foreign payload
    cx.insert(sc.params["at"], Req(p, reply_wire(cx.m, p, text, "stream", must_cut=[at])))
    return cx.logs(sc.params["owner"])


def _stream_bytes(cx: _Ctx, p: RequestPlan, text: str, split_at=None, finish="stop", done=True) -> list[bytes]:
    return sse_events(p.endpoint, p.rid, pieces(text, cx.m.rng, [split_at] if split_at is not None else []),
                      p.n_tokens, finish, done)


@st.composite
def cut_leak(draw, cls, variant=None):
    v = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    return Scenario(cls, v, params)


@builder("stream-cut-mid-line")
def _b_cut(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    ep = "generate" if v.startswith("generate") or v == "complete-body-cut" else sc.params["endpoint"]
    kind = "plain" if v == "complete-body-cut" else "stream"
    p = cx.victim_plan(ep, kind, f)
    text = cx.displaced(p, f)
    fpay = cx.show(f)[1:-1]
    fend = text.index(fpay) + len(fpay) + 1  # just after the foreign canary's "]"
    if v == "complete-body-cut":  # the JSON body cut after the leaked text
        body = complete_body(ep, p.rid, text, p.n_tokens)
        at = body.index(fpay.encode()) + len(fpay) + 1
        w = Wire(200, body[:at + 3], "cut", cx.m.lat())
    elif v == "reset-after-chunk":  # whole events, then the connection reset (no line cut)
        evs = _stream_bytes(cx, p, text[:fend], finish=None, done=False)
        w = Wire(200, b"".join(evs), "cut", cx.m.lat())
    else:
        if v == "openai-split-into-cut-line":  # first part in the last whole event, the rest in the cut line
            split = text.index(fpay) + sc.params["split"]
            evs = sse_events(ep, p.rid, [text[:split], text[split:fend]], p.n_tokens, None, False)
        elif v in ("generate-chunk-before-cut",):  # the foreign canary in a whole event, a later line cut
            evs = sse_events(ep, p.rid, [text[:fend], text[fend:fend + 4] or "x"], p.n_tokens, None, False)
        else:  # the foreign canary only in the cut line
            evs = sse_events(ep, p.rid, [text[:text.index(fpay)], text[text.index(fpay):fend]], p.n_tokens, None, False)
        last = evs[-1]
        if v == "generate-chunk-before-cut":
            tail = last[:-6]
        else:  # the line ends just after the foreign canary's closing bracket and one more byte
            rest = (fpay[sc.params["split"]:] if v == "openai-split-into-cut-line" else fpay).encode()
            tail = last[:last.index(rest) + len(rest) + 2]
        w = Wire(200, b"".join(evs[:-1]) + tail, "eof" if sc.params["seed"] % 2 else "cut", cx.m.lat())
    cx.insert(sc.params["at"], Req(p, w))
    return cx.logs(owner)


@st.composite
def after_done_leak(draw, cls, variant=None):
    v = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    if cls == "stream-after-malformed-line":
        params["malformed_kind"] = draw(st.sampled_from(tuple(MALFORMED_LINES)))
    return Scenario(cls, v, params)


def _trailing_events(cx, p_ep, rid, n_tokens, f_text, variant, split):
    """Events of the reply that arrives after the victim's own (keep-alive desync, interleaving): the
    owner's recitation carrying the foreign canary — split across two events, or whole."""
    if variant == "generate-cumulative":
        return sse_events("generate", rid, [f_text[:split], f_text[split:]], n_tokens)
    if variant == "openai-whole":
        return sse_events(p_ep, rid, [f_text], n_tokens)
    return sse_events(p_ep, rid, [f_text[:split], f_text[split:]], n_tokens)


@builder("stream-after-done")
def _b_after_done(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    ep = "generate" if v == "generate-cumulative" else sc.params["endpoint"]
    p = cx.m.plan(ep, "stream")
    own = _stream_bytes(cx, p, recite(p.canaries))  # the victim's own complete stream, to [DONE]
    f_text = cx.show(f)[1:-1] + "]["
    if v == "another-reply":  # a whole other reply (its own JSON events) follows the [DONE]
        trail = sse_events(ep, "other", pieces(f_text, cx.m.rng, [sc.params["split"]]), 77)
    else:
        trail = _trailing_events(cx, ep, p.rid, p.n_tokens, f_text, v, sc.params["split"])
    cx.insert(sc.params["at"], Req(p, Wire(200, b"".join(own + trail), "eof", cx.m.lat())))
    return cx.logs(owner)


MALFORMED_LINES = {"html": b"data: <html><body>502 Bad Gateway</body></html>\n\n", "number": b"data: 42\n\n",
                   "cut-json": b'data: {"text": "the of and\n\n', "array": b'data: ["x"]\n\n'}


@builder("stream-after-malformed-line")
def _b_malformed(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    ep = "generate" if v == "generate-cumulative" else sc.params["endpoint"]
    p = cx.m.plan(ep, "stream")
    text = recite(p.canaries)
    k = max(1, len(text) // 2)
    head = sse_events(ep, p.rid, pieces(text[:k], cx.m.rng), p.n_tokens, None, False)
    bad = MALFORMED_LINES[sc.params["malformed_kind"]]
    f_text = cx.show(f)[1:-1] + "]["
    if v == "another-reply":
        trail = sse_events(ep, "other", pieces(f_text, cx.m.rng, [sc.params["split"]]), 77)
    else:
        trail = _trailing_events(cx, ep, p.rid, p.n_tokens, text[k:] + f_text, v,
                                 len(text) - k + sc.params["split"])
    cx.insert(sc.params["at"], Req(p, Wire(200, b"".join(head + [bad] + trail), "eof", cx.m.lat())))
    return cx.logs(owner)


@st.composite
def after_malformed_leak(draw, cls, variant=None):
    return draw(after_done_leak(cls, variant))


@st.composite
def abort_leak(draw, cls, variant=None):
    v = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    # a timeout is a liveness FAIL by itself: each one comes with decode SIGKILLed, so the timeouts are the
    # accepted known finding sglang-decode-death-unanswered and only the leak can make the log red
    return Scenario(cls, v, params, accept_known=(cls == "timeout"))


@builder("aborted")
@builder("disconnected")
@builder("timeout")
def _b_abort(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    ep = "generate" if v.startswith("generate") or v == "complete-body-partial" else sc.params["endpoint"]
    kind = {"aborted": "abort_after", "disconnected": "disconnect_before_first_token"}.get(sc.cls, "stream")
    if v == "complete-body-partial":
        kind = "plain"
    p = cx.victim_plan(ep, kind, f)
    text = cx.displaced(p, f)
    fpay = cx.show(f)[1:-1]
    i = text.index(fpay)
    fend = i + len(fpay) + 1
    end = {"aborted": "abort", "disconnected": "disconnect"}.get(sc.cls, "timeout")
    faults, agents = [], []
    if v == "no-response-yet":  # aborted before the headers: the reply the client saw is nothing ...
        w = Wire(None, b"", "abort", cx.m.lat(), after_ms=p.abort_after_ms)
        cx.insert(sc.params["at"], Req(p, w))
        # ... so the leak is in another request's reply: an aborted stream of the same log
        q = cx.victim_plan(ep, "abort_after", f)
        t2 = cx.displaced(q, f)
        evs = sse_events(ep, q.rid, pieces(t2[:t2.index(fpay) + len(fpay) + 1], cx.m.rng), q.n_tokens, None, False)
        cx.insert(sc.params["at"] + 1, Req(q, Wire(200, b"".join(evs), "abort", cx.m.lat(), after_ms=q.abort_after_ms)))
        return cx.logs(owner)
    if v == "complete-body-partial":
        body = complete_body(ep, p.rid, text, p.n_tokens)
        w = Wire(200, body[:body.index(fpay.encode()) + len(fpay) + 4], end, 60.0 + cx.m.lat())
    elif "split" in v:  # the foreign payload split between a whole event and the partial line after it
        split = i + sc.params["split"]
        evs = sse_events(ep, p.rid, [text[:split], text[split:fend]], p.n_tokens, None, False)
        if sc.cls == "disconnected":
            body = b"".join(evs)
        else:
            body = b"".join(evs[:-1]) + evs[-1][:evs[-1].index(text[split:fend].encode()) + (fend - split) + 2]
        w = Wire(200, body, end, cx.m.lat(), after_ms=p.abort_after_ms)
    else:
        evs = sse_events(ep, p.rid, pieces(text[:fend], cx.m.rng), p.n_tokens, None, False)
        if sc.cls == "disconnected":
            evs = sse_events(ep, p.rid, [text[:fend]], p.n_tokens, None, False)
        w = Wire(200, b"".join(evs), end, cx.m.lat(), after_ms=p.abort_after_ms)
    if sc.cls == "timeout":
        w.latency_s = TIMEOUT_S + 5 + cx.m.lat()
    at = sc.params["at"]
    if sc.cls == "timeout":  # decode SIGKILLed: the timeouts are sglang-decode-death-unanswered
        faults.append({"injector": "process", "action": "fired", "kind": "sigkill", "role": "decode",
                       "pids": [4242], "at": ("sent", p.rid), "survivors": []})
        at = min(at, 15)  # early enough that the requests after the kill are many (the kill's power)
    cx.insert(at, Req(p, w))
    return cx.logs(owner, faults=faults, agents=agents)


@st.composite
def http_error_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    klass, shape = label.split("/")
    params = _leak_common(draw)
    params.update(status=draw(st.sampled_from([s for s in ERROR_STATUSES if f"{s // 100}xx" == klass])), shape=shape,
                  endpoint=draw(st.sampled_from(("generate", "completions", "chat"))),
                  kind=draw(st.sampled_from(("plain", "stream"))), owner=draw(owner_kinds))
    return Scenario(cls, label, params)


@builder("http-error")
def _b_http_error(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    sse_error = sc.params["shape"] == "sse-error-event"
    # an error event after HTTP 200 ends the stream "ok" with the reply cut short: not a probe reply to count
    p = cx.m.plan(sc.params["endpoint"], "stream" if sse_error else sc.params["kind"], expect_echo=not sse_error)
    msg = (f"KV transfer failed for bootstrap room 4417: decode read {cx.show(f)} from a page it did not "
           f"receive")
    if sc.params["shape"] == "sse-error-event":  # HTTP 200, then the stream's error event
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text[:12], cx.m.rng), p.n_tokens, None, False)
        err = b"data: " + _compact({"error": {"message": msg, "type": "InternalServerError",
                                              "code": sc.params["status"]}}) + b"\n\n"
        w = Wire(200, b"".join(evs + [err, b"data: [DONE]\n\n"]), "eof", cx.m.lat())
    else:
        w = Wire(sc.params["status"], error_body(sc.params["shape"], sc.params["status"], msg), "eof", cx.m.lat())
    cx.insert(sc.params["at"], Req(p, w))
    return cx.logs(owner)


@st.composite
def raw_missing_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    where, raw = label.split("/")
    params.update(variant=where, raw=raw, owner=draw(owner_kinds))
    return Scenario(cls, label, params)


class _NoRaw(LogSpec):
    """A log whose victim's body record lacks ``raw`` (absent or null): an older driver, another tool."""

    victim: str = ""
    how: str = "absent"
    fields: dict = None

    def _write(self, log, path):
        outer = self

        class Strip:
            def emit(self, ev, **f):
                if ev == "body" and f.get("rid") == outer.victim:
                    f.update(outer.fields)
                    if outer.how == "absent":
                        f.pop("raw", None)
                    else:
                        f["raw"] = None
                return log.emit(ev, **f)

            def close(self):
                pass

        super()._write(Strip(), path)


@builder("raw-missing")
def _b_raw_missing(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    shown = cx.show(f)
    if v == "text":
        p = cx.victim_plan("generate", "plain", f)
        text = cx.displaced(p, f)
        w, fields = reply_wire(cx.m, p, text, "complete"), {}
    elif v == "meta":  # the stop string that matched: a foreign canary
        p = cx.m.plan("generate", "plain")
        w = reply_wire(cx.m, p, recite(p.canaries), "complete",
                       meta_extra={"finish_reason": {"type": "stop", "matched": shown}})
        fields = {}
    elif v == "output_ids":  # --skip-tokenizer-init: no text, the reply is its token ids
        p = cx.victim_plan("generate", "plain", f, expect_echo=False)
        ids = ids_of(cx.displaced(p, f)) + [EOS]
        body = json.dumps({"text": "", "output_ids": ids, "meta_info": {
            "id": p.rid, "finish_reason": {"type": "stop", "matched": EOS}, "prompt_tokens": p.n_tokens,
            "completion_tokens": len(ids), "cached_tokens": 0}}).encode()
        w, fields = Wire(200, body, "eof", cx.m.lat()), {}
    else:
        p = cx.m.plan("generate", "plain")
        msg = f"KV transfer failed: decode read {shown} from a page it did not receive"
        w, fields = Wire(500, error_body("sglang", 500, msg), "eof", cx.m.lat()), {}
    cx.insert(sc.params["at"], Req(p, w))
    spec = _NoRaw("main", cx.reqs, meta=cx.meta(owner))
    spec.victim, spec.how, spec.fields = p.rid, sc.params["raw"], fields
    out = [spec]
    if cx.other_reqs:
        out.append(LogSpec("other", cx.other_reqs))
    return out


@st.composite
def leg_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(leg_status=draw(st.sampled_from((400, 500, 502, 503))), when=draw(st.sampled_from(("early", "late"))),
                  decode=label.split("-", 1)[1], owner=draw(owner_kinds))
    return Scenario(cls, f"decode-{params['decode']}", params)


@builder("prefill-leg-error")
def _b_leg(sc, leak):
    cx = _Ctx(sc, leak, pd=True)
    for r in cx.reqs:
        r.wire.leg = (200, None, "late")
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    p = cx.m.plan("generate", "plain")
    err = json.dumps({"object": "error", "message": f"Prefill failed: bootstrap room reused, KV of {cx.show(f)} "
                                                      "still queued", "type": "InternalServerError", "param": None,
                      "code": sc.params["leg_status"]})[:500]
    if sc.params["decode"] == "ok":
        w = reply_wire(cx.m, p, recite(p.canaries), "complete")
    else:
        w = Wire(500, error_body("sglang", 500, "Decode transfer failed"), "eof", cx.m.lat())
    w.leg = (sc.params["leg_status"], err, sc.params["when"])
    cx.insert(sc.params["at"], Req(p, w))
    return cx.logs(owner)


@st.composite
def cross_log_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(endpoint=draw(st.sampled_from(("generate", "completions", "chat"))),
                  delivery=draw(st.sampled_from(DELIVERIES)), order=label)
    return Scenario(cls, params["order"], params)


@builder("cross-log")
def _b_cross(sc, leak):
    cx = _Ctx(sc, leak)
    # log B is a powered clean log of its own; the victim in A recites one of B's canaries
    for _ in range(36):
        cx.other_reqs.append(clean_request(cx.other, "generate", "complete", 3))
    owner = cx.other.rng.choice(cx.other_reqs)
    f = next(c for c in owner.plan.canaries if c[1] != canary.ALPHABET[-1])
    cx.planted = f
    p = cx.victim_plan(sc.params["endpoint"], "plain" if sc.params["delivery"] == "complete" else "stream", f)
    cx.insert(sc.params["at"], Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])))
    a, b = LogSpec("A", cx.reqs, meta=cx.meta("other-log")), LogSpec("B", cx.other_reqs)
    return [a, b] if sc.params["order"] == "A,B" else [b, a]


@st.composite
def unknown_origin_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params["endpoint"], params["delivery"] = label.split("/")
    params["owner"] = "nobody"
    return Scenario(cls, params["endpoint"] + "/" + params["delivery"], params)


@builder("unknown-origin")
def _b_unknown(sc, leak):
    cx = _Ctx(sc, leak)
    f = cx.foreign("nobody")
    p = cx.victim_plan(sc.params["endpoint"], "plain" if sc.params["delivery"] == "complete" else "stream", f)
    cx.insert(sc.params["at"], Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])))
    return cx.logs("nobody")


@st.composite
def duplicate_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(delivery=label, owner=draw(owner_kinds))
    if cls == "duplicate-json-key":
        params["keys"] = draw(st.sampled_from(("text,raw", "every-field")))
    return Scenario(cls, params["delivery"], params, malformed=True, twin_green=False)


@builder("duplicate-body-record")
@builder("duplicate-json-key")
def _b_dup(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    p = cx.victim_plan("generate", "plain" if sc.params["delivery"] == "complete" else "stream", f)
    w = reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])
    clean = reply_wire(cx.m, p, recite(p.canaries), sc.params["delivery"])
    special = "dup_body" if sc.cls == "duplicate-body-record" else "dup_key"
    cx.insert(sc.params["at"], Req(p, w, special=special, clean_wire=clean, dup_keys=sc.params.get("keys", "")))
    return cx.logs(owner)


@st.composite
def cut_last_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(delivery=label, owner=draw(owner_kinds))
    return Scenario(cls, params["delivery"], params, malformed=True, twin_green=False)


@builder("cut-last-line")
def _b_cut_last(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    p = cx.victim_plan("generate", "plain" if sc.params["delivery"] == "complete" else "stream", f)
    cx.reqs.append(Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"]), special="cut_last"))
    cx.victims.append(p.rid)
    return cx.logs(owner)


# ----------------------------------------------------------------- known-finding shapes
def _short_fault(victim: RequestPlan) -> tuple[list, list]:
    fault = {"action": "armed", "fault": "short-1", "kind": "short", "role": "prefill", "target": {"rid": victim.rid},
             "params": {"pages": 1}, "count": 1, "injector": "agent", "at": ("sent", victim.rid)}
    fired = {"agent_ev": "fault_fired", "wall": ("sent", victim.rid), "seq": 17, "pid": 4242, "role": "prefill",
             "source": "agent", "fault": "short-1", "kind": "short", "room": 4417, "rid": victim.rid, "pages_sent": 1,
             "pages_reserved": victim.n_tokens, "page_size": 1, "dst_pages": [3], "dst_pages_total": 1,
             "dst_page_offset": 0,
             "note": "success reported; remaining decode pages unwritten"}
    return [fault], [fired]


@st.composite
def short_blind_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = {"seed": draw(st.integers(0, 2**16)), "n_blind": draw(st.integers(20, 40)),
              "delivery": label, "at": draw(st.integers(1, 40))}
    return Scenario(cls, params["delivery"], params, accept_known=True, twin_green=False)


@builder("short-blind-known")
def _b_short_blind(sc, leak):
    cx = _Ctx(sc, leak)
    for _ in range(sc.params["n_blind"]):  # a model that cannot echo: every reply empty
        p = cx.m.plan("generate", "plain")
        cx.reqs.append(Req(p, reply_wire(cx.m, p, "", "complete")))
    at = min(sc.params["at"], len(cx.reqs))
    f = cx.m.rng.choice([c for r in cx.reqs[:at] for c in r.plan.canaries if c[1] != canary.ALPHABET[-1]])
    cx.planted = f
    p = cx.victim_plan("generate", "plain" if sc.params["delivery"] == "complete" else "stream", f)
    text = cx.show(f)[1:-1] + "]["  # the short transfer's stale pages: the blind model still shows it
    cx.insert(at, Req(p, reply_wire(cx.m, p, text, sc.params["delivery"])))
    faults, agents = _short_fault(p)
    return cx.logs("log", faults=faults, agents=agents)


@st.composite
def short_after_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(delivery=label, gap=draw(st.integers(0, 5)))
    return Scenario(cls, params["delivery"], params, accept_known=True)


@builder("short-owner-after-victim")
def _b_short_after(sc, leak):
    cx = _Ctx(sc, leak)
    at = min(sc.params["at"], 15)
    # the owner is sent after the victim ended: in a later wave of requests (LogSpec.concurrency 16)
    owner = cx.reqs[(at // 16 + 1) * 16 - 1 + sc.params["gap"]]
    f = next(c for c in owner.plan.canaries if c[1] != canary.ALPHABET[-1])
    cx.planted = f
    p = cx.victim_plan("generate", "plain" if sc.params["delivery"] == "complete" else "stream", f)
    cx.insert(at, Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])))
    faults, agents = _short_fault(p)
    return cx.logs("log", faults=faults, agents=agents)


# ----------------------------------------------------------------- a canary recited cut short
@st.composite
def cut_short_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = _leak_common(draw)
    params.update(owner=label, how=draw(st.sampled_from(("aborted", "cut"))),
                  endpoint=draw(st.sampled_from(("generate", "completions", "chat"))))
    return Scenario(cls, params["owner"], params)


@builder("cut-short-recital")
def _b_cut_short(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    kind = "abort_after" if sc.params["how"] == "aborted" else "stream"
    p = cx.victim_plan(sc.params["endpoint"], kind, f)
    text = cx.displaced(p, f)
    fpay = cx.show(f)[1:-1]
    upto = text.index(fpay) + 9  # nine characters of the foreign payload, no closing bracket
    evs = sse_events(p.endpoint, p.rid, pieces(text[:upto], cx.m.rng, [text.index(fpay)]), p.n_tokens, None, False)
    w = Wire(200, b"".join(evs), "abort" if kind == "abort_after" else "cut", cx.m.lat(), after_ms=p.abort_after_ms)
    cx.insert(sc.params["at"], Req(p, w))
    return cx.logs(owner)


# ----------------------------------------------------------------- the power floor, gamed
@st.composite
def gamed_power(draw):
    params = {"seed": draw(st.integers(0, 2**16)), "n_empty": draw(st.integers(18, 20)),
              "n_many": draw(st.integers(2, 3)), "per_many": draw(st.integers(30, 32)),
              "n_503": draw(st.integers(150, 200)), "shape": draw(st.sampled_from(ERROR_SHAPES))}
    return Scenario("power-floor-gamed", "no-leak", params, twin_green=False)


@builder("power-floor-gamed")
def _b_gamed(sc, leak):
    m = Mint("main", sc.params["seed"])
    reqs = []
    for _ in range(sc.params["n_empty"]):  # no canaries: "echoed" by saying nothing
        p = m.plan("generate", "plain", canaries=[])
        reqs.append(Req(p, reply_wire(m, p, "", "complete")))
    for _ in range(sc.params["n_many"]):
        p = m.plan("generate", "plain", ncan=sc.params["per_many"], n_tokens=600)
        reqs.append(Req(p, reply_wire(m, p, recite(p.canaries), "complete")))
    for _ in range(sc.params["n_503"]):
        p = m.plan("generate", "plain")
        reqs.append(Req(p, Wire(503, error_body(sc.params["shape"], 503, "Service Unavailable"), "eof", m.lat())))
    m.rng.shuffle(reqs)
    return [LogSpec("main", reqs)]


# ----------------------------------------------------------------- mirror: clean logs with power
MIRROR_MIN = 60  # complete HTTP-200 probe requests per log


@st.composite
def mirror(draw):
    """1-2 logs; per log how many clean requests of each (endpoint, delivery) — at least 60 in all,
    each with 1-3 canaries — and how many of each kind of clean noise (< 20 % of the log's requests)."""
    n_logs = draw(st.integers(1, 2))
    logs = []
    for i in range(n_logs):
        pd = draw(st.booleans())
        counts = [draw(st.integers(0, 14)) for _ in COMBOS]
        counts[0] += max(0, MIRROR_MIN - sum(counts))
        noise = [draw(st.integers(0, 2)) for _ in NOISE]
        cap = (sum(counts) * 20 - 1) // 80  # noise / (clean + noise) < 20 %
        while sum(noise) > cap:
            noise[noise.index(max(noise))] -= 1
        logs.append({"base": {f"{a}/{b}": c for (a, b), c in zip(COMBOS, counts) if c},
                     "noise": {w: c for w, c in zip(NOISE, noise) if c}, "pd": pd,
                     "version": draw(st.sampled_from(("0.5.23", "0.5.22", None))), "seed": draw(st.integers(0, 2**16))})
    return Scenario("mirror", f"{n_logs}-log", {"logs": tuple(logs)}, twin_green=True)


@builder("mirror")
def _b_mirror(sc, leak):
    out = []
    for i, lg in enumerate(sc.params["logs"]):
        m = Mint(f"mir{i}", lg["seed"])
        shapes = [tuple(k.split("/")) for k, c in lg["base"].items() for _ in range(c)]
        m.rng.shuffle(shapes)
        reqs = [clean_request(m, "generate" if lg["pd"] else EP[ep], d, m.rng.randint(1, 3)) for ep, d in shapes]
        for what, c in lg["noise"].items():
            for _ in range(c):
                if what == "leg_error" and not lg["pd"]:
                    what = "http_error"
                reqs.insert(m.rng.randrange(len(reqs) + 1), noise_request(m, what, m.rng.choice(list(PATHS)), lg["pd"]))
        if lg["pd"]:
            for r in reqs:
                if r.wire.leg is None:
                    r.wire.leg = (200, None, m.rng.choice(("early", "late")))
        out.append(LogSpec(f"mir{i}", reqs, version=lg["version"], pd=lg["pd"]))
    return out


def mirror_summary(sc: Scenario) -> str:
    return "; ".join(f"log {i}: clean {lg['base']}, noise {lg['noise']}, pd={lg['pd']}, version={lg['version']}, "
                     f"seed={lg['seed']}" for i, lg in enumerate(sc.params["logs"]))


# ----------------------------------------------------------------- the class table
LEAK_CLASSES = {
    "complete-generate": complete_leak,
    "complete-openai": complete_leak,
    "stream-generate": stream_leak,
    "stream-openai-split": stream_leak,
    "stream-cut-mid-line": cut_leak,
    "stream-after-done": after_done_leak,
    "stream-after-malformed-line": after_malformed_leak,
    "aborted": abort_leak,
    "disconnected": abort_leak,
    "timeout": abort_leak,
    "http-error": http_error_leak,
    "raw-missing": raw_missing_leak,
    "prefill-leg-error": leg_leak,
    "cross-log": cross_log_leak,
    "unknown-origin": unknown_origin_leak,
    "duplicate-body-record": duplicate_leak,
    "duplicate-json-key": duplicate_leak,
    "cut-last-line": cut_last_leak,
    "short-blind-known": short_blind_leak,
    "short-owner-after-victim": short_after_leak,
    "checkers-liveness": complete_leak,
    "cut-short-recital": cut_short_leak,
}

# every variant each class must produce (the property run checks it saw each one)
VARIANTS = {
    "complete-generate": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "complete-openai": {f"{e}/{o}" for e in ("completions", "chat") for o in ("log", "other-log", "nobody")},
    "stream-generate": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "stream-openai-split": {f"{e}/{o}" for e in ("completions", "chat") for o in ("log", "other-log", "nobody")},
    "stream-cut-mid-line": {"generate-chunk-before-cut", "generate-in-cut-line", "openai-split-into-cut-line",
                            "openai-in-cut-line", "complete-body-cut", "reset-after-chunk"},
    "stream-after-done": {"openai-split", "openai-whole", "generate-cumulative", "another-reply"},
    "stream-after-malformed-line": {"openai-split", "openai-whole", "generate-cumulative", "another-reply"},
    "aborted": {"generate", "openai-merged", "openai-split-into-partial-line", "no-response-yet"},
    "disconnected": {"generate-buffered", "openai-whole-buffered", "openai-split-buffered"},
    "timeout": {"generate", "openai-merged", "openai-split-into-partial-line", "complete-body-partial"},
    "http-error": {f"{s}xx/{b}" for s in (4, 5) for b in ERROR_SHAPES + ("sse-error-event",)},
    "raw-missing": {f"{w}/{r}" for w in ("text", "meta", "output_ids", "error") for r in ("absent", "null")},
    "prefill-leg-error": {"decode-ok", "decode-error"},
    "cross-log": {"A,B", "B,A"},
    "unknown-origin": {f"{e}/{d}" for e in ("generate", "completions", "chat") for d in DELIVERIES},
    "duplicate-body-record": set(DELIVERIES),
    "duplicate-json-key": set(DELIVERIES),
    "cut-last-line": set(DELIVERIES),
    "short-blind-known": set(DELIVERIES),
    "short-owner-after-victim": set(DELIVERIES),
    "checkers-liveness": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "cut-short-recital": {"log", "unjudged-log"},
}


def leak_scenarios(cls: str, variant: str | None = None):
    """Scenarios of shape class ``cls`` (every variant of :data:`VARIANTS`, or only ``variant``)."""
    return LEAK_CLASSES[cls](cls, variant)
