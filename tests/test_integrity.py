"""The exact-reply oracle (``kvchaos.oracles.integrity``) and the contract it holds replies to
(``kvchaos.probe.contract``): where each must FAIL (one token changed at the first, a middle or the last
position; a reply right for another prompt; a canary dropped; metadata of another request; a stream
chunk that differs; text where the probe has none) and where it must PASS (every endpoint and delivery,
replies cut short that are the beginning of what they must be), and what it does not judge, said."""

from __future__ import annotations

import json
import random

import pytest

from kvchaos import canary, oracles
from kvchaos.oracles import FAIL, PASS, UNKNOWN
from kvchaos.probe import contract, prompt
from kvchaos.workload import Workload

EOS = 2
VOCAB_IDS = None


def ids(text: str) -> list[int]:
    global VOCAB_IDS
    if VOCAB_IDS is None:
        from kvchaos.model import char_vocab

        VOCAB_IDS = char_vocab()
    return [VOCAB_IDS[c] for c in text]


def header(model="probe"):
    return {"ev": "experiment", "schema": 2, "id": "x", "wall": 100.0,
            "engine": {"name": "sglang", "version": "0.5.23"},
            "layout": {"kv_layout": "mha-p1-fp32", "spec": {"model": model, "page_size": 1}}}


def reply(p, text=None, *, status=200, outcome="ok", finish="stop", meta=None, stream=False, raw=None):
    """The records the driver writes for plan ``p`` answered with ``text`` (default: what it must be)."""
    want = contract.expected(p.prompt).text
    text = want if text is None else text
    eos = [EOS] if finish == "stop" else []
    m = {"id": p.rid, "finish_reason": {"type": finish, **({"matched": EOS} if finish == "stop" else {})},
         "prompt_tokens": len(p.prompt), "completion_tokens": len(text) + len(eos), "cached_tokens": 0}
    m.update(meta or {})
    if raw is None:
        raw = json.dumps({"text": text, "output_ids": ids(text) + eos, "meta_info": m})
    return [{"ev": "send", "rid": p.rid, "wall": 101.0},
            {"ev": "status", "rid": p.rid, "status": status},
            {"ev": "body", "rid": p.rid, "text": text, "output_ids": ids(text) + eos, "meta": m, "raw": raw,
             "complete": outcome == "ok"},
            {"ev": "end", "rid": p.rid, "outcome": outcome, "latency_s": 0.3, "status": status, "wall": 101.5}]


def plans(n=30, seed=3, **kw):
    wl = Workload(seed, n_tenants=4, prefix="i")
    return [wl.request(wl.tenants[i % 4], n_tokens=200 + 7 * i, **kw) for i in range(n)]


def log(ps, override=None, model="probe"):
    """A header, the plans and their replies; ``override``: rid -> the records of that request instead."""
    override = override or {}
    ev = [header(model)] + [{"ev": "plan", "rid": p.rid, **{k: v for k, v in p.to_dict().items() if k != "rid"}}
                            for p in ps]
    for p in ps:
        ev += override.get(p.rid) or reply(p)
    return ev


def flip(text: str, at: int) -> str:
    """``text`` with the character at ``at`` changed to another canary character."""
    c = text[at]
    other = "Q" if c != "Q" else "R"
    return text[:at] + other + text[at + 1:]


# ------------------------------------------------------------------ the contract
def test_the_recital_is_in_alphabet_order_each_canary_once():
    cs = ["[7AAAAAAAAA]", "[BCDEFGHIJK]", "[2ZZZZZZZZZ]", "[BCDEFGHIJK]"]
    assert contract.recital(cs) == "BCDEFGHIJK][2ZZZZZZZZZ][7AAAAAAAAA]["  # A-Z, then 2-7: not ASCII order
    rng = random.Random(1)
    cs = canary.mint(rng, 3)
    c = contract.expected(prompt(rng, 300, cs))
    assert c.defined and c.text == contract.recital(cs) and c.head == 300 and c.tokens == 37


