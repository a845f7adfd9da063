"""Fault injectors that prove they fired.

- ``faults.agent``    in-engine agent, loaded into every SGLang server process (transfer delay /
                      failure / short transfer / hold-then-late-write, transfer-start events,
                      engine-bug replay mutations); ``faults.client`` is its harness-side client.
- ``faults.proxy``    toxiproxy-API-compatible TCP fault proxy (asyncio); ``faults.netfault``
                      drives it — or a real toxiproxy-server — through ``toxiproxy-python``.
- ``faults.process``  SIGKILL / SIGSTOP+SIGCONT of a server's process tree, restart, rejoin.
- ``faults.request``  request-level faults (planted leaks for oracle self-tests; aborts and
                      client disconnects are request kinds of ``kvchaos.workload``).

Every fault: arm → verify (evidence in the event log, ``FaultDidNotFire`` otherwise) → heal.
Every injector hands back the same kind of handle, a :class:`Fault` (``faults.base``): ``id``,
``kind``, ``injector``, ``verify()``, ``heal()`` (idempotent), ``fired_events()`` — an
``ArmedFault`` (agent), ``NetFault`` (proxy toxic) or ``ProcessFault`` (SIGKILL / SIGSTOP).
:class:`FaultKit` bundles them for one test; the pytest fixture ``faults`` heals it after the
test even on failure and errors the test if anything is still armed afterwards.

The cluster layer (``kvchaos.cluster``) never imports this package: the network proxy it places in
front of the router comes from here as a factory — ``Cluster(spec, workdir,
proxy_factory=faults.open_network_proxy)``, or once per process ``faults.install_network_proxy()`` —
and the agent its engines load at boot is named from here — ``Cluster(..., agent_module=AGENT_MODULE)``,
or once per process ``faults.install_agent()``. ``faults.install()`` does both.

This module stays light (it is imported into every engine process that loads the agent).
"""

from __future__ import annotations

import time

from .base import Fault, FaultDidNotFire  # noqa: F401
from .client import AgentClient, AgentError, ArmedFault  # noqa: F401


def open_network_proxy(where: str, token: str):
    """The cluster's proxy factory (``kvchaos.cluster.hooks.ProxyFactory``): the embedded
    toxiproxy-API proxy (``where="embedded"``) or a real toxiproxy-server (``host:port``), driven by
    :class:`faults.netfault.NetworkFaults`."""
    from .netfault import NetworkFaults  # on use: toxiproxy's client stays out of engine processes

    return NetworkFaults.open(where, token)


AGENT_MODULE = __name__ + ".agent"  # what an engine's boot hook imports (kvchaos/_boot/sitecustomize.py)


def install_network_proxy():
    """Make :func:`open_network_proxy` the proxy factory of every ``kvchaos.cluster.Cluster`` this
    process builds without one (what the kvchaos pytest plugin and CLI do at start-up). Returns the
    factory it replaced."""
    # imported here, not at the top: this package is imported into every engine process (the agent)
    from kvchaos.cluster.hooks import set_default_proxy_factory

    return set_default_proxy_factory(open_network_proxy)


def install_agent():
    """Make :data:`AGENT_MODULE` the in-engine agent of every ``kvchaos.cluster.Cluster`` this process
    builds without one. Returns the module name it replaced."""
    from kvchaos.cluster.hooks import set_engine_agent  # see install_network_proxy

    return set_engine_agent(AGENT_MODULE)


def install() -> None:
    """Both: the network proxy factory and the in-engine agent (what the pytest plugin and CLI call)."""
    install_network_proxy()
    install_agent()


def copy_agent_event(log, e: dict) -> None:
    """One agent event in a harness log: ``ev == "agent"``, the agent's own kind in ``agent_ev``."""
    log.emit("agent", agent_ev=e["ev"], **{k: v for k, v in e.items() if k not in ("t", "ev")})


def k8s_from_env(log=None, env=None):
    """Process faults through Kubernetes for an attached cluster (faults/k8s.py), when
    ``KVCHAOS_K8S_NAMESPACE`` and ``KVCHAOS_K8S_SELECTORS`` (``prefill:app=sglang-prefill;decode:app=...``)
    say which pods serve each role (``KVCHAOS_K8S_CHAOS_MESH=1``: kill through a Chaos Mesh PodChaos);
    None when they are not set."""
    import os

    env = os.environ if env is None else env
    ns, raw = env.get("KVCHAOS_K8S_NAMESPACE"), env.get("KVCHAOS_K8S_SELECTORS")
    if not ns and not raw:
        return None
    sel = {}
    for part in filter(None, (x.strip() for x in (raw or "").split(";"))):
        role, colon, s = part.partition(":")
        if not colon or role not in ("prefill", "decode") or not s:
            raise ValueError(f"KVCHAOS_K8S_SELECTORS={raw!r}: expected prefill:<label selector>;decode:<label selector>")
        sel[role] = s
    if not ns or set(sel) != {"prefill", "decode"}:
        raise ValueError("Kubernetes process faults need KVCHAOS_K8S_NAMESPACE and a selector for prefill and decode "
                         f"in KVCHAOS_K8S_SELECTORS (got namespace {ns!r}, roles {sorted(sel)})")
    from .k8s import KubernetesProcessFaults  # on use: only a Kubernetes deployment needs it

    return KubernetesProcessFaults(ns, sel, log=log, chaos_mesh=env.get("KVCHAOS_K8S_CHAOS_MESH") == "1")


