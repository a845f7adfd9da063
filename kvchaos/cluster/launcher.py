"""Launch, attach to and supervise a prefill/decode/router cluster (and a single reference server).

``Cluster(spec, workdir).start()`` starts SGLang prefill and decode servers concurrently, waits
for each ``/health`` with a bounded deadline (checking every poll that the process is still
alive, so a server that dies at start is reported with the tail of its log instead of a hang),
then starts the router and waits until it reports both workers healthy and one request has
made the full round trip. ``stop()`` is idempotent and also runs from the reaper if the owner
dies. ``AttachedCluster`` offers the same surface over URLs of servers someone else runs.

With ``spec.network_proxy`` set, the router is started behind fault proxies made by a *proxy
factory* handed in from the fault layer (``proxy_factory=``, or the process default set by
``faults.install_network_proxy()``): this package launches and owns processes and ports and never
imports the faults that act on them (see :mod:`kvchaos.cluster.hooks`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .api import AgentMissing, ClusterAPI, ClusterStartError, Endpoints, ProxyFactoryMissing, wait_healthy
from .argv import LOOPBACK, engine_env, resolve_model, router_argv, server_argv
from .engine_errors import scan_engine_errors
from .hooks import ProxyFactory, default_proxy_factory, engine_agent
from .netns import TwoHosts
from .ports import release_ports, reserve_ports
from .procs import ManagedProcess, leftover, stop_all, tree_pids
from .reaper import Reaper
from .spec import ClusterSpec

DECODE_DROP_WAIT_S = 25.0  # how long a prefill restart waits for decode to drop the old instance


# --------------------------------------------------------------------------- launched cluster
class Cluster(ClusterAPI):
    """A launched prefill + decode + router cluster.

    ``proxy_factory(where, token) -> NetworkProxy`` makes the network proxies when
    ``spec.network_proxy`` is set (e.g. ``faults.open_network_proxy``); None = the process default
    (:func:`kvchaos.cluster.hooks.set_default_proxy_factory`), and with neither ``start()`` raises
    :class:`ProxyFactoryMissing` before launching anything. The proxy object is ``self.proxy``.
    """

    def __init__(self, spec: ClusterSpec, workdir: str | os.PathLike, reaper: Reaper | None = None,
                 proxy_factory: ProxyFactory | None = None, agent_module: str | None = None):
        self.spec = spec
        self.proxy_factory = proxy_factory
        self.agent_module = agent_module
        self.workdir = Path(workdir)
        self.token = f"kvc-{os.getpid()}-{secrets.token_hex(4)}"
        self._own_reaper = reaper is None
        self.reaper = reaper
        self.procs: dict[str, ManagedProcess] = {}
        self.ports: list[int] = []
        self.endpoints: Endpoints | None = None
        self.timings: dict[str, float] = {}
        self.model_path: str | None = None
        self.agent_dir: str | None = None
        self.agent_urls: dict[str, str] = {}  # agent_channel = "tcp": role -> its agent gateway
        self.hosts = None  # topology = "two-hosts": kvchaos.cluster.netns.TwoHosts
        self.agent_token: str | None = None
        self.proxy = None  # what proxy_factory made, when spec.network_proxy is set (hooks.NetworkProxy)
        self._launch: dict[str, tuple] = {}  # role -> (argv, env, log, health url) for restart()
        self.restarts: list[dict] = []
        self._decode_log_at_prefill_start = 0  # where decode's log stood when the running prefill started
        self._log_offsets: dict[str, int] = {}
        self.engine_failures: list[dict] = []  # every engine error (kvchaos/findings.toml [[engine_error]]) seen, with "healed" (restart record)

    # -- lifecycle
    def start(self) -> "Cluster":
        t0 = time.monotonic()
        try:
            self._start(t0)
        except BaseException:
            self.stop()
            raise
        return self

    def _proxy_factory(self) -> ProxyFactory | None:
        """The factory for this cluster's network proxies (None when the spec asks for none)."""
        return _from_above(self.spec.network_proxy, self.proxy_factory or default_proxy_factory(), ProxyFactoryMissing(
            f"profile {self.spec.name!r} sets network_proxy = {self.spec.network_proxy!r}, but no proxy "
            "factory was given: the cluster layer launches processes and ports, the network fault proxy "
            "comes from the fault layer. Pass Cluster(spec, workdir, proxy_factory=faults.open_network_proxy), "
            "or call faults.install_network_proxy() once at start-up (the kvchaos pytest plugin and CLI "
            "do), or set network_proxy = \"\" for a cluster without fault proxies."))

    def _agent_module(self) -> str | None:
        """The module every engine loads as its agent (None when the spec asks for none)."""
        return _from_above(self.spec.agent, self.agent_module or engine_agent(), AgentMissing(
            f"profile {self.spec.name!r} loads the in-engine agent (agent = true), but no agent module was "
            "given: the cluster layer launches the engines, the agent comes from the fault layer. Pass "
            "Cluster(spec, workdir, agent_module=faults.AGENT_MODULE), call faults.install_agent() (or "
            "faults.install()) once at start-up, or set agent = false in the profile."))

    def _start(self, t0: float) -> None:
        spec = self.spec
        proxy_factory = self._proxy_factory()  # refuse before launching anything
        agent_module = self._agent_module()
        if self.reaper is None:
            self.reaper = Reaper(self.token)
        self.model_path = resolve_model(spec)
        p_port, boot_port, d_port, r_port, m_port = self.ports = reserve_ports(5)
        env = engine_env(spec)
        logs = self.workdir / "logs"
        if spec.topology == "two-hosts":  # prefill and decode in namespaces of their own (reaper-registered)
            self.hosts = TwoHosts().up(self.reaper)
        host = {r: self.hosts.ip(r) if self.hosts else LOOPBACK for r in ("prefill", "decode")}
        pre = f"http://{host['prefill']}:{p_port}"
        dec = f"http://{host['decode']}:{d_port}"
        rou = f"http://{LOOPBACK}:{r_port}"
        self.endpoints = Endpoints(router=rou, prefill=pre, decode=dec, bootstrap_port=boot_port)
        role_env = {"prefill": dict(env), "decode": dict(env)}
        if self.hosts:  # the address SGLang advertises (bootstrap, Mooncake); its namespace has no route out
            for role in role_env:
                role_env[role]["SGLANG_HOST_IP"] = host[role]
        if spec.agent:
            # short path: a Unix socket path must stay under 108 bytes
            self.agent_dir = tempfile.mkdtemp(prefix=f"kvc-ag-{os.getpid()}-", dir="/tmp")
            self.reaper.register_cleanup("path", self.agent_dir)  # gone even if we are SIGKILLed
            for role in role_env:
                role_env[role].update(KVCHAOS_AGENT=self.agent_dir, KVCHAOS_AGENT_ROLE=role,
                                      KVCHAOS_BOOT_AGENT=agent_module)
            if spec.agent_channel == "tcp" or self.hosts:  # each server's gateway; its files stay engine-side
                gw_ports = reserve_ports(2)
                self.ports += gw_ports
                self.agent_token = secrets.token_hex(16)
                for role, port in zip(("prefill", "decode"), gw_ports):
                    self.agent_urls[role] = f"tcp://{host[role]}:{port}"
                    # two hosts: the directory is a tmpfs only the engine's mount namespace sees
                    d = self.hosts.mounts[role] if self.hosts else os.path.join(self.agent_dir, role)
                    role_env[role].update(KVCHAOS_AGENT=self.agent_urls[role], KVCHAOS_AGENT_TOKEN=self.agent_token,
                                          KVCHAOS_AGENT_DIR=d)
        argvs = {"prefill": server_argv(spec, self.model_path, "prefill", p_port, boot_port, host["prefill"]),
                 "decode": server_argv(spec, self.model_path, "decode", d_port, host=host["decode"])}
        if self.hosts:
            argvs = {r: self.hosts.wrap(r, a) for r, a in argvs.items()}
        self._launch["prefill"] = (argvs["prefill"], role_env["prefill"], logs / "prefill.log", f"{pre}/health")
        self._launch["decode"] = (argvs["decode"], role_env["decode"], logs / "decode.log", f"{dec}/health")
        for role in ("prefill", "decode"):
            argv, renv, log, _ = self._launch[role]
            self.procs[role] = ManagedProcess(role, argv, renv, log, self.reaper, self.token)
        deadline = t0 + spec.startup_timeout_s
        wait_healthy(self.procs, {"prefill": f"{pre}/health", "decode": f"{dec}/health"}, deadline)
        self.timings["servers_healthy_s"] = time.monotonic() - t0
        r_pre, r_dec = pre, dec
        if proxy_factory is not None:
            extra = reserve_ports(3)
            self.ports += extra
            self.proxy = proxy_factory(spec.network_proxy, self.token)
            # two hosts: the router's proxies listen on the bridge, where decode can reach them too —
            # sglang-router hands decode the prefill URL's host as the bootstrap host, so prefill's
            # bootstrap port is proxied there as well (same number)
            on = self.hosts.host_ip if self.hosts else LOOPBACK
            r_pre = self.proxy.add("prefill", extra[0], p_port, host["prefill"], listen_host=on)
            r_dec = self.proxy.add("decode", extra[1], d_port, host["decode"], listen_host=on)
            if self.hosts:
                self.proxy.add("bootstrap", boot_port, boot_port, host["prefill"], listen_host=on)
            client = self.proxy.add("client", extra[2], r_port)
            self.endpoints.router_direct = rou
            self.endpoints.router = client
            self.endpoints.proxies = self.proxy.describe()
        self.procs["router"] = ManagedProcess(
            "router", router_argv(spec, r_pre, boot_port, r_dec, r_port, m_port), env,
            logs / "router.log", self.reaper, self.token)
        t_router = time.monotonic()
        try:
            self._wait_router(deadline)
            self._first_round_trip(deadline)
        except ClusterStartError as e:
            raise type(e)(f"{e}\n(the servers were healthy {t_router - t0:.0f} s into the start: the router was "
                          f"launched with {deadline - t_router:.0f} s of startup_timeout_s = "
                          f"{spec.startup_timeout_s:.0f} s left)") from e
        self.timings["router_ready_s"] = time.monotonic() - t0

    def _wait_router(self, deadline: float) -> None:
        rou = self.endpoints.router_direct or self.endpoints.router
        if self.spec.router == "sglang-router":
            wait_healthy(self.procs, {"router": f"{rou}/readiness"}, deadline,
                         check=lambda _r, resp: resp.json().get("healthy_workers", 0) >= 2)
        else:
            wait_healthy(self.procs, {"router": f"{rou}/health"}, deadline)

    def restart(self, role: str, timeout_s: float | None = None) -> dict:
        """Stop ``role`` (if still running) and start it again on the same ports and flags, then
        wait until it is healthy and the router counts it again. Returns timings."""
        if role not in self._launch:
            raise ValueError(f"cannot restart {role!r}; roles: {sorted(self._launch)}")
        t0 = time.monotonic()
        old = self.procs.get(role)
        # decode may have dropped the old prefill already (killed before this restart): look from where
        # decode's log stood when that prefill started
        mark = self._decode_log_at_prefill_start if role == "prefill" and "decode" in self.procs else None
        if old is not None:
            stop_all([old], grace_s=5.0)
        dropped = self._wait_decode_dropped_prefill(mark) if mark is not None else None
        argv, renv, log, health = self._launch[role]
        if role == "prefill":
            self._decode_log_at_prefill_start = self._log_size("decode") or 0
        self.procs[role] = ManagedProcess(role, argv, renv, log, self.reaper, self.token)
        deadline = t0 + (timeout_s or self.spec.startup_timeout_s)
        wait_healthy({role: self.procs[role]}, {role: health}, deadline)
        healthy = time.monotonic() - t0
        self._wait_router(deadline)
        rec = {"role": role, "healthy_s": round(healthy, 2), "rejoined_s": round(time.monotonic() - t0, 2),
               "pid": self.procs[role].pid}
        if mark is not None:
            rec["decode_dropped_prefill_s"] = dropped
        self.restarts.append(rec)
        return rec

    def _log_size(self, role: str) -> int | None:
        p = self.procs.get(role)
        try:
            return os.path.getsize(p.log_path) if p is not None else None
        except OSError:
            return None

    def _wait_decode_dropped_prefill(self, mark: int, timeout_s: float = DECODE_DROP_WAIT_S) -> float | None:
        """After prefill stopped: seconds until decode's log, read from ``mark`` (where it stood when that
        prefill started), says decode dropped the instance (SGLang's heartbeat: "Lost connection with
        prefill instance"; at once when it already did), or None after ``timeout_s``. A prefill back
        on the same bootstrap address inside decode's heartbeat window is never re-handshaken (decode
        keeps the dead instance's session; every later transfer fails: seen on 0.5.23 with restarts
        ~15 s apart), so a restart starts the new prefill only once decode has let go of the old."""
        t0 = time.monotonic()
        path = self.procs["decode"].log_path
        while time.monotonic() - t0 < timeout_s:
            try:
                with open(path, "rb") as f:
                    f.seek(mark)
                    if b"Lost connection with prefill instance" in f.read():
                        return round(time.monotonic() - t0, 2)
            except OSError:
                return None
            time.sleep(0.5)
        return None

    def _first_round_trip(self, deadline: float) -> None:
        last = None
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = self.generate(text="kvchaos warmup", max_new_tokens=1, timeout=30)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(1.0)
        raise ClusterStartError(f"router never completed a request: {last}")

    def check_alive(self) -> None:
        for p in self.procs.values():
            if not p.alive():
                raise p.died_error("is no longer running")

    def engine_errors(self) -> list[dict]:
        """Known engine failures that leave the process running (so check_alive cannot see them),
        found in the servers' logs since the last call: see ``kvchaos.cluster.engine_errors``."""
        new = scan_engine_errors({r: p.log_path for r, p in self.procs.items() if r != "router"}, self._log_offsets)
        for f in new:
            f["healed"] = None
        self.engine_failures += new
        return new

    def heal_engine_errors(self) -> list[dict]:
        """Restart each role with an unhealed engine failure (the process lives on but no longer
        works); return those failures, each with its restart record under ``healed``."""
        self.engine_errors()
        todo = [f for f in self.engine_failures if f["healed"] is None]
        for role in sorted({f["role"] for f in todo}):
            rec = self.restart(role)
            # and what the old process wrote before it was stopped: healed by the same restart
            for f in todo + self.engine_errors():
                if f["role"] == role:
                    f["healed"] = rec
        return todo

    def stop(self) -> list[int]:
        """Stop everything (router first, so no new requests reach dying servers). Returns leftovers."""
        if "router" in self.procs:
            stop_all([self.procs["router"]], grace_s=3.0)
        stop_all([p for r, p in self.procs.items() if r != "router"])
        release_ports(self.ports)
        self.ports = []
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        if self.agent_dir:
            shutil.rmtree(self.agent_dir, ignore_errors=True)
            if self.reaper is not None:
                self.reaper.forget_cleanup("path", self.agent_dir)
        left = leftover([p.pgid for p in self.procs.values()], self.token)
        if self.hosts is not None:  # after the processes: nothing may still hold the namespaces
            left += self.hosts.down()
            self.hosts = None
        if self._own_reaper and self.reaper is not None:
            self.reaper.close()
            self.reaper = None
        return left

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_paths(self) -> dict:
        return {r: str(p.log_path) for r, p in self.procs.items()}

    def all_pids(self) -> list[int]:
        """Every live process of this cluster (servers, their scheduler/detokenizer children, router)."""
        return tree_pids([p.pgid for p in self.procs.values()], self.token)

    def describe(self) -> dict:
        return {"mode": "launched", "spec": self.spec.to_dict(), "endpoints": self.endpoints.as_dict() if self.endpoints else None,
                "agent_dir": self.agent_dir, "agent_urls": self.agent_urls, "restarts": self.restarts,
                "topology": self.hosts.describe() if self.hosts else "one-host",
                "model_path": self.model_path, "timings": self.timings, "logs": self.log_paths(),
                "pids": {r: p.pid for r, p in self.procs.items()}}


def _from_above(wanted, given, missing: Exception):
    """What the fault layer handed in (``given``) when the spec wants it, None when it does not; raises
    ``missing`` (before anything is launched) when it is wanted and nothing was handed in."""
    if not wanted:
        return None
    if given is None:
        raise missing
    return given


def dump_describe(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj.describe(), indent=2, default=str))


if __name__ == "__main__":  # pragma: no cover
    # the cluster alone has no fault proxy to offer (``kvchaos up`` starts one with it)
    c = Cluster(ClusterSpec.load(sys.argv[1] if len(sys.argv) > 1 else "cpu", network_proxy=""), "/tmp/kvchaos-manual")
    with c:
        print(json.dumps(c.describe(), indent=2))
