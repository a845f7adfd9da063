"""The cluster places network proxies made by a factory handed in from the fault layer.

``kvchaos.cluster`` never imports ``faults`` (tests/test_layering.py); here the launcher really
launches — stub prefill/decode/router processes standing in for SGLang (seconds, no model) — and
the router reaches both servers, and the client the router, through the proxies of whichever
factory was given: per cluster (``proxy_factory=``), or per process
(``faults.install_network_proxy()``); with neither it refuses before launching anything.
"""

from __future__ import annotations

import re
import stat
import sys
import textwrap

import pytest

import faults
from faults.netfault import NetworkFaults
from kvchaos.cluster import (AgentMissing, Cluster, ClusterSpec, ClusterStartError, ProxyFactoryMissing,
                             default_proxy_factory, engine_agent, set_default_proxy_factory, set_engine_agent)

STUB = textwrap.dedent('''
    """Stand-in for ``python -m sglang.launch_server`` / ``python -m sglang_router.launch_router``."""
    import json, os, sys, urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    argv = sys.argv[1:]
    module = argv[argv.index("-m") + 1]
    port = int(argv[argv.index("--port") + 1])
    router = module.startswith("sglang_router")
    never_ready = router and os.environ.get("STUB_ROUTER_NEVER_READY") == "1"  # a router that never sees its workers
    up = [argv[argv.index("--prefill") + 1], argv[argv.index("--decode") + 1]] if router else []

    def post(url, body):
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json({"healthy_workers": 0 if never_ready else 2} if self.path == "/readiness" else {"ok": True})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if router:  # prefill then decode, like a PD router; the answer is decode's
                post(up[0], body)
                return self._json({**post(up[1], body), "via": up})
            self._json({"text": "stub " + module, "port": port})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def spec(tmp_path):
    stub = tmp_path / "stub_engine.py"
    stub.write_text(STUB)
    py = tmp_path / "python"  # the "engine interpreter": runs the stub whatever module it is asked for
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {stub} \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return ClusterSpec(name="stub", model=str(tmp_path), engine_python=str(py), cpu_compat=False, agent=False,
                       network_proxy="embedded", startup_timeout_s=60.0, request_timeout_s=10.0)


@pytest.fixture
def no_default():
    prev = set_default_proxy_factory(None)
    yield
    set_default_proxy_factory(prev)


def test_a_cluster_asking_for_a_proxy_refuses_to_start_without_a_factory(spec, tmp_path, no_default):
    c = Cluster(spec, tmp_path / "c")
    with pytest.raises(ProxyFactoryMissing, match="proxy_factory=faults.open_network_proxy") as e:
        c.start()
    assert "faults.install_network_proxy()" in str(e.value) and "network_proxy = \"\"" in str(e.value)
    assert c.procs == {} and c.ports == [] and c.reaper is None and c.proxy is None  # nothing was launched
    assert not (tmp_path / "c" / "logs").exists()


def test_a_cluster_loading_the_agent_refuses_to_start_without_an_agent_module(spec, tmp_path, no_default):
    spec.agent = True
    prev = set_engine_agent(None)
    try:
        c = Cluster(spec, tmp_path / "c", proxy_factory=faults.open_network_proxy)
        with pytest.raises(AgentMissing, match="agent_module=faults.AGENT_MODULE") as e:
            c.start()
        assert "faults.install_agent()" in str(e.value) and "agent = false" in str(e.value)
        assert c.procs == {} and c.ports == [] and c.reaper is None  # nothing was launched
        assert faults.install_agent() is None and engine_agent() == faults.AGENT_MODULE == "faults.agent"
        with pytest.raises(TypeError):
            set_engine_agent("faults.agent:boot")
    finally:
        set_engine_agent(prev)


def test_no_proxy_no_factory_needed(spec, tmp_path, no_default):
    spec.network_proxy = ""
    with Cluster(spec, tmp_path) as c:
        assert c.proxy is None and c.endpoints.router_direct is None and c.endpoints.proxies == {}
        r = c.generate(text="hi", max_new_tokens=1)
        assert r.status_code == 200 and r.json()["via"] == [c.endpoints.prefill, c.endpoints.decode]


def test_the_factory_given_places_every_proxy(spec, tmp_path, no_default):
    calls, made = [], []

    def factory(where, token):
        calls.append((where, token))
        made.append(faults.open_network_proxy(where, token))
        return made[-1]

    c = Cluster(spec, tmp_path, proxy_factory=factory).start()
    try:
        assert calls == [("embedded", c.token)] and c.proxy is made[0] and isinstance(c.proxy, NetworkFaults)
        e = c.endpoints
        assert set(e.proxies) == {"client", "prefill", "decode"}
        assert e.router == f"http://{e.proxies['client']['listen']}" and e.router_direct != e.router
        toxics = {name: c.proxy.toxic(name, "latency", latency=1) for name in ("client", "prefill", "decode")}
        r = c.generate(text="through the proxies", max_new_tokens=1)
        assert r.status_code == 200
        assert r.json()["via"] == [f"http://{e.proxies[n]['listen']}" for n in ("prefill", "decode")]
        for t in toxics.values():
            assert t.verify()["fired"]["bytes"] > 0  # each hop really went through its proxy
        assert c.describe()["endpoints"]["proxies"] == e.proxies
    finally:
        c.stop()
    assert c.proxy is None
    with pytest.raises(Exception):
        made[0].tp.get_proxy(made[0].full("client")).toxics()  # the embedded proxy server is gone


def test_a_router_that_runs_out_of_the_start_says_how_much_the_servers_left_it(spec, tmp_path, no_default):
    """The start has one budget (startup_timeout_s) for the servers, then the router: a router that times
    out says when the servers were healthy and how much of the budget it was launched with (CI once read
    only the router's empty log after the servers, starved beside other sessions, had used it up)."""
    spec.network_proxy = ""
    spec.startup_timeout_s = 6.0
    spec.env = {**spec.env, "STUB_ROUTER_NEVER_READY": "1"}
    c = Cluster(spec, tmp_path)
    with pytest.raises(ClusterStartError) as e:
        c.start()
    msg = str(e.value)
    assert "timed out waiting for ['router'] to become healthy" in msg, msg
    m = re.search(r"the servers were healthy (\d+) s into the start: the router was launched with (\d+) s of "
                  r"startup_timeout_s = 6 s left", msg)
    assert m and int(m[1]) + int(m[2]) in (5, 6, 7), msg  # the two parts add up to the budget (rounded)
    assert c.procs == {} or all(not p.alive() for p in c.procs.values())  # the failed start left nothing running


def test_the_process_default_serves_every_cluster_built_without_one(spec, tmp_path, no_default):
    assert faults.install_network_proxy() is None and default_proxy_factory() is faults.open_network_proxy
    with Cluster(spec, tmp_path / "a") as c:
        assert isinstance(c.proxy, NetworkFaults) and c.generate(text="x", max_new_tokens=1).status_code == 200
    explicit = []

    def mine(where, token):
        explicit.append(where)
        return faults.open_network_proxy(where, token)

    with Cluster(spec, tmp_path / "b", proxy_factory=mine) as c:  # an explicit factory wins
        assert explicit == ["embedded"]
    with pytest.raises(TypeError):
        set_default_proxy_factory("faults.open_network_proxy")
