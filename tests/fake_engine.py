"""A fake SGLang-like HTTP server for the harness's own unit tests (never used by suites).

/generate answers with the text from a per-test script: echo the prompt's canaries, leak another
prompt's text, stream slowly, hang, or reject; for the driver's partial-reply logging it can also
cut a reply mid-line, stall a stream, answer 500 with a body, or send a malformed stream line.
Binds 127.0.0.1 on a free port.

Behaviours (the reply is the probe's recital of the prompt's canaries, then ``leak_text``):
  echo       answer normally
  reject     400 with an error message
  hang       sleep 30 s before the headers
  cut        send part of the reply, then close the connection in the middle of its last line
             (stream: the last event's line loses its last 4 bytes; plain: the body is cut in half)
  cut_eof    stream without chunked framing (``Connection: close``), cut mid-line the same way:
             to HTTP the reply ends cleanly, only the unterminated line shows it was cut
  stall      stream every event, then send nothing more (no ``[DONE]``) until the engine stops
  error500   500 whose JSON error message holds the reply
  malformed  stream the first event, then a line that is not JSON (holding the reply), then the rest
``chunk_chars`` characters of the reply per stream event; ``eager_first_chunk`` sends the first event
in the same write as the headers (a client that leaves at the headers already has it).
"""

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvchaos import canary
from kvchaos.model import char_vocab
from kvchaos.probe.contract import recital


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # clients dropping streamed or cut connections are expected here, not worth a traceback
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """One request to a :class:`FakeEngine`; ``engine`` (set on a per-engine subclass) is read at
    request time, so a test may change its behaviour, ``leak_text`` or ``leak_min_chars`` while it runs."""

    protocol_version = "HTTP/1.1"
    engine: "FakeEngine"

    def log_message(self, *a):
        pass

    def do_POST(self):
        eng = self.engine
        if self.path.startswith("/flush_cache"):  # SGLang's: empties caches, not what the pages hold
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if eng.held:  # SGLang refuses while a request is queued, running or parked
                return self._json(400, {"error": "Timed out waiting for idle state."})
            eng.flushes += 1
            eng.flushed_at = len(eng.requests)
            return self._json(200, {"ok": True})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        eng.requests.append((self.path, body))
        if self.path == "/abort_request":
            if body.get("abort_all") and eng.held == "abortable":
                eng.held = None
            return self._json(200, {"ok": True})
        text = body.get("text") or body.get("prompt") or "".join(m["content"] for m in body.get("messages", []))
        if eng.behaviour == "reject":
            return self._json(400, {"error": {"message": "Input length exceeds the maximum allowed length"}})
        if eng.behaviour == "hang":
            time.sleep(30)
        time.sleep(eng.delay_s)
        # what the probe model answers (kvchaos.probe.contract): its context's canaries in recital order
        reply = recital(c for _, c in canary.find(text))
        if len(text) >= eng.leak_min_chars:
            reply += eng.leak_for(text)
        if eng.behaviour == "error500":
            return self._json(500, {"error": {"message": f"engine failed after: {reply}"}})
        if body.get("stream"):
            return self._stream(reply, self.path)
        if self.path == "/generate":
            vocab = char_vocab()
            return self._json(200, {"text": reply, "output_ids": [vocab.get(ch, 3) for ch in reply] + [2],
                                    "meta_info": {"finish_reason": {"type": "stop"}}})
        if self.path == "/v1/completions":
            return self._json(200, {"choices": [{"text": reply}]})
        return self._json(200, {"choices": [{"message": {"content": reply}}]})

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.engine.behaviour == "cut":
            self.wfile.write(data[:len(data) // 2])
            return self._hang_up()
        self.wfile.write(data)

    def _events(self, reply, path):
        eng = self.engine
        n = eng.chunk_chars
        ends = list(range(n, len(reply), n)) + [len(reply)]
        out = []
        for a, b in zip([0] + ends, ends):
            obj = {"text": reply[:b]} if path == "/generate" else {"choices": [{"text": reply[a:b]}]}
            out.append(f"data: {json.dumps(obj)}\n\n".encode())
        if eng.behaviour == "malformed":
            out.insert(1, f"data: {{not json {reply}\n\n".encode())
        return out

    def _stream(self, reply, path):
        eng = self.engine
        events = self._events(reply, path)
        cut, chunked = eng.behaviour in ("cut", "cut_eof"), eng.behaviour != "cut_eof"
        frame = self._frame if chunked else (lambda data: data)
        writes = [frame(e) for e in events]
        if cut:  # the last line stops 4 bytes short ('"}\n\n' for /generate); a chunk header announces it whole
            writes[-1] = (f"{len(events[-1]):x}\r\n".encode() if chunked else b"") + events[-1][:-4]
        head = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                + ("Transfer-Encoding: chunked\r\n" if chunked else "Connection: close\r\n") + "\r\n").encode()
        if eng.eager_first_chunk:
            head += writes.pop(0)
        try:
            self.wfile.write(head)
            for data in writes:
                time.sleep(eng.chunk_delay_s)
                self.wfile.write(data)
            if cut:
                return self._hang_up()
            if eng.behaviour == "stall":
                eng.stopped.wait(30)
            self.wfile.write(self._frame(b"data: [DONE]\n\n") + self._frame(b""))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _frame(self, data):
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    def _hang_up(self):
        """Close the connection (a FIN: what was sent arrives, then EOF)."""
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


class FakeEngine:
    def __init__(self, behaviour="echo", delay_s=0.0, chunk_delay_s=0.0, leak_text="", chunk_chars=1,
                 eager_first_chunk=False):
        self.behaviour, self.delay_s, self.chunk_delay_s, self.leak_text = behaviour, delay_s, chunk_delay_s, leak_text
        self.chunk_chars, self.eager_first_chunk = chunk_chars, eager_first_chunk
        self.leak_min_chars = 0  # leak only into replies to prompts at least this long
        self.requests = []
        self.flushes = 0
        self.flushed_at = 0  # len(requests) at the last /flush_cache: what came after is this run's traffic
        # requests "held" in the engine: None (idle), "abortable" (abort_all empties it), "stuck" (nothing does)
        self.held = None
        self.stopped = threading.Event()
        handler = type("H", (_Handler,), {"engine": self})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def leak_for(self, text: str) -> str:
        """What a reply to ``text`` leaks (``leak_text``; a subclass may work it out from what it was sent)."""
        return self.leak_text

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
