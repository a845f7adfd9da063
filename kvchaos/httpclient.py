"""The harness's one-off HTTP calls (health, ``/metrics``, ``/server_info``, ``/flush_cache``, a single
``/generate``), without the TLS context httpx builds per call.

``httpx.get(url)`` makes a client per call, and the client a TLS context loading certifi's CA bundle:
~54 ms of CPU on this machine class (httpx 0.29) for a call to 127.0.0.1 over plain http that costs
~2.5 ms with the context already built (``python bench/http_calls.py`` prints both). The harness polls
health every 0.5 s through a cluster's start and ``/metrics`` every 0.5 s while it waits for quiet, so
in a cluster session the contexts were ~30 % of the pytest process's CPU (py-spy over the clean
control and its cluster's start, 2026-12-07). Here the context httpx would build
(:func:`httpx.create_ssl_context`, the same CA bundle and ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``) is built
once per process and handed to every call. Each call still opens and closes a connection of its own,
as before: nothing is kept alive between calls (a kept-alive connection to the engines' uvicorn meets
its keep-alive close; ``sglang-pd-keepalive-race-hang`` is that race), so the wire sees what it saw.
The request driver (``kvchaos.workload.driver``) keeps one aiohttp session per run and is not this."""

from __future__ import annotations

import ssl
import threading

import httpx

_lock = threading.Lock()
_tls: ssl.SSLContext | None = None


def tls_context() -> ssl.SSLContext:
    """The process's one TLS context, as httpx builds its default (built on first use)."""
    global _tls
    if _tls is None:
        with _lock:
            if _tls is None:
                _tls = httpx.create_ssl_context()
    return _tls


def get(url: str, **kwargs) -> httpx.Response:
    """``httpx.get`` with the shared TLS context."""
    return httpx.get(url, verify=tls_context(), **kwargs)


def post(url: str, **kwargs) -> httpx.Response:
    """``httpx.post`` with the shared TLS context."""
    return httpx.post(url, verify=tls_context(), **kwargs)
