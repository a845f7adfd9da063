"""Processes kvchaos starts: each in its own process group, tagged, logged, reaped.

Every engine process is started with ``start_new_session=True`` (own session and process group,
so a Ctrl-C in the terminal reaches pytest first and teardown is ordered), its stdout+stderr go to
a log file kept for the report, and its environment carries ``KVCHAOS_OWNER=<token>`` so the
out-of-process :mod:`kvchaos.cluster.reaper` can find it — and all its children — even if the
owner is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from .reaper import ENV_KEY, Reaper, kill_tree, related


class ProcessDied(RuntimeError):
    pass


def log_tail(path, n: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``n`` lines of a log, reading at most its last ``max_bytes``."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - max_bytes))
        lines = f.read().decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-n:])


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, reaper: Reaper | None,
                 token: str, cwd: str | None = None):
        self.name, self.argv, self.log_path, self.token = name, argv, Path(log_path), token
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"# kvchaos: {name}: {' '.join(argv)}\n".encode())
        full_env = {**env, ENV_KEY: token}
        self.popen = subprocess.Popen(
            argv, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, close_fds=True, cwd=cwd,
        )
        self.pgid = self.popen.pid  # session leader: pgid == pid
        if reaper is not None:
            reaper.register(self.pgid, token)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def returncode(self):
        return self.popen.poll()

    def tail(self, n: int = 40) -> str:
        try:
            return log_tail(self.log_path, n)
        except OSError as e:
            return f"<log unreadable: {e}>"

    def died_error(self, what: str = "exited") -> ProcessDied:
        return ProcessDied(
            f"{self.name} (pid {self.pid}) {what} with code {self.returncode()}; log {self.log_path}\n"
            f"--- last lines ---\n{self.tail()}"
        )

    def signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM the group, wait up to grace_s, SIGKILL the group."""
        stop_all([self], grace_s)

    def _group_alive(self) -> bool:
        self.popen.poll()  # reap the leader if it exited
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        # a group whose only members are zombies is dead for our purposes
        return any(_is_live(p) for p in _group_members(self.pgid))


def stop_all(procs: list[ManagedProcess], grace_s: float = 8.0) -> None:
    """Stop several groups in parallel (SGLang servers take ~5.5 s to exit on SIGTERM)."""
    signalled = [p for p in procs if p.signal_group(signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p._group_alive() for p in signalled):
        time.sleep(0.05)
    for p in procs:
        p.signal_group(signal.SIGKILL)
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        p._log.close()


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(entry.name))
    return out


def _is_live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tree_pids(roots, token: str) -> list[int]:
    """Live processes of the trees started from ``roots`` (sessions, groups, descendants, token)."""
    return sorted(related(set(roots), token))


def leftover(roots, token: str, grace_s: float = 5.0) -> list[int]:
    """Kill whatever of those trees is still alive; return what survived even SIGKILL (should be [])."""
    return kill_tree(set(roots), token, grace_s)
