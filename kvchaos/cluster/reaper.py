"""Out-of-process reaper: nothing kvchaos starts outlives the process that started it.

The owner (pytest, ``kvchaos up``) starts one reaper in a session of its own with a pipe on its
stdin. The owner writes ``pgid N`` (and ``token T``) lines as it launches process groups. When the pipe reaches EOF
— the owner exited normally, crashed, got Ctrl-C, or was SIGKILLed (the kernel closes its fds) —
the reaper kills:

* every process in the session or group of a registered leader, every descendant of one (also
  those that called ``setsid``; the reaper snapshots the tree every 0.5 s, keyed by pid and start
  time so a recycled pid is never hit), and every process whose environment carries
  ``KVCHAOS_OWNER=<token>`` — SIGTERM, then SIGKILL after a grace period.

Run as ``python -m kvchaos.cluster.reaper TOKEN [GRACE_S]``. It writes what it killed to stderr.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvchaos.cluster import tmpfiles
from kvchaos.cluster.ports import release_owner

ENV_KEY = "KVCHAOS_OWNER"


def proc_table() -> dict[int, tuple[int, int, int, int, str]]:
    """pid -> (ppid, pgid, sid, starttime, state) for every process, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                f = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(name)] = (int(f[1]), int(f[2]), int(f[3]), int(f[19]), f[0].decode())
    return out


def pids_with_token(token: str, table=None) -> list[int]:
    """Live processes whose *initial* environment has KVCHAOS_OWNER=<token> (excluding ourselves).

    Processes that call setproctitle (SGLang's scheduler and detokenizer) overwrite the memory
    /proc/<pid>/environ shows, so this alone undercounts: see :func:`related`.
    """
    return _pids_with_tokens([token], proc_table() if table is None else table)


# a process this old (seconds) that showed none of the tokens never will: it exec'd long ago, and
# setproctitle only ever hides an environment. The periodic snapshots skip re-reading such environments
# (every process's, every 0.5-2.5 s: most of the reaper's CPU); the final kill reads them all again.
SETTLED_AGE_S = 10.0


def _pids_with_tokens(tokens, table, unrelated: set | None = None) -> list[int]:
    """:func:`pids_with_token` for several tokens, each environment read once. ``unrelated``: (pid,
    start time) of processes already read and settled without any of ``tokens``; skipped, and added to."""
    needles = {f"{ENV_KEY}={t}".encode() for t in tokens}
    if not needles:
        return []
    me = os.getpid()
    settled_before = None
    if unrelated is not None:
        try:
            with open("/proc/uptime") as f:
                settled_before = (float(f.read().split()[0]) - SETTLED_AGE_S) * _CLK_TCK
        except (OSError, ValueError, IndexError):
            settled_before = None
    found = []
    for pid, (_pp, _g, _s, st, state) in table.items():
        if pid == me or state == "Z" or (unrelated is not None and (pid, st) in unrelated):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:  # a kernel thread (no environment), not ours to read, or gone
            env = b""
        if needles & set(env.split(b"\0")):
            found.append(pid)
        elif settled_before is not None and st < settled_before:
            unrelated.add((pid, st))
    return found


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def related(roots: set[int], tokens, table=None, unrelated: set | None = None) -> dict[int, int]:
    """Live processes belonging to the launched trees: pid -> starttime.

    A process belongs if it is in the session or process group of a root (we start every root
    with its own session), descends from a root or from such a process (ppid closure, which
    follows a child that called setsid), or carries one of ``tokens`` in its environment.
    ``unrelated``: see :func:`_pids_with_tokens` (the periodic snapshots pass one; a kill reads all).
    """
    table = proc_table() if table is None else table
    tokens = [tokens] if isinstance(tokens, str) else list(tokens)
    me = os.getpid()
    members = {pid for pid, (_pp, g, sid, _st, _state) in table.items() if g in roots or sid in roots or pid in roots}
    members.update(_pids_with_tokens(tokens, table, unrelated))
    children: dict[int, list[int]] = {}
    for pid, (pp, *_rest) in table.items():
        children.setdefault(pp, []).append(pid)
    stack = list(members)
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in members:
                members.add(c)
                stack.append(c)
    return {p: table[p][3] for p in members if p != me and p in table and table[p][4] != "Z"}


def _still_same(known: dict[int, int], table) -> set[int]:
    """Previously seen pids that still run the same process (start time unchanged: no pid reuse)."""
    return {p for p, st in known.items() if p in table and table[p][3] == st and table[p][4] != "Z"}


