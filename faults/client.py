"""Harness side of the in-engine agent (``faults/agent/``): find the agents, arm, prove, heal.

Every engine process that patched something listens on ``<ctl dir>/agent-<pid>.sock``. An
:class:`AgentClient` broadcasts a command to the agents of one role (``prefill``/``decode``) and
merges their replies — locally through those sockets and files, or, for engines on other hosts
(``remote={role: "tcp://host:port"}`` and the shared token), through each server's TCP gateway
(``faults/agent/net.py``) without reading any engine-side file. Faults it arms are recorded as ``fault`` events in the run's event log
(``armed``, ``fired`` with the agent's evidence, ``healed``), so a report can show exactly when a
fault acted on which request.

    ctl = AgentClient(cluster.agent_dir, log)
    f = ctl.arm("prefill", "delay", target={"rid": plan.rid}, params={"ms": 300})
    ... run the request ...
    f.verify()          # raises FaultDidNotFire if no agent reported it acting
    ctl.heal_all()      # the fixture does this after every test, even on failure
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from .base import Fault, FaultDidNotFire  # noqa: F401 - FaultDidNotFire is also faults.client's
from .wire import PARK_STAGES, PROTOCOL, AgentAddressError, EventFiles, call_unix, parse_url


class AgentError(RuntimeError):
    pass


class AgentRefused(AgentError):
    """The gateway refused the harness (wrong token, another protocol version): not worth a retry."""


class GatewayClient:
    """One role's agent gateway over TCP: a connection per request, bounded by ``timeout``; every
    error names the role and the address."""

    def __init__(self, url: str, token: str | None, role: str, timeout: float = 10.0):
        self.url, self.role, self.timeout = url, role, timeout
        self.host, self.port = parse_url(url)
        if not token:
            raise AgentAddressError(f"{role} agent {url}: no token (KVCHAOS_AGENT_TOKEN, or the cluster's agent_token)")
        self._token = token

    def request(self, req: dict) -> dict:
        msg = {**req, "token": self._token, "protocol": PROTOCOL}
        deadline = time.monotonic() + self.timeout
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as s:
                s.sendall((json.dumps(msg) + "\n").encode())
                buf = b""
                while not buf.endswith(b"\n"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no reply within {self.timeout} s")
                    d = s.recv(1 << 20)
                    if not d:
                        break
                    buf += d
        except OSError as e:
            raise AgentError(f"{self.role} agent at {self.url} unreachable: {e}") from None
        if not buf:
            raise AgentError(f"{self.role} agent at {self.url} closed the connection without a reply")
        out = json.loads(buf)
        if not out.get("ok"):
            err = AgentRefused if out.get("refused") else AgentError
            raise err(f"{self.role} agent at {self.url}: {out.get('error')}")
        return out


# the hook that holds a request at each ``park`` stage (the agent's own table)
PARK_HOOKS = {stage: hook for stage, (_role, hook, _what) in PARK_STAGES.items()}


def _call(sock_path: str, req: dict, timeout: float = 10.0) -> dict:
    out = call_unix(sock_path, req, timeout)
    if not out.get("ok"):
        raise AgentError(f"agent {sock_path}: {out.get('error')}")
    return out


@dataclass
class ArmedFault(Fault):
    """A fault armed in the engine agents of one role (the :class:`faults.Fault` of the agent)."""

    client: "AgentClient"
    id: str
    role: str
    kind: str
    target: dict
    params: dict
    agents: list = field(default_factory=list)
    count: int | None = None  # how many firings it was armed for (None: the kind's default)
    healed: bool = field(default=False, init=False, compare=False)
    injector: ClassVar[str] = "agent"

    def fired_events(self) -> list[dict]:
        return [e for e in self.client.events(self.role) if e.get("fault") == self.id and e["ev"] == "fault_fired"]

    def verify(self, at_least: int = 1, timeout: float = 0.0) -> list[dict]:
        """The agent's evidence that this fault acted; FaultDidNotFire if there is none."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self.fired_events()
            if len(ev) >= at_least:
                for e in ev:
                    self.client._log_fired(self, e)
                return ev
            if time.monotonic() >= deadline:
                raise FaultDidNotFire(
                    f"fault {self.kind} {self.id} on {self.role} target={self.target}: "
                    f"{len(ev)} firing(s) reported, expected >= {at_least}")
            time.sleep(0.05)

    def release(self) -> None:
        """Let what the fault holds go: a held write lands (``hold``), a parked request moves on (``park``)."""
        n = sum(self.client._each(self.role, {"cmd": "release", "id": self.id}, key="released"))
        if not n:
            raise AgentError(f"fault {self.id}: no agent held anything of it to release")
        self.client._log("released", self)

    def heal(self) -> None:
        """Disarm in every live agent of the role. Idempotent; agents that are gone (a killed or
        restarted process) took the fault with them."""
        if self.healed:
            return
        agents = self.client.agents(self.role)
        for a in agents:
            self.client._send(a, {"cmd": "heal", "id": self.id})
        self.healed = True
        self.client._log("healed", self)
        self.client._armed.pop(self.id, None)


