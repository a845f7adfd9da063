"""Process faults on a launched cluster: SIGKILL, SIGSTOP/SIGCONT, restart and rejoin.

A role's processes are the server's whole tree (the HTTP process, its scheduler and detokenizer
subprocesses — found by session, process group and parent links, so a child that called setsid
is still caught). Each action writes a ``fault`` event with the pids it signalled and the state
it then observed in ``/proc`` (``T`` = stopped, gone = killed): that is its proof of firing.

``kill(role)`` and ``stop(role)`` return a :class:`ProcessFault` — the same handle shape as every
other injector's (:class:`faults.Fault`): ``verify()`` gives the evidence (the pids signalled and
the states then observed), ``heal()`` restarts a killed role / SIGCONTs a stopped one, once.
``cont(role)`` and ``restart(role)`` heal by role; ``heal_all`` resumes anything stopped and
restarts anything killed, so the session cluster is whole again after a test — also when the test
failed half-way.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from kvchaos.cluster.reaper import proc_table, related

from .base import Fault, FaultDidNotFire
from .k8s import RoleFaults


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


STOPPED = ("T", "t")


def _signal(pids, sig) -> None:
    """Send ``sig`` to each of ``pids`` (one already gone is passed over)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _await_states(pids, done: tuple, timeout_s: float, poll_s: float) -> None:
    """Poll ``/proc`` until every pid's state is one of ``done`` or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_state(p) not in done for p in pids):
        time.sleep(poll_s)


class ProcessFault(Fault):
    """SIGKILL (``kind="sigkill"``) or SIGSTOP (``kind="sigstop"``) of one role's process tree.

    Truthy, and for older callers also a sequence of its ``pids`` (``len``, iteration, ``in``).
    """

    injector = "process"

    def __init__(self, owner: "ProcessFaults", role: str, kind: str, pids: list[int], at: float,
                 states: dict[int, str | None], record: dict):
        self.owner, self.role, self.kind = owner, role, kind
        self.pids = list(pids)
        self.at = at
        self.states = dict(states)  # pid -> /proc state observed right after the signal (None: gone)
        self.record = record  # the ``fired`` event, as written to the log
        self.id = f"{kind}-{role}-{uuid.uuid4().hex[:8]}"
        self.healed = False
        self.heal_record: dict | None = None  # the restart record (sigkill) / states after SIGCONT (sigstop)

    # -- the common fault handle
    def _acted(self) -> bool:
        if not self.pids:
            return False
        seen = [s for s in self.states.values() if s is not None]
        if self.kind == "sigkill":
            return all(s == "Z" for s in seen)
        return bool(seen) and all(s in STOPPED for s in seen)

    def fired_events(self) -> list[dict]:
        return [dict(self.record)] if self._acted() else []

    def verify(self) -> dict:
        """What was signalled and what ``/proc`` showed right after: every process gone (sigkill)
        or stopped (sigstop); :class:`FaultDidNotFire` otherwise."""
        if not self._acted():
            raise FaultDidNotFire(f"{self.kind} {self.role}: pids {self.pids} observed {self.states}")
        return {"id": self.id, "kind": self.kind, "role": self.role, "pids": list(self.pids), "at": self.at,
                "states": dict(self.states), "now": {p: _state(p) for p in self.pids}}

    def heal(self) -> dict | None:
        """Restart the killed role (on its ports, rejoined to the router) / SIGCONT the stopped
        processes. Idempotent; returns the heal record."""
        if not self.healed:
            if self.kind == "sigkill":
                if self.role in self.owner.killed:
                    self.owner.restart(self.role)  # marks this handle healed with the restart record
                self.healed = True
            else:
                self.owner._resume(self)
        return self.heal_record

    # -- backward compatibility: kill()/stop() used to return the pid list
    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.pids)

    def __iter__(self):
        return iter(self.pids)

    def __contains__(self, pid) -> bool:
        return pid in self.pids

    def __repr__(self) -> str:
        return (f"ProcessFault(id={self.id!r}, kind={self.kind!r}, role={self.role!r}, pids={self.pids}, "
                f"healed={self.healed})")


class ProcessFaults(RoleFaults):
    injector = "process"

    def __init__(self, cluster, log=None):
        if not hasattr(cluster, "procs") or not hasattr(cluster, "restart"):
            raise TypeError("process faults need a launched cluster (not attach mode): "
                            "kvchaos cannot signal processes it did not start")
        self.cluster, self.log = cluster, log
        self.stopped: dict[str, list[int]] = {}  # role -> pids stopped and not yet resumed
        self.killed: set[str] = set()  # roles killed and not yet restarted
        self.faults: list[ProcessFault] = []  # every handle made, in order

    def pids(self, role: str) -> list[int]:
        if role not in self.cluster.procs:
            raise ValueError(f"unknown role {role!r}; one of {sorted(self.cluster.procs)}")
        p = self.cluster.procs[role]
        return sorted(related({p.pgid}, [], proc_table()))

    def _signal_role(self, role: str, sig, verb: str) -> tuple[list[int], float]:
        """Send ``sig`` to every process of ``role``: (their pids, when); :class:`FaultDidNotFire` if none lives."""
        pids = self.pids(role)
        if not pids:
            raise FaultDidNotFire(f"{verb} {role}: no live process to {verb}")
        t = time.time()
        _signal(pids, sig)
        return pids, t

    def kill(self, role: str) -> ProcessFault:
        """SIGKILL every process of ``role`` at once (no graceful shutdown, transfers cut mid-way)."""
        pids, t = self._signal_role(role, signal.SIGKILL, "kill")
        self.killed.add(role)
        _await_states(pids, (None, "Z"), 10, 0.05)
        left = [p for p in pids if _state(p) not in (None, "Z")]
        self.cluster.procs[role].popen.poll()
        states = {p: _state(p) for p in pids}
        rec = self._emit(action="fired", kind="sigkill", role=role, pids=pids, at=t, survivors=left)
        return self._made(ProcessFault(self, role, "sigkill", pids, t, states, rec),
                          f"kill {role}: pids {left} survived SIGKILL" if left else None)

    def stop(self, role: str) -> ProcessFault:
        """SIGSTOP the role's processes: alive, sockets open, answering nothing (a hung node)."""
        pids, t = self._signal_role(role, signal.SIGSTOP, "stop")
        self.stopped[role] = sorted(set(self.stopped.get(role, [])) | set(pids))
        _await_states(pids, (*STOPPED, None), 5, 0.02)
        states = {p: _state(p) for p in pids}
        rec = self._emit(action="fired", kind="sigstop", role=role, pids=pids, states=states)
        f = ProcessFault(self, role, "sigstop", pids, t, states, rec)
        return self._made(f, None if f._acted() else f"stop {role}: not all processes stopped: {states}")

    def _resume(self, f: ProcessFault) -> None:
        _signal(f.pids, signal.SIGCONT)
        left = [p for p in self.stopped.get(f.role, []) if p not in f.pids]
        if left:
            self.stopped[f.role] = left
        else:
            self.stopped.pop(f.role, None)
        states = {p: _state(p) for p in f.pids}
        f.healed, f.heal_record = True, {"states": states}
        self._emit(action="healed", kind="sigcont", role=f.role, pids=f.pids, states=states)

    def cont(self, role: str) -> None:
        """SIGCONT whatever of ``role`` is stopped (heals its sigstop faults)."""
        open_ = self._open(role, "sigstop")
        for f in open_:
            self._resume(f)
        pids = self.stopped.pop(role, [])  # stopped outside a handle (none today); resume them too
        _signal(pids, signal.SIGCONT)
        if pids or not open_:
            self._emit(action="healed", kind="sigcont", role=role, pids=pids,
                       states={p: _state(p) for p in pids})

    def restart(self, role: str) -> dict:
        """Start ``role`` again on its ports and wait until the router counts it (heals its sigkill faults)."""
        rec = self.cluster.restart(role)
        self.killed.discard(role)
        for f in self._open(role, "sigkill"):
            f.healed, f.heal_record = True, rec
        self._emit(action="healed", kind="restart", **rec)
        return rec

    def armed(self) -> list[str]:
        return [f"stopped:{r}" for r in self.stopped] + [f"killed:{r}" for r in sorted(self.killed)]

    def heal_all(self) -> None:
        for role in list(self.stopped):
            self.cont(role)
        for role in sorted(self.killed):
            self.restart(role)
