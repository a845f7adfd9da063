"""The driver logs every byte a client received, whatever the outcome: a cut, timed-out, aborted,
disconnected, failed or malformed reply still has its one ``body`` event (``raw``, ``complete``)
before its one ``end`` (``bytes_received``), so the isolation oracle scans partial replies too.
Runs against tests/fake_engine.py (loopback), never a real engine."""

import json
import socket
import time

import pytest

from kvchaos import canary, oracles
from kvchaos.workload import EventLog, Workload, run_plans
from tests.fake_engine import FakeEngine

MARK = "[QZ7XK2MBNW]"  # canary-shaped text the fake appends to every reply


def _run(plans, timeout_s=10.0, **fake):
    with FakeEngine(leak_text=fake.pop("leak_text", MARK), **fake) as eng, EventLog() as log:
        t0 = time.monotonic()
        ends = run_plans(eng.url, plans, log, concurrency=4, timeout_s=timeout_s, abort_urls=(eng.url,))
        elapsed = time.monotonic() - t0
        aborted = {b["rid"] for path, b in eng.requests if path == "/abort_request"}
    assert [e["rid"] for e in ends] == [p.rid for p in plans]
    return log.records, elapsed, aborted


def _body_end(records, rid):
    """``rid``'s body and end, checked: exactly one of each, the body before the end, which is last."""
    mine = [e for e in records if e.get("rid") == rid]
    bodies = [e for e in mine if e["ev"] == "body"]
    ends = [e for e in mine if e["ev"] == "end"]
    assert len(bodies) == 1 and len(ends) == 1, [e["ev"] for e in mine]
    assert mine[-1] is ends[0] and mine.index(bodies[0]) < mine.index(ends[0])
    assert ends[0]["bytes_received"] == len(bodies[0]["raw"].encode())
    return bodies[0], ends[0]


def _statuses(records, rid):
    return [(e["status"], bool(e.get("headers_only"))) for e in records if e["ev"] == "status" and e["rid"] == rid]


def test_complete_replies_are_logged_whole(tmp_path):
    wl = Workload(11, n_tenants=3)
    plans = [wl.request(kind=k, endpoint=e) for k in ("plain", "stream") for e in ("generate", "completions", "chat")]
    ev, _, _ = _run(plans)
    for p in plans:
        body, end = _body_end(ev, p.rid)
        assert end["outcome"] == "ok" and end["status"] == 200 and body["complete"] is True, (p.kind, p.endpoint)
        assert body["text"].endswith(MARK) and all(canary.payload(c) in body["text"] for c in p.canaries)
        if p.kind == "plain":
            assert json.loads(body["raw"])  # the whole JSON document
            assert MARK in body["raw"] and body["chunks"] is None
        else:  # every event line as sent, up to the end marker
            assert body["raw"].count("data: ") == body["chunks"] + 1 and body["raw"].endswith("data: [DONE]\n\n")
            if p.endpoint == "generate":  # cumulative text (OpenAI endpoints send it in pieces)
                assert MARK in body["raw"]


@pytest.mark.parametrize("behaviour", ["cut", "cut_eof"])
@pytest.mark.parametrize("endpoint,tail", [("generate", MARK), ("completions", '{"text": "]"}')])
def test_stream_cut_mid_line_keeps_the_partial_line(behaviour, endpoint, tail):
    p = Workload(12).request(kind="stream", endpoint=endpoint)
    ev, _, _ = _run([p], behaviour=behaviour)
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "cut" and end["status"] == 200 and "error" in end
    assert _statuses(ev, p.rid) == [(200, True)]  # the headers said 200; the reply never finished
    assert body["complete"] is False
    assert body["raw"].endswith(tail)  # the line the cut interrupted
    assert body["text"].endswith(MARK[:-1])  # every complete line parsed, the cut one not
    assert body["chunks"] == body["raw"].count("data: ") - 1


def test_plain_body_cut_in_half():
    p = Workload(13).request()
    ev, _, _ = _run([p], behaviour="cut")
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "cut" and end["status"] == 200
    assert _statuses(ev, p.rid) == [(200, True)]
    assert body["complete"] is False and body["text"] == "" and body["chunks"] is None
    assert body["raw"].startswith('{"text": "') and MARK in body["raw"]


