"""The agent's TCP channel (faults/agent/net.py + faults.client.AgentClient(remote=...)): control and
evidence through the gateway with a shared token, never an engine-side file; bad input named (wrong
token, another protocol version, an unreachable gateway, an address on every interface), nothing
waits without a bound; a standby process takes the gateway over when its process is gone."""

from __future__ import annotations

import socket
import time

import pytest

import faults.agent as agent_mod
import faults.client as engine
from faults import wire
from faults.agent import net
from faults.client import AgentClient, AgentError, AgentRefused

TOKEN = "s3cret-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path, monkeypatch):
    """One prefill agent (this process) behind a gateway on a loopback port."""
    d = tmp_path / "engine-side"
    d.mkdir()
    monkeypatch.setattr(agent_mod.control, "ROLE", "prefill")
    a = agent_mod.Agent(str(d))
    monkeypatch.setattr(agent_mod.control, "AGENT", a)
    a.serve()
    port = _free_port()
    gw = net.Gateway(str(d), "127.0.0.1", port, TOKEN, "prefill")
    assert gw.try_serve()
    yield a, gw, f"tcp://127.0.0.1:{port}"
    gw.stop()
    a._srv.shutdown()
    a._srv.server_close()


class _NoFiles:
    """Stands in for the harness's file access: any use is a read of an engine-side file."""

    def glob(self, *a, **k):
        raise AssertionError(f"the harness listed engine-side files: {a}")


def test_arm_verify_events_heal_over_tcp_without_reading_engine_files(served, monkeypatch):
    a, _gw, url = served
    monkeypatch.setattr(engine, "glob", _NoFiles())
    monkeypatch.setattr(engine, "open", lambda *x, **k: (_ for _ in ()).throw(AssertionError(f"opened {x}")),
                        raising=False)
    ctl = AgentClient(remote={"prefill": url}, token=TOKEN, timeout=5)
    (info,) = ctl.agents("prefill")
    assert info["via"] == "prefill" and info["role"] == "prefill"
    f = ctl.arm("prefill", "delay", target={"rid": "r-1"}, params={"ms": 1}, hooks=())
    assert [x["id"] for x in ctl.armed()] == [f.id]
    a.emit("fault_fired", fault=f.id, kind="delay", rid="r-1", ms=1)
    assert f.verify(timeout=2)[0]["rid"] == "r-1"
    a.emit("transfer_start", rid="r-2", room=7, pages=3)
    assert ctl.wait_event("prefill", "transfer_start", timeout=2, rid="r-2")["pages"] == 3
    n = len(ctl.events("prefill"))
    assert len(ctl.events("prefill")) == n  # incremental: nothing received twice
    f.heal()
    assert ctl.armed() == [] and not a.faults
    assert ctl.agents("decode") == []  # no gateway for decode was given


def test_wrong_token_and_other_version_are_refused_by_name(served, monkeypatch):
    _a, _gw, url = served
    with pytest.raises(AgentRefused, match=rf"prefill agent at {url}: .*wrong token"):
        AgentClient(remote={"prefill": url}, token="guess", timeout=5).agents("prefill")
    monkeypatch.setattr(engine, "PROTOCOL", wire.PROTOCOL + 1)
    with pytest.raises(AgentRefused, match=rf"agent protocol {wire.PROTOCOL}, harness speaks {wire.PROTOCOL + 1}"):
        AgentClient(remote={"prefill": url}, token=TOKEN, timeout=5).wait_agents("prefill", (), timeout=1)


