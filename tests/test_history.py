"""The one history (kvchaos/history.py): what the loader refuses, what makes a history incomplete, and
every view of what a client received — each a place a leak used to go unread."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvchaos import canary, oracles
from kvchaos.cli import main
from kvchaos.history import SCHEMA, History, HistoryError, load, parse, raw_views
from kvchaos.model import char_vocab
from kvchaos.oracles.base import Checker, Verdict, check_safe, compose
from kvchaos.probe.contract import recital

REPO = Path(__file__).resolve().parents[1]
A, B = "[ABCDEFGHIJ]", "[KLMNOPQRST]"


def plan(rid, cs, **kw):
    return {"ev": "plan", "rid": rid, "tenant": rid, "canaries": cs, "expect_echo": True, "kind": "plain", **kw}


def body(rid, **kw):
    return {"ev": "body", "rid": rid, "complete": True, **kw}


def leaks(records) -> bool:
    v = oracles.isolation(History(records))
    return v.status == oracles.FAIL and any(w["owner_rid"] == "a" and w["victim_rid"] == "b" for w in v.witnesses)


# --------------------------------------------------------------------------- the loader
def test_a_key_given_twice_in_a_record_is_bad_input():
    line = '{"ev": "body", "rid": "b", "text": "' + A[1:-1] + '", "text": ""}'
    with pytest.raises(HistoryError, match="key 'text' given twice"):
        parse(line, "x.jsonl")


@pytest.mark.parametrize("ev", ["plan", "send", "body", "end"])
def test_a_second_record_of_a_request_is_bad_input_never_an_overwrite(ev):
    recs = [plan("a", [A]), plan("b", [B]), body("b", text=A[1:-1]), {"ev": "end", "rid": "b", "outcome": "ok"},
            {"ev": "send", "rid": "b"}]
    second = {"plan": plan("b", [B]), "send": {"ev": "send", "rid": "b"}, "body": body("b", text="clean"),
              "end": {"ev": "end", "rid": "b", "outcome": "ok"}}[ev]
    with pytest.raises(HistoryError, match=f"a second '{ev}' record for request 'b'"):
        History(recs + [second])


def test_a_cut_last_line_makes_the_history_incomplete_and_nothing_passes(tmp_path):
    rng = random.Random(1)
    recs = []
    for i in range(40):
        cs = canary.mint(rng, 2)
        recs += [plan(f"c{i}", cs), {"ev": "status", "rid": f"c{i}", "status": 200},
                 body(f"c{i}", text=recital(cs)),
                 {"ev": "end", "rid": f"c{i}", "outcome": "ok"}]
    p = tmp_path / "cut.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"ev": "body", "rid": "c1", "text": "QZ7X')
    h = load(p)
    assert h.problems and "the last line is cut" in h.problems[0] and h.records[-1]["ev"] == "truncated"
    assert oracles.isolation(h).status == oracles.PASS  # the checker alone would pass it
    from kvchaos.policy import Context, Policy

    pol = Policy()
    vs = pol.gate([oracles.isolation(h)], h)
    assert vs[0].status == oracles.UNKNOWN and "incomplete" in vs[0].summary
    assert pol.judge(vs, Context.of(h)).red


def test_a_bad_line_before_the_last_is_bad_input():
    with pytest.raises(HistoryError, match="x.jsonl:1: not JSON"):
        parse('{"ev": "plan"\n{"ev": "end"}\n', "x.jsonl")


def test_logs_written_before_the_schema_are_read_and_judged():
    """Schema 1 (no ``schema`` in the header): the committed incident logs are read as they are."""
    old = REPO / "reports" / "incidents" / "glm53-replay" / "events.jsonl"
    h = load(old)
    assert h.schema == 1 and h.plans and SCHEMA == 3
    assert main(["judge", str(old)]) == 1  # the replayed leak, still a FAIL


# --------------------------------------------------------------------------- what the client received
def test_a_stream_after_a_malformed_line_is_read_with_its_deltas_joined():
    raw = ('data: {"choices": [{"text": "XY"}]}\n\ndata: {not json\n\n'
           'data: {"choices": [{"text": "ABCDE"}]}\n\ndata: {"choices": [{"text": "FGHIJ"}]}\n\n')
    assert ("choices[0].text joined", "XYABCDEFGHIJ") in raw_views(raw)
    recs = [plan("a", [A]), plan("b", [B]), body("b", text="XY", raw=raw, complete=False)]
    assert leaks(recs)


def test_bytes_after_done_are_read():
    raw = 'data: {"text": "KLMNOPQRST]["}\n\ndata: [DONE]\n\ndata: {"text": "ABC' + 'DEFGHIJ]["}\n\n'
    assert leaks([plan("a", [A]), plan("b", [B]), body("b", text="KLMNOPQRST][", raw=raw)])


@pytest.mark.parametrize("where", ["meta", "output_ids", "error", "leg", "error_record", "other_field"])
def test_what_the_client_received_without_raw_is_scanned(where):
    recs = [plan("a", [A]), plan("b", [B])]
    if where == "meta":
        recs.append(body("b", text="", meta={"note": {"x": ["..." + A[1:-1] + "..."]}}))
    elif where == "output_ids":
        ids = [char_vocab()[ch] for ch in A[1:-1] + "]"]
        recs.append(body("b", text="", output_ids=ids))
    elif where == "error":
        recs.append(body("b", text="", error="bad input near " + A[1:-1]))
    elif where == "leg":
        recs.append({"ev": "prefill_leg", "rid": "b", "status": 500, "error": "prefill said " + A[1:-1]})
    elif where == "error_record":
        recs.append({"ev": "error", "rid": "b", "error": "ClientPayloadError('" + A[1:-1] + "')"})
    else:
        recs.append(body("b", text="", choices=[{"message": {"content": A[1:-1]}}]))
    assert leaks(recs), where


def test_one_matching_rule_a_cut_recital_of_a_canary_nobody_known_minted_is_a_leak():
    """9 characters of a canary minted in a log the judgement was not given, cut by the budget: the
    same 8-character rule as a known canary's window."""
    recs = [plan("b", [B]), body("b", text="KLMNOPQRST][QZ7XK2MBN", complete=True)]
    v = oracles.isolation(History(recs))
    assert v.status == oracles.FAIL and v.witnesses[0]["match"] == "unknown-origin"
    assert v.witnesses[0]["matched"] == "QZ7XK2MBN"
    # degenerate output is not a canary
    recs = [plan("b", [B]), body("b", text="KLMNOPQRST][EEEEEEEEEEEE", complete=True)]
    assert not oracles.isolation(History(recs)).witnesses


