"""Two hosts on one machine: prefill and decode each in a Linux network namespace of its own.

``topology = "two-hosts"`` (the ``cpu-2host`` runs: ``--kvchaos-topology two-hosts``): a bridge in the
machine's own namespace (``kvc<k>br``, 10.231.<k>.1/24, where the router and the harness stay) and one
namespace per role (``kvc<k>p`` at 10.231.<k>.2, ``kvc<k>d`` at .3), each joined to the bridge by a veth
pair. Prefill and decode reach each other (bootstrap, Mooncake over TCP) and are reached (HTTP, agent
gateways) only at those addresses; nothing leaves the machine. Each server also runs in a mount
namespace of its own with a private tmpfs over its agent directory: the agents' sockets and event files
exist only inside the engine's view — the harness sees an empty directory and must use the TCP gateway.

Everything created here is registered with the cluster's out-of-process reaper (``netns`` / ``link``
lines), which deletes it after killing the processes — also when the harness is SIGKILLed; a normal
stop deletes it at once. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``ip`` (iproute2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

BASE = "10.231"  # 10.231.<k>.0/24 per cluster; k in 1..250
ROLES = ("prefill", "decode")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, timeout: float = 10.0) -> str:
    cmd = ["ip", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsError("two-hosts topology needs 'ip' (iproute2): apt-get install iproute2") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(cmd)}: no answer within {timeout} s") from None
    if r.returncode:
        raise NetnsError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()} (exit {r.returncode})")
    return r.stdout


def _subnets_in_use() -> set[int]:
    used = set()
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        for tok in line.split():
            if tok.startswith(BASE + "."):
                try:
                    used.add(int(tok.split(".")[2]))
                except (IndexError, ValueError):
                    pass
    return used


class TwoHosts:
    """The namespaces, links and addresses of one two-host cluster (see the module doc)."""

    def __init__(self, k: int | None = None):
        if os.geteuid() != 0:
            raise NetnsError("two-hosts topology creates network namespaces: run as root (or with CAP_NET_ADMIN)")
        if shutil.which("ip") is None:
            raise NetnsError("two-hosts topology needs 'ip' (iproute2): apt-get install iproute2")
        self.k = k
        self.reaper = None
        self.created: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self.mounts: dict[str, str] = {}  # role -> the directory each engine sees as a private tmpfs

    # ------------------------------------------------------------------ names
    @property
    def bridge(self) -> str:
        return f"kvc{self.k}br"

    def ns(self, role: str) -> str:
        return f"kvc{self.k}{role[0]}"

    def ip(self, role: str) -> str:
        return f"{BASE}.{self.k}.{2 + ROLES.index(role)}"

    @property
    def host_ip(self) -> str:
        return f"{BASE}.{self.k}.1"

    # ------------------------------------------------------------------ lifecycle
    def up(self, reaper=None, attempts: int = 5) -> "TwoHosts":
        """Create the bridge, the namespaces and their links; registers each with ``reaper`` as it is
        created (so a failure half-way, or a SIGKILL of the harness, still removes it). A subnet another
        cluster took meanwhile is given up for the next free one (``attempts`` times)."""
        self.reaper = reaper
        chosen = self.k
        for i in range(attempts):
            if chosen is None:
                used = _subnets_in_use()
                taken = set(_ip("netns", "list").split())
                free = [k for k in range(1, 251) if k not in used and f"kvc{k}p" not in taken]
                if not free:
                    raise NetnsError(f"no free {BASE}.<k>.0/24 subnet for another two-host cluster")
                self.k = free[(os.getpid() + i) % len(free)]  # spread concurrent xdist workers
            try:
                return self._up()
            except NetnsError as e:
                if chosen is not None or "File exists" not in str(e) or i == attempts - 1:
                    raise
        raise NetnsError("unreachable")

    def _up(self) -> "TwoHosts":
        reaper = self.reaper
        try:
            self._add("link", self.bridge, reaper, "link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for role in ROLES:
                ns, h, n = self.ns(role), f"{self.ns(role)}h", f"{self.ns(role)}n"
                self._add("netns", ns, reaper, "netns", "add", ns)
                self._add("link", h, reaper, "link", "add", h, "type", "veth", "peer", "name", n)
                _ip("link", "set", h, "master", self.bridge)
                _ip("link", "set", h, "up")
                _ip("link", "set", n, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.ip(role)}/24", "dev", n)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", n, "up")
                self.mounts[role] = tempfile.mkdtemp(prefix=f"kvc{self.k}{role[0]}-", dir="/tmp")
                if reaper is not None:
                    reaper.register_cleanup("path", self.mounts[role])
        except Exception:
            self.down()
            raise
        return self

    def _add(self, kind: str, name: str, reaper, *args: str) -> None:
        _ip(*args)
        self.created.append((kind, name))
        if reaper is not None:
            reaper.register_cleanup(kind, name)

    def wrap(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``role``'s namespace, with a private tmpfs over its engine-side directory."""
        d = self.mounts[role]
        return ["ip", "netns", "exec", self.ns(role), "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", f'mount -t tmpfs kvchaos-engine-side "{d}" && exec "$@"', "kvchaos-engine", *argv]

    def down(self) -> list[str]:
        """Delete what :meth:`up` created (namespaces first: their veth ends go with them). Returns
        what could not be deleted."""
        left = []
        for kind, name in reversed(self.created):
            try:
                _ip(*(("netns", "del", name) if kind == "netns" else ("link", "del", name)))
            except NetnsError as e:
                if "Cannot find" not in str(e) and "No such" not in str(e) and "does not exist" not in str(e):
                    left.append(f"{kind} {name}: {e}")
                    continue
            if getattr(self, "reaper", None) is not None:
                self.reaper.forget_cleanup(kind, name)  # a later cluster may take the name
        self.created = []
        for d in self.mounts.values():
            shutil.rmtree(d, ignore_errors=True)
            if getattr(self, "reaper", None) is not None:
                self.reaper.forget_cleanup("path", d)
        self.mounts = {}
        return left

    def describe(self) -> dict:
        return {"topology": "two-hosts", "bridge": self.bridge, "host_ip": self.host_ip,
                "namespaces": {r: self.ns(r) for r in ROLES}, "addresses": {r: self.ip(r) for r in ROLES}}


def of_subnet(k: int) -> list[str]:
    """:func:`leftovers` of the cluster on subnet ``k`` only: ``kvc12p`` is subnet 12's, never 1's."""
    return [x for x in leftovers() if (m := re.match(r"kvc(\d+)", x.split()[1])) and int(m.group(1)) == k]


def leftovers(prefix: str = "kvc") -> list[str]:
    """Namespaces and links of ours still present (``kvc<k>...``): what a clean end must not leave."""
    out = [f"netns {n}" for n in _ip("netns", "list").split() if n.startswith(prefix) and n[3:4].isdigit()]
    for line in _ip("-o", "link", "show").splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix) and name[3:4].isdigit():
                out.append(f"link {name}")
    return out
