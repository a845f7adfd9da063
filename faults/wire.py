"""The agent's wire protocol: what the in-engine agent (``faults.agent``) and the harness-side client
(``faults.client``) both speak. The harness imports this module, never the engine-side ones.

* :data:`PROTOCOL` — the version both sides send; a mismatch is refused by name.
* Agent addresses: ``tcp://HOST:PORT`` (:func:`parse_url`), or a Unix socket in the control directory.
* One JSON object per line each way (:func:`call_unix`; the TCP gateway: ``faults/agent/net.py``).
* Evidence: every agent appends its events to ``events-<pid>.jsonl`` (:class:`EventFiles` reads them).
* :data:`PARK_STAGES` — where the ``park`` fault can hold a request, and the hook that holds it there.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import threading
from urllib.parse import urlsplit

PROTOCOL = 1  # bump when a command or reply changes shape: a harness of another version is refused by name


class AgentAddressError(ValueError):
    pass


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); anything else is named."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None or u.path not in ("", "/"):
        raise AgentAddressError(f"agent address {url!r}: expected tcp://HOST:PORT (e.g. tcp://10.0.0.5:7810)")
    return u.hostname, port


def call_unix(path: str, req: dict, timeout: float) -> dict:
    """One request to the agent listening on Unix socket ``path``; its reply (``ok`` False with the
    ``error`` when it closed without one)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall((json.dumps(req) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            d = s.recv(1 << 20)
            if not d:
                break
            buf += d
    finally:
        s.close()
    if not buf:
        return {"ok": False, "error": f"closed without a reply to {req.get('cmd')}"}
    return json.loads(buf)


class EventFiles:
    """The agents' ``events-<pid>.jsonl`` files in one directory, read incrementally: only the bytes
    appended since the last read are parsed (a line still being written waits for the next read);
    those of dead processes stay. Used by the gateway on the engine's host and by a harness that
    shares the host (``AgentClient`` with a control directory)."""

    def __init__(self, d: str):
        self.dir = d
        self.cache: dict[str, tuple[int, list]] = {}
        self.lock = threading.Lock()

    def read(self) -> list[dict]:
        """Every event of every file so far."""
        out = []
        with self.lock:
            for path in glob.glob(os.path.join(self.dir, "events-*.jsonl")):
                off, parsed = self.cache.get(path, (0, []))
                try:
                    with open(path, "rb") as fh:
                        fh.seek(off)
                        chunk = fh.read()
                except OSError:
                    chunk = b""
                end = chunk.rfind(b"\n") + 1
                for line in chunk[:end].splitlines():
                    try:
                        parsed.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
                self.cache[path] = (off + end, parsed)
                out.extend(parsed)
        return out

    def since(self, marks: dict) -> list[dict]:
        """The events past ``marks`` ({pid: last seq seen})."""
        return [e for e in self.read() if e.get("seq", 0) > int(marks.get(str(e.get("pid")), 0))]


# stage -> (role, the hook that holds it there, what it holds)
PARK_STAGES = {
    "decode_prealloc": ("decode", "DecodePreallocQueue._update_handshake_waiters",
                        "after the handshake, before decode pre-allocates its pages (prefill waits in its "
                        "bootstrap queue: decode has sent no metadata)"),
    "prefill_waiting": ("prefill", "Scheduler.get_new_batch_prefill",
                        "bootstrapped, in prefill's waiting queue, not yet prefilled"),
    "decode_waiting": ("decode", "_get_new_prebuilt_batch",
                       "its KV received, in decode's waiting queue, not yet decoding"),
}
