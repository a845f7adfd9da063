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

Modules: ``toxics`` (the fault model: toxic types, a toxic's state and draws, validation), ``pipe``
(the TCP side: a proxy's listener, its links, the per-chunk toxic pipeline), ``api`` (the REST
routes), ``server`` (:class:`ProxyServer`: the loop, the event log, the HTTP framing; ``main``),
``client`` (the toxiproxy-python client the harness drives it with).
"""

from __future__ import annotations

from .api import VERSION
from .client import toxiproxy_client
from .pipe import CHUNK, Proxy
from .pipe import _Link  # noqa: F401 - private names of the single-module proxy, still reachable here
from .server import ProxyServer, main
from .toxics import STREAMS, TOXIC_TYPES, ApiError, Toxic
from .toxics import _check_attrs, _slice, _split_hostport  # noqa: F401 - as _Link above

__all__ = ["CHUNK", "STREAMS", "TOXIC_TYPES", "VERSION", "ApiError", "Proxy", "ProxyServer", "Toxic", "main",
           "toxiproxy_client"]
