"""What suites use of a cluster, launched or attached: endpoints, health waits, requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from kvchaos import httpclient
from kvchaos.canary import Registry

from .procs import ManagedProcess
from .spec import ClusterSpec


class ClusterStartError(RuntimeError):
    pass


class ProxyFactoryMissing(ClusterStartError):
    """The spec asks for a network proxy, and no proxy factory was given or installed."""


class AgentMissing(ClusterStartError):
    """The spec asks for the in-engine agent, and no agent module was given or installed."""


def _http_ok(url: str, timeout: float = 2.0) -> httpx.Response | None:
    try:
        r = httpclient.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


def cpu_pressure_us() -> int | None:
    """Linux PSI: microseconds so far in which some runnable task waited for a CPU (None where the
    kernel does not say)."""
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
        return int(some[-1].split("=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def starved_share(since_s: float, pressure_at_since: int | None) -> str:
    """'; some runnable task waited for a CPU N% of those N s (...)', or '' where the kernel does not
    say: what tells a start starved by other work on the machine from one that hung."""
    now = cpu_pressure_us()
    waited = time.monotonic() - since_s
    if now is None or pressure_at_since is None or waited <= 0:
        return ""
    share = min(1.0, (now - pressure_at_since) / 1e6 / waited)
    return (f"; some runnable task waited for a CPU {share:.0%} of those {waited:.0f} s "
            "(Linux PSI /proc/pressure/cpu: near 100% is a machine shared with other work, not a hang)")


def wait_healthy(procs: dict[str, ManagedProcess], urls: dict[str, str], deadline: float,
                 check=None) -> None:
    """Wait until every url in ``urls`` answers; raise ProcessDied / ClusterStartError otherwise.

    ``check(role, response) -> bool`` can require more than HTTP 200. The timeout's message says how long
    it waited and for how much of that some task was kept from a CPU.
    """
    t0, pressure0 = time.monotonic(), cpu_pressure_us()
    pending = dict(urls)
    while pending:
        for role in list(pending):
            p = procs[role]
            if not p.alive():
                raise p.died_error("died during startup")
            r = _http_ok(pending[role])
            if r is not None and (check is None or check(role, r)):
                pending.pop(role)
        if not pending:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {r} ({procs[r].log_path}) ---\n{procs[r].tail(25)}" for r in pending)
            raise ClusterStartError(f"timed out waiting for {sorted(pending)} to become healthy: waited "
                                    f"{time.monotonic() - t0:.0f} s{starved_share(t0, pressure0)}\n{tails}")
        time.sleep(0.5)


@dataclass
class Endpoints:
    router: str
    prefill: str
    decode: str
    bootstrap_port: int | None = None
    # with a network proxy: the router's own address ("router" is then the client-side proxy)
    router_direct: str | None = None
    proxies: dict = field(default_factory=dict)  # proxy name -> {"listen", "upstream"}

    def as_dict(self) -> dict:
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode,
                "bootstrap_port": self.bootstrap_port, "router_direct": self.router_direct,
                "proxies": self.proxies}


class ClusterAPI:
    """What suites use, launched or attached."""

    endpoints: Endpoints
    spec: ClusterSpec

    @property
    def canaries(self):
        """Every canary the harness sent this cluster (``kvchaos.canary.Registry``): its KV pages may
        hold any of them, so a reply reciting one names its owner. Experiments on this cluster add
        their plans and hand it to their checkers; :meth:`generate` adds what it sends."""
        reg = self.__dict__.get("_canaries")
        if reg is None:
            reg = self.__dict__["_canaries"] = Registry()
        return reg

    def server_info(self, role: str = "decode", timeout: float = 10.0) -> dict:
        url = getattr(self.endpoints, role)
        r = httpclient.get(f"{url}/server_info", timeout=timeout)
        r.raise_for_status()
        return r.json()

    def generate(self, text=None, input_ids=None, max_new_tokens=16, timeout=None, via="router", **extra) -> httpx.Response:
        body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, **extra}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
            self.canaries.add_text(text or "", extra.get("rid"), "cluster.generate")
        url = getattr(self.endpoints, via) if via in ("router", "prefill", "decode") else via
        return httpclient.post(f"{url}/generate", json=body, timeout=timeout or self.spec.paced(self.spec.request_timeout_s))

    def check_alive(self) -> None:
        pass

    def log_paths(self) -> dict:
        return {}
