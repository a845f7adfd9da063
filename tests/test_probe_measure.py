"""Stale-KV reconstruction from the agent's transfer events (no cluster), the decode page indices the
agent puts in those events, and the probe benchmark's argument parsing."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import faults.agent as agent_mod
from faults.client import AgentClient
from kvchaos import canary
from kvchaos.probe.measure import judge_stale_trial, stale_canaries, stale_map

REPO = Path(__file__).resolve().parents[1]
C = "[KQ2ZMX7ABD]"  # a donor's canary
OWN = "[AB3CDEFGHJ]"


def _donor(n: int, at: int, c: str = C) -> str:
    """A donor prompt of ``n`` filler characters with canary ``c`` at position ``at``."""
    text = "x" * at + c + "y" * (n - at - len(c))
    assert len(text) == n and text[at:at + 12] == c
    return text


class Log:
    """Synthetic prefill agent events in the order they happen."""

    def __init__(self, page_size: int):
        self.ps, self.events, self.wall = page_size, [], 100.0

    def _ev(self, ev, rid, **kw):
        self.wall += 0.01
        self.events.append({"ev": ev, "rid": rid, "wall": self.wall, "role": "prefill", "page_size": self.ps, **kw})

    def write(self, rid, pages, offset=0, ret=0, total=None):
        """A donor's chunk: transfer_start on its first chunk, then write_end of every page."""
        if offset == 0:
            self._ev("transfer_start", rid, dst_pages=list(pages), dst_pages_total=len(pages), dst_page_offset=0)
        self._ev("write_end", rid, ret=ret, dst_pages=list(pages),
                 dst_pages_total=len(pages) if total is None else total, dst_page_offset=offset)

    def victim(self, rid, reserved, keep):
        """The victim's transfer cut short: ``keep`` pages of ``reserved`` written."""
        self._ev("transfer_start", rid, dst_pages=list(reserved), dst_pages_total=len(reserved), dst_page_offset=0)
        self._ev("fault_fired", rid, kind="short", pages_sent=keep, pages_reserved=len(reserved),
                 dst_pages=list(reserved), dst_pages_total=len(reserved), dst_page_offset=0)
        self._ev("write_end", rid, ret=0, dst_pages=list(reserved[:keep]), dst_pages_total=keep, dst_page_offset=0)


# ------------------------------------------------------------------ page size 64
def test_page64_canary_across_a_page_boundary_with_pages_out_of_order_excludes_the_trial():
    """Donor pages 0 and 1 land in the victim's stale pages 2 and 1: the canary the donor had across
    its page boundary (positions 58..69) is split and reversed in the victim — not a whole canary
    there, so the trial is excluded even though the reply happens to contain the payload."""
    donor = _donor(128, 58)
    log = Log(64)
    log.write("d1-t001", [7], offset=0)  # the donor in two chunks: its page 0 -> decode page 7
    log.write("d1-t001", [8], offset=1)  # its page 1 -> decode page 8
    log.victim("v-t002", reserved=[3, 8, 7], keep=1)
    smap = stale_map(log.events, "v-t002")
    assert smap.stale_pages == [1, 2] and smap.written == {0} and smap.unknown == 0
    assert smap.slots[64] == ("d1-t001", 64) and smap.slots[128] == ("d1-t001", 0)
    verdict = judge_stale_trial(smap, {"d1-t001": donor}, 192, OWN[1:] + "][" + canary.payload(C) + "][")
    assert verdict["eligible"] is False and verdict["hit"] is False and verdict["whole"] == []


def test_page64_whole_canary_in_order_counts_and_its_recital_is_a_hit():
    donor = _donor(128, 58)  # across the donor's page boundary, but the pages stay in order
    other = _donor(100, 10, "[ZZ2ZMX7ABD]")
    log = Log(64)
    log.write("d2-t004", [5, 6])  # written first, then overwritten below: not the last writer of 7
    log.write("d1-t001", [7, 8])
    log.write("d2-t004", [9])  # page 9 is not the victim's
    log.victim("v-t002", reserved=[3, 7, 8], keep=1)
    smap = stale_map(log.events, "v-t002")
    whole = stale_canaries(smap, {"d1-t001": donor, "d2-t004": other}, 192)
    assert [(w.rid, w.canary, w.victim_pos, w.donor_pos) for w in whole] == [("d1-t001", C, 64 + 58, 58)]
    hit = judge_stale_trial(smap, {"d1-t001": donor}, 192, OWN[1:] + "][" + canary.payload(C) + "][")
    assert hit["eligible"] and hit["hit"] and hit["recited"] == [C]
    miss = judge_stale_trial(smap, {"d1-t001": donor}, 192, OWN[1:] + "][")
    assert miss["eligible"] and not miss["hit"]
    # the victim's prompt ends inside the canary: positions past it are decode's own tokens
    assert stale_canaries(smap, {"d1-t001": donor}, 64 + 58 + 11) == []


