"""Extension points a higher layer plugs into the cluster layer, which never imports that layer.

The network proxy. With ``spec.network_proxy`` set, :class:`~kvchaos.cluster.Cluster` places
three TCP proxies — ``client`` (client → router), ``prefill`` and ``decode`` (router → each
server) — before it starts the router, because the router must be launched with their addresses.
The cluster owns the processes and ports; what a proxy *is* (the embedded toxiproxy-API proxy or
a real toxiproxy-server, and the faults it injects) belongs to the fault layer. So the cluster
takes a *proxy factory* ``factory(where, token) -> NetworkProxy`` from above:

- per cluster: ``Cluster(spec, workdir, proxy_factory=faults.open_network_proxy)``, or
- per process: :func:`set_default_proxy_factory` once at start-up (``faults.install_network_proxy()``
  does this; the kvchaos pytest plugin and CLI call it), used by every ``Cluster`` built without one.

A cluster whose spec asks for a proxy and that has no factory refuses to start (before launching
anything) with :class:`ProxyFactoryMissing`, saying which of the two to do.

The in-engine agent. With ``spec.agent`` set, every engine process loads an agent module at start
(``kvchaos/_boot/sitecustomize.py`` imports the module named in ``KVCHAOS_BOOT_AGENT`` and calls its
``boot()``). Which module that is belongs to the fault layer too: per cluster
``Cluster(..., agent_module=faults.AGENT_MODULE)``, or per process :func:`set_engine_agent`
(``faults.install_agent()``; ``faults.install()`` does both). Without one, ``start()`` raises
:class:`AgentMissing` before launching anything.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class NetworkProxy(Protocol):
    """What the cluster needs from a network proxy (``faults.netfault.NetworkFaults`` is one)."""

    def add(self, name: str, listen_port: int, upstream_port: int, upstream_host: str = "127.0.0.1",
            listen_host: str = "127.0.0.1") -> str:
        """Proxy ``listen_host:listen_port`` → ``upstream_host:upstream_port`` as ``name``; its URL."""

    def describe(self) -> dict:
        """Proxy name -> {"listen", "upstream"} (recorded in ``Endpoints.proxies``)."""

    def armed(self) -> list:
        """Faults still active on the proxies (a session checks this is empty at the end)."""

    def close(self) -> None:
        """Remove the proxies and stop anything the factory started (called by ``Cluster.stop``)."""


# (where, token) -> NetworkProxy. where: spec.network_proxy ("embedded" or host:port); token: the
# cluster's owner token, a prefix that keeps this cluster's proxy names apart from others'.
ProxyFactory = Callable[[str, str], NetworkProxy]

_default_proxy_factory: ProxyFactory | None = None


def set_default_proxy_factory(factory: ProxyFactory | None) -> ProxyFactory | None:
    """Make ``factory`` the proxy factory of every Cluster built without one; return the previous one."""
    global _default_proxy_factory
    if factory is not None and not callable(factory):
        raise TypeError(f"proxy factory must be callable (where, token) -> proxy, not {factory!r}")
    prev, _default_proxy_factory = _default_proxy_factory, factory
    return prev


def default_proxy_factory() -> ProxyFactory | None:
    return _default_proxy_factory


# the module every engine process of an agent-loading cluster imports at boot (its ``boot()`` is called)
_engine_agent: str | None = None


def set_engine_agent(module: str | None) -> str | None:
    """Make ``module`` (a dotted module name with a ``boot()`` function) the in-engine agent of every
    Cluster built without one; return the previous one."""
    global _engine_agent
    if module is not None and (not isinstance(module, str) or not all(p.isidentifier() for p in module.split("."))):
        raise TypeError(f"engine agent must be a dotted module name, not {module!r}")
    prev, _engine_agent = _engine_agent, module
    return prev


def engine_agent() -> str | None:
    return _engine_agent