def test_stalled_stream_times_out_with_what_it_got():
    p = Workload(14).request(kind="stream")
    ev, elapsed, _ = _run([p], timeout_s=1.0, behaviour="stall")
    assert elapsed < 5
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "timeout" and end["bound_s"] == 1.0
    assert body["complete"] is False and body["chunks"] > 0
    assert MARK in body["raw"] and body["text"].endswith(MARK)


def test_abort_after_logs_the_stream_so_far():
    p = Workload(15).request(kind="abort_after", abort_after_ms=300)
    ev, elapsed, aborted = _run([p], behaviour="stall")
    assert elapsed < 5 and aborted == {p.rid}
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "aborted"
    assert body["complete"] is False and body["chunks"] > 0 and MARK in body["raw"]


def test_disconnect_at_the_headers_logs_the_bytes_that_came_with_them():
    p = Workload(16).request(kind="disconnect_before_first_token")
    # one event holding the whole reply, in the same write as the headers; then nothing
    ev, _, aborted = _run([p], behaviour="stall", eager_first_chunk=True, chunk_chars=10_000)
    assert aborted == {p.rid}
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "disconnected"
    assert not any(e["ev"] == "first_byte" for e in ev)  # it never read the reply
    assert body["complete"] is False and body["text"] == "" and MARK in body["raw"]


@pytest.mark.parametrize("kind", ["plain", "stream"])
def test_error_status_body_is_logged(kind):
    p = Workload(17).request(kind=kind)
    ev, _, _ = _run([p], behaviour="error500")
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "http_error" and end["status"] == 500
    assert body["complete"] is True  # read to its end: the error is the whole reply
    assert MARK in body["raw"] and MARK in body["error"] and body["text"] == ""


def test_malformed_stream_line_ends_the_request_as_an_error():
    p = Workload(18).request(kind="stream")
    ev, _, _ = _run([p], behaviour="malformed")
    body, end = _body_end(ev, p.rid)
    assert end["outcome"] == "error" and "not a JSON object" in end["error"]
    assert body["complete"] is False and body["chunks"] == 1
    assert MARK in body["raw"]  # the malformed line holds the whole reply


def test_no_response_no_body():
    hang = Workload(19).request()
    ev, _, _ = _run([hang], timeout_s=1.0, behaviour="hang")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    refused_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there
    refused = Workload(20).request()
    with EventLog() as log:
        run_plans(refused_url, [refused], log, timeout_s=5)
    for records, p, outcome in ((ev, hang, "timeout"), (log.records, refused, "error")):
        mine = [e for e in records if e.get("rid") == p.rid]
        assert not any(e["ev"] == "body" for e in mine)
        (end,) = [e for e in mine if e["ev"] == "end"]
        assert end["outcome"] == outcome and end["bytes_received"] == 0 and "status" not in end


def test_foreign_canary_only_in_a_cut_line_is_a_leak():
    wl = Workload(21, n_tenants=2)
    owner = wl.request(wl.tenants[0])
    victim = wl.request(wl.tenants[1], kind="stream")
    # one event holding the whole reply, cut mid-line: the foreign canary is in no parsed text
    ev, _, _ = _run([owner, victim], behaviour="cut", chunk_chars=10_000, leak_text=owner.canaries[0])
    body, end = _body_end(ev, victim.rid)
    assert end["outcome"] == "cut" and body["text"] == "" and owner.canaries[0] in body["raw"]
    v = oracles.isolation(ev)
    assert v.status == oracles.FAIL, v
    assert {(w["victim_rid"], w["owner_rid"]) for w in v.witnesses} == {(victim.rid, owner.rid)}