class FaultKit:
    def __init__(self, cluster, log, seeds=None):
        """``seeds``: the test's :class:`kvchaos.workload.seed.Seeds` — every fault armed through this kit
        draws its randomness (jitter, toxicity) from the next fault seed of the run."""
        from .process import ProcessFaults  # on use: it imports kvchaos.cluster, which engine processes never need

        self.cluster, self.log = cluster, log
        self.t0 = time.time()
        self._collected: set = set()
        self.agent = AgentClient.for_cluster(cluster, log, seeds=seeds)
        self.net = getattr(cluster, "proxy", None)
        if self.net is not None:
            self.net.log = log
            self.net.seeds = seeds
        try:
            self.proc = ProcessFaults(cluster, log)
        except TypeError:  # not launched by kvchaos: through the cluster manager, when one is named
            self.proc = k8s_from_env(log)

    def need(self, what: str):
        got = getattr(self, what)
        if got is None:
            why = {"agent": "the cluster was started without the in-engine agent (agent = false), or is attached "
                            "without agent gateways (prefill_agent=tcp://...,decode_agent=tcp://... and KVCHAOS_AGENT_TOKEN)",
                   "net": "the cluster has no network proxy (set network_proxy = \"embedded\" or host:port)",
                   "proc": "process faults need a launched cluster, or for an attached one the pods of each role "
                           "(KVCHAOS_K8S_NAMESPACE, KVCHAOS_K8S_SELECTORS: Kubernetes, faults/k8s.py)"}[what]
            raise RuntimeError(f"fault injector {what!r} unavailable: {why}")
        return got

    def collect_agent_events(self) -> list[dict]:
        """Copy the agents' events since this kit was made into the test's event log."""
        if self.agent is None:
            return []
        evs = [e for e in self.agent.events() if e["wall"] >= self.t0]
        for e in evs:
            key = (e.get("pid"), e.get("seq"))
            if key in self._collected:
                continue
            self._collected.add(key)
            copy_agent_event(self.log, e)
        return evs

    def copy_agent_events(self, log, since: float = 0.0) -> list[dict]:
        """Write this kit's agent events from wall time ``since`` on into ``log`` (a suite's own
        event log); returns them."""
        evs = [e for e in self.collect_agent_events() if e["wall"] >= since]
        for e in evs:
            copy_agent_event(log, e)
        return evs


    def heal_all(self, wait_s: float = 60.0) -> list[str]:
        """Heal every injector; return what is still armed afterwards (should be nothing), and, where
        the cluster would not serve again within ``wait_s`` after the heal, that (0: not waited for)."""
        errors = []
        for name in ("proc", "net", "agent"):
            inj = getattr(self, name)
            if inj is None:
                continue
            try:
                inj.heal_all()
            except Exception as e:  # noqa: BLE001 - keep healing the others, report all
                errors.append(f"{name}: heal failed: {e!r}")
        try:
            self.collect_agent_events()
        except Exception as e:  # noqa: BLE001
            errors.append(f"agent events: {e!r}")
        for name in ("proc", "net", "agent"):
            inj = getattr(self, name)
            if inj is not None:
                left = inj.armed()
                if left:
                    errors.append(f"{name}: still armed after heal: {left}")
        if not errors and wait_s > 0:
            err = self.wait_serving(wait_s)
            if err:
                errors.append(err)
        return errors

    def wait_serving(self, timeout_s: float = 60.0) -> str | None:
        """Reset between tests: after heal, the cluster must serve a request again (the router's
        circuit breaker and SGLang's failed-session probe need a few seconds after some faults)."""
        t0 = time.monotonic()
        last = None
        try:
            self.cluster.check_alive()
        except Exception as e:  # noqa: BLE001 - a crashed engine is the finding; say so at once
            return f"an engine process died during the test: {e}"
        while time.monotonic() - t0 < timeout_s:
            try:
                r = self.cluster.generate(text="kvchaos heal check", max_new_tokens=1, timeout=30)
                if r.status_code == 200:
                    self.log.emit("healed_serving", after_s=round(time.monotonic() - t0, 2))
                    return None
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except Exception as e:  # noqa: BLE001
                last = repr(e)
            time.sleep(0.5)
        return f"cluster did not serve again within {timeout_s}s after heal: {last}"
