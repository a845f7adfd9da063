"""The harness-facing client: the official toxiproxy-python one."""

from __future__ import annotations


def toxiproxy_client(host: str, port: int):
    """The official toxiproxy-python client, pointed at ``host:port``.

    toxiproxy-python keeps host/port as class attributes of APIConsumer (one server per
    process); we set them here so every caller goes through one place."""
    # imported on use: only the harness needs the client (it pulls in requests); the proxy server
    # itself (``python -m faults.proxy``) runs without it
    from toxiproxy import Toxiproxy  # toxiproxy-python
    from toxiproxy.api import APIConsumer

    APIConsumer.host, APIConsumer.port = host, int(port)
    return Toxiproxy()
