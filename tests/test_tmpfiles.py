"""What kvchaos leaves in the temporary directory goes away: its owner's reaper deletes it when the
owner is SIGKILLed, and the next session's sweep deletes what a dead owner left without one — never
what a live owner still uses."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from kvchaos.cluster import ports, tmpfiles
from kvchaos.cluster.reaper import Reaper

REPO = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def port_dir(tmp_path, monkeypatch):
    d = tmp_path / "ports"
    monkeypatch.setenv("KVCHAOS_PORT_DIR", str(d))
    return d


def test_only_kvchaos_entries_are_ours():
    t = Path(tempfile.gettempdir())
    assert tmpfiles.is_ours(t / "kvc-ag-123-abc_9")
    assert tmpfiles.is_ours(t / "kvchaos-xdist-0af3.lock") and tmpfiles.is_ours(t / "kvchaos-xdist-0af3.lock.turnstile")
    assert tmpfiles.is_ours(t / "kvc12p-x1y2")
    for bad in ("kvc-ag-x-abc", "kvchaos-xdist-zz.lock", "kvc12q-x", "other", "kvc-ag-1-a/../../etc"):
        assert not tmpfiles.is_ours(t / bad), bad
    assert not tmpfiles.is_ours("kvc-ag-1-a")  # relative
    assert not tmpfiles.is_ours("/etc/kvc-ag-1-a")  # elsewhere
    with pytest.raises(ValueError, match="not a kvchaos temporary entry"):
        tmpfiles.remove("/etc/passwd")
    with pytest.raises(ValueError, match="not a kvchaos temporary entry"):
        Reaper.register_cleanup(object.__new__(Reaper), "path", "/home")


def test_sweep_removes_dead_owners_entries_and_keeps_live_ones(port_dir):
    dead, me = _dead_pid(), os.getpid()
    t = Path("/tmp")
    dead_dir = Path(tempfile.mkdtemp(prefix=f"kvc-ag-{dead}-", dir=t))
    live_dir = Path(tempfile.mkdtemp(prefix=f"kvc-ag-{me}-", dir=t))
    (dead_dir / "prefill.sock").write_text("")
    dead_lock = Path(tempfile.gettempdir()) / f"kvchaos-xdist-{os.urandom(6).hex()}.lock"
    dead_lock.write_text(f"{dead}\n")
    dead_gate = dead_lock.with_name(dead_lock.name + ".turnstile")
    dead_gate.write_text("")
    live_lock = Path(tempfile.gettempdir()) / f"kvchaos-xdist-{os.urandom(6).hex()}.lock"
    live_lock.write_text(f"{me}\n")
    old_lock = Path(tempfile.gettempdir()) / f"kvchaos-xdist-{os.urandom(6).hex()}.lock"
    old_lock.write_text("")  # an older kvchaos's lock file: no owner named, untouched for two days
    os.utime(old_lock, (time.time() - 2 * 86400,) * 2)
    young_lock = Path(tempfile.gettempdir()) / f"kvchaos-xdist-{os.urandom(6).hex()}.lock"
    young_lock.write_text("")  # no owner named, but it may be a live older run's
    mount = Path(tempfile.mkdtemp(prefix="kvc987654p-", dir=t))  # its namespace does not exist
    live_ports = ports.reserve_ports(2)
    port_dir.joinpath("20001").write_text(str(dead))
    try:
        gone = tmpfiles.sweep()
        for p in (dead_dir, dead_lock, dead_gate, old_lock, mount, port_dir / "20001"):
            assert not p.exists(), p
        assert str(port_dir / "20001") in gone
        assert live_dir.exists() and live_lock.exists() and young_lock.exists()
        assert all((port_dir / str(p)).exists() for p in live_ports)
    finally:
        ports.release_ports(live_ports)
        for p in (live_dir, dead_dir, mount):
            tmpfiles.remove(p)
        for p in (live_lock, dead_lock, dead_gate, old_lock, young_lock):
            p.unlink(missing_ok=True)


OWNER = textwrap.dedent("""
    import json, os, sys, tempfile, time
    from pathlib import Path
    from kvchaos.cluster import ports
    from kvchaos.cluster.reaper import Reaper
    out = Path(sys.argv[1])
    r = Reaper("kvc-test-tmpfiles", grace_s=1.0)
    agent = tempfile.mkdtemp(prefix=f"kvc-ag-{os.getpid()}-", dir="/tmp")
    Path(agent, "decode.sock").write_text("")
    lock = Path(tempfile.gettempdir()) / f"kvchaos-xdist-{os.urandom(6).hex()}.lock"
    lock.write_text(f"{os.getpid()}\\n")
    for p in (agent, str(lock)):
        r.register_cleanup("path", p)
    got = ports.reserve_ports(3)
    time.sleep(0.5)
    tmp = out.with_name(out.name + ".tmp")  # whole or absent: the test reads it the moment it exists
    tmp.write_text(json.dumps({"agent": agent, "lock": str(lock), "ports": got, "pid": os.getpid()}))
    tmp.rename(out)
    time.sleep(600)
""")


def test_a_reaper_whose_owner_died_before_it_started_still_releases_the_owners_ports(port_dir):
    """The owner is named on the reaper's command line: one SIGKILLed while the reaper's interpreter was
    still starting (make test runs the unit tests beside the cluster session) leaves the reaper reparented,
    and getppid() would name init."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    port_dir.mkdir(parents=True, exist_ok=True)
    port_dir.joinpath("20002").write_text(str(gone.pid))
    port_dir.joinpath("20003").write_text(str(os.getpid()))  # a live owner's: kept
    r = subprocess.run([sys.executable, "-c", "import sys; from kvchaos.cluster.reaper import main; "
                        "sys.exit(main(sys.argv[1:]))", "kvc-test-owner-gone", "0.1", str(gone.pid)],
                       stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not port_dir.joinpath("20002").exists() and port_dir.joinpath("20003").exists(), r.stderr


def test_sigkilled_owners_reaper_deletes_its_entries_and_ports(tmp_path, port_dir):
    info = tmp_path / "info.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(info)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not info.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        got = json.loads(info.read_text())
        entries = [Path(got["agent"]), Path(got["lock"])] + [port_dir / str(p) for p in got["ports"]]
        assert all(p.exists() for p in entries)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=20)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.exists() for p in entries):
            time.sleep(0.1)
        assert [str(p) for p in entries if p.exists()] == []
    finally:
        if owner.poll() is None:
            owner.kill()