# ------------------------------------------------------------------ page size 1
def test_page1_whole_canary_in_consecutive_stale_slots_is_a_hit():
    donor = _donor(40, 14)
    log = Log(1)
    log.write("d1-t001", range(100, 140))  # token i of the donor -> decode slot 100 + i
    reserved = list(range(200, 232)) + list(range(100, 132))  # 32 written slots, then donor tokens 0..31
    log.victim("v-t002", reserved=reserved, keep=32)
    smap = stale_map(log.events, "v-t002")
    assert len(smap.stale_pages) == 32 and smap.slots[32] == ("d1-t001", 0)
    verdict = judge_stale_trial(smap, {"d1-t001": donor}, 64, OWN[1:] + "][" + canary.payload(C) + "][")
    assert verdict["eligible"] and verdict["hit"] and verdict["whole"] == [C]


def test_page1_donor_slots_out_of_order_exclude_the_trial():
    donor = _donor(40, 14)
    log = Log(1)
    log.write("d1-t001", range(100, 140))
    reserved = list(range(200, 232)) + list(range(131, 99, -1))  # the donor's tokens, reversed
    log.victim("v-t002", reserved=reserved, keep=32)
    smap = stale_map(log.events, "v-t002")
    verdict = judge_stale_trial(smap, {"d1-t001": donor}, 64, canary.payload(C))
    assert not verdict["eligible"] and not verdict["hit"]
    assert verdict["any_donor_canary_in_reply"] == [C]  # reported, but the trial does not count


# ------------------------------------------------------------------ what is not known
def test_writes_before_the_trial_or_incomplete_or_failed_are_not_known():
    donor = _donor(40, 14)
    log = Log(1)
    log.write("d0-t009", range(100, 140))  # before the trial began: decode may have overwritten it since
    since = log.wall + 0.001
    log.write("d1-t001", range(100, 120))  # this trial: the first 20 slots
    log.victim("v-t002", reserved=list(range(200, 232)) + list(range(100, 140)), keep=32)
    smap = stale_map(log.events, "v-t002", since=since)
    assert smap.slots[32] == ("d1-t001", 0) and 32 + 25 not in smap.slots and smap.unknown == 20
    assert stale_canaries(smap, {"d1-t001": donor, "d0-t009": donor}, 72) == []  # slots 32+20.. unknown
    # without `since` the older donor is the last writer of slots 120..139
    assert stale_map(log.events, "v-t002").slots[32 + 25] == ("d0-t009", 25)

    log = Log(1)
    log.write("d1-t001", range(100, 140))
    log.write("d2-t003", range(300, 304), total=5000)  # page list cut at the agent's bound
    log.write("d3-t004", range(120, 130), ret=-1)  # a write that did not succeed
    log.victim("v-t002", reserved=list(range(200, 232)) + list(range(100, 140)), keep=32)
    smap = stale_map(log.events, "v-t002")
    assert smap.resets == 1 and smap.slots == {} and smap.unknown == 40


def test_writes_after_the_victims_transfer_began_are_ignored_and_no_events_is_none():
    donor = _donor(40, 14)
    log = Log(1)
    log.write("d1-t001", range(100, 140))
    log.victim("v-t002", reserved=list(range(200, 232)) + list(range(100, 140)), keep=32)
    log.write("d9-t009", range(100, 140))  # after: not what decode read
    smap = stale_map(log.events, "v-t002")
    assert smap.slots[32 + 14] == ("d1-t001", 14)
    assert stale_map(log.events, "nobody") is None
    assert judge_stale_trial(None, {"d1-t001": donor}, 72, "x")["eligible"] is False