def test_colliding_canaries_have_no_defined_recital():
    rng = random.Random(2)
    a = canary.mint(rng, 1)[0]
    same_first = "[" + a[1] + "QQQQRRRRS]"
    c = contract.expected(prompt(rng, 300, [a, same_first]))
    assert not c.defined and "first character" in c.why
    shared_trigram = "[" + ("B" if a[1] != "B" else "C") + a[2:5] + "777777]"
    c = contract.expected(prompt(rng, 300, [a, shared_trigram]))
    assert not c.defined and "trigram" in c.why
    # the same canary twice (a conversation repeats its turns) is one canary: defined
    text = prompt(rng, 300, [a])
    c = contract.expected(text[:100] + " " + a + " " + text[100:])
    assert c.defined and c.text == contract.recital([a])


def test_a_canary_next_to_the_trigger_or_no_trigger_is_not_defined():
    rng = random.Random(3)
    cs = canary.mint(rng, 1)
    assert "ends within" in contract.expected("the " * 5 + cs[0] + " [").why
    assert "trigger" in contract.expected(prompt(rng, 100, cs)[:-1]).why


def test_a_truncated_head_recites_the_canaries_it_kept_after_a_bracket_of_its_own():
    rng = random.Random(4)
    cs = canary.mint(rng, 3)
    text = prompt(rng, 900, cs)
    at = sorted(text.index(c) for c in cs)
    keep = at[1] + 12 + 20  # the second canary whole, 20 characters of filler after it
    c = contract.truncated(text, keep)
    kept = [x for x in cs if text.index(x) + 12 <= keep]
    assert c.defined and c.text == "[" + contract.recital(kept) and len(kept) == 2
    assert not contract.truncated(text, at[1] + 5).defined  # through a canary
    assert not contract.truncated(text, at[1] + 14).defined  # right after one: read as already recited
    with pytest.raises(ValueError):
        contract.truncated(text, 900)


# ------------------------------------------------------------------ PASS
def test_clean_replies_of_every_shape_pass():
    ps = plans(40)
    over = {}
    p = ps[3]  # cut by its token limit: the beginning of what it must be
    text = contract.expected(p.prompt).text[:20]
    over[p.rid] = reply(p, text, finish="length")
    p = ps[4]  # the client left: what arrived is the beginning
    over[p.rid] = reply(p, contract.expected(p.prompt).text[:7], outcome="aborted", finish="abort")
    p = ps[5]  # an error reply: nothing to judge
    over[p.rid] = reply(p, "", status=503, outcome="http_error", finish="abort")
    v = oracles.integrity(log(ps, over))
    assert v.status == PASS, v
    assert v.stats["whole"] == 37 and v.stats["beginning"] == 2 and v.stats["not_judged"] == {
        "an error reply (no model text)": 1}


def test_a_planted_prompt_is_held_to_the_recital_of_what_it_carries():
    """The self-test plants a donor's prompt into a victim's: the victim must then recite both."""
    from faults.request import plant_leak

    ps = plans(10)
    plant_leak(ps[1], ps[0])
    v = oracles.integrity(log(ps))
    assert v.status == PASS, v
    assert contract.expected(ps[1].prompt).canaries == tuple(sorted(set(ps[0].canaries + ps[1].canaries),
                                                                     key=lambda c: canary.ALPHABET.index(c[1])))


