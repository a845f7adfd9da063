"""Process faults on a launched cluster: SIGKILL, SIGSTOP/SIGCONT, restart and rejoin.

A role's processes are the server's whole tree (the HTTP process, its scheduler and detokenizer
subprocesses — found by session, process group and parent links, so a child that called setsid
is still caught). Each action writes a ``fault`` event with the pids it signalled and the state
it then observed in ``/proc`` (``T`` = stopped, gone = killed): that is its proof of firing.

``heal_all`` resumes anything stopped and restarts anything killed, so the session cluster is
whole again after a test — also when the test failed half-way.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from kvchaos.cluster.reaper import proc_table, related

from .engine import FaultDidNotFire


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


class ProcessFaults:
    def __init__(self, cluster, log=None):
        if not hasattr(cluster, "procs") or not hasattr(cluster, "restart"):
            raise TypeError("process faults need a launched cluster (not attach mode): "
                            "kvchaos cannot signal processes it did not start")
        self.cluster, self.log = cluster, log
        self.stopped: dict[str, list[int]] = {}
        self.killed: set[str] = set()

    def pids(self, role: str) -> list[int]:
        if role not in self.cluster.procs:
            raise ValueError(f"unknown role {role!r}; one of {sorted(self.cluster.procs)}")
        p = self.cluster.procs[role]
        return sorted(related({p.pgid}, [], proc_table()))

    def _emit(self, **f):
        if self.log is not None:
            self.log.emit("fault", injector="process", **f)

    def kill(self, role: str) -> list[int]:
        """SIGKILL every process of ``role`` at once (no graceful shutdown, transfers cut mid-way)."""
        pids = self.pids(role)
        if not pids:
            raise FaultDidNotFire(f"kill {role}: no live process to kill")
        t = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed.add(role)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_state(p) not in (None, "Z") for p in pids):
            time.sleep(0.05)
        left = [p for p in pids if _state(p) not in (None, "Z")]
        self.cluster.procs[role].popen.poll()
        self._emit(action="fired", kind="sigkill", role=role, pids=pids, at=t, survivors=left)
        if left:
            raise FaultDidNotFire(f"kill {role}: pids {left} survived SIGKILL")
        return pids

    def stop(self, role: str) -> list[int]:
        """SIGSTOP the role's processes: alive, sockets open, answering nothing (a hung node)."""
        pids = self.pids(role)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self.stopped[role] = pids
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_state(p) not in ("T", "t", None) for p in pids):
            time.sleep(0.02)
        states = {p: _state(p) for p in pids}
        self._emit(action="fired", kind="sigstop", role=role, pids=pids, states=states)
        if not all(s in ("T", "t") for s in states.values() if s is not None):
            raise FaultDidNotFire(f"stop {role}: not all processes stopped: {states}")
        return pids

    def cont(self, role: str) -> None:
        pids = self.stopped.pop(role, [])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._emit(action="healed", kind="sigcont", role=role, pids=pids,
                   states={p: _state(p) for p in pids})

    def restart(self, role: str) -> dict:
        rec = self.cluster.restart(role)
        self.killed.discard(role)
        self._emit(action="healed", kind="restart", **rec)
        return rec

    def armed(self) -> list[str]:
        return [f"stopped:{r}" for r in self.stopped] + [f"killed:{r}" for r in sorted(self.killed)]

    def heal_all(self) -> None:
        for role in list(self.stopped):
            self.cont(role)
        for role in sorted(self.killed):
            self.restart(role)
