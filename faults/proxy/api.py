"""The toxiproxy REST API: what each (path, method) does to the proxies and their toxics.

:func:`route` answers one request as ``(status, payload)`` or raises :class:`ApiError`; the HTTP
framing around it is :class:`faults.proxy.server.ProxyServer`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .pipe import Proxy
from .toxics import ApiError, Toxic, _check_attrs, _split_hostport

if TYPE_CHECKING:
    from .server import ProxyServer

VERSION = "2.12.0-kvchaos"
PROXY, TOXICS, TOXIC = "proxies/{name}", "proxies/{name}/toxics", "proxies/{name}/toxics/{toxic}"
_ROOTS = ("proxies", "reset", "populate", "version", "events")  # a path under these: 405, not 404


async def route(server: "ProxyServer", method: str, path: str, body):
    parts = [x for x in path.split("/") if x]
    shape = _shape(parts)
    target = _target(server, shape, parts)  # 404 for a proxy or toxic that is not there, whatever the method
    handler = ROUTES.get((shape, method))
    if handler is not None:
        return await handler(server, body, *target)
    if parts and parts[0] in _ROOTS:
        raise ApiError(405, f"method {method} not allowed on {path}")
    raise ApiError(404, f"no route {path}")


def _shape(parts: list[str]) -> str | None:
    """Which resource a path names: a root (``version``, ``proxies``, ...) or one of ``PROXY``,
    ``TOXICS``, ``TOXIC`` (a path segment never holds a ``/``, so these match no root); None for
    anything else."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) >= 2 and parts[0] == "proxies":
        if len(parts) == 2:
            return PROXY
        if len(parts) in (3, 4) and parts[2] == "toxics":
            return TOXICS if len(parts) == 3 else TOXIC
    return None


def _target(server: "ProxyServer", shape: str | None, parts: list[str]) -> tuple:
    """The proxy (and toxic) a path names, as the handler's extra arguments."""
    if shape not in (PROXY, TOXICS, TOXIC):
        return ()
    p = get_proxy(server, parts[1])
    if shape != TOXIC:
        return (p,)
    if parts[3] not in p.toxics:
        raise ApiError(404, "toxic not found")
    return p, p.toxics[parts[3]]


def get_proxy(server: "ProxyServer", name: str) -> Proxy:
    if name not in server.proxies:
        raise ApiError(404, "proxy not found")
    return server.proxies[name]


async def create_proxy(server: "ProxyServer", body) -> Proxy:
    if not isinstance(body, dict):
        raise ApiError(400, "proxy: body must be a JSON object")
    name = body.get("name")
    if not name or not isinstance(name, str):
        raise ApiError(400, "proxy: missing name")
    if name in server.proxies:
        raise ApiError(409, "proxy already exists")
    upstream = body.get("upstream")
    _split_hostport(upstream, "upstream")
    listen = body.get("listen") or "127.0.0.1:0"
    _split_hostport(listen, "listen")
    p = Proxy(server, name, listen, upstream, body.get("enabled", True))
    if p._want_enabled is not False:
        await p.start()
    server.proxies[name] = p
    server.event("proxy_created", proxy=name, listen=p.listen, upstream=upstream)
    return p


# ---------------------------------------------------------------- /version /events /reset /populate
async def _version(server, body):
    return 200, VERSION


async def _events(server, body):
    return 200, server.events


async def _reset(server, body):
    for p in server.proxies.values():
        p.toxics.clear()
        await p.start()
    server.event("reset")
    return 204, None


async def _populate(server, body):
    if not isinstance(body, list):
        raise ApiError(400, "populate: body must be a list of proxies")
    out = []
    for spec in body:
        existing = server.proxies.get(spec.get("name")) if isinstance(spec, dict) else None
        if existing is not None:
            await existing.stop()
            del server.proxies[existing.name]
        out.append((await create_proxy(server, spec)).as_dict())
    return 201, {"proxies": out}


# ---------------------------------------------------------------- /proxies[/{name}]
async def _list_proxies(server, body):
    return 200, {n: p.as_dict() for n, p in server.proxies.items()}


async def _create_proxy(server, body):
    return 201, (await create_proxy(server, body)).as_dict()


async def _get_proxy(server, body, p: Proxy):
    return 200, p.as_dict()


async def _delete_proxy(server, body, p: Proxy):
    await p.stop()
    del server.proxies[p.name]
    server.event("proxy_deleted", proxy=p.name)
    return 204, None


async def _update_proxy(server, body, p: Proxy):
    body = body or {}
    if "upstream" in body:
        _split_hostport(body["upstream"], "upstream")
        p.upstream = body["upstream"]
    if "listen" in body and body["listen"] != p.listen:
        _split_hostport(body["listen"], "listen")
        await p.stop()
        p.listen = body["listen"]
        await p.start()
    if "enabled" in body:
        if body["enabled"]:
            await p.start()
        else:
            await p.stop()
            server.event("proxy_disabled", proxy=p.name)
    return 200, p.as_dict()


# ---------------------------------------------------------------- /proxies/{name}/toxics[/{toxic}]
async def _list_toxics(server, body, p: Proxy):
    return 200, [t.as_dict() for t in p.toxics.values()]


async def _add_toxic(server, body, p: Proxy):
    t = Toxic.from_body(body)
    if t.name in p.toxics:
        raise ApiError(409, "toxic already exists")
    p.toxics[t.name] = t
    server.event("toxic_added", proxy=p.name, toxic=t.name, type=t.type, stream=t.stream,
                 attributes=t.attributes, toxicity=t.toxicity)
    return 200, t.as_dict()


async def _get_toxic(server, body, p: Proxy, t: Toxic):
    return 200, t.as_dict()


async def _remove_toxic(server, body, p: Proxy, t: Toxic):
    del p.toxics[t.name]
    server.event("toxic_removed", proxy=p.name, toxic=t.name, fired=dict(t.fired))
    return 204, None


async def _update_toxic(server, body, p: Proxy, t: Toxic):
    body = body or {}
    if "attributes" in body:
        t.attributes.update(_check_attrs(t.type, body["attributes"]))
    if "toxicity" in body:
        t.toxicity = float(body["toxicity"])
    p.toxics_changed()  # a reset_peer / timeout's new timeout: the links' watches read it again
    return 200, t.as_dict()


ROUTES = {
    ("version", "GET"): _version,
    ("events", "GET"): _events,
    ("reset", "POST"): _reset,
    ("populate", "POST"): _populate,
    ("proxies", "GET"): _list_proxies,
    ("proxies", "POST"): _create_proxy,
    (PROXY, "GET"): _get_proxy,
    (PROXY, "DELETE"): _delete_proxy,
    (PROXY, "POST"): _update_proxy,
    (PROXY, "PATCH"): _update_proxy,
    (TOXICS, "GET"): _list_toxics,
    (TOXICS, "POST"): _add_toxic,
    (TOXIC, "GET"): _get_toxic,
    (TOXIC, "DELETE"): _remove_toxic,
    (TOXIC, "POST"): _update_toxic,
    (TOXIC, "PATCH"): _update_toxic,
}
