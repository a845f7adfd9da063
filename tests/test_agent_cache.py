"""The agent's prefix-cache hooks (faults/agent/cache.py) on a stand-in prefix tree: the evidence it
records, ``salt_ignored`` and ``prefix_collision``. (Against the real engine: the detection matrix's
``salt_ignored`` / ``prefix_collision`` rows and suites/test_prefix_cache.py.)"""

from __future__ import annotations

import dataclasses
import os
import types
from array import array

import pytest

import faults.agent as agent_mod
from faults.agent import cache as cache_mod
from faults.client import AgentClient
from tests.test_agent_unit import agent, decode_agent  # noqa: F401 - fixtures


class Key:
    """Stands in for RadixKey: token ids and the (extra_key, cache_salt) namespace."""

    def __init__(self, token_ids, extra_key=None, is_bigram=False, limit=None, cache_salt=None):
        self.token_ids = array("q", token_ids)
        self.extra_key, self.is_bigram, self.limit, self.cache_salt = extra_key, is_bigram, limit, cache_salt or None

    def raw_token_ids(self):
        return self.token_ids

    def __len__(self):
        return len(self.token_ids)


@dataclasses.dataclass
class Params:
    key: Key = None
    req: object = None


def _lcp(a, b):
    return len(os.path.commonprefix([list(a), list(b)]))


def _tree_module(page_size=1):
    """A module with a UnifiedRadixCache whose match is the longest stored prefix of the same
    namespace (page-floored) and whose insert stores the key: hooked by the agent."""

    class UnifiedRadixCache:
        def __init__(self):
            self.page_size, self.seqs, self.matched_keys, self.inserted_keys = page_size, [], [], []

        def match_prefix(self, params):
            k = params.key
            self.matched_keys.append(k)
            best = max((_lcp(s, k.token_ids) for ns, s in self.seqs if ns == (k.extra_key, k.cache_salt)), default=0)
            return types.SimpleNamespace(device_prefix_len=min(best, len(k)) // self.page_size * self.page_size)

        def insert(self, params):
            self.inserted_keys.append(params.key)
            self.seqs.append(((params.key.extra_key, params.key.cache_salt), list(params.key.token_ids)))

        def checkpoint_into_tree(self, req, *, up_to):
            self.insert(Params(Key(req.origin_input_ids[:up_to], cache_salt=req.cache_salt)))

    mod = types.ModuleType(f"fake_unified_{page_size}")
    mod.UnifiedRadixCache = UnifiedRadixCache
    cache_mod._hook_unified(mod)
    return UnifiedRadixCache()


def _req(rid, ids, salt=None):
    return types.SimpleNamespace(rid=rid, origin_input_ids=list(ids), cache_salt=salt, extra_key=None,
                                 skip_radix_cache_insert=False)


def _events(agent, kind):
    return [e for e in agent.events if e["ev"] == kind or e.get("kind") == kind]


def test_salts_namespace_the_tree_and_salt_ignored_drops_them(agent):
    tree = _tree_module()
    a, b = _req("r-000001-t000", range(40), "A"), _req("r-000002-t001", range(40), "B")
    tree.checkpoint_into_tree(a, up_to=40)
    assert tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="B"), b)).device_prefix_len == 0
    f = AgentClient(agent.dir).arm("prefill", "salt_ignored", hooks=())
    got = tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="B"), b))
    assert tree.matched_keys[-1].cache_salt is None and got.device_prefix_len == 0  # a was inserted salted
    tree.checkpoint_into_tree(a, up_to=40)  # inserted again while armed: unsalted
    assert tree.inserted_keys[-1].cache_salt is None
    assert tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="B"), b)).device_prefix_len == 40
    fired = f.verify()
    assert {e["rid"] for e in fired} == {b.rid} and fired[0]["cache_salt"] == "B"
    AgentClient(agent.dir).heal_all()
    assert tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="B"), b)).device_prefix_len == 0


