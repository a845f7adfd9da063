"""Stand-ins and fixtures shared by the agent's unit tests (tests/test_agent_*.py): a stand-in KV
manager, a live agent serving its control socket for prefill or decode, and one hooked KV write."""

from __future__ import annotations

import types

import numpy as np
import pytest

import faults.agent as agent_mod


class FakeManager:
    """Stands in for MooncakeKVManager: send_kvcache records what it was asked to write."""

    def __init__(self):
        self.calls = []
        self.request_status = {}

    def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None):
        self.calls.append((session_id, list(prefill_kv_indices), list(dst_kv_indices)))
        return 0

    def check_status(self, room):
        return self.request_status[room]


def new_agent(tmp_path, monkeypatch, role):
    """An agent of ``role`` in a directory of its own, installed as the process's agent (not serving)."""
    d = tmp_path / f"ag-{role}"
    d.mkdir()
    monkeypatch.setattr(agent_mod.control, "ROLE", role)
    a = agent_mod.Agent(str(d))
    monkeypatch.setattr(agent_mod.control, "AGENT", a)
    return a


def start_agent(tmp_path, monkeypatch, role):
    """:func:`new_agent`, serving its control socket."""
    a = new_agent(tmp_path, monkeypatch, role)
    a.serve()
    return a


@pytest.fixture(params=["prefill"])
def agent(request, tmp_path, monkeypatch):
    a = start_agent(tmp_path, monkeypatch, request.param)
    yield a
    a._srv.shutdown()
    a._srv.server_close()


decode_agent = pytest.fixture(params=["decode"], name="decode_agent")(agent.__wrapped__)


@pytest.fixture
def mgr(agent):
    cls = type("FakeManager", (FakeManager,), {})
    cls.send_kvcache = agent_mod._make_send(FakeManager.send_kvcache, "mooncake")
    return cls()


def send_chunk(mgr, room, rid, n=8):
    agent_mod.AGENT.tls.chunk = types.SimpleNamespace(room=room, index_slice=slice(0, n), is_last_chunk=True)
    with agent_mod.AGENT.lock:
        agent_mod.AGENT.room_rid[room] = rid
    idx = np.arange(n, dtype=np.int32)
    return mgr.send_kvcache("sess", idx, [0], idx + 100)