# --------------------------------------------------------------------------- checkers and the policy
def test_a_checker_that_crashes_is_unknown():
    class Broken(Checker):
        name = "broken"

        def check(self, history, registry=None):
            raise KeyError("boom")

    v = check_safe(Broken(), History([plan("a", [A])]))
    assert v.status == oracles.UNKNOWN and "crashed" in v.summary and "KeyError" in v.stats["crashed"]
    vs = compose(Broken(), oracles.Isolation()).check([plan("a", [A])])
    assert [x.status for x in vs][0] == oracles.UNKNOWN
    assert isinstance(vs[1], Verdict)


def test_no_flag_switches_a_leak_checker_off(tmp_path):
    """``--checkers liveness`` on a leaking log: isolation still runs (not claimed) and its FAIL is red."""
    rng = random.Random(2)
    recs = [{"ev": "experiment", "engine": {"name": "sglang", "version": "0.5.23"}, "schema": 2}]
    for i in range(30):
        cs = canary.mint(rng, 2)
        text = recital(cs) + (A[1:-1] + "][" if i == 7 else "")
        recs += [plan(f"c{i}", cs), {"ev": "status", "rid": f"c{i}", "status": 200}, body(f"c{i}", text=text),
                 {"ev": "end", "rid": f"c{i}", "outcome": "ok", "latency_s": 0.2}]
    recs.append(plan("a", [A]))
    recs += [{"ev": "probe", "phase": ph, "role": "decode", "kv_used": 0, "ok": True} for ph in ("before", "after")]
    p = tmp_path / "leak.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["judge", "--checkers", "liveness", str(p)]) == 1