def test_sglang_error_response_is_an_error():
    """SGLang answers a failed request with its ErrorResponse (``{"object": "error", "message": ...}``,
    e.g. decode's 500 for a request aborted before decoding): logged as the error, not as empty text."""
    from kvchaos.workload.driver import _extract

    msg = "Decode handshake failed for request rank=0 ... Aborted by AbortReq."
    body = {"object": "error", "message": msg, "type": "500", "param": None, "code": 500}
    assert _extract(body, "generate") == ("", None, None, msg)
    assert _extract({"text": "ok", "meta_info": {}}, "generate") == ("ok", None, {}, None)


def test_openai_replies_carry_their_finish_reason():
    """An OpenAI reply's finish reason (``choices[0].finish_reason``; a stream's last chunk) is in the
    body's meta, where /generate has it: an abort on /v1/completions is told from a success."""
    from kvchaos.workload.driver import _extract, _merge_stream

    body = {"choices": [{"text": "AB", "finish_reason": "abort"}], "usage": {"prompt_tokens": 9}}
    assert _extract(body, "completions") == ("AB", None, {"prompt_tokens": 9, "finish_reason": "abort"}, None)
    merged = None
    for ch in ({"choices": [{"delta": {"content": "A"}, "finish_reason": None}]},
               {"choices": [{"delta": {"content": "B"}, "finish_reason": "stop"}]}):
        merged = _merge_stream(merged, ch, "chat")
    assert _extract(merged, "chat") == ("AB", None, {"finish_reason": "stop"}, None)


def _run_stall(behaviour, n=12, timeout_s=1.0, stall_s=1.0, kind="plain"):
    wl = Workload(21, n_tenants=3)
    plans = [wl.request(kind=kind) for _ in range(n)]
    with FakeEngine(behaviour=behaviour) as eng, EventLog() as log:
        t0 = time.monotonic()
        ends = run_plans(eng.url, plans, log, concurrency=4, timeout_s=timeout_s, stall_s=stall_s)
        elapsed = time.monotonic() - t0
    assert [e["rid"] for e in ends] == [p.rid for p in plans]  # every plan ends, sent or not
    return plans, log.records, elapsed


def test_a_wedged_cluster_stops_the_run_sending():
    """Every request hangs: the first wave's timeouts show nothing answered for stall_s, so the 8 plans
    not yet sent end ``not_sent`` at once (no send record), after one ``stall`` record; the timeouts stay
    and liveness still FAILs on them."""
    plans, ev, elapsed = _run_stall("hang")
    outcomes = [e["outcome"] for e in ev if e["ev"] == "end"]
    assert outcomes.count("timeout") == 4 and outcomes.count("not_sent") == 8, outcomes
    stall = [e for e in ev if e["ev"] == "stall"]
    assert len(stall) == 1 and stall[0]["quiet_s"] >= 1.0 and stall[0]["timed_out"] in {p.rid for p in plans[:4]}
    sent = {e["rid"] for e in ev if e["ev"] == "send"}
    assert sent == {p.rid for p in plans[:4]}
    assert elapsed < 2.5 * 1.0 + 1.5, elapsed  # one wave of timeouts, not three
    v = oracles.liveness(ev, bound_s=1.0)
    assert v.status == oracles.FAIL and {w["rid"] for w in v.witnesses} == {p.rid for p in plans[:4]}


def test_without_stall_s_a_wedged_run_sends_every_plan():
    plans, ev, _ = _run_stall("hang", n=8, stall_s=None)
    assert [e["outcome"] for e in ev if e["ev"] == "end"] == ["timeout"] * 8
    assert not [e for e in ev if e["ev"] == "stall"]


def test_a_timeout_after_recent_reply_bytes_is_no_stall():
    """Streams that sent every event and then went quiet time out after 1 s of silence, under stall_s
    (5 s) since their last byte: the cluster answered, so every plan is sent."""
    plans, ev, _ = _run_stall("stall", n=8, stall_s=5.0, kind="stream")
    assert [e["outcome"] for e in ev if e["ev"] == "end"].count("not_sent") == 0
    assert len({e["rid"] for e in ev if e["ev"] == "send"}) == 8


def test_stall_s_must_be_positive():
    with pytest.raises(ValueError, match="stall_s"):
        run_plans("http://127.0.0.1:1", [], EventLog(), stall_s=0)
