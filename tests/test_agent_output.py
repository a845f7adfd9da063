"""The output-stream mutations (``faults/agent/output.py``) against a stand-in for SGLang 0.5.23's
``_GenerationStreamAccumulator``: ``token_flip`` changes one token of a targeted reply before it is first
sent (never one already sent, never twice), ``meta_swap`` exchanges two targeted requests' prompt and
cached token counts when they are sent in one batch; neither touches anything while not armed."""

from __future__ import annotations

import types

import pytest

from faults.agent import output
from tests.agent_fakes import new_agent


def _module():
    class _GenerationStreamAccumulator:  # what output_streamer.py's accept/to_payload do with a request
        def __init__(self):
            self.rids, self.output_ids, self.prompt_tokens, self.cached_tokens = [], [], [], []

        def accept(self, *, req):
            self.rids.append(req.rid)
            self.output_ids.append(list(req.output_ids[req.send_token_offset:]))
            req.send_token_offset = len(req.output_ids)
            self.prompt_tokens.append(len(req.origin_input_ids))
            self.cached_tokens.append(req.cached_tokens)

        def to_payload(self):
            return {"rids": self.rids, "output_ids": self.output_ids, "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens}

    mod = types.ModuleType("stand_in_output_streamer")
    mod._GenerationStreamAccumulator = _GenerationStreamAccumulator
    output._hook_output(mod)
    return mod._GenerationStreamAccumulator


def _req(rid, n_in, out, cached=0):
    return types.SimpleNamespace(rid=rid, origin_input_ids=list(range(n_in)), output_ids=list(out),
                                 send_token_offset=0, cached_tokens=cached)


@pytest.fixture
def decode(tmp_path, monkeypatch):
    a = new_agent(tmp_path, monkeypatch, "decode")
    yield a
    a.heal()


def _step(cls, reqs):
    acc = cls()
    for r in reqs:
        acc.accept(req=r)
    return acc.to_payload()


def test_token_flip_changes_one_unsent_token_of_its_target_once(decode):
    cls = _module()
    decode.arm({"kind": "token_flip", "id": "tf", "target": {"rid": "v"}, "params": {"at": 2}})
    v, o = _req("v", 10, [40, 41]), _req("o", 10, [40, 41])
    assert _step(cls, [v, o])["output_ids"] == [[40, 41], [40, 41]]  # index 2 not produced yet
    v.output_ids.append(42)
    o.output_ids.append(42)
    assert _step(cls, [v, o])["output_ids"] == [[43], [42]]  # flipped as it is first sent; the other untouched
    v.output_ids.append(44)
    assert _step(cls, [v])["output_ids"] == [[44]]
    fired = [e for e in decode.events if e["ev"] == "fault_fired"]
    assert [(e["rid"], e["at"], e["old"], e["new"]) for e in fired] == [("v", 2, 42, 43)]


def test_token_flip_never_rewrites_a_token_already_sent_nor_writes_an_end_of_sequence(decode):
    cls = _module()
    decode.arm({"kind": "token_flip", "id": "tf", "target": {"tenant": "t1"}, "params": {"at": 0}})
    sent = _req("r1-000001-t1", 5, [7])
    sent.send_token_offset = 1  # a stream already sent its first token
    assert _step(cls, [sent])["output_ids"] == [[]]
    eos_next = _req("r1-000002-t1", 5, [3])  # 3 ^ 1 = 2 is </s>: another id
    assert _step(cls, [eos_next])["output_ids"] == [[3 ^ 4]]


def test_token_flip_refuses_a_bad_index():
    with pytest.raises(ValueError, match="params.at"):
        output._flip_check({"at": -1})


def test_meta_swap_exchanges_two_targets_counts_in_one_batch(decode):
    cls = _module()
    decode.arm({"kind": "meta_swap", "id": "ms", "target": {"rid_regex": "^(a|b)$"}, "params": {}})
    a, b, c = _req("a", 100, [1], cached=5), _req("b", 200, [1], cached=9), _req("c", 300, [1])
    p = _step(cls, [a, c, b])
    assert p["prompt_tokens"] == [200, 300, 100] and p["cached_tokens"] == [9, 0, 5]
    assert _step(cls, [a])["prompt_tokens"] == [100]  # alone in its batch: nothing to swap with
    (e,) = [e for e in decode.events if e["ev"] == "fault_fired"]
    assert (e["rid"], e["other"], e["swapped"]["prompt_tokens"]) == ("a", "b", [100, 200])


def test_nothing_changes_while_not_armed(decode):
    cls = _module()
    a, b = _req("a", 100, [1, 2, 3]), _req("b", 200, [4])
    assert _step(cls, [a, b]) == {"rids": ["a", "b"], "output_ids": [[1, 2, 3], [4]], "prompt_tokens": [100, 200],
                                  "cached_tokens": [0, 0]}
    decode.arm({"kind": "token_flip", "id": "tf", "target": {"rid": "a"}, "params": {"at": 0}})
    decode.heal("tf")
    assert output._ARMED["token_flip"] == 0


def test_faults_armed_at_boot_are_the_engine_as_built(decode, capsys):
    """KVCHAOS_AGENT_ARM: armed as the process starts, those of its role; a heal of everything and the
    harness's still-armed checks leave them; a bad list is said, never a crash."""
    import faults.agent as agent_mod

    ids = agent_mod.arm_at_boot('[{"kind": "token_flip", "target": {"tenant": "t003"}, "params": {"at": 5}, '
                                '"role": "decode"}, {"kind": "meta_swap", "role": "prefill"}]')
    assert len(ids) == 1 and decode.faults[ids[0]]["kind"] == "token_flip"
    assert decode.armed() == [] and decode.heal() == [] and ids[0] in decode.faults
    assert any(e["ev"] == "armed" and e.get("boot") for e in decode.events)
    assert agent_mod.arm_at_boot("{not json") == [] and "not a JSON list" in capsys.readouterr().err
    assert agent_mod.arm_at_boot('[{"kind": "token_flip", "params": {"at": -1}}]') == []
    assert "not armed" in capsys.readouterr().err
    decode.heal(ids[0])