def test_a_leak_checker_that_crashes_is_red_even_when_not_claimed():
    """A history that crashes isolation must not let ``--checkers liveness`` turn it green."""
    from kvchaos.policy import Context, Policy

    h = History([plan("a", [A])])
    v = Verdict("isolation", oracles.UNKNOWN, "the checker crashed: boom", [], {"crashed": "boom"})
    live = Verdict("liveness", oracles.PASS, "ok")
    j = Policy().judge([live, v], Context.of(h), claimed={"liveness"})
    assert j.red and j.status == oracles.UNKNOWN
    with pytest.raises(HistoryError, match="'layout' must be an object"):
        History([{"ev": "experiment", "layout": "mha"}, plan("a", [A])])


def test_a_payload_split_between_the_last_event_and_a_cut_line_is_whole_again():
    raw = 'data: {"choices": [{"text": "ABCDE"}]}\n\ndata: {"id": "cmpl-1", "choices": [{"index": 0, "text": "FGHIJ]x'
    assert ("choices[0].text joined", "ABCDEFGHIJ]x") in raw_views(raw)
    assert leaks([plan("a", [A]), plan("b", [B]), body("b", text="ABCDE", raw=raw, complete=False)])


def test_a_record_naming_no_request_is_read_too():
    """A record of a kind the harness does not write, naming no request: what it carries is read."""
    recs = [plan("a", [A]), plan("b", [B]), {"ev": "chunk", "data": "..." + A[1:-1] + "..."}]
    v = oracles.isolation(History(recs))
    assert v.status == oracles.FAIL and v.witnesses[0]["victim_rid"] is None
    assert v.witnesses[0]["view"] == "chunk (no rid)"


def test_an_engine_side_id_is_named_back_by_its_canaries_only_where_one_plan_fits():
    """The OpenAI routes reach decode under an id of its own; its ``kv_prealloc`` lists the input's
    canaries. Exactly those of one plan, or (where none has exactly those) every one of them in one plan
    only: named. A conversation's later turn repeats an earlier turn's canaries and is no match for it;
    canaries two plans share, or none, name nobody."""
    from kvchaos.history import History
    ev = [{"ev": "plan", "rid": "t1", "tenant": "a", "canaries": ["[AAAAAAAAAA]", "[BBBBBBBBBB]"]},
          {"ev": "plan", "rid": "t2", "tenant": "a", "canaries": ["[AAAAAAAAAA]", "[BBBBBBBBBB]", "[CCCCCCCCCC]"]},
          {"ev": "plan", "rid": "x1", "tenant": "b", "canaries": ["[DDDDDDDDDD]"]},
          {"ev": "plan", "rid": "x2", "tenant": "b", "canaries": ["[DDDDDDDDDD]", "[EEEEEEEEEE]"]},
          {"ev": "plan", "rid": "x3", "tenant": "b", "canaries": ["[DDDDDDDDDD]", "[FFFFFFFFFF]"]}]

    def pre(eid, cs):
        return {"ev": "agent", "agent_ev": "kv_prealloc", "role": "decode", "rid": eid, "canaries": cs, "wall": 1.0}
    h = History(ev + [pre("e1", ["[BBBBBBBBBB]", "[AAAAAAAAAA]"]), pre("e2", ["[CCCCCCCCCC]"]),
                      pre("e3", ["[DDDDDDDDDD]", "[EEEEEEEEEE]"]), pre("e4", ["[AAAAAAAAAA]"]),
                      pre("e5", ["[ZZZZZZZZZZ]"]), pre("t1", ["[AAAAAAAAAA]", "[BBBBBBBBBB]"]), pre("e6", None)])
    assert h.engine_rids() == {"e1": "t1", "e2": "t2", "e3": "x2"}
