"""The two-hosts topology's plumbing (kvchaos/cluster/netns.py): namespaces reachable only at their own
addresses, an engine-side directory the harness cannot see, and nothing left behind — after a normal
stop, and after a SIGKILL of the owner (the reaper deletes the namespaces and links it was told of).
Needs root and iproute2 (CI's machines have both); skipped, named, without them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvchaos.cluster import netns
from kvchaos.cluster.procs import ManagedProcess
from kvchaos.cluster.reaper import Reaper

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")
REPO = Path(__file__).resolve().parents[1]


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _mine(h) -> list[str]:
    return netns.of_subnet(h.k)


def test_two_hosts_reach_each_other_only_at_their_addresses_and_hide_engine_files(tmp_path):
    r = Reaper("kvc-netns-test")
    h = netns.TwoHosts().up(r)
    try:
        assert h.ip("prefill") != h.ip("decode") and set(_mine(h)) >= {f"netns {h.ns('prefill')}", f"link {h.bridge}"}
        server = textwrap.dedent(f"""
            import os, socket
            open(os.path.join({h.mounts['prefill']!r}, 'engine-side.txt'), 'w').write('only in here')
            s = socket.socket(); s.bind(({h.ip('prefill')!r}, 18123)); s.listen(1)
            c, _ = s.accept(); c.sendall(str(sorted(os.listdir({h.mounts['prefill']!r}))).encode()); c.close()
        """)
        p = ManagedProcess("prefill", h.wrap("prefill", [sys.executable, "-c", server]), dict(os.environ),
                           tmp_path / "p.log", r, "kvc-netns-test")

        conn, deadline = None, time.monotonic() + 20
        while conn is None and time.monotonic() < deadline and p.alive():
            try:
                conn = socket.create_connection((h.ip("prefill"), 18123), timeout=1)
            except OSError:
                time.sleep(0.1)
        assert conn is not None, p.tail()
        inside = conn.recv(1000).decode()
        conn.close()
        assert inside == "['engine-side.txt']", (inside, p.tail())
        assert os.listdir(h.mounts["prefill"]) == []  # the harness's view of the same directory
        # decode's namespace reaches prefill's address too (Mooncake / bootstrap go this way)
        out = subprocess.run(["ip", "-n", h.ns("decode"), "route", "get", h.ip("prefill")],
                             capture_output=True, text=True)
        assert f"dev {h.ns('decode')}n" in out.stdout, out
        assert _wait(lambda: not p.alive())
    finally:
        assert h.down() == []
        r.close()
    assert _mine(h) == [] and not any(Path(d).exists() for d in h.mounts.values())


def test_a_sigkilled_owner_leaves_no_namespace_link_or_process(tmp_path):
    owner = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from kvchaos.cluster import netns
        from kvchaos.cluster.procs import ManagedProcess
        from kvchaos.cluster.reaper import Reaper
        r = Reaper("kvc-netns-kill")
        h = netns.TwoHosts().up(r)
        p = ManagedProcess("decode", h.wrap("decode", [sys.executable, "-c", "import time; time.sleep(300)"]),
                           dict(os.environ), {str(tmp_path / 'd.log')!r}, r, "kvc-netns-kill")
        print(h.k, p.pid, flush=True)
        time.sleep(300)
    """)
    o = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        k, pid = map(int, o.stdout.readline().split())
        assert os.path.exists(f"/proc/{pid}") and f"netns kvc{k}d" in netns.leftovers()
        o.send_signal(signal.SIGKILL)
        o.wait(10)
        gone = _wait(lambda: not os.path.exists(f"/proc/{pid}") and
                     not netns.of_subnet(k), timeout=30)
        assert gone, (os.path.exists(f"/proc/{pid}"), netns.leftovers())
    finally:
        if o.poll() is None:
            o.kill()


def test_reaper_refuses_to_delete_what_is_not_ours():
    r = Reaper("kvc-netns-refuse")
    try:
        for kind, name in (("netns", "default"), ("link", "eth0"), ("route", "kvc1br")):
            with pytest.raises(ValueError, match="not a kvchaos namespace or link"):
                r.register_cleanup(kind, name)
    finally:
        r.close()


def test_of_subnet_names_only_that_subnets_namespaces_and_links(monkeypatch):
    """Two two-host clusters at once (make test's two-host session beside others): subnet 1's check must
    not see subnet 12's bridge."""
    monkeypatch.setattr(netns, "leftovers", lambda prefix="kvc": ["netns kvc1p", "netns kvc12p", "link kvc12br",
                                                                   "link kvc1br", "link kvc1ph"])
    assert netns.of_subnet(1) == ["netns kvc1p", "link kvc1br", "link kvc1ph"]
    assert netns.of_subnet(12) == ["netns kvc12p", "link kvc12br"]
    assert netns.of_subnet(2) == []
