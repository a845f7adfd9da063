"""A fake SGLang-like HTTP server for the harness's own unit tests (never used by suites).

/generate answers with the text from a per-test script: echo the prompt's canaries, leak another
prompt's text, stream slowly, hang, or reject. Binds 127.0.0.1 on a free port.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvchaos import canary


class FakeEngine:
    def __init__(self, behaviour="echo", delay_s=0.0, chunk_delay_s=0.0, leak_text=""):
        self.behaviour, self.delay_s, self.chunk_delay_s, self.leak_text = behaviour, delay_s, chunk_delay_s, leak_text
        self.requests = []
        eng = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                eng.requests.append((self.path, body))
                if self.path == "/abort_request":
                    return self._json(200, {"ok": True})
                text = body.get("text") or body.get("prompt") or "".join(m["content"] for m in body.get("messages", []))
                if eng.behaviour == "reject":
                    return self._json(400, {"error": {"message": "Input length exceeds the maximum allowed length"}})
                if eng.behaviour == "hang":
                    time.sleep(30)
                time.sleep(eng.delay_s)
                reply = "".join(canary.payload(c) + "][" for _, c in canary.find(text)) + eng.leak_text
                if body.get("stream"):
                    return self._stream(reply, self.path)
                if self.path == "/generate":
                    return self._json(200, {"text": reply, "output_ids": [ord(ch) for ch in reply],
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
                self.wfile.write(data)

            def _stream(self, reply, path):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(1, len(reply) + 1):
                        time.sleep(eng.chunk_delay_s)
                        obj = {"text": reply[:i]} if path == "/generate" else {"choices": [{"text": reply[i - 1]}]}
                        self._chunk(f"data: {json.dumps(obj)}\n\n".encode())
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _chunk(self, data):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