# ------------------------------------------------------------------ the agent's events
@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_mod.control, "ROLE", "prefill")
    a = agent_mod.Agent(str(tmp_path))
    monkeypatch.setattr(agent_mod.control, "AGENT", a)
    a.serve()
    yield a
    a._srv.shutdown()
    a._srv.server_close()


def test_agent_events_carry_decode_pages_offsets_and_the_short_cut(agent, monkeypatch):
    class Mgr:
        kv_args = types.SimpleNamespace(page_size=64)

        def send_kvcache(self, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None):
            return 0

    Mgr.send_kvcache = agent_mod._make_send(Mgr.send_kvcache, "mooncake")
    m = Mgr()
    ctl = AgentClient(agent.dir)
    with agent.lock:
        agent.room_rid[31] = "v-t002"
        agent.room_rid[32] = "d1-t001"
    ctl.arm("prefill", "short", target={"rid": "v-t002"}, params={"pages": 1}, count=100, hooks=())
    for room, off, dst in ((32, 0, [7]), (32, 1, [8]), (31, 0, [3, 8, 7])):
        agent.tls.chunk = types.SimpleNamespace(room=room, index_slice=slice(off, off + len(dst)), is_last_chunk=True)
        assert m.send_kvcache("s", np.arange(len(dst)), [0], np.array(dst, dtype=np.int64)) == 0
    ev = ctl.events("prefill")
    start = next(e for e in ev if e["ev"] == "transfer_start" and e["rid"] == "v-t002")
    assert (start["dst_pages"], start["dst_pages_total"], start["dst_page_offset"]) == ([3, 8, 7], 3, 0)
    assert all(type(p) is int for p in start["dst_pages"])
    ends = [(e["rid"], e["dst_pages"], e["dst_page_offset"]) for e in ev if e["ev"] == "write_end"]
    assert ends == [("d1-t001", [7], 0), ("d1-t001", [8], 1), ("v-t002", [3], 0)]  # the victim's cut to 1 page
    smap = stale_map(ev, "v-t002")  # the same reconstruction as from the synthetic log
    assert smap.slots[64] == ("d1-t001", 64) and smap.slots[128] == ("d1-t001", 0)

    monkeypatch.setattr(agent_mod.transfer, "DST_PAGES_MAX", 2)  # bounded: first entries and the count
    agent.tls.chunk = types.SimpleNamespace(room=33, index_slice=slice(0, 5), is_last_chunk=True)
    m.send_kvcache("s", np.arange(5), [0], np.arange(40, 45))
    big = [e for e in ctl.events("prefill") if e.get("room") == 33]
    assert {(e["ev"], tuple(e["dst_pages"]), e["dst_pages_total"]) for e in big} == {
        ("transfer_start", (40, 41), 5), ("write_end", (40, 41), 5)}


# ------------------------------------------------------------------ the benchmark's arguments
def _bench():
    spec = importlib.util.spec_from_file_location("bench_probe_model", REPO / "bench" / "probe_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_probe_model", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bad, says", [
    ("xyz-p64-bf16", "attention 'xyz' is not one of"),
    ("mla64", "expected <attention>-p<page size>-<dtype>"),
    ("mla-p64-int8", "dtype 'int8' is not one of"),
])
def test_bench_rejects_a_bad_layout_with_a_clear_message(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().parse_args(["--layout", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"layout {bad!r}" in err and says in err


def test_bench_applies_the_layout_and_sizes_the_pool():
    a = _bench().parse_args(["--layout", "mla-p64-bf16", "--quick", "--backend", "mooncake_tcp"])
    s = a.spec
    assert a.layout == "mla-p64-bf16" and (s.model, s.page_size, s.dtype) == ("probe:mla", 64, "bfloat16")
    assert s.pool_tokens == 8192 and s.pool_tokens >= 2 * s.context_length and s.transfer_backend == "mooncake_tcp"
    assert (a.echo, a.contamination, a.stale) == (50, 50, 20)
    d = _bench().parse_args([])
    assert d.layout == "mha-p1-fp32" and d.spec.model == "probe"  # the profile's own
    odd = _bench().parse_args(["--layout", "gqa-p48-fp32"])  # the pool rounds up to whole pages
    assert odd.spec.pool_tokens % 48 == 0 and odd.spec.pool_tokens >= 8192
