"""Servers someone else runs (a staging deployment, a GPU box): the cluster surface over their URLs."""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

from .api import ClusterAPI, ClusterStartError, Endpoints, _http_ok
from .spec import ClusterSpec


class AttachedCluster(ClusterAPI):
    """Servers someone else runs (a staging deployment, a GPU box). Nothing is started or killed."""

    def __init__(self, endpoints: Endpoints, spec: ClusterSpec | None = None, agent_urls: dict | None = None,
                 agent_token: str | None = None):
        self.endpoints = endpoints
        self.spec = spec or ClusterSpec.load("cpu")
        self.timings = {}
        self.agent_urls = dict(agent_urls or {})  # role -> tcp:// gateway of the agent loaded in its engine
        self.agent_token = agent_token

    @classmethod
    def parse(cls, text: str, spec: ClusterSpec | None = None, env=None) -> "AttachedCluster":
        """``router=URL,prefill=URL,decode=URL`` (all three required), and, when the remote engines
        load the agent (``KVCHAOS_AGENT=tcp://...``), ``prefill_agent=tcp://HOST:PORT,decode_agent=...``
        with the shared token in ``KVCHAOS_AGENT_TOKEN``: every agent fault then works attached."""
        env = os.environ if env is None else env
        parts, agents = {}, {}
        roles = ("router", "prefill", "decode", "prefill_agent", "decode_agent")
        for item in filter(None, (s.strip() for s in text.split(","))):
            if "=" not in item:
                raise ValueError(f"--kvchaos-attach: {item!r} is not role=URL (roles: {', '.join(roles)})")
            k, v = item.split("=", 1)
            if k not in roles:
                raise ValueError(f"--kvchaos-attach: unknown role {k!r} (roles: {', '.join(roles)})")
            if k.endswith("_agent"):
                u = urlsplit(v)
                try:
                    ok = u.scheme == "tcp" and u.hostname and u.port
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"--kvchaos-attach: {k}={v!r} must be tcp://HOST:PORT (the engine's KVCHAOS_AGENT)")
                agents[k[: -len("_agent")]] = v
                continue
            if not v.startswith(("http://", "https://")):
                raise ValueError(f"--kvchaos-attach: {k}={v!r} must be an http(s) URL")
            parts[k] = v.rstrip("/")
        missing = {"router", "prefill", "decode"} - set(parts)
        if missing:
            raise ValueError(f"--kvchaos-attach: missing {sorted(missing)}; give router=URL,prefill=URL,decode=URL")
        token = env.get("KVCHAOS_AGENT_TOKEN") or None
        if agents and not token:
            raise ValueError(f"--kvchaos-attach: agent gateways given for {sorted(agents)} but KVCHAOS_AGENT_TOKEN "
                             "is not set (the token the engines were started with)")
        return cls(Endpoints(**parts), spec, agents, token)

    def start(self, timeout_s: float = 30.0) -> "AttachedCluster":
        deadline = time.monotonic() + timeout_s
        pending = {"router": f"{self.endpoints.router}/health", "prefill": f"{self.endpoints.prefill}/health",
                   "decode": f"{self.endpoints.decode}/health"}
        while pending and time.monotonic() < deadline:
            for k in list(pending):
                if _http_ok(pending[k]):
                    pending.pop(k)
            if pending:
                time.sleep(0.5)
        if pending:
            raise ClusterStartError(f"attach: no healthy answer within {timeout_s:.0f}s from {pending}")
        return self

    def stop(self) -> list[int]:
        return []

    def describe(self) -> dict:
        return {"mode": "attached", "endpoints": self.endpoints.as_dict(), "agent_urls": self.agent_urls}
