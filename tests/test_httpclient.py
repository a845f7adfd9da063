"""kvchaos.httpclient: one TLS context per process for the harness's one-off calls, a connection of its
own per call as before, and no bare ``httpx.get`` / ``httpx.post`` left in the harness's code."""

from __future__ import annotations

import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvchaos import httpclient

REPO = Path(__file__).resolve().parents[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive offered: a client that kept connections would reuse one

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.server.seen.append((self.command, self.path, body, self.client_address[1]))
        out = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def counted_contexts(monkeypatch):
    """TLS contexts built from now on (httpx builds its default with ssl.create_default_context)."""
    made = []
    real = ssl.create_default_context

    def counting(*a, **kw):
        made.append(a or kw)
        return real(*a, **kw)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    monkeypatch.setattr(httpclient, "_tls", None)
    return made


def test_one_tls_context_for_every_call_where_httpx_builds_one_per_call(server, counted_contexts):
    srv, url = server
    for i in range(4):
        assert httpclient.get(f"{url}/health?i={i}", timeout=5).json() == {"ok": True}
        assert httpclient.post(f"{url}/generate", json={"i": i}, timeout=5).status_code == 200
    assert len(counted_contexts) == 1, counted_contexts
    ctx = httpclient.tls_context()
    assert ctx is httpclient.tls_context() and len(counted_contexts) == 1
    # what httpx's own default is: certificates and host names checked
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    # the counter sees httpx's path: a bare call builds another (what this module exists to avoid)
    httpx.get(f"{url}/health", timeout=5)
    assert len(counted_contexts) == 2


def test_each_call_opens_a_connection_of_its_own_and_sends_what_it_was_given(server):
    srv, url = server
    httpclient.get(f"{url}/metrics", timeout=5)
    httpclient.post(f"{url}/flush_cache", params={"timeout": 1.0}, timeout=5)
    httpclient.post(f"{url}/generate", json={"text": "x"}, timeout=5)
    assert [(m, p) for m, p, _, _ in srv.seen] == [("GET", "/metrics"), ("POST", "/flush_cache?timeout=1.0"),
                                                    ("POST", "/generate")]
    assert srv.seen[2][2] == b'{"text":"x"}'
    # nothing kept alive between calls: three calls, three client ports
    assert len({port for *_, port in srv.seen}) == 3


def test_calls_from_threads_share_the_context(server, counted_contexts):
    srv, url = server
    got = []
    threads = [threading.Thread(target=lambda: got.append(httpclient.get(f"{url}/x", timeout=5).status_code))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == [200] * 8 and len(counted_contexts) == 1


def test_errors_are_httpx_errors_as_before():
    with pytest.raises(httpx.HTTPError):
        httpclient.get("http://127.0.0.1:9/", timeout=1)  # discard port: nothing listens


BARE = re.compile(r"\bhttpx\.(get|post|put|delete|head|patch|request|stream)\(")


def test_no_bare_httpx_call_is_left_in_the_harness():
    """Every one-off call in kvchaos/ and faults/ goes through kvchaos.httpclient (a bare httpx.get is
    ~54 ms of CPU for its TLS context; a cluster start polls health ~600 times)."""
    bare = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for root in ("kvchaos", "faults") for p in sorted((REPO / root).rglob("*.py"))
            if p != REPO / "kvchaos" / "httpclient.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if BARE.search(line)]
    assert bare == []