class AgentClient:
    """``ctl_dir``: the agents' control directory on this host; or ``remote={role: "tcp://host:port"}``
    with ``token``: each role's gateway over TCP (nothing engine-side is read from disk)."""

    def __init__(self, ctl_dir: str | None = None, log=None, timeout: float = 10.0, seeds=None,
                 remote: dict | None = None, token: str | None = None):
        if (ctl_dir is None) == (not remote):
            raise ValueError("AgentClient: give the agents' control directory, or remote={role: 'tcp://host:port'} "
                             "with a token — one of the two")
        self.dir = ctl_dir
        self.remote = {role: GatewayClient(url, token, role, timeout) for role, url in (remote or {}).items()}
        self.log = log
        self.seeds = seeds  # kvchaos.workload.seed.Seeds: each armed fault's ``seed`` param (its draws)
        self.timeout = timeout
        self._armed: dict[str, ArmedFault] = {}
        self._logged: set = set()
        self._files = EventFiles(ctl_dir) if ctl_dir else None  # local: the agents' event files
        self._marks: dict[str, dict[str, int]] = {}  # remote: role -> {pid: last seq received}
        self._revents: dict[str, list] = {}  # remote: role -> events received
        self._unreachable: dict[str, str] = {}  # remote: role -> the last error reaching its gateway

    @classmethod
    def for_cluster(cls, cluster, log=None, seeds=None, timeout: float = 10.0) -> "AgentClient | None":
        """The client of a cluster's agents: over TCP when it has gateways (``agent_urls`` and
        ``agent_token``), else through its control directory; None without an agent."""
        urls = getattr(cluster, "agent_urls", None)
        if urls:
            return cls(log=log, seeds=seeds, timeout=timeout, remote=dict(urls), token=cluster.agent_token)
        d = getattr(cluster, "agent_dir", None)
        return cls(d, log, timeout=timeout, seeds=seeds) if d else None

    def where(self, role: str | None = None) -> str:
        if not self.remote:
            return str(self.dir)
        return ", ".join(f"{r} {g.url}" for r, g in self.remote.items() if role in (None, r))

    def _send(self, a: dict, req: dict) -> dict:
        """One agent command to agent ``a`` (from :meth:`agents`)."""
        if "via" in a:
            return self.remote[a["via"]].request({"cmd": "call", "pid": a["pid"], "req": req})
        return _call(a["sock"], req, self.timeout)

    # ------------------------------------------------------------ discovery
    def agents(self, role: str | None = None) -> list[dict]:
        if self.remote:
            out = []
            for r, gw in self.remote.items():
                if role not in (None, r):
                    continue
                try:
                    got = gw.request({"cmd": "agents"})
                except AgentRefused:
                    raise  # a wrong token or version is not a wait: say so now
                except AgentError as e:
                    self._unreachable[r] = str(e)
                    continue
                self._unreachable.pop(r, None)
                out += [{**a, "via": r} for a in got["agents"] if role in (None, a.get("role"), r)]
            return out
        out = []
        for info_path in sorted(glob.glob(os.path.join(self.dir, "agent-*.json"))):
            try:
                info = json.loads(open(info_path).read())
            except (OSError, json.JSONDecodeError):
                continue
            if role and info.get("role") != role:
                continue
            if not os.path.exists(info["sock"]):
                continue
            try:
                os.kill(int(info["pid"]), 0)
            except (ProcessLookupError, PermissionError):
                continue
            out.append(info)
        return out

    def wait_agents(self, role: str, hooks: tuple[str, ...] = ("send_kvcache",), timeout: float = 30.0) -> list[dict]:
        """Agents of ``role`` whose hooks include each name in ``hooks`` (the scheduler process)."""
        deadline = time.monotonic() + timeout
        while True:
            ok, absent = [], set()
            for a in self.agents(role):
                try:
                    got = self._send(a, {"cmd": "ping"})
                except (OSError, AgentError):
                    continue
                h = got["hooks"]
                if all(any(x in name for name in h) for x in hooks):
                    ok.append(a)
                absent |= {x for x in hooks for name in got.get("absent", ()) if name.endswith(f".{x}")}
            if ok:
                return ok
            if absent:  # the engine's class has no such method: waiting would not bring it
                raise AgentError(f"the {role} engine has no {', '.join(sorted(absent))} (an optional hook its SGLang "
                                 "release lacks): this fault cannot be armed there")
            if time.monotonic() > deadline:
                why = f"; {self._unreachable[role]}" if role in self._unreachable else ""
                raise AgentError(
                    f"no {role} agent with hooks {hooks} in {self.where(role)} after {timeout}s "
                    f"(found: {[(a['pid'], a['role']) for a in self.agents()]}){why}; was the cluster started "
                    "with the agent?")
            time.sleep(0.2)

    def _each(self, role: str, req: dict, key: str | None = None) -> list:
        agents = self.agents(role)
        if not agents:
            why = f": {self._unreachable[role]}" if role in self._unreachable else ""
            raise AgentError(f"no live {role} agent in {self.where(role)}{why}")
        outs = []
        for a in agents:
            r = self._send(a, req)
            outs.append(r.get(key) if key else r)
        return outs

    # ------------------------------------------------------------ faults
    def arm(self, role: str, kind: str, target: dict | None = None, params: dict | None = None,
            count: int | None = None, ttl_s: float = 600.0, hooks: tuple[str, ...] | None = None) -> ArmedFault:
        if kind == "park" and (params or {}).get("stage") not in PARK_HOOKS:
            raise ValueError(f"park: params.stage must be one of {tuple(PARK_HOOKS)}, got {(params or {}).get('stage')!r}")
        need = hooks if hooks is not None else (("send_kvcache",) if kind in ("delay", "fail", "short", "hold") else
                         ("is_unadmitted_reject",) if kind == "reject_admitted" else
                         # a setting on the live schedulers: no reject-path hook (0.5.19 has none)
                         ("Scheduler.__init__",) if kind == "input_limit" else
                         ("TokenToKVPoolAllocator.alloc",) if kind == "double_alloc" else
                         ("_release_request",) if kind == "early_free" else
                         ("MooncakeKVManager.send_kvcache",) if kind == "stall_status_read" else
                         ("Req.load_kv_cache", "DecodePreallocQueue.__init__") if kind == "retract" else
                         (PARK_HOOKS[(params or {}).get("stage")],) if kind == "park" else
                         ("Scheduler.get_new_batch_prefill",) if kind == "chunked_prefill" else
                         ("_GenerationStreamAccumulator.accept",) if kind == "token_flip" else
                         ("_GenerationStreamAccumulator.to_payload",) if kind == "meta_swap" else
                         ("send_kvcache",))
        agents = self.wait_agents(role, need)
        fid = f"{kind}-{uuid.uuid4().hex[:8]}"
        params = dict(params or {})
        if self.seeds is not None and "seed" not in params:
            params["seed"] = self.seeds.fault()
        req = {"cmd": "arm", "id": fid, "kind": kind, "target": target or {"any": True},
               "params": params, "ttl_s": ttl_s}
        if count is not None:
            req["count"] = count
        for a in agents:
            self._send(a, req)
        f = ArmedFault(self, fid, role, kind, req["target"], req["params"], [a["pid"] for a in agents], count=count)
        self._armed[fid] = f
        self._log("armed", f)
        return f

    def events(self, role: str | None = None) -> list[dict]:
        """Every agent's events, read from the per-process JSONL files — so the evidence of a
        process that crashed or was killed is still there. Files are read incrementally (only the
        bytes appended since the last call; a line still being written waits for the next call).
        Remote: what each role's gateway read from those files on its host since the last call."""
        if self.remote:
            return self._remote_events(role)
        out = [e for e in self._files.read() if role is None or e.get("role") == role]
        return sorted(out, key=lambda e: (e["wall"], e.get("seq", 0)))

    def _remote_events(self, role: str | None) -> list[dict]:
        out = []
        for r, gw in self.remote.items():
            if role not in (None, r):
                continue
            marks = self._marks.setdefault(r, {})
            got = self._revents.setdefault(r, [])
            try:
                new = gw.request({"cmd": "events", "since": marks})["events"]
            except AgentError as e:
                self._unreachable[r] = str(e)  # what it sent before stays; the next call asks again
                new = []
            for e in new:
                k = str(e.get("pid"))
                if e.get("seq", 0) > marks.get(k, 0):
                    marks[k] = e["seq"]
                got.append(e)
            out += [e for e in got if role is None or e.get("role") == role]
        return sorted(out, key=lambda e: (e["wall"], e.get("seq", 0)))

    def wait_event(self, role: str, ev: str, timeout: float = 30.0, **match) -> dict:
        """Block until an agent of ``role`` logs event ``ev`` whose fields match (e.g. rid=...)."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events(role):
                if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
                    return e
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {ev} {match} from {role} agent within {timeout}s")
            time.sleep(0.02)

    def armed(self) -> list[dict]:
        """What every live agent still has armed (the session checks this is empty)."""
        out = []
        for a in self.agents():
            try:
                out.extend(self._send(a, {"cmd": "armed"})["armed"])
            except (OSError, AgentError):
                continue
        return out

    def heal_all(self) -> list[str]:
        healed = []
        for a in self.agents():
            try:
                healed += self._send(a, {"cmd": "heal"})["healed"]
            except (OSError, AgentError):
                continue
        for f in list(self._armed.values()):
            f.healed = True
            self._log("healed", f)
        self._armed.clear()
        return healed

    # ------------------------------------------------------------ event log
    def _log(self, what: str, f: ArmedFault) -> None:
        if self.log is not None:
            self.log.emit("fault", action=what, fault=f.id, kind=f.kind, role=f.role, target=f.target,
                          params=f.params, count=f.count, injector="agent")

    def _log_fired(self, f: ArmedFault, e: dict) -> None:
        key = (f.id, e.get("seq"), e.get("pid"))
        if self.log is not None and key not in self._logged:
            self._logged.add(key)
            self.log.emit("fault", action="fired", fault=f.id, kind=f.kind, role=f.role, injector="agent",
                          rid=e.get("rid"), evidence={k: v for k, v in e.items() if k not in ("t",)})
