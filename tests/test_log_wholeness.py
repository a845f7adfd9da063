"""Logs that prove they are whole (kvchaos/history.py): the runner closes each experiment with a record
of what it wrote (``experiment_end``: the records before it, their digest, the requests and fault actions);
a log cut at any line boundary, with records dropped, added or edited, or missing its close is incomplete
— nothing in it can PASS — and a file holding several experiments is judged under each one's header.

Metamorphic relations (stated once, checked on a log the runner's writer wrote and on every cut of it):
* **cut** — a log cut at any line boundary is never green (it cannot show it is whole), and while the
  leaking reply is in it, it stays a FAIL;
* **append** — appending another experiment to a file never changes the first's judgement, and the
  second is judged under its own header."""

from __future__ import annotations

import json
import random

import pytest

from kvchaos import canary, oracles
from kvchaos.history import SCHEMA, History, close_record, read_records, split_experiments
from kvchaos.policy import EXIT
from kvchaos.probe.contract import recital
from kvchaos.workload.events import EventLog
from tests.property_harness import judge



def write(path, n=40, leak_at=None, version="0.5.23", exp_id="e1", seed=3) -> None:
    """One experiment as the runner writes it: header, plans, replies, fault records, close."""
    rng = random.Random(seed)
    log = EventLog(path)
    log.emit("experiment", schema=SCHEMA, id=exp_id, name="wholeness", n=n,
             engine={"name": "sglang", "version": version, "roles": {}})
    log.emit("method", faults=["f1"], during=False)
    log.emit("fault", action="armed", fault="f1", kind="transfer_delay", role="decode")
    first = None
    for i in range(n):
        rid = f"{exp_id}-r{i}"
        cs = canary.mint(rng, 2)
        first = first or cs[0]
        text = recital(cs) + (first[1:-1] + "][" if i == leak_at else "")
        log.emit("plan", rid=rid, tenant=f"t{i}", canaries=cs, expect_echo=True, kind="plain", endpoint="generate")
        log.emit("send", rid=rid)
        log.emit("status", rid=rid, status=200)
        log.emit("body", rid=rid, text=text, complete=True)
        log.emit("end", rid=rid, outcome="ok", latency_s=0.1)
    log.emit("fault", action="healed", fault="f1", kind="transfer_delay", role="decode")
    close_record(log, exp_id)
    log.close()


def rc(path) -> int:
    return judge([path], "--checkers", "isolation")[0]


def test_a_whole_log_is_judged_and_its_close_checks_out(tmp_path):
    p = tmp_path / "whole.jsonl"
    write(p)
    h = History(read_records(p))
    assert h.complete, h.problems
    close = h.by_ev["experiment_end"][0]
    assert close["counts"] == {"end": 40, "fault armed": 1, "fault healed": 1, "plan": 40, "send": 40}
    assert rc(p) == EXIT[oracles.PASS]


def test_no_cut_at_any_line_boundary_makes_a_log_greener(tmp_path):
    """Every cut is incomplete, so never green (those before the leaking reply are clean logs cut short);
    while the leaking reply is in it, it stays a FAIL."""
    p = tmp_path / "log.jsonl"
    leak_at = 30
    write(p, n=40, leak_at=leak_at)
    lines = p.read_text().splitlines(keepends=True)
    assert rc(p) == EXIT[oracles.FAIL]
    whole = tmp_path / "clean.jsonl"
    write(whole, n=40)
    assert rc(whole) == EXIT[oracles.PASS]  # the same log without the leak is green: the cuts alone turn it red
    leak_line = next((i for i, x in enumerate(lines) if f'"rid": "e1-r{leak_at}"' in x and '"body"' in x), None)
    first_plan = next(i for i, x in enumerate(lines) if '"ev": "plan"' in x)
    for k in range(1, len(lines)):
        cut = tmp_path / f"cut{k}.jsonl"
        cut.write_text("".join(lines[:k]))
        got = rc(cut)
        if k <= first_plan:  # no request yet: nothing to judge, bad input
            assert got == 2, (k, got)
            continue
        assert got != EXIT[oracles.PASS] and got != 2, f"cut after line {k}: exit {got}"
        if leak_line is not None and k > leak_line:
            assert got == EXIT[oracles.FAIL], f"cut after line {k} keeps the leak, exit {got}"


@pytest.mark.parametrize("edit", ["drop", "add", "change"])
def test_records_dropped_added_or_changed_before_the_close_are_seen(tmp_path, edit):
    p = tmp_path / "log.jsonl"
    write(p)
    lines = p.read_text().splitlines(keepends=True)
    body = next(i for i, x in enumerate(lines) if '"ev": "body"' in x)
    if edit == "drop":
        lines[body:body + 1] = []
    elif edit == "add":
        lines.insert(body, json.dumps({"ev": "note", "wall": 1.0}) + "\n")
    else:
        rec = json.loads(lines[body])
        rec["complete"] = False
        lines[body] = json.dumps(rec) + "\n"
    p.write_text("".join(lines))
    h = History(read_records(p))
    assert not h.complete and any("closing record" in x for x in h.problems), h.problems
    assert rc(p) != EXIT[oracles.PASS]


def test_records_after_the_close_are_seen(tmp_path):
    p = tmp_path / "log.jsonl"
    write(p)
    with open(p, "a") as f:
        f.write(json.dumps({"ev": "body", "rid": "late", "text": "x"}) + "\n")
    h = History(read_records(p))
    assert any("after the experiment's closing record" in x for x in h.problems), h.problems


def test_an_appended_experiment_is_judged_under_its_own_header(tmp_path):
    """A clean experiment, then one under another engine version that leaks, in one file: two judgements;
    the second's leak is not read under the first's header, and the first stays what it was."""
    p = tmp_path / "two.jsonl"
    write(p, exp_id="e1")
    first = rc(p)
    write(p, exp_id="e2", leak_at=5, version="0.5.19", seed=4)
    parts = split_experiments(read_records(p))
    assert [next(e for e in x if e["ev"] == "experiment")["id"] for x in parts] == ["e1", "e2"]
    assert all(History(x).complete for x in parts)
    code, out = judge([p], "--checkers", "isolation")
    assert code == EXIT[oracles.FAIL] and "[experiment 1 of 2: e1]" in out and "[experiment 2 of 2: e2]" in out
    assert "sglang 0.5.19" in out
    assert first == EXIT[oracles.PASS]
    h = History(read_records(p))  # read as one, it says it is not one experiment: nothing in it can PASS
    assert any("2 experiments in one history" in x for x in h.problems)


def test_a_log_of_a_newer_schema_is_bad_input(tmp_path):
    p = tmp_path / "new.jsonl"
    write(p)
    lines = p.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["schema"] = SCHEMA + 1
    lines[0] = json.dumps(head) + "\n"
    p.write_text("".join(lines))
    code, out = judge([p])
    assert code == 2 and f"history schema {SCHEMA + 1}, newer than this kvchaos reads" in out


def test_a_request_sent_and_never_ended_makes_an_old_log_incomplete():
    """Schema 2 logs carry no close: a request sent without its end still says the log stops short."""
    recs = [{"ev": "experiment", "schema": 2, "id": "x"}, {"ev": "plan", "rid": "a", "canaries": []},
            {"ev": "send", "rid": "a"}]
    assert any("sent and never ended" in x for x in History(recs).problems)
