"""Network faults on the cluster's HTTP paths, through the toxiproxy API.

The cluster launcher (``network_proxy`` in the profile) places three proxies:

- ``client``: client → router (the address suites get as ``endpoints.router``),
- ``prefill`` and ``decode``: router → each server (the router is launched with these URLs).

The same code drives the embedded proxy (``faults/proxy/``, ``network_proxy = "embedded"``) and a
real ``toxiproxy-server`` (``network_proxy = "host:port"``, or ``KVCHAOS_TOXIPROXY``), always through
the official ``toxiproxy-python`` client. With the embedded proxy each toxic also reports what it
touched (``fired`` counters), so :meth:`NetFault.verify` proves it acted; against a real
toxiproxy-server there are no counters and ``verify`` says so (the suite's measured effect is
the evidence then).

The cluster does not import this module: whoever launches the cluster hands it
``NetworkFaults.open`` as its proxy factory (``faults.open_network_proxy``; see
``kvchaos.cluster.hooks``), and the cluster keeps what it made as ``cluster.proxy``.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

import requests

from .base import Fault, FaultDidNotFire
from .proxy import ProxyServer, toxiproxy_client

_ACT_ON_CONNECT = ("reset_peer", "timeout", "slow_close")  # act on a connection without its bytes


@dataclass
class NetFault(Fault):
    """A toxic on one of the cluster's proxies (the :class:`faults.Fault` of the network proxy)."""

    owner: "NetworkFaults"
    proxy: str  # logical name: client / prefill / decode
    name: str
    type: str
    stream: str
    attributes: dict
    toxicity: float
    healed: bool = field(default=False, init=False, compare=False)
    last_stats: dict | None = field(default=None, init=False, compare=False)  # counters when healed
    injector: ClassVar[str] = "proxy"

    @property
    def id(self) -> str:
        return self.name

    @property
    def kind(self) -> str:
        return self.type

    def _touched(self, st: dict | None, min_bytes: int = 1) -> bool:
        return st is not None and (st["bytes"] >= min_bytes or (self.type in _ACT_ON_CONNECT
                                                                and st["connections"] > 0))

    def fired_events(self) -> list[dict]:
        """The toxic's counters as one record when it touched anything (live, or as they were when
        it was healed); ``[]`` otherwise — also on a real toxiproxy-server, which has no counters."""
        st = self.last_stats if self.healed else self.stats()
        if not self._touched(st):
            return []
        return [{"fault": self.name, "kind": self.type, "proxy": self.proxy, "stream": self.stream, "fired": st}]

    def stats(self) -> dict | None:
        """The embedded proxy's counters for this toxic (None on a real toxiproxy-server)."""
        r = requests.get(f"{self.owner.api}/proxies/{self.owner.full(self.proxy)}/toxics/{self.name}", timeout=5)
        if r.status_code == 404:
            return None
        return r.json().get("fired")

    def verify(self, min_bytes: int = 1) -> dict:
        """The toxic's counters as evidence that it touched traffic (also after it was healed: an
        experiment heals its faults before the test verifies them)."""
        st = self.last_stats if self.healed else self.stats()
        if st is None:
            if self.owner.embedded:
                raise FaultDidNotFire(f"toxic {self.name} on {self.proxy} vanished before verify")
            ev = {"fired": None, "note": "real toxiproxy-server: no counters; judge by measured effect"}
        else:
            if not self._touched(st, min_bytes):
                raise FaultDidNotFire(f"toxic {self.type} on {self.proxy} ({self.stream}) touched nothing: {st}")
            ev = {"fired": st}
        self.owner._log("fired", self, evidence=ev)
        return ev

    def heal(self) -> None:
        """Remove the toxic. Idempotent (also after ``NetworkFaults.heal_all``)."""
        if self.healed:
            return
        p = self.owner.tp.get_proxy(self.owner.full(self.proxy))
        if p is not None and p.get_toxic(self.name) is not None:
            st = self.last_stats = self.stats()
            p.destroy_toxic(self.name)
            self.owner._log("healed", self, evidence={"fired": st})
        self.healed = True
        self.owner._faults.pop(self.name, None)


