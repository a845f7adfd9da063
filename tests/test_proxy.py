"""faults/proxy/ driven by the official toxiproxy-python client, over loopback.

Each toxic is checked by its measured effect on real TCP traffic (a loopback echo / HTTP server),
not by the API echoing what we posted, and by its ``fired`` counters."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from faults.proxy import ProxyServer, toxiproxy_client


class EchoServer:
    """Loopback TCP server: echoes every byte back; counts connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c):
        with c:
            while True:
                try:
                    d = c.recv(65536)
                except OSError:
                    return
                if not d:
                    return
                c.sendall(d)

    def close(self):
        self._stop = True
        self.sock.close()


@pytest.fixture(scope="module")
def srv():
    s = ProxyServer().start()
    yield s
    s.stop()


@pytest.fixture
def tp(srv):
    client = toxiproxy_client("127.0.0.1", srv.port)
    yield client
    client.destroy_all()


@pytest.fixture
def echo():
    e = EchoServer()
    yield e
    e.close()


def _connect(listen: str, timeout=5.0) -> socket.socket:
    host, port = listen.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def _roundtrip(s: socket.socket, payload: bytes) -> tuple[bytes, float]:
    t0 = time.monotonic()
    s.sendall(payload)
    got = b""
    while len(got) < len(payload):
        d = s.recv(65536)
        if not d:
            break
        got += d
    return got, time.monotonic() - t0


def test_create_list_get_destroy(tp, echo):
    assert tp.running()
    assert b"kvchaos" in tp.version()
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="echo")
    assert p.listen.startswith("127.0.0.1:") and not p.listen.endswith(":0")
    assert set(tp.proxies()) == {"echo"}
    assert tp.get_proxy("echo").upstream == f"127.0.0.1:{echo.port}"
    with pytest.raises(ProxyExists):
        tp.create(upstream=f"127.0.0.1:{echo.port}", name="echo")
    with _connect(p.listen) as s:
        assert _roundtrip(s, b"hello")[0] == b"hello"
    assert p.destroy()
    assert tp.get_proxy("echo") is None


def test_bad_input_named(tp, echo, srv):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="bad")
    with pytest.raises(InvalidToxic, match="unknown type"):
        p.add_toxic(type="latencyy", attributes={"latency": 1})
    with pytest.raises(InvalidToxic, match="unknown attribute .*latncy"):
        p.add_toxic(type="latency", attributes={"latncy": 1})
    with pytest.raises(InvalidToxic, match="toxicity"):
        p.add_toxic(type="latency", toxicity=3, attributes={"latency": 1})
    with pytest.raises(InvalidToxic, match="upstream must be host:port"):
        tp.create(upstream="nonsense", name="bad2")
    with pytest.raises(NotFound):
        p.destroy_toxic("nope")
    import requests

    r = requests.post(f"{srv.url}/proxies", data=b"{not json", timeout=5)
    assert r.status_code == 400 and "bad json" in r.json()["error"]


# Margins a loaded machine keeps (make test runs clusters beside): 3 s of latency, under half of it once healed.
def test_latency_applies_and_heals(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="lat")
    with _connect(p.listen) as s:
        base = min(_roundtrip(s, b"x" * 100)[1] for _ in range(5))
        p.add_toxic(type="latency", stream="downstream", attributes={"latency": 3000, "jitter": 0})
        got, dt = _roundtrip(s, b"y" * 100)  # the already-open connection is affected too
        assert got == b"y" * 100
        assert dt >= 3.0, f"latency toxic did not delay: {dt * 1000:.1f} ms"
        fired = p.get_toxic("latency_downstream")
        assert fired is not None
        p.destroy_toxic("latency_downstream")
        _, dt2 = _roundtrip(s, b"z" * 100)
        assert dt2 < 1.5, f"still slow after heal: {dt2 * 1000:.1f} ms (baseline {base * 1000:.1f} ms)"


def test_fired_counters_prove_the_toxic_touched_traffic(srv, tp, echo):
    import requests

    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="cnt")
    p.add_toxic(type="latency", name="l", stream="upstream", attributes={"latency": 1})
    p.add_toxic(type="latency", name="never", stream="upstream", toxicity=0.0, attributes={"latency": 500})
    with _connect(p.listen) as s:
        _roundtrip(s, b"a" * 1000)
    toxics = {t["name"]: t for t in requests.get(f"{srv.url}/proxies/cnt/toxics", timeout=5).json()}
    assert toxics["l"]["fired"]["bytes"] == 1000 and toxics["l"]["fired"]["connections"] == 1
    assert toxics["never"]["fired"] == {"connections": 0, "chunks": 0, "bytes": 0}  # toxicity 0: did not fire


def test_bandwidth(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="bw")
    p.add_toxic(type="bandwidth", stream="downstream", attributes={"rate": 100})  # 100 KB/s
    with _connect(p.listen) as s:
        got, dt = _roundtrip(s, b"b" * 50_000)
    assert got == b"b" * 50_000
    assert 0.4 <= dt <= 3.0, f"50 KB at 100 KB/s took {dt:.2f} s"


def test_limit_data_closes_after_n_bytes(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="lim")
    p.add_toxic(type="limit_data", stream="downstream", attributes={"bytes": 10})
    with _connect(p.listen) as s:
        s.sendall(b"0123456789abcdef")
        got = b""
        while True:
            d = s.recv(100)
            if not d:
                break
            got += d
    assert got == b"0123456789"


def test_reset_peer(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="rst")
    p.add_toxic(type="reset_peer", attributes={"timeout": 100})
    with _connect(p.listen) as s:
        t0 = time.monotonic()
        with pytest.raises(ConnectionResetError):
            while time.monotonic() - t0 < 5:
                s.sendall(b"x")
                if not s.recv(10):
                    raise AssertionError("closed cleanly, expected RST")
                time.sleep(0.01)
    assert 0.09 <= time.monotonic() - t0 < 2


