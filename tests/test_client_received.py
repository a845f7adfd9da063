"""What the client received is every string, by JSON path (kvchaos/history.py: ``raw_views``): a
canary streamed in pieces is whole again in whatever field the engine carried it, however the stream
was chunked; and the runner's own ``leak_seen`` record is never read as green.

Metamorphic relations, each stated once and checked on drawn logs (Hypothesis):
* **fields** — moving a reply's text to any field an engine's API can carry it in (OpenAI content,
  ``reasoning_content``, a tool call's ``arguments``, logprob tokens; /generate's cumulative or incremental
  ``text``, its output-token logprobs; an error body's message) does not change the verdict;
* **chunks** — re-chunking a stream at any character boundary does not change the verdict;
* **names** — renaming every request id does not change the verdict;
* **noise** — adding records of a kind the harness does not write, naming no request and carrying no
  canary, does not change the verdict.
A leak stays a FAIL naming its owner; a clean log stays green."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvchaos import canary, oracles
from kvchaos.history import History, raw_views, stream_reply_text
from kvchaos.oracles import Isolation, Liveness, Sensitivity
from kvchaos.policy import Context, Policy
from kvchaos.probe.contract import recital

SETTINGS = dict(derandomize=True, deadline=None, database=None, max_examples=25)
FIELDS = ("content", "reasoning_content", "tool_arguments", "chat_logprobs", "completions_text",
          "completions_logprobs", "generate_cumulative", "generate_incremental", "generate_logprobs", "error")


def _chunk(text: str, cuts) -> list[str]:
    at = sorted({c for c in cuts if 0 < c < len(text)})
    return [text[a:b] for a, b in zip([0] + at, at + [len(text)])]


def sse(field: str, pieces: list[str], rid: str = "r") -> tuple[str, str]:
    """(raw body, the text a driver that reads only the reply's content parsed) of a stream carrying
    ``pieces`` in ``field``."""
    evs, so_far = [], ""
    for i, p in enumerate(pieces):
        if field == "content":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"content": p}}]}
        elif field == "reasoning_content":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"reasoning_content": p}}]}
        elif field == "tool_arguments":
            e = {"id": rid, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": p}}]}}]}
        elif field == "chat_logprobs":
            e = {"id": rid, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": [
                {"token": p, "logprob": -0.01, "top_logprobs": []}]}}]}
        elif field == "completions_text":
            e = {"id": rid, "choices": [{"index": 0, "text": p}]}
        elif field == "completions_logprobs":
            e = {"id": rid, "choices": [{"index": 0, "text": "", "logprobs": {"tokens": [p], "token_logprobs": [-0.01]}}]}
        elif field == "generate_cumulative":
            so_far += p
            e = {"text": so_far, "meta_info": {"id": rid, "completion_tokens": i + 1}}
        elif field == "generate_incremental":
            e = {"text": p, "meta_info": {"id": rid, "completion_tokens": i + 1}}
        elif field == "generate_logprobs":
            e = {"text": "", "meta_info": {"id": rid, "output_token_logprobs": [[-0.01, 7, p]]}}
        elif field == "error":
            e = {"error": {"message": p, "code": 500}}
        else:
            raise ValueError(field)
        evs.append("data: " + json.dumps(e) + "\n\n")
    raw = "".join(evs) + "data: [DONE]\n\n"
    text = "".join(pieces) if field in ("content", "completions_text") else (
        so_far if field == "generate_cumulative" else (pieces[-1] if field == "generate_incremental" else ""))
    return raw, text


def log(n: int, field: str, cuts, leak: bool, rename=None, noise: int = 0) -> list[dict]:
    """``n`` requests, two canaries each, every reply its recital streamed in ``field`` chunked at ``cuts``
    (character offsets); with ``leak`` the last request's reply holds the first request's first canary."""
    rng = random.Random(7)
    name = rename or (lambda r: r)
    recs = [{"ev": "experiment", "id": "m", "schema": 2, "name": "metamorphic", "n": n}]
    owner = None
    for i in range(n):
        rid = name(f"r{i}")
        cs = canary.mint(rng, 2)
        owner = owner or (rid, cs[0])
        want = recital(cs)
        if leak and i == n - 1:
            want = want[:-1] + owner[1] + "["  # the owner's canary recited as if it were this request's
        raw, text = sse(field, _chunk(want, cuts), rid)
        recs += [{"ev": "plan", "rid": rid, "tenant": f"t{i}", "canaries": cs, "expect_echo": True, "kind": "stream",
                  "endpoint": "chat", "stream": True},
                 {"ev": "send", "rid": rid, "wall": 100.0 + i}, {"ev": "status", "rid": rid, "status": 200},
                 {"ev": "body", "rid": rid, "text": text, "raw": raw, "complete": True},
                 {"ev": "end", "rid": rid, "outcome": "ok", "wall": 100.5 + i}]
    for j in range(noise):
        recs.insert(1 + (7 * j) % len(recs), {"ev": "engine_note", "note": f"gc pass {j}", "wall": 100.0 + j})
    return recs


def verdict(recs) -> tuple[str, set]:
    """(isolation's status, the owners it names) of a log, as the suites judge it."""
    h = History(recs)
    v = oracles.isolation(h)
    return v.status, {w.get("owner_rid") for w in v.witnesses}


cuts = st.lists(st.integers(min_value=1, max_value=60), max_size=12)


@settings(**SETTINGS)
@given(field=st.sampled_from(FIELDS), cuts=cuts)
def test_a_leak_is_a_fail_naming_its_owner_in_every_field_however_chunked(field, cuts):
    status, owners = verdict(log(4, field, cuts, leak=True))
    assert status == oracles.FAIL and owners == {"r0"}, (field, cuts, status, owners)


@settings(**SETTINGS)
@given(field=st.sampled_from(FIELDS), cuts=cuts)
def test_a_clean_log_names_no_leak_in_any_field_however_chunked(field, cuts):
    status, owners = verdict(log(4, field, cuts, leak=False))
    assert status != oracles.FAIL, (field, cuts, owners)


@settings(**SETTINGS)
@given(field=st.sampled_from(FIELDS), cuts=cuts, leak=st.booleans(), noise=st.integers(0, 5),
       salt=st.integers(0, 10**6))
def test_renaming_requests_and_adding_unrelated_records_change_nothing(field, cuts, leak, noise, salt):
    base = verdict(log(4, field, cuts, leak))
    renamed = verdict(log(4, field, cuts, leak, rename=lambda r: f"x{salt}-{r}", noise=noise))
    assert base[0] == renamed[0] and len(base[1]) == len(renamed[1]), (base, renamed)


@settings(**SETTINGS)
@given(cuts=cuts)
def test_an_incremental_generate_stream_is_judged_as_whole_replies_and_green(cuts):
    """``--incremental-streaming-output``: each chunk holds only its new text; the reply is every chunk
    joined, so the echo (power) is there and a clean run is green, not UNKNOWN."""
    recs = log(40, "generate_incremental", cuts, leak=False)
    recs[0]["engine"] = {"name": "sglang", "version": "0.5.23", "incremental_streaming_output": True}
    for r in recs:
        if r["ev"] == "plan":
            r["endpoint"] = "generate"
    h = History(recs)
    for rid in h.plans:
        assert h.reply_text(rid) == recital(h.plans[rid]["canaries"])
    p = Policy()
    checks, claimed = p.checks([Isolation(), Sensitivity(), Liveness(bound_s=60)])
    j = p.judge(p.gate(checks.check(h, canary.Registry()), h), Context.of(h), required={"isolation": "pass"},
                claimed=claimed)
    assert not j.red, j.message()


def test_stream_reply_text_reads_cumulative_and_incremental_chunks():
    cum, _ = sse("generate_cumulative", ["[AB", "CD", "E]["])
    inc, _ = sse("generate_incremental", ["[AB", "CD", "E]["])
    assert stream_reply_text(cum) == stream_reply_text(inc) == "[ABCDE]["


def test_a_line_cut_mid_string_is_closed_and_joined_with_the_events_before_it():
    raw = 'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "ABCDE"}}]}\n\n' \
          'data: {"choices": [{"index": 0, "delta": {"reasoning_content": "FGHIJ]x'
    assert ("choices[0].delta.reasoning_content joined", "ABCDEFGHIJ]x") in raw_views(raw)


def test_two_choices_of_one_stream_are_joined_each_on_its_own():
    """OpenAI's ``index`` places a chunk's choice: n=2 streams interleave, each choice is whole."""
    evs = [{"choices": [{"index": i % 2, "delta": {"content": p}}]} for i, p in enumerate(["[AB", "[KL", "CD]", "MN]"])]
    raw = "".join("data: " + json.dumps(e) + "\n\n" for e in evs)
    views = dict(raw_views(raw))
    assert views["choices[0].delta.content joined"] == "[ABCD]"
    assert views["choices[1].delta.content joined"] == "[KLMN]"


def test_the_runners_leak_seen_record_is_a_fail_whatever_the_log_now_shows():
    """The live judge saw a leak (``leak_seen``); a log that no longer shows it (rewritten, its reply cut
    out) is a FAIL naming what the runner saw, never green."""
    recs = log(40, "content", [], leak=False)
    h = History(recs)
    v = oracles.isolation(h)
    assert v.status == oracles.PASS
    seen = recs + [{"ev": "leak_seen", "oracle": "isolation", "victims": ["r39"], "owners": ["r0"], "after_s": 1.2}]
    h2 = History(seen)
    g = Policy().gate([oracles.isolation(h2)], h2)[0]
    assert g.status == oracles.FAIL and "leak_seen" in g.summary and g.witnesses[0]["victims"] == ["r39"]
    assert Policy().judge([g], Context.of(h2)).red
