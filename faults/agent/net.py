"""The agent's control and evidence channel over TCP: what a harness on another host talks to.

An engine started with ``KVCHAOS_AGENT=tcp://HOST:PORT`` and ``KVCHAOS_AGENT_TOKEN=<secret>`` keeps
everything the local agent does — each process that patched something listens on its Unix socket and
appends its events to ``events-<pid>.jsonl`` in a control directory on the engine's own host
(``KVCHAOS_AGENT_DIR``, default ``/tmp/kvchaos-agent-<role>-<port>``: the copy that survives a crash)
— and one of the server's processes also listens on HOST:PORT: the *gateway*. Every process tries to
bind it; the first wins, the others retry every second, so when the gateway's process dies another
takes over. The harness never reads an engine-side file: it asks the gateway.

Wire format: one JSON object per line each way. Every request carries ``token`` (compared in constant
time) and ``protocol`` (:data:`PROTOCOL`); a wrong token or another protocol is refused with an error
naming the gateway's address and role, and the connection is closed. Commands:

* ``agents`` — the live agents of this server: pid, role, hooks;
* ``call`` (``pid``, ``req``) — one agent command (``ping arm heal release armed events``) to the
  agent of process ``pid``, its reply returned as is;
* ``events`` (``since``: {pid: seq}) — every event of every local agent with a ``seq`` past
  ``since[pid]`` (read incrementally from the events files; those of dead processes too).

HOST must be an address of the engine's host; ``0.0.0.0`` / ``::`` (every interface) only with
``KVCHAOS_AGENT_BIND_ALL=1``.
"""

from __future__ import annotations

import errno
import glob
import hmac
import json
import os
import socket
import socketserver
import sys
import threading

from ..wire import PROTOCOL, AgentAddressError, EventFiles, call_unix

ANY_HOST = ("0.0.0.0", "::", "")


def bind_allowed(host: str, env=None) -> bool:
    env = os.environ if env is None else env
    return host not in ANY_HOST or env.get("KVCHAOS_AGENT_BIND_ALL") == "1"


def local_agents(d: str) -> list[dict]:
    """The live agents whose info files are in ``d`` (pid alive, socket present)."""
    out = []
    for info_path in sorted(glob.glob(os.path.join(d, "agent-*.json"))):
        try:
            with open(info_path) as fh:
                info = json.load(fh)
            os.kill(int(info["pid"]), 0)
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            continue
        if os.path.exists(info.get("sock", "")):
            out.append(info)
    return out


class Gateway:
    """The TCP face of one engine server's agents (see the module doc)."""

    def __init__(self, ctl_dir: str, host: str, port: int, token: str, role: str, timeout: float = 10.0):
        if not token:
            raise AgentAddressError("KVCHAOS_AGENT_TOKEN is empty: the agent's TCP channel needs a shared token")
        if not bind_allowed(host):
            raise AgentAddressError(f"agent address tcp://{host}:{port} listens on every interface; set "
                                    "KVCHAOS_AGENT_BIND_ALL=1 to allow it, or give the host's own address")
        self.dir, self.host, self.port, self.role = ctl_dir, host, port, role
        self._token = token.encode()
        self.timeout = timeout
        self.events = EventFiles(ctl_dir)
        self.server = None
        self._stop = threading.Event()

    # ------------------------------------------------------------- serving
    def where(self) -> str:
        return f"kvchaos agent gateway tcp://{self.host}:{self.port} ({self.role or 'no role'})"

    def handle(self, req: dict) -> dict:
        tok = req.get("token")
        if not isinstance(tok, str) or not hmac.compare_digest(tok.encode(), self._token):
            return {"ok": False, "refused": True, "error": f"{self.where()}: wrong token"}
        if req.get("protocol") != PROTOCOL:
            return {"ok": False, "refused": True,
                    "error": f"{self.where()}: agent protocol {PROTOCOL}, harness speaks {req.get('protocol')!r} "
                             "(harness and engine-side kvchaos are different versions)"}
        cmd = req.get("cmd")
        if cmd == "agents":
            return {"ok": True, "role": self.role, "protocol": PROTOCOL,
                    "agents": [{"pid": a["pid"], "role": a.get("role"), "hooks": a.get("hooks", [])}
                               for a in local_agents(self.dir)]}
        if cmd == "call":
            a = next((a for a in local_agents(self.dir) if int(a["pid"]) == int(req.get("pid", -1))), None)
            if a is None:
                return {"ok": False, "error": f"{self.where()}: no live agent in process {req.get('pid')}"}
            try:
                return call_unix(a["sock"], req.get("req") or {}, self.timeout)
            except (OSError, ValueError) as e:
                return {"ok": False, "error": f"{self.where()}: agent {a['pid']}: {e!r}"}
        if cmd == "events":
            return {"ok": True, "events": self.events.since(req.get("since") or {})}
        return {"ok": False, "error": f"{self.where()}: unknown command {cmd!r}; one of agents call events"}

    def _make_server(self):
        gw = self

        class H(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.settimeout(gw.timeout * 3)
                for line in self.rfile:
                    try:
                        out = gw.handle(json.loads(line))
                    except Exception as e:  # noqa: BLE001 - every error goes back, named
                        out = {"ok": False, "error": f"{gw.where()}: {type(e).__name__}: {e}"}
                    self.wfile.write((json.dumps(out, default=str) + "\n").encode())
                    if out.get("refused"):
                        return

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class S(socketserver.ThreadingMixIn, socketserver.TCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = family

        return S((self.host, self.port), H)

    def try_serve(self) -> bool:
        """Bind HOST:PORT and serve on a daemon thread; False when another process holds it."""
        try:
            self.server = self._make_server()
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
        threading.Thread(target=self.server.serve_forever, name="kvchaos-agent-gw", daemon=True).start()
        return True

    def run_or_stand_by(self, every_s: float = 1.0) -> threading.Thread:
        """Serve now, or retry every ``every_s`` on a daemon thread (taking over when the gateway's
        process is gone) until this process ends or :meth:`stop` is called."""
        def loop():
            while not self._stop.is_set():
                try:
                    if self.try_serve():
                        return
                except OSError as e:
                    sys.stderr.write(f"{self.where()}: cannot listen: {e}\n")
                    return
                self._stop.wait(every_s)
        t = threading.Thread(target=loop, name="kvchaos-agent-gw-standby", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