def _reset_after(s: socket.socket, bound_s: float = 5.0, t0: float | None = None) -> float:
    """Seconds until ``s`` (idle: nothing sent) is reset by the proxy, counted from ``t0`` (default: now)."""
    t0 = time.monotonic() if t0 is None else t0
    s.settimeout(bound_s)
    with pytest.raises(ConnectionResetError):
        if not s.recv(10):
            raise AssertionError("closed cleanly, expected RST")
    return time.monotonic() - t0


def test_reset_peer_added_to_an_open_idle_link_fires_at_its_time(tp, echo):
    """The watch sleeps until a change: a toxic added while a link is open and silent still acts,
    ``timeout`` ms after it was added."""
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="rst-late")
    with _connect(p.listen) as s:
        assert _roundtrip(s, b"up")[0] == b"up"
        time.sleep(0.3)
        t0 = time.monotonic()  # before the API call: its reply may come after the 150 ms have started
        p.add_toxic(type="reset_peer", attributes={"timeout": 150})
        dt = _reset_after(s, t0=t0)
    assert 0.12 <= dt < 3.0, dt  # at its 150 ms, where a loaded machine lets it run; never is 5 s


def test_reset_peer_timeout_updated_through_the_api_is_read_again(tp, echo, srv):
    """An update of the attributes wakes the watch: 60 s shortened to 100 ms resets at ~100 ms."""
    import requests

    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="rst-upd")
    p.add_toxic(type="reset_peer", name="r", attributes={"timeout": 60000})
    with _connect(p.listen) as s:
        time.sleep(0.2)
        r = requests.post(f"http://127.0.0.1:{srv.port}/proxies/rst-upd/toxics/r",
                          json={"attributes": {"timeout": 100}}, timeout=5)
        assert r.status_code == 200, r.text
        dt = _reset_after(s)
    assert dt < 3.0, dt  # the 100 ms read again, not the 60 s (a loaded machine may run it late)


def test_idle_links_do_not_poll(tp, echo, srv):
    """With no reset_peer/timeout toxic a link's watch sleeps until the toxics change: 20 idle links
    for 0.5 s do not wake it at all (a 5 ms poll woke each ~100 times, most of a core under load)."""
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="idle")
    p.add_toxic(type="latency", attributes={"latency": 1})  # a toxic, but not a timed one
    socks = [_connect(p.listen) for _ in range(20)]
    try:
        for s in socks:
            assert _roundtrip(s, b"i")[0] == b"i"
        proxy = srv.proxies["idle"]
        before = proxy.watch_wakeups
        time.sleep(0.5)
        assert proxy.watch_wakeups - before == 0
        p.add_toxic(type="reset_peer", attributes={"timeout": 50})  # now each one wakes, and acts
        for s in socks:
            _reset_after(s)
        assert 20 <= proxy.watch_wakeups - before <= 60, proxy.watch_wakeups - before
    finally:
        for s in socks:
            s.close()


def test_timeout_drops_then_closes(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="to")
    p.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 300})
    with _connect(p.listen) as s:
        t0 = time.monotonic()
        s.sendall(b"dropped")
        assert s.recv(10) == b""  # nothing echoed; closed after the timeout
        assert time.monotonic() - t0 >= 0.29


def test_slicer_and_slow_close(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="sl")
    p.add_toxic(type="slicer", stream="downstream",
                attributes={"average_size": 10, "size_variation": 5, "delay": 2000})
    with _connect(p.listen) as s:
        got, dt = _roundtrip(s, b"s" * 500)
    assert got == b"s" * 500 and dt >= 0.05  # ~50 slices x 2 ms
    t = p.get_toxic("slicer_downstream")
    assert t is not None


def test_disable_drops_connections_and_reset_restores(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="dn")
    s = _connect(p.listen)
    p.disable()
    assert s.recv(10) == b""  # active connection dropped
    s.close()
    with pytest.raises(OSError):
        _connect(p.listen, timeout=1).close()
    p.add_toxic(type="latency", attributes={"latency": 5000})
    assert tp.reset()
    p2 = tp.get_proxy("dn")
    assert p2.enabled and p2.toxics() == {}
    with _connect(p2.listen) as s2:
        got, dt = _roundtrip(s2, b"ok")
    assert got == b"ok" and dt < 2.5, dt  # half the toxic's delay: a loaded machine is not a toxic


def test_toxicity_is_per_connection(tp, echo):
    p = tp.create(upstream=f"127.0.0.1:{echo.port}", name="tx")
    p.add_toxic(type="latency", toxicity=0.5, attributes={"latency": 80})
    slow = 0
    for _ in range(40):
        with _connect(p.listen) as s:
            slow += _roundtrip(s, b"q")[1] >= 0.08
    assert 8 <= slow <= 32, f"toxicity 0.5 applied to {slow}/40 connections"


def test_network_faults_keep_their_server_when_another_client_is_made(srv, echo):
    """toxiproxy-python keeps host/port on a class: a second client must not redirect the cluster's."""
    from faults.netfault import NetworkFaults

    nf = NetworkFaults.open("embedded", "own")
    try:
        nf.add("client", 0, echo.port)
        toxiproxy_client("127.0.0.1", srv.port)  # someone else's client, e.g. a test's own proxy
        t = nf.toxic("client", "latency", latency=5)
        assert [a["toxic"] for a in nf.armed()] == [t.name]
        assert not any(p.startswith("own-") for p in toxiproxy_client("127.0.0.1", srv.port).proxies())
        nf.heal_all()
        assert nf.armed() == []
    finally:
        nf.close()
