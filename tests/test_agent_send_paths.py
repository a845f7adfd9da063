"""The agent's hooks on every KV write path, on stand-in managers: paged transfers (page indices,
``page_size`` in the events), HiSparse's device destination list, Mooncake's MLA ``send_kvcache_dcp``
and NIXL's peer paths — each with the same evidence and the ``short`` / ``fail`` faults."""

from __future__ import annotations

import types

import numpy as np
import pytest

import faults.agent as agent_mod
from faults.client import AgentClient

from tests.agent_fakes import FakeManager, agent, send_chunk  # noqa: F401 - fixtures


def _paged_mgr(agent, page_size=16):
    cls = type("PagedManager", (FakeManager,), {})
    cls.send_kvcache = agent_mod._make_send(FakeManager.send_kvcache, "mooncake")
    m = cls()
    m.kv_args = types.SimpleNamespace(page_size=page_size)
    return m


def test_transfer_events_count_pages_and_say_the_page_size(agent):
    """With page size > 1 SGLang hands the KV write page indices (kv_to_page_indices): the events'
    pages, the short fault's pages and write_end's pages are KV pages, and the events carry page_size."""
    m = _paged_mgr(agent)
    ctl = AgentClient(agent.dir)
    s = ctl.arm("prefill", "short", target={"room": 21}, params={"pages": 2}, hooks=())
    assert send_chunk(m, 21, "p16", n=5) == 0  # a 70-token prompt: 5 pages of 16
    assert m.calls[-1][1] == [0, 1] and m.calls[-1][2] == [100, 101]
    ev = ctl.events("prefill")
    start = next(e for e in ev if e["ev"] == "transfer_start" and e["room"] == 21)
    end = next(e for e in ev if e["ev"] == "write_end" and e["room"] == 21)
    assert (start["pages"], start["reserved"], start["page_size"]) == (5, 5, 16)
    assert (end["pages"], end["page_size"]) == (5, 16) and "path" not in end
    fired = s.verify()[0]
    assert (fired["pages_sent"], fired["pages_reserved"], fired["page_size"]) == (2, 5, 16)


def test_short_cuts_every_destination_list_of_the_hisparse_send(agent):
    seen = {}

    class M(FakeManager):
        def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None,
                         dst_device_kv_indices=None):
            seen["dev"] = list(dst_device_kv_indices)
            return super().send_kvcache(session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices)

    M.send_kvcache = agent_mod._make_send(M.send_kvcache, "mooncake")
    m = M()
    AgentClient(agent.dir).arm("prefill", "short", target={"room": 22}, params={"pages": 3}, hooks=())
    agent.tls.chunk = types.SimpleNamespace(room=22, index_slice=slice(0, 6), is_last_chunk=True)
    idx = np.arange(6, dtype=np.int32)
    assert m.send_kvcache("s", idx, [0], idx + 100, None, dst_device_kv_indices=idx + 500) == 0
    assert m.calls[-1][1] == [0, 1, 2] and seen["dev"] == [500, 501, 502]


def test_mla_dcp_send_is_hooked_and_short_keeps_the_whole_destination(agent):
    """Mooncake's send_kvcache_dcp (MLA with decode context parallel) is a second KV write path:
    same evidence and faults; its destination list is the request's whole reservation, so short cuts
    the source pages and num_kv_tokens only."""
    calls = []

    class M(FakeManager):
        def send_kvcache_dcp(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *,
                             num_kv_tokens, src_page_offset=0, executor=None):
            calls.append((list(prefill_kv_indices), list(dst_kv_indices), num_kv_tokens))
            return 0

    M.send_kvcache_dcp = agent_mod._make_send_dcp(M.send_kvcache_dcp, "mooncake")
    m = M()
    m.kv_args = types.SimpleNamespace(page_size=64)
    ctl = AgentClient(agent.dir)
    s = ctl.arm("prefill", "short", target={"room": 23}, params={"pages": 1}, hooks=())
    agent.tls.chunk = types.SimpleNamespace(room=23, index_slice=slice(0, 3), is_last_chunk=True)
    src, dst = np.arange(3, dtype=np.int32), np.arange(6, dtype=np.int32) + 100
    assert m.send_kvcache_dcp("s", src, [0], dst, num_kv_tokens=150, src_page_offset=0) == 0
    assert calls[-1] == ([0], list(range(100, 106)), 64)
    fired = s.verify()[0]
    assert fired["path"] == "send_kvcache_dcp" and fired["pages_sent"] == 1 and fired["page_size"] == 64
    start = next(e for e in ctl.events("prefill") if e["ev"] == "transfer_start" and e["room"] == 23)
    assert start["path"] == "send_kvcache_dcp" and start["pages"] == 3
    # not shorted: passed through untouched
    agent.tls.chunk = types.SimpleNamespace(room=24, index_slice=slice(0, 3), is_last_chunk=True)
    assert m.send_kvcache_dcp("s", src, [0], dst, num_kv_tokens=150) == 0
    assert calls[-1] == ([0, 1, 2], list(range(100, 106)), 150)


def test_nixl_peer_paths_fail_by_raising_and_short_both_lists(agent):
    """NIXL's send_kvcache_mixed / send_kvcache_slice (peer, src, dst): hooked like send_kvcache."""
    calls = []

    class M(FakeManager):
        def send_kvcache_mixed(self, peer_name, prefill_kv_indices, dst_kv_indices):
            calls.append((list(prefill_kv_indices), list(dst_kv_indices)))
            return ["handle"]

    M.send_kvcache_mixed = agent_mod._make_send_peer(M.send_kvcache_mixed, "nixl")
    m = M()
    ctl = AgentClient(agent.dir)
    ctl.arm("prefill", "short", target={"room": 25}, params={"pages": 2}, hooks=())
    f = ctl.arm("prefill", "fail", target={"room": 26}, hooks=())
    idx = np.arange(4, dtype=np.int32)
    agent.tls.chunk = types.SimpleNamespace(room=25, index_slice=slice(0, 4), is_last_chunk=True)
    assert m.send_kvcache_mixed("peer", idx, idx + 10) == ["handle"]
    assert calls[-1] == ([0, 1], [10, 11])
    agent.tls.chunk = types.SimpleNamespace(room=26, index_slice=slice(0, 4), is_last_chunk=True)
    with pytest.raises(RuntimeError, match="kvchaos injected"):
        m.send_kvcache_mixed("peer", idx, idx + 10)
    assert len(calls) == 1 and f.verify()[0]["room"] == 26
    end = [e for e in ctl.events("prefill") if e["ev"] == "write_end" and e["room"] == 25]
    assert end[0]["ret"] == "handles" and end[0]["path"] == "send_kvcache_mixed"