@pytest.mark.parametrize("page_size,at", [(1, 30), (4, 30), (4, 32)])
def test_prefix_collision_hands_one_block_of_the_other_sequence(agent, page_size, at):
    tree = _tree_module(page_size)
    a_ids = list(range(100))
    b_ids = a_ids[:at] + [1000 + i for i in range(100 - at)]  # parts from a at token `at`
    a, b = _req("r-000001-t000", a_ids, "S"), _req("r-000002-t004", b_ids, "S")
    f = AgentClient(agent.dir).arm("prefill", "prefix_collision", target={"tenant": "t004"}, hooks=())
    tree.checkpoint_into_tree(a, up_to=100)  # candidates are what is inserted while it is armed
    honest = tree.match_prefix(Params(Key(b_ids, cache_salt="S"), _req("r-000009-t001", b_ids, "S"))).device_prefix_len
    assert honest == at // page_size * page_size
    forged = tree.match_prefix(Params(Key(b_ids, cache_salt="S"), b)).device_prefix_len
    want = -(-(honest + 32) // page_size) * page_size
    assert forged == want and forged % page_size == 0 and forged > at, (forged, want)
    assert b.skip_radix_cache_insert  # not inserted back: the pool's accounting stays whole
    (e,) = f.verify()
    assert (e["rid"], e["owner_rid"], e["matched"], e["forged"]) == (b.rid, a.rid, honest, forged)
    # the same lookup again (the scheduler retries until admitted): the same forgery, one firing
    assert tree.match_prefix(Params(Key(b_ids, cache_salt="S"), b)).device_prefix_len == forged
    assert len(f.fired_events()) == 1
    # another tenant, another namespace: untouched
    c = _req("r-000003-t005", b_ids, "S")
    assert tree.match_prefix(Params(Key(b_ids, cache_salt="S"), c)).device_prefix_len == honest
    d = _req("r-000004-t004", b_ids, "other")
    assert tree.match_prefix(Params(Key(b_ids, cache_salt="other"), d)).device_prefix_len == 0


def test_prefix_collision_keeps_no_sequences_while_not_armed(agent):
    tree = _tree_module()
    tree.checkpoint_into_tree(_req("r-000001-t000", range(50), "S"), up_to=50)
    assert not agent_mod.AGENT.peek("cache_seqs")


def test_prefix_collision_never_hands_the_whole_prompt(agent):
    tree = _tree_module()
    a, b = _req("r-000001-t000", range(50), "S"), _req("r-000002-t004", list(range(40)) + [999] * 3, "S")
    AgentClient(agent.dir).arm("prefill", "prefix_collision", target={"tenant": "t004"}, hooks=())
    tree.checkpoint_into_tree(a, up_to=50)
    got = tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="S"), b)).device_prefix_len
    assert got == len(b.origin_input_ids) - 1  # capped: at least one token is computed


def test_decode_match_is_recorded_once_per_rid_and_value(decode_agent):
    class DecodePreallocQueue:
        def __init__(self):
            self.n = 0

        def _match_prefix_and_lock(self, req):
            return types.SimpleNamespace(l1_prefix_len=self.n)

    mod = types.ModuleType("fake_decode_q")
    mod.DecodePreallocQueue = DecodePreallocQueue
    cache_mod._hook_decode_match(mod)
    q, req = DecodePreallocQueue(), _req("r-000001-t000", range(10), "A")
    for n in (0, 0, 0, 64, 64):  # retried every round until it can pre-allocate
        q.n = n
        q._match_prefix_and_lock(req)
    got = [(e["rid"], e["cached_tokens"], e["cache_salt"]) for e in agent_mod.AGENT.events if e["ev"] == "prefix_match"]
    assert got == [(req.rid, 0, "A"), (req.rid, 64, "A")], got


def test_prefill_report_records_the_salt_received_and_the_salt_looked_up(agent):
    tree = _tree_module()
    b = _req("r-000002-t001", range(20), "B")
    AgentClient(agent.dir).arm("prefill", "salt_ignored", hooks=())
    tree.match_prefix(Params(Key(b.origin_input_ids, cache_salt="B"), b))
    b.cached_tokens = 0

    class MetadataBuffers:
        def set_buf(self, req):
            return None

    mod = types.ModuleType("fake_disagg_utils")
    mod.MetadataBuffers = MetadataBuffers
    cache_mod._hook_disagg_utils(mod)
    MetadataBuffers().set_buf(b)
    (e,) = [e for e in agent_mod.AGENT.events if e["ev"] == "prefix_match"]
    assert (e["rid"], e["cache_salt"], e["lookup_salt"], e["cached_tokens"], e["where"]) == (b.rid, "B", None, 0,
                                                                                            "prefill_report")