def test_unreachable_gateway_is_named_within_the_bound():
    url = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
    ctl = AgentClient(remote={"decode": url}, token=TOKEN, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(AgentError, match=rf"no decode agent .* in decode {url} after 1s.*decode agent at {url} unreachable"):
        ctl.wait_agents("decode", (), timeout=1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(AgentError, match=rf"no live decode agent in decode {url}: decode agent at {url} unreachable"):
        ctl.heal_all() or ctl._each("decode", {"cmd": "ping"})


@pytest.mark.parametrize("url,why", [("http://h:1", "expected tcp://HOST:PORT"), ("tcp://h", "expected tcp://"),
                                     ("tcp://:80", "expected tcp://"), ("tcp://h:x", "expected tcp://")])
def test_bad_addresses_are_named(url, why):
    with pytest.raises(wire.AgentAddressError, match=why):
        wire.parse_url(url)


def test_every_interface_only_when_asked_and_a_token_is_required(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCHAOS_AGENT_BIND_ALL", raising=False)
    with pytest.raises(wire.AgentAddressError, match="KVCHAOS_AGENT_BIND_ALL=1"):
        net.Gateway(str(tmp_path), "0.0.0.0", 1, TOKEN, "decode")
    with pytest.raises(wire.AgentAddressError, match="needs a shared token"):
        net.Gateway(str(tmp_path), "127.0.0.1", 1, "", "decode")
    with pytest.raises(wire.AgentAddressError, match="no token"):
        AgentClient(remote={"decode": "tcp://127.0.0.1:1"}, token=None)
    with pytest.raises(ValueError, match="one of the two"):
        AgentClient()
    monkeypatch.setenv("KVCHAOS_AGENT_BIND_ALL", "1")
    net.Gateway(str(tmp_path), "0.0.0.0", 1, TOKEN, "decode")  # asked for: allowed


def test_a_fault_needing_a_method_the_engines_class_lacks_is_refused_at_once_by_name(served):
    """An optional hook the engine's class does not have (SGLang 0.5.19's decode mixin has no
    ``_get_new_prebuilt_batch``) is reported by the agent; a fault that needs it is refused then, naming
    it, not after the 30 s wait for hooks that are still being installed."""
    from faults.agent import control

    class Mixin:  # stands in for an engine class of a release without the method
        def run(self):
            return 1

    class Mod:
        SchedulerDisaggregationDecodeMixin = Mixin
    control._hook_class(Mod, "SchedulerDisaggregationDecodeMixin", optional={"_get_new_prebuilt_batch": lambda o: o})
    a, _gw, url = served
    assert a.absent == ["SchedulerDisaggregationDecodeMixin._get_new_prebuilt_batch"]
    ctl = AgentClient(remote={"prefill": url}, token=TOKEN, timeout=5)
    t = time.monotonic()
    with pytest.raises(AgentError, match="the prefill engine has no _get_new_prebuilt_batch"):
        ctl.wait_agents("prefill", ("_get_new_prebuilt_batch",), timeout=20)
    assert time.monotonic() - t < 5
    with pytest.raises(AgentError, match="no prefill agent with hooks"):  # a hook not reported absent: waited for
        ctl.wait_agents("prefill", ("some_other_hook",), timeout=0.5)


def test_a_standby_process_takes_the_gateway_over(served):
    a, gw, url = served
    host, port = wire.parse_url(url)
    other = net.Gateway(a.dir, host, port, TOKEN, "prefill")
    assert not other.try_serve()  # the port is held
    other.run_or_stand_by(every_s=0.1)
    gw.stop()  # the gateway's process is gone
    ctl = AgentClient(remote={"prefill": url}, token=TOKEN, timeout=2)
    try:
        assert [x["pid"] for x in ctl.wait_agents("prefill", (), timeout=5)] == [a.pid]
    finally:
        other.stop()


def test_agent_boot_reads_a_tcp_address(tmp_path, monkeypatch):
    """``KVCHAOS_AGENT=tcp://...`` boots the agent with its own control directory and a gateway;
    without a token it refuses, named, and loads nothing."""
    port = _free_port()
    monkeypatch.setattr(agent_mod.control, "AGENT", None)
    monkeypatch.setenv("KVCHAOS_AGENT", f"tcp://127.0.0.1:{port}")
    monkeypatch.setenv("KVCHAOS_AGENT_ROLE", "decode")
    monkeypatch.setenv("KVCHAOS_AGENT_DIR", str(tmp_path / "ctl"))
    monkeypatch.delenv("KVCHAOS_AGENT_TOKEN", raising=False)
    monkeypatch.setattr(agent_mod.sys, "meta_path", list(agent_mod.sys.meta_path))
    agent_mod.boot()
    assert agent_mod.control.AGENT is None
    monkeypatch.setenv("KVCHAOS_AGENT_TOKEN", TOKEN)
    agent_mod.boot()
    try:
        assert agent_mod.control.AGENT.dir == str(tmp_path / "ctl")
        ctl = AgentClient(remote={"decode": f"tcp://127.0.0.1:{port}"}, token=TOKEN, timeout=2)
        deadline = time.monotonic() + 5
        while agent_mod.GATEWAY.server is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.agents("decode") == []  # up, and no process has patched anything yet
    finally:
        agent_mod.GATEWAY.stop()
