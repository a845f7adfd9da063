"""One fault-handle shape for every injector (faults.Fault): verify() proves, heal() undoes, once.

Process faults are checked on real processes (a small process tree in its own session standing
in for a server role, and a stand-in cluster that restarts it); agent and network handles on a
real agent control directory and the embedded proxy over loopback. No SGLang needed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from faults import Fault, FaultDidNotFire
from faults.client import AgentClient, ArmedFault
from faults.client import FaultDidNotFire as EngineFaultDidNotFire
from faults.netfault import NetFault, NetworkFaults
from faults.process import ProcessFault, ProcessFaults, _state
from kvchaos.cluster.reaper import kill_tree

# a role's tree: a leader and one child in its group (like launch_server and its scheduler)
TREE = "import os, time\nif os.fork() == 0:\n    time.sleep(120)\ntime.sleep(120)\n"


class Log:
    def __init__(self):
        self.records = []

    def emit(self, ev, **fields):
        self.records.append({"ev": ev, **fields})

    def faults(self, **match):
        return [r for r in self.records if r["ev"] == "fault" and all(r.get(k) == v for k, v in match.items())]


class Proc:
    def __init__(self):
        self.popen = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
        self.pgid = self.pid = self.popen.pid


class StandInCluster:
    """What ProcessFaults needs from a launched cluster: ``procs`` and ``restart(role)``."""

    def __init__(self, roles=("decode",)):
        self.procs = {r: Proc() for r in roles}
        self.restarts = []

    def restart(self, role):
        old = self.procs[role]
        kill_tree({old.pgid}, [], grace_s=2.0)
        old.popen.wait(timeout=10)
        self.procs[role] = Proc()
        rec = {"role": role, "healthy_s": 0.0, "rejoined_s": 0.01, "pid": self.procs[role].pid}
        self.restarts.append(rec)
        return rec

    def close(self):
        for p in self.procs.values():
            try:
                os.killpg(p.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait(timeout=10)


def _tree(proc: ProcessFaults, role: str, n: int = 2, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := proc.pids(role)) < n:
        assert time.monotonic() < deadline, f"{role} tree never had {n} processes: {pids}"
        time.sleep(0.02)
    return pids


def _states(pids) -> set:
    return {_state(p) for p in pids}


@pytest.fixture
def standin():
    c = StandInCluster(("prefill", "decode"))
    yield c
    c.close()


@pytest.fixture
def proc(standin):
    return ProcessFaults(standin, Log())


# ------------------------------------------------------------------ process faults
def test_stop_returns_a_handle_that_proves_and_heals_once(proc):
    pids = _tree(proc, "decode")
    f = proc.stop("decode")
    assert isinstance(f, ProcessFault) and isinstance(f, Fault)
    assert (f.kind, f.role, f.injector, f.pids) == ("sigstop", "decode", "process", pids) and f.id
    assert _states(pids) <= {"T", "t"}
    ev = f.verify()
    assert ev["pids"] == pids and set(ev["states"].values()) <= {"T", "t"} and ev["kind"] == "sigstop"
    assert [{"ev": "fault", **e} for e in f.fired_events()] == proc.log.faults(action="fired", kind="sigstop")
    assert proc.armed() == ["stopped:decode"]
    f.heal()
    assert f.healed and proc.armed() == []
    assert _states(pids) & {"T", "t"} == set()  # running (or sleeping) again
    f.heal()  # idempotent: no second SIGCONT event
    assert len(proc.log.faults(action="healed", kind="sigcont")) == 1
    assert f.verify()["pids"] == pids  # the evidence of the firing stays


def test_the_handle_still_reads_like_the_old_pid_list(proc):
    """Suites do ``killed["pids"] = proc.kill(role)`` / ``assert killed.get("pids")`` and
    ``proc.stop(role)`` ... ``proc.cont(role)``."""
    pids = _tree(proc, "decode")
    f = proc.stop("decode")
    assert f and len(f) == len(pids) and list(f) == pids and pids[0] in f
    proc.cont("decode")
    assert f.healed and proc.armed() == [] and _states(pids) & {"T", "t"} == set()
    f.heal()
    assert len(proc.log.faults(action="healed", kind="sigcont")) == 1
    killed = {"pids": proc.kill("prefill")}
    assert killed.get("pids") and killed["pids"].pids


def test_kill_handle_proves_every_process_gone_and_heals_by_one_restart(proc, standin):
    pids = _tree(proc, "prefill")
    f = proc.kill("prefill")
    assert (f.kind, f.role, f.pids) == ("sigkill", "prefill", pids)
    assert _states(pids) <= {None, "Z"}
    ev = f.verify()
    assert ev["pids"] == pids and all(s in (None, "Z") for s in ev["states"].values())
    assert proc.armed() == ["killed:prefill"]
    rec = f.heal()
    assert rec == standin.restarts[0] and f.heal_record == rec and proc.armed() == []
    assert f.heal() == rec and len(standin.restarts) == 1  # idempotent: one restart
    assert proc.log.faults(action="healed", kind="restart") and standin.procs["prefill"].popen.poll() is None
    # restart by role (the old way) heals the handle too
    g = proc.kill("prefill")
    proc.restart("prefill")
    assert g.healed and g.heal_record == standin.restarts[1]
    g.heal()
    assert len(standin.restarts) == 2


def test_heal_all_heals_what_the_test_left(proc, standin):
    _tree(proc, "decode")
    s = proc.stop("decode")
    k = proc.kill("prefill")
    proc.heal_all()
    assert s.healed and k.healed and proc.armed() == [] and len(standin.restarts) == 1
    proc.heal_all()
    s.heal(), k.heal()
    assert len(standin.restarts) == 1


def test_a_handle_heals_on_leaving_its_block(proc):
    pids = _tree(proc, "decode")
    with proc.stop("decode") as f:
        assert _states(pids) <= {"T", "t"}
    assert f.healed and _states(pids) & {"T", "t"} == set()


def test_verify_without_evidence_raises_fault_did_not_fire(proc):
    pids = _tree(proc, "decode")
    states = {p: _state(p) for p in pids}  # running: nothing was stopped
    f = ProcessFault(proc, "decode", "sigstop", pids, time.time(), states, {})
    assert f.fired_events() == []
    with pytest.raises(FaultDidNotFire):
        f.verify()
    with pytest.raises(AssertionError):  # a test that relied on it fails, not errors
        ProcessFault(proc, "decode", "sigkill", pids, time.time(), states, {}).verify()
    assert FaultDidNotFire is EngineFaultDidNotFire
    with pytest.raises(FaultDidNotFire):
        ProcessFault(proc, "decode", "sigkill", [], time.time(), {}, {}).verify()


def test_a_role_with_no_live_process_cannot_be_faulted(proc, standin):
    os.killpg(standin.procs["decode"].pgid, signal.SIGKILL)
    standin.procs["decode"].popen.wait(timeout=10)
    deadline = time.monotonic() + 10
    while proc.pids("decode") and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(FaultDidNotFire, match="no live process"):
        proc.stop("decode")
    with pytest.raises(FaultDidNotFire, match="no live process"):
        proc.kill("decode")
    with pytest.raises(ValueError, match="unknown role"):
        proc.stop("router")


# ------------------------------------------------------------------ agent and network handles
def test_agent_handle_is_a_fault_and_heals_once(tmp_path):
    log = Log()
    ctl = AgentClient(str(tmp_path), log)
    f = ArmedFault(ctl, "delay-0001", "prefill", "delay", {"any": True}, {"ms": 5})
    ctl._armed[f.id] = f
    assert isinstance(f, Fault) and (f.id, f.kind, f.injector) == ("delay-0001", "delay", "agent")
    assert f.fired_events() == []
    with pytest.raises(FaultDidNotFire):
        f.verify()
    f.heal()  # no live agent of the role (the process is gone): nothing left armed
    f.heal()
    assert f.healed and ctl._armed == {} and len(log.faults(action="healed")) == 1
    g = ArmedFault(ctl, "hold-0002", "decode", "hold", {}, {})
    ctl._armed[g.id] = g
    ctl.heal_all()
    g.heal()
    assert g.healed and [r["fault"] for r in log.faults(action="healed")] == ["delay-0001", "hold-0002"]


@pytest.fixture
def echo_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def serve():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            with c:
                while d := c.recv(65536):
                    c.sendall(d)

    threading.Thread(target=serve, daemon=True).start()
    yield s.getsockname()[1]
    s.close()


def test_network_handle_is_a_fault_with_evidence_that_survives_heal(echo_port):
    nf = NetworkFaults.open("embedded", "handles")
    try:
        nf.log = Log()
        url = nf.add("client", 0, echo_port)
        t = nf.toxic("client", "latency", latency=1)
        assert isinstance(t, NetFault) and isinstance(t, Fault)
        assert (t.id, t.kind, t.injector) == (t.name, "latency", "proxy")
        assert t.fired_events() == []
        with pytest.raises(FaultDidNotFire):
            t.verify()
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"hello")
            assert s.recv(16) == b"hello"
        ev = t.verify()
        assert ev["fired"]["bytes"] >= 5
        t.heal()
        t.heal()
        assert t.healed and nf.armed() == [] and len(nf.log.faults(action="healed")) == 1
        assert t.fired_events()[0]["fired"]["bytes"] >= 5  # the counters as they were at heal
        assert t.verify()["fired"]["bytes"] >= 5  # an experiment heals before the test verifies
    finally:
        nf.close()


def test_every_injector_returns_the_same_handle_shape(proc, tmp_path, echo_port):
    nf = NetworkFaults.open("embedded", "shape")
    try:
        nf.add("client", 0, echo_port)
        handles = [ArmedFault(AgentClient(str(tmp_path)), "fail-1", "prefill", "fail", {}, {}),
                   nf.toxic("client", "timeout", timeout=0),
                   proc.stop("decode")]
        for h in handles:
            assert isinstance(h, Fault), h
            assert isinstance(h.id, str) and h.id and isinstance(h.kind, str) and h.kind
            assert h.injector in ("agent", "proxy", "process")
            assert callable(h.verify) and callable(h.heal) and isinstance(h.fired_events(), list)
            assert h.evidence() == h.fired_events() or h.injector == "proxy"
            h.heal()
            h.heal()
            assert h.healed
        assert {h.injector for h in handles} == {"agent", "proxy", "process"}
        assert proc.armed() == [] and nf.armed() == []
    finally:
        nf.close()