class NetworkFaults:
    def __init__(self, tp, api: str, token: str, server: ProxyServer | None):
        self.api, self.token, self.server = api, token, server
        host, _, port = api.rpartition("//")[2].rpartition(":")
        self._where = (host, int(port))
        self.embedded = server is not None
        self.log = None  # an EventLog, set by the test fixture
        self.seeds = None  # the test's kvchaos.workload.seed.Seeds, set by the fault kit: toxics draw from it
        self._names: dict[str, dict] = {}
        self._faults: dict[str, NetFault] = {}

    @property
    def tp(self):
        """The toxiproxy-python client, re-pointed at this server on every use: the client keeps
        host/port as class attributes, so any other client in the process (a test's own proxy)
        would otherwise redirect our calls."""
        return toxiproxy_client(*self._where)

    @classmethod
    def open(cls, where: str, token: str) -> "NetworkFaults":
        where = os.environ.get("KVCHAOS_TOXIPROXY") or where
        if where == "embedded":
            srv = ProxyServer("127.0.0.1", 0).start()
            return cls(toxiproxy_client("127.0.0.1", srv.port), srv.url, token, srv)
        host, _, port = where.rpartition(":")
        tp = toxiproxy_client(host, int(port))
        if not tp.running():
            raise ConnectionError(f"no toxiproxy-server at {where} (network_proxy / KVCHAOS_TOXIPROXY)")
        return cls(tp, f"http://{host}:{port}", token, None)

    def full(self, name: str) -> str:
        return f"{self.token}-{name}"

    def add(self, name: str, listen_port: int, upstream_port: int, upstream_host: str = "127.0.0.1",
            listen_host: str = "127.0.0.1") -> str:
        p = self.tp.create(upstream=f"{upstream_host}:{upstream_port}", name=self.full(name),
                           listen=f"{listen_host}:{listen_port}")
        self._names[name] = {"listen": p.listen, "upstream": p.upstream}
        return f"http://{p.listen}"

    def describe(self) -> dict:
        return dict(self._names)

    def toxic(self, proxy: str, type: str, stream: str = "downstream", toxicity: float = 1.0,
              **attributes) -> NetFault:
        if proxy not in self._names:
            raise ValueError(f"unknown proxy {proxy!r}; this cluster has {sorted(self._names)}")
        name = f"{type}-{stream}-{uuid.uuid4().hex[:6]}"
        seeds = getattr(self, "seeds", None)
        if seeds is not None and "seed" not in attributes:
            attributes = {**attributes, "seed": seeds.fault()}
        p = self.tp.get_proxy(self.full(proxy))
        p.add_toxic(type=type, stream=stream, toxicity=toxicity, name=name, attributes=attributes)
        f = NetFault(self, proxy, name, type, stream, attributes, toxicity)
        self._faults[name] = f
        self._log("armed", f)
        return f

    def armed(self) -> list[dict]:
        out = []
        for name in self._names:
            p = self.tp.get_proxy(self.full(name))
            if p is None:
                continue
            out += [{"proxy": name, "toxic": t} for t in p.toxics()]
            if not p.enabled:
                out.append({"proxy": name, "disabled": True})
        return out

    def heal_all(self) -> None:
        for f in list(self._faults.values()):
            f.heal()
        for name in self._names:
            p = self.tp.get_proxy(self.full(name))
            if p is not None:
                for t in list(p.toxics()):
                    p.destroy_toxic(t)
                if not p.enabled:
                    p.enable()

    def close(self) -> None:
        try:
            for name in self._names:
                p = self.tp.get_proxy(self.full(name))
                if p is not None:
                    p.destroy()
        except Exception:
            pass
        if self.server is not None:
            self.server.stop()

    def _log(self, action: str, f: NetFault, evidence=None) -> None:
        if self.log is not None:
            self.log.emit("fault", action=action, fault=f.name, kind=f.type, injector="proxy", proxy=f.proxy,
                          stream=f.stream, attributes=f.attributes, toxicity=f.toxicity, evidence=evidence,
                          at=time.time())