# ------------------------------------------------------------------ FAIL
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_token_changed_anywhere_is_a_fail_naming_the_reply_and_the_position(where):
    ps = plans()
    p = ps[7]
    want = contract.expected(p.prompt).text
    at = {"first": 0, "middle": len(want) // 2, "last": len(want) - 1}[where]
    v = oracles.integrity(log(ps, {p.rid: reply(p, flip(want, at))}))
    assert v.status == FAIL, v
    (w,) = v.witnesses
    assert w["rid"] == p.rid and w["position"] == at and w["tenant"] == p.tenant, w
    assert w["expected"] and w["got"] and w["expected"] != w["got"]
    if where == "last":  # the closing bracket changed: no canary character touched, isolation has nothing to see
        assert oracles.isolation(log(ps, {p.rid: reply(p, flip(want, at))})).status != FAIL


def test_a_reply_right_for_another_prompt_names_that_request():
    ps = plans()
    a, b = ps[2], ps[9]
    v = oracles.integrity(log(ps, {a.rid: reply(a, contract.expected(b.prompt).text)}))
    assert v.status == FAIL
    (w,) = v.witnesses
    assert w["rid"] == a.rid and w["owner_rid"] == b.rid and "exactly what" in w["owner_how"]


def test_a_dropped_canary_and_a_foreign_fragment_are_fails():
    ps = plans()
    p, q = ps[5], ps[11]
    want = contract.expected(p.prompt).text
    v = oracles.integrity(log(ps, {p.rid: reply(p, want[12:])}))  # its first canary dropped
    assert v.status == FAIL and v.witnesses[0]["position"] == 0
    # seven characters of another request's canary in place of one of its own: not a whole canary
    frag = canary.payload(q.canaries[0])[:7]
    v = oracles.integrity(log(ps, {p.rid: reply(p, frag + want[7:])}))
    assert v.status == FAIL and v.witnesses[0]["owner_rid"] == q.rid, v.witnesses


@pytest.mark.parametrize("field,value", [("id", "OTHER"), ("prompt_tokens", 17), ("completion_tokens", 3),
                                         ("cached_tokens", 10_000)])
def test_metadata_that_is_not_the_requests_own_is_a_fail(field, value):
    ps = plans()
    p = ps[4]
    if value == "OTHER":
        value = ps[8].rid
    v = oracles.integrity(log(ps, {p.rid: reply(p, meta={field: value})}))
    assert v.status == FAIL, v
    (w,) = v.witnesses
    assert w["rid"] == p.rid and w["field"] == field and w["got"] == str(value)
    if field == "id":
        assert w["owner_rid"] == ps[8].rid


def test_output_ids_that_are_not_the_text_are_a_fail():
    ps = plans()
    p = ps[6]
    recs = reply(p)
    recs[2]["output_ids"] = ids(flip(recs[2]["text"], 3)) + [EOS]
    v = oracles.integrity(log(ps, {p.rid: recs}))
    assert v.status == FAIL and v.witnesses[0]["position"] == 3 and "output_ids" in v.witnesses[0]["view"]


def test_a_stream_chunk_that_differs_is_a_fail_even_when_the_last_one_is_right():
    ps = plans()
    p = ps[8]
    want = contract.expected(p.prompt).text
    chunks = [want[:5], flip(want[:12], 9), want]  # the middle chunk showed a wrong character
    raw = "".join(f"data: {json.dumps({'text': t})}\n\n" for t in chunks) + "data: [DONE]\n\n"
    v = oracles.integrity(log(ps, {p.rid: reply(p, stream=True, raw=raw)}))
    assert v.status == FAIL and v.witnesses[0]["position"] == 9 and "stream chunk" in v.witnesses[0]["view"]


def test_model_text_in_reasoning_content_is_a_fail():
    ps = plans()
    p = ps[2]
    want = contract.expected(p.prompt).text
    raw = json.dumps({"choices": [{"message": {"content": want, "reasoning_content": "ABCDEFGH"}}]})
    v = oracles.integrity(log(ps, {p.rid: reply(p, raw=raw)}))
    assert v.status == FAIL and "reasoning_content" in v.witnesses[0]["field"]


def test_a_reply_cut_short_must_still_be_the_beginning_of_what_it_must_be():
    ps = plans()
    p = ps[1]
    want = contract.expected(p.prompt).text
    v = oracles.integrity(log(ps, {p.rid: reply(p, flip(want, 5)[:9], outcome="cut", finish="abort")}))
    assert v.status == FAIL and v.witnesses[0]["contract"] == "beginning of the reply"


def test_an_oversized_prompt_answered_as_if_read_whole_must_recite_it_whole():
    """The GLM-5.3 class: a 200 whose engine says it read the whole prompt but decoded over pages it never
    had. Integrity fails it whether or not the stale pages held a canary (a bare '[' reply too)."""
    ps = plans()
    wl = Workload(9, n_tenants=4, prefix="o")
    big = wl.request(wl.tenants[0], "oversized", n_tokens=900, n_canaries=3)
    v = oracles.integrity(log(ps + [big], {big.rid: reply(big, "[")}))
    assert v.status == FAIL and v.witnesses[0]["rid"] == big.rid
    # an engine that truncated it (auto-truncate) says so in prompt_tokens: held to the head's contract
    keep = next(k for k in range(400, 600) if contract.truncated(big.prompt, k).defined)
    head = contract.truncated(big.prompt, keep).text
    v = oracles.integrity(log(ps + [big], {big.rid: reply(big, head, meta={"prompt_tokens": keep})}))
    assert v.status == PASS, v


# ------------------------------------------------------------------ not judged, UNKNOWN
def test_what_cannot_be_judged_is_said_and_too_little_judged_is_unknown():
    ps = plans(10)
    for p in ps[:8]:
        p.expect_echo = False
    v = oracles.integrity(log(ps))
    assert v.status == UNKNOWN and "2 replies judged of 10" in v.summary
    assert v.stats["not_judged"] == {"not a probe prompt (its plan says it is not built to be recited)": 8}


def test_a_real_model_is_judged_against_a_reference_or_not_at_all():
    ps = plans(6)
    v = oracles.integrity(log(ps, model="/models/llama"))
    assert v.status == UNKNOWN and "no reference" in v.summary
    ref = {p.rid: {"output_ids": ids(contract.expected(p.prompt).text) + [EOS]} for p in ps}
    assert oracles.Integrity(reference=ref).check(log(ps, model="/models/llama")).status == PASS
    p = ps[2]
    bad = log(ps, {p.rid: reply(p, flip(contract.expected(p.prompt).text, 4))}, model="/models/llama")
    v = oracles.Integrity(reference=ref).check(bad)
    assert v.status == FAIL and v.witnesses[0]["position"] == 4
    # the reference's top two tokens within tie_nats at that position: a numerical near-tie, not a fail
    ref[p.rid]["top2_margin"] = [1.0] * 4 + [0.01] + [1.0] * 40
    v = oracles.Integrity(reference=ref).check(bad)
    assert v.status == PASS and v.stats["not_judged"] == {"judged up to a numerical near-tie of the reference": 1}


def test_a_long_context_copy_of_the_probe_is_a_probe():
    ps = plans(4)
    v = oracles.integrity(log(ps, model="/root/.cache/kvchaos/models/probe-mla-c08639a35f74-ctx1048576"))
    assert v.stats["probe_contract"] is True and v.status == PASS


# ------------------------------------------------------------------ attacks: rewriting the log
def test_a_log_without_its_prompts_still_holds_replies_to_the_plans_canaries():
    ps = plans()
    p = ps[3]
    ev = log(ps, {p.rid: reply(p, flip(contract.expected(p.prompt).text, 2))})
    for e in ev:
        if e.get("ev") == "plan":
            e.pop("prompt")
    v = oracles.integrity(ev)
    assert v.status == FAIL and v.witnesses[0]["rid"] == p.rid


def test_the_live_judge_sees_a_wrong_reply_in_part_of_a_run():
    ps = plans()
    p = ps[3]
    ev = log(ps, {p.rid: reply(p, flip(contract.expected(p.prompt).text, 2))})
    judge = oracles.Integrity().live({x.rid: {} for x in ps})
    part = [ev[0]] + [e for e in ev if e.get("rid") == p.rid]
    assert judge(part).status == FAIL


def test_a_stream_chunks_metadata_of_another_request_is_a_fail_though_the_last_chunk_is_right():
    """meta_swap's shape: two streams in one batch had their prompt_tokens exchanged mid-stream."""
    ps = plans()
    p = ps[8]
    want = contract.expected(p.prompt).text
    good = {"id": p.rid, "prompt_tokens": len(p.prompt)}
    chunks = [(want[:5], {**good, "prompt_tokens": len(p.prompt) + 7}), (want, good)]
    raw = "".join(f"data: {json.dumps({'text': t, 'meta_info': m})}\n\n" for t, m in chunks) + "data: [DONE]\n\n"
    v = oracles.integrity(log(ps, {p.rid: reply(p, stream=True, raw=raw)}))
    assert v.status == FAIL and v.witnesses[0]["field"] == "prompt_tokens" and "chunk" in v.witnesses[0]["view"]


def test_the_references_top_two_margins_come_from_sglangs_top_logprobs():
    from kvchaos.schedule import top2_margins

    top = [[[-0.01, 5, "a"], [-4.6, 9, "b"]], [[-0.70, 7, None], [-0.72, 3, None]], [[-0.1, 1, None]], None]
    m = top2_margins(top)
    assert [round(x, 2) if x is not None else None for x in m] == [4.59, 0.02, None, None]