def kill_tree(roots: set[int], tokens, grace_s: float = 5.0, known: dict[int, int] | None = None) -> list[int]:
    """SIGTERM every related process, wait up to grace_s, SIGKILL the rest. Returns survivors."""
    known = dict(known or {})

    def targets():
        table = proc_table()
        now = related(roots, tokens, table)
        known.update(now)
        return set(now) | _still_same(known, table)

    def send(pids, sig):
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass

    t = targets()
    if not t:
        return []
    send(t, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        t = targets()
        if not t:
            return []
        time.sleep(0.1)
    for _ in range(3):
        send(targets(), signal.SIGKILL)
        time.sleep(0.3)
        t = targets()
        if not t:
            return []
    return sorted(t)


SCAN_FRESH_S, FRESH_FOR_S, SCAN_SETTLED_S = 0.5, 60.0, 2.5


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m kvchaos.cluster.reaper TOKEN [GRACE_S [OWNER_PID]]\n")
        return 2
    token = argv[0]
    grace = float(argv[1]) if len(argv) > 1 else 5.0
    # whoever started us: its port reservations go when it has gone. Named by the owner, not read from
    # getppid(): an owner SIGKILLed while this interpreter was still starting (a busy machine) would leave
    # us reparented, and its reservations to the next session's sweep
    owner = int(argv[2]) if len(argv) > 2 else os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal must not kill the reaper first
    roots: set[int] = set()
    tokens = {token}
    known: dict[int, int] = {}
    unrelated: set[tuple[int, int]] = set()  # (pid, start time) settled without a token: not re-read
    cleanup: list[tuple[str, str]] = []  # ("netns" | "link", name): deleted after the processes
    paths: list[str] = []  # kvchaos.cluster.tmpfiles entries: deleted last
    buf = b""
    new_root_at, scanned_at = time.monotonic(), 0.0
    while True:
        ready, _, _ = select.select([0], [], [], SCAN_FRESH_S)
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:  # EOF: the owner is gone (or closed us on purpose)
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                parts = text.split()
                if text.startswith(("path ", "forget path ")):
                    name = text.split("path ", 1)[1]
                    if text.startswith("forget"):
                        paths = [x for x in paths if x != name]
                    elif tmpfiles.is_ours(name):
                        paths.append(name)
                elif len(parts) == 2 and parts[0] == "pgid" and parts[1].isdigit():
                    roots.add(int(parts[1]))
                    new_root_at = time.monotonic()
                elif len(parts) == 2 and parts[0] == "token":
                    tokens.add(parts[1])
                    unrelated.clear()  # settled without the old tokens says nothing of the new one
                elif len(parts) == 3 and parts[0] == "forget" and parts[1] in ("netns", "link"):
                    cleanup = [c for c in cleanup if c != (parts[1], parts[2])]
                elif len(parts) == 2 and parts[0] in ("netns", "link") and _OURS.match(parts[1]):
                    cleanup.append((parts[0], parts[1]))
        # remember every descendant we have seen, in case it later escapes its group and its token (a
        # scheduler that calls setsid and retitles itself): each scan reads all of /proc, so every
        # SCAN_FRESH_S while a tree is new (it spawns then) and every SCAN_SETTLED_S after
        now = time.monotonic()
        every = SCAN_FRESH_S if now - new_root_at < FRESH_FOR_S else SCAN_SETTLED_S
        if roots and now - scanned_at >= every:
            known.update(related(roots, tokens, unrelated=unrelated))
            scanned_at = now
    left = kill_tree(roots, tokens, grace, known)
    if left:
        sys.stderr.write(f"kvchaos reaper: still alive after SIGKILL: {left}\n")
    kept = _delete(cleanup)
    for name in paths:
        try:
            if not tmpfiles.remove(name):
                kept.append(f"path {name}")
        except OSError as e:
            kept.append(f"path {name} ({e})")
    released = release_owner(owner)
    if released:
        sys.stderr.write(f"kvchaos reaper: released {len(released)} port reservations of pid {owner}\n")
    if kept:
        sys.stderr.write(f"kvchaos reaper: could not delete {kept}\n")
    return 1 if left or kept else 0


_OURS = re.compile(r"^kvc[0-9]+[a-z]+$")  # only the namespaces / links kvchaos.cluster.netns names


def _delete(cleanup: list[tuple[str, str]]) -> list[str]:
    """Delete registered namespaces and links, newest first (a namespace takes its veth end along;
    an already-gone one is fine)."""
    kept = []
    for kind, name in reversed(cleanup):
        cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            kept.append(f"{kind} {name} ({e})")
            continue
        err = (r.stderr or "").strip()
        if r.returncode and not any(x in err for x in ("Cannot find", "No such", "does not exist")):
            kept.append(f"{kind} {name} ({err})")
        elif not r.returncode:
            sys.stderr.write(f"kvchaos reaper: deleted {kind} {name}\n")
    return kept


class Reaper:
    """Owner-side handle. Start once per owning process; register every launched group."""

    def __init__(self, token: str, grace_s: float = 5.0, python: str = sys.executable):
        self.token = token
        self._tokens = {token}
        self.proc = subprocess.Popen(
            [python, "-c", "import sys; from kvchaos.cluster.reaper import main; sys.exit(main(sys.argv[1:]))", token, str(grace_s),
             str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": _repo_root() + os.pathsep + os.environ.get("PYTHONPATH", "")},
            text=True,
        )

    def register(self, pgid: int, token: str | None = None) -> None:
        """Kill group ``pgid`` (and everything tagged ``token``) when the owner goes away."""
        if self.proc.poll() is None:
            if token and token not in self._tokens:
                self._tokens.add(token)
                self.proc.stdin.write(f"token {token}\n")
            self.proc.stdin.write(f"pgid {pgid}\n")
            self.proc.stdin.flush()

    def register_cleanup(self, kind: str, name: str) -> None:
        """Delete network namespace / link ``name`` (``kvc<k>...``), or ``path`` (an agent directory, an
        xdist lock file, a mount directory: :mod:`kvchaos.cluster.tmpfiles`), after the processes, when
        the owner goes away (kvchaos.cluster.netns, the launcher, the xdist plugin)."""
        if kind == "path":
            if not tmpfiles.is_ours(name):
                raise ValueError(f"reaper cleanup: {name!r} is not a kvchaos temporary entry")
        elif kind not in ("netns", "link") or not _OURS.match(name):
            raise ValueError(f"reaper cleanup: {kind} {name!r} is not a kvchaos namespace or link (kvc<k>...)")
        if self.proc.poll() is None:
            self.proc.stdin.write(f"{kind} {name}\n")
            self.proc.stdin.flush()

    def forget_cleanup(self, kind: str, name: str) -> None:
        """``name`` was deleted by its owner: the reaper need not (a later cluster may reuse it)."""
        if self.proc.poll() is None:
            self.proc.stdin.write(f"forget {kind} {name}\n")
            self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> int | None:
        """Close the pipe (the reaper sweeps once more) and wait for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
