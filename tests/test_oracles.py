"""Every oracle on hand-made event logs: one log where it must FAIL, one where it must PASS, and
the UNKNOWN cases in between."""

import math
import random

import pytest

from kvchaos import canary, oracles
from kvchaos.oracles import FAIL, PASS, UNKNOWN
from kvchaos.oracles.isolation import DEFAULT_FLOOR, ECHO_RATE, _class_figures
from kvchaos.probe.contract import recital

A = "[ABCDEFGHIJ]"   # minted for r1 (tenant ta)
B = "[KLMNOPQRST]"   # minted for r2 (tenant tb)
C = "[UVWXYZ2345]"   # minted for r3 (tenant ta)


def plan(rid, tenant, canaries, **kw):
    return {"ev": "plan", "rid": rid, "tenant": tenant, "canaries": canaries, "expect_echo": True,
            "oversized": False, "kind": "plain", **kw}


def done(rid, text, status=200, latency=0.5, error=None, outcome=None):
    return [{"ev": "status", "rid": rid, "status": status},
            {"ev": "body", "rid": rid, "text": text, "error": error, "meta": {"finish_reason": {"type": "stop"}}},
            {"ev": "end", "rid": rid, "outcome": outcome or ("ok" if status == 200 else "http_error"), "latency_s": latency}]


def echo(cs):
    return recital(cs)  # what the probe answers: kvchaos.probe.contract


def crowd(n=30, k=2, seed=5, prefix="c"):
    """``n`` clean requests of 4 tenants, ``k`` canaries each, every reply reciting its own."""
    rng = random.Random(seed)
    ev = []
    for i in range(n):
        cs = canary.mint(rng, k)
        ev += [plan(f"{prefix}{i}", f"t{i % 4}", cs)] + done(f"{prefix}{i}", echo(cs))
    return ev


def clean_log():
    """r1..r3 (A, B, C) plus enough clean echoing requests for the sensitivity floor."""
    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B]), plan("r3", "ta", [C])]
    ev += done("r1", A[1:] + "][") + done("r2", B[1:] + "][") + done("r3", C[1:] + "][")
    return ev + crowd()


def test_isolation_passes_on_clean_echoing_log():
    v = oracles.isolation(clean_log())
    assert v.status == PASS and v.witnesses == [] and "33/33 requests" in v.summary, v


def test_sensitivity_floor_needs_enough_evidence():
    # 30 requests x 2 canaries: 60/60 trials, 95 % lower bound 0.951 >= 0.95
    assert oracles.sensitivity(crowd(30, 2)).status == PASS
    # 30 requests x 1 canary: 30/30, lower bound 0.905: not enough evidence that a leak would show
    v = oracles.sensitivity(crowd(30, 1))
    assert v.status == UNKNOWN and v.stats["lower_bound"] < 0.95, v
    # fewer than 20 requests: UNKNOWN however well they echo
    v = oracles.sensitivity(crowd(19, 3))
    assert v.status == UNKNOWN and "fewer than 20" in v.summary
    assert oracles.isolation(crowd(19, 3)).status == UNKNOWN


def test_one_echoing_reply_among_a_hundred_errors_is_not_evidence():
    """CI path: min_samples was 1, so 99 HTTP 500s and one echo judged isolation PASS ("1/1 = 100 %")."""
    ev = crowd(1, 2)
    rng = random.Random(9)
    for i in range(99):
        ev += [plan(f"e{i}", "tx", canary.mint(rng, 2))] + done(f"e{i}", "", status=500, error="Internal Server Error")
    v = oracles.isolation(ev)
    assert v.status == UNKNOWN, v
    assert v.stats["power"]["classes"]["all"]["evidence"] == 1


def test_binomial_lower_bound():
    assert oracles.binomial_lower_bound(59, 59) > 0.95 > oracles.binomial_lower_bound(58, 58)
    assert abs(oracles.binomial_lower_bound(99, 100) - 0.9534) < 1e-3
    assert oracles.binomial_lower_bound(0, 10) == 0.0 and 0.99 < oracles.binomial_lower_bound(2000, 2000) < 1


def test_isolation_fails_with_witness_naming_victim_and_owner():
    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B])]
    ev += done("r1", A[1:] + "][") + done("r2", B[1:] + "][" + A[1:] + "][")  # r2 recites r1's canary
    v = oracles.isolation(ev)
    assert v.status == FAIL
    w = v.witnesses[0]
    assert (w["victim_rid"], w["victim_tenant"], w["owner_rid"], w["owner_tenant"]) == ("r2", "tb", "r1", "ta")
    assert w["matched"] == "ABCDEFGHIJ" and w["match"] == "exact" and w["status"] == 200
    s, e = w["offsets"]
    assert (B[1:] + "][" + A[1:] + "][")[s:e] == "ABCDEFGHIJ"
    assert len(v.witnesses) == 1  # the partial windows inside the exact hit are not reported again


def test_isolation_catches_partial_and_same_tenant_leaks():
    ev = [plan("r1", "ta", [A]), plan("r3", "ta", [C])]
    ev += done("r1", A[1:]) + done("r3", C[1:] + " ...CDEFGHIJ")  # 8-char window of r1's canary
    v = oracles.isolation(ev)
    assert v.status == FAIL
    w = v.witnesses[0]
    assert w["match"] == "partial" and w["owner_rid"] == "r1" and w["same_tenant"] is True
    assert w["matched"] == "CDEFGHIJ"


def test_isolation_is_unknown_not_pass_when_the_model_does_not_echo():
    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B])]
    ev += done("r1", "zzzz") + done("r2", "qqqq")  # a random model: no echo, no leak visible
    v = oracles.isolation(ev)
    assert v.status == UNKNOWN and "cannot show that a leak would be seen" in v.summary


def test_leak_found_even_when_echo_is_low():
    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B])]
    ev += done("r1", "zzzz") + done("r2", "x" + A[1:])
    assert oracles.isolation(ev).status == FAIL


def test_isolation_scans_error_bodies_too():
    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B])]
    ev += done("r1", A[1:]) + done("r2", "", status=400, error="bad request near " + A[1:])
    v = oracles.isolation(ev)
    assert v.status == FAIL and v.witnesses[0]["status"] == 400


def test_sensitivity_pass_and_unknown():
    assert oracles.sensitivity(clean_log()).status == PASS
    ev = clean_log()
    ev[7]["text"] = "nothing"  # r2 forgot its canary: 62/63 canaries < 99 %
    v = oracles.sensitivity(ev)
    assert v.status == UNKNOWN and v.stats["eligible"] == 33 and v.stats["echoed"] == 32, v
    assert oracles.sensitivity([]).status == UNKNOWN


def test_differential():
    ev = [plan("r1", "ta", [A])] + done("r1", A[1:])
    ev[2]["output_ids"] = [1, 2, 3]
    assert oracles.differential(ev, {"r1": {"output_ids": [1, 2, 3]}}).status == PASS
    v = oracles.differential(ev, {"r1": {"output_ids": [1, 9, 3], "text": "x"}})
    assert v.status == FAIL and v.witnesses[0]["first_diff"] == 1
    assert oracles.differential(ev, {}).status == UNKNOWN


def test_http_semantics():
    ok = [plan("r9", "ta", [A], oversized=True)] + done("r9", "", status=400, error="Input length exceeds")
    assert oracles.http_semantics(ok).status == PASS
    bad = [plan("r9", "ta", [A], oversized=True)] + done("r9", "fluent reply " + A[1:], status=200)
    v = oracles.http_semantics(bad)
    assert v.status == FAIL and v.witnesses[0]["problem"] == "rejected-size prompt answered HTTP 200"
    five = [plan("r9", "ta", [A], oversized=True)] + done("r9", "", status=503, error="no workers")
    assert oracles.http_semantics(five).status == FAIL
    hang = [plan("r9", "ta", [A], oversized=True), {"ev": "end", "rid": "r9", "outcome": "timeout", "latency_s": 60}]
    assert oracles.http_semantics(hang).status == UNKNOWN


def test_http_semantics_of_a_stream_judges_what_came_after_its_200_headers():
    """A stream's headers say 200 before the engine looked at the prompt: an error event and no content
    is its rejection; content is an answer (FAIL); headers then nothing decide nothing (liveness's)."""
    def stream(events):
        return [plan("s1", "ta", [A], oversized=True, kind="stream"),
                {"ev": "status", "rid": "s1", "status": 200, "headers_only": True}] + events

    hung = stream([{"ev": "body", "rid": "s1", "text": "", "error": None, "raw": ""},
                   {"ev": "end", "rid": "s1", "outcome": "timeout", "latency_s": 30, "status": 200}])
    assert oracles.http_semantics(hung).status == UNKNOWN
    rejected = stream([{"ev": "status", "rid": "s1", "status": 200},
                       {"ev": "body", "rid": "s1", "text": "", "error": "Input length exceeds", "raw": "data: ..."},
                       {"ev": "end", "rid": "s1", "outcome": "ok", "latency_s": 0.1}])
    assert oracles.http_semantics(rejected).status == PASS
    answered = stream([{"ev": "status", "rid": "s1", "status": 200},
                       {"ev": "body", "rid": "s1", "text": "fluent " + A[1:], "error": None, "raw": "data: ..."},
                       {"ev": "end", "rid": "s1", "outcome": "ok", "latency_s": 0.1}])
    assert oracles.http_semantics(answered).status == FAIL
    cut_with_content = stream([{"ev": "body", "rid": "s1", "text": "fluent " + A[1:], "error": None, "raw": "data:"},
                               {"ev": "end", "rid": "s1", "outcome": "timeout", "latency_s": 30, "status": 200}])
    assert oracles.http_semantics(cut_with_content).status == FAIL
    empty_ok = stream([{"ev": "status", "rid": "s1", "status": 200},
                       {"ev": "body", "rid": "s1", "text": "", "error": None, "raw": "data: [DONE]"},
                       {"ev": "end", "rid": "s1", "outcome": "ok", "latency_s": 0.1}])
    assert oracles.http_semantics(empty_ok).status == FAIL  # 200, ended, and no rejection said


@pytest.mark.parametrize("case,status", [
    ("clean", PASS), ("hang", FAIL), ("no_end", FAIL), ("slow", FAIL), ("pool_lost", FAIL),
    ("dead_after", FAIL), ("no_probe", UNKNOWN), ("not_sent", UNKNOWN), ("not_sent_after_timeout", FAIL)])
def test_liveness(case, status):
    ev = clean_log()
    probes = [{"ev": "probe", "phase": "before", "role": "decode", "kv_used": 0},
              {"ev": "probe", "phase": "after", "role": "decode", "kv_used": 0, "ok": True}]
    if case == "hang":
        i = next(i for i, e in enumerate(ev) if e["ev"] == "end" and e["rid"] == "r3")
        ev[i] = {"ev": "end", "rid": "r3", "outcome": "timeout", "latency_s": 30}
    elif case == "no_end":
        ev = ev[:-1]
    elif case == "slow":
        ev[-1]["latency_s"] = 31
    elif case == "pool_lost":
        probes[1]["kv_used"] = 512
    elif case == "dead_after":
        probes[1]["ok"] = False
    elif case.startswith("not_sent"):  # a plan a stalled run never sent (stall_s): no evidence, never PASS
        ev = [e for e in ev if not (e.get("rid") == "r3" and e["ev"] not in ("plan", "end"))]
        ev[[j for j, e in enumerate(ev) if e["ev"] == "end" and e["rid"] == "r3"][0]] = {
            "ev": "end", "rid": "r3", "outcome": "not_sent", "latency_s": 0.0, "bytes_received": 0}
        if case == "not_sent_after_timeout":
            ev = [{**e, "outcome": "timeout", "latency_s": 30} if e["ev"] == "end" and e["rid"] == "r1" else e
                  for e in ev]
    if case != "no_probe":
        ev += probes
    v = oracles.liveness(ev, bound_s=30)
    assert v.status == status, v
    if status == FAIL:
        assert v.witnesses


@pytest.mark.parametrize("after_ms,outcome,status", [
    (4, "drained", UNKNOWN),      # within two hosts' clock skew of a drained release: cannot be ordered
    (-4, "drained", PASS),        # ended before it
    (4, "timeout", FAIL),         # a release that did not wait: judged as stamped
    (4, None, FAIL),
    (300, "drained", FAIL),       # far past any skew: a write after a release decode called drained
])
def test_kv_lifecycle_orders_a_drained_release_and_a_write_only_beyond_the_clock_skew(after_ms, outcome, status):
    ag = {"source": "agent", "ev": "agent"}
    ev = [{**ag, "agent_ev": "kv_released", "room": 7, "rid": "r1", "wall": 100.0},
          {**ag, "agent_ev": "write_end", "room": 7, "rid": "r1", "pages": 4, "wall_start": 99.0,
           "wall": 100.0 + after_ms / 1000}]
    if outcome:
        ev.insert(1, {**ag, "agent_ev": "deferred_release", "room": 7, "rid": "r1", "outcome": outcome, "wall": 100.0})
    v = oracles.kv_lifecycle(ev)
    assert v.status == status, v
    if status == UNKNOWN:
        assert "cannot be ordered" in v.summary and v.stats["within_clock_skew"][0]["after_release_ms"] == 4.0


@pytest.mark.parametrize("case,status", [
    ("write_before_release", PASS), ("write_after_release", FAIL), ("copied_into_test_log", FAIL),
    ("no_agent", UNKNOWN), ("nothing_released", UNKNOWN)])
def test_kv_lifecycle(case, status):
    w = {"ev": "write_end", "source": "agent", "room": 7, "rid": "r1", "pages": 300, "wall_start": 99.0, "wall": 100.0}
    rel = {"ev": "kv_released", "source": "agent", "room": 7, "rid": "r1", "deferred_release_enabled": True, "wall": 100.5}
    other = {"ev": "write_end", "source": "agent", "room": 8, "rid": "r2", "pages": 10, "wall_start": 101.0, "wall": 101.5}
    ev = [w, rel, other]
    if case == "write_after_release":  # planted: decode gave the pages back, the late write lands 2 s later
        rel = {**rel, "wall": 98.0, "deferred_release_enabled": False}
        ev = [w, rel, other]
    elif case == "copied_into_test_log":
        ev = [{**e, "ev": "agent", "agent_ev": e["ev"]} for e in (w, {**rel, "wall": 98.0}, other)]
    elif case == "no_agent":
        ev = clean_log()
    elif case == "nothing_released":
        ev = [w, other]
    v = oracles.kv_lifecycle(ev)
    assert v.status == status, v
    if status == FAIL:
        x = v.witnesses[0]
        assert (x["room"], x["rid"], x["after_release_ms"]) == (7, "r1", 2000.0)
        assert len(v.witnesses) == 1  # room 8 was never released: its write is fine
        assert x["release_outcome"] is None and x["reused_by"] == []  # no deferred-release / page evidence


def test_kv_lifecycle_names_the_release_outcome_and_who_got_the_pages():
    """A write held past decode's deferred-release timeout: the witness says SGLang released on
    timeout (not on the drain ack) and which later request was given some of those pages."""
    ag = {"source": "agent", "ev": "agent"}
    ev = [{**ag, "agent_ev": "transfer_start", "room": 7, "rid": "r1", "dst_pages": [1, 2, 3, 4], "wall": 90.0},
          {**ag, "agent_ev": "deferred_release", "room": 7, "rid": "r1", "outcome": "timeout", "wall": 98.0},
          {**ag, "agent_ev": "kv_released", "room": 7, "rid": "r1", "wall": 98.0},
          {**ag, "agent_ev": "transfer_start", "room": 8, "rid": "r2", "dst_pages": [3, 4, 9], "wall": 99.0},
          {**ag, "agent_ev": "transfer_start", "room": 9, "rid": "r3", "dst_pages": [1], "wall": 97.0},  # before
          {**ag, "agent_ev": "write_end", "room": 7, "rid": "r1", "pages": 4, "wall_start": 89.0, "wall": 100.0},
          {**ag, "agent_ev": "write_end", "room": 8, "rid": "r2", "pages": 3, "wall_start": 99.0, "wall": 99.5}]
    v = oracles.kv_lifecycle(ev)
    assert v.status == FAIL and v.stats["release_outcomes"] == {"timeout": 1}
    (w,) = v.witnesses
    assert w["release_outcome"] == "timeout"
    assert w["reused_by"] == [{"rid": "r2", "room": 8, "pages": 2, "transfer_start_after_release_ms": 1000.0}]


@pytest.mark.parametrize("case,status", [
    ("resumed_bit_exact", PASS), ("restored_differs", FAIL), ("digest_changed", FAIL), ("answered_unresumed", FAIL),
    ("aborted_unresumed", PASS), ("nothing_retracted", UNKNOWN), ("hook_failed", UNKNOWN), ("other_log", UNKNOWN)])
def test_retraction(case, status):
    ag = {"source": "agent", "ev": "agent"}
    ret = {**ag, "agent_ev": "kv_retracted", "rid": "r1", "kept_tokens": 300, "digest": "aa", "wall": 10.0}
    res = {**ag, "agent_ev": "kv_resumed", "rid": "r1", "restored_tokens": 300, "digest": "aa", "restored_equal": True,
           "wall": 10.2}
    ev = clean_log() + [ret, res]
    if case == "restored_differs":  # planted: the pool at the new slots is not what was copied out
        ev[-1] = {**res, "restored_equal": False, "digest": "bb"}
    elif case == "digest_changed":  # the host copy itself changed between retraction and resume
        ev[-1] = {**res, "digest": "bb"}
    elif case == "answered_unresumed":  # r1 was answered 200, but decode never restored its KV
        ev = ev[:-1]
    elif case == "aborted_unresumed":  # r2 was retracted and then failed: no answer to judge
        ev = [e for e in clean_log() if not (e.get("rid") == "r2" and e["ev"] in ("status", "body", "end"))]
        ev += done("r2", "", status=500, error="aborted") + [ret, res, {**ret, "rid": "r2"}]
    elif case == "nothing_retracted":
        ev = clean_log()
    elif case == "hook_failed":
        ev = ev[:-1] + [{**ag, "agent_ev": "hook_error", "hook": "load_kv_cache", "error": "boom"}]
    elif case == "other_log":  # retractions of requests this log did not send are not evidence
        ev = clean_log() + [{**ret, "rid": "zz"}, {**res, "rid": "zz"}]
    v = oracles.retraction(ev)
    assert v.status == status, v
    if status == FAIL:
        assert v.witnesses[0]["rid"] == "r1" and len(v.witnesses) == 1
    if case == "resumed_bit_exact":
        assert v.stats["retractions"] == 1 and v.stats["resumes"] == 1
    with pytest.raises(ValueError, match="min_retractions"):
        oracles.Retraction(min_retractions=0)


@pytest.mark.parametrize("case,status", [
    ("error_and_abort_200", PASS), ("held_but_success_200", FAIL), ("error_without_message", FAIL),
    ("too_late_unheld", PASS), ("no_abort", UNKNOWN), ("never_answered", UNKNOWN),
    ("ingested_while_held_then_success_200", FAIL), ("let_go_before_ingested", PASS),
    ("none_ingested_in_time", UNKNOWN), ("never_ingested", UNKNOWN), ("read_by_the_role_that_did_not_hold_it", PASS),
    ("hold_let_go_by_the_harness_first", PASS)])
def test_abort_semantics(case, status):
    def ab(rid, stage, held=True):
        return {"ev": "fault", "action": "abort_request", "kind": "abort", "rid": rid, "stage": stage, "held": held}

    def reply(rid, finish, status=200, error=None):
        return [{"ev": "status", "rid": rid, "status": status},
                {"ev": "body", "rid": rid, "text": "x", "error": error, "meta": {"finish_reason": {"type": finish}}},
                {"ev": "end", "rid": rid, "outcome": "ok" if status == 200 else "http_error"}]

    ev = [plan("r1", "ta", [A]), plan("r2", "tb", [B]), ab("r1", "decode_prealloc"), ab("r2", "decode_waiting")]
    ev += reply("r1", "abort", 500, error="Decode handshake failed") + reply("r2", "abort")
    if case == "held_but_success_200":  # planted: parked in decode's waiting queue, aborted, then served whole
        ev = ev[:4] + reply("r1", "abort", 500, error="e") + reply("r2", "length")
    elif case == "error_without_message":
        ev = ev[:4] + reply("r1", None, 500) + reply("r2", "abort")
    elif case == "too_late_unheld":  # nothing held it: the abort may land after the reply ended
        ev = ev[:3] + [ab("r2", "decoding", held=False)] + reply("r1", "abort", 500, error="e") + reply("r2", "stop")
    elif case == "no_abort":
        ev = [e for e in ev if e["ev"] != "fault"]
    elif case == "never_answered":
        ev = ev[:4]
    else:  # the agent logs when a scheduler acted on an abort (abort_ingested) and when it let a held request go

        def agent(kind, rid, wall, **kw):
            return {"ev": "agent", "agent_ev": kind, "role": "decode", "rid": rid, "wall": wall, **kw}

        served = ev[:4] + reply("r1", "abort", 500, error="e") + reply("r2", "stop")
        r1_in_time = [agent("abort_ingested", "r1", 10.0), agent("fault_fired", "r1", 10.5, phase="released")]
        if case == "ingested_while_held_then_success_200":  # read while parked, and still served whole: lost
            ev = served + r1_in_time + [agent("abort_ingested", "r2", 20.0),
                                        agent("fault_fired", "r2", 20.5, phase="released")]
        elif case == "let_go_before_ingested":  # released at 20.5, the abort read at 21.9: nothing lost
            ev = served + r1_in_time + [agent("fault_fired", "r2", 20.5, phase="released"),
                                        agent("abort_ingested", "r2", 21.9)]
        elif case == "none_ingested_in_time":  # every held request let go before its abort was read: blind
            ev = served[:2] + served[2:4] + reply("r1", "stop") + reply("r2", "stop") + [
                agent("fault_fired", "r1", 10.0, phase="released"), agent("abort_ingested", "r1", 11.0),
                agent("fault_fired", "r2", 20.5, phase="released"), agent("abort_ingested", "r2", 21.9)]
        elif case == "never_ingested":  # another request's abort read, these never: no proof either way
            ev = ev[:4] + reply("r1", "stop") + reply("r2", "stop") + [agent("abort_ingested", "zz", 1.0)]
        elif case == "hold_let_go_by_the_harness_first":  # a hold's release is the harness's record alone
            ev = served + r1_in_time + [{**agent("fault_fired", "r2", 19.0, phase="held"), "role": "prefill"},
                                        {"ev": "fault", "action": "released", "kind": "hold", "target": {"rid": "r2"},
                                         "at": 20.0}, {**agent("abort_ingested", "r2", 20.4), "role": "prefill"}]
        elif case == "read_by_the_role_that_did_not_hold_it":  # prefill read r2's abort; decode held it
            ev = served + r1_in_time + [agent("fault_fired", "r2", 19.0, phase="held"),
                                        {**agent("abort_ingested", "r2", 20.0), "role": "prefill"},
                                        agent("fault_fired", "r2", 20.5, phase="released")]
    v = oracles.abort_semantics(ev)
    assert v.status == status, v
    if status == FAIL:
        assert len(v.witnesses) == 1 and v.witnesses[0]["rid"] == (
            "r2" if case in ("held_but_success_200", "ingested_while_held_then_success_200") else "r1")
    if case == "error_and_abort_200":
        assert v.stats["outcomes"]["decode_waiting"] == {"rid": "r2", "status": 200, "finish_reason": "abort",
                                                          "held": True, "ingested_in_time": None, "attempts": None,
                                                          "text_chars": 1, "error": None}
    if case == "let_go_before_ingested":
        assert v.stats["not_in_time"] == ["r2"] and v.stats["outcomes"]["decode_waiting"]["ingested_in_time"] is False


def test_aborted_replies_are_not_echo_evidence_on_any_endpoint():
    """A reply finished by an abort is not held to echoing its canaries — /generate's
    ``{"type": "abort"}`` and an OpenAI endpoint's ``"abort"`` alike; a cut short ``stop`` still is."""
    base = clean_log()
    for fr, counted in (({"type": "abort"}, False), ("abort", False), ("stop", True), ({"type": "stop"}, True)):
        ev = base + [plan("ab", "tz", ["[ZZZZZZZZZZ]"]), {"ev": "status", "rid": "ab", "status": 200},
                     {"ev": "body", "rid": "ab", "text": "", "meta": {"finish_reason": fr}},
                     {"ev": "end", "rid": "ab", "outcome": "ok"}]
        v = oracles.sensitivity(ev)
        assert v.stats["eligible"] == oracles.sensitivity(base).stats["eligible"] + counted, (fr, v.stats)


def test_canaries_sent_outside_a_workload_have_an_origin():
    """A probe measurement's or a smoke test's prompt is registered by its text: a reply reciting one
    of its canaries from stale KV names that origin instead of 'minted by nobody'."""
    reg = canary.Registry()
    (c,) = canary.mint(random.Random(9), 1)
    reg.add_text(f"some words {c} more words", "probe-1", "probe measurement")
    (m,) = reg.entries()
    assert (m.canary, m.rid, m.source) == (c, "probe-1", "probe measurement")


def test_the_class_floor_is_met_by_a_small_class_that_recited_everything_and_no_more():
    """A fault's class of the minimum 5 requests x 2 canaries, every canary recited, can show a leak (a
    fresh clone's prefill-kill run had exactly this, 10/10, bound 0.741, and was UNKNOWN); the same class
    with one canary unrecited cannot, nor can one of 15 (bound 0.721 < 0.75)."""
    f = DEFAULT_FLOOR
    per = {f"r{i}": (2, 2) for i in range(5)}
    full = _class_figures("agent:hold", list(per), per, f, ECHO_RATE)
    assert full["met"] and full["lower_bound"] < f.class_min_rate, full
    one_missed = _class_figures("agent:hold", list(per), {**per, "r0": (2, 1)}, f, ECHO_RATE)
    assert not one_missed["met"] and "echo lower bound" in one_missed["why"], one_missed
    per15 = {f"r{i}": (3, 3) for i in range(5)}
    assert not _class_figures("agent:hold", list(per15), {**per15, "r0": (3, 2)}, f, ECHO_RATE)["met"]


def _paced(ev, pace):
    return [{"ev": "experiment", "schema": 2, "layout": {"kv_layout": "like:llama-3.1-8b-p64-bf16",
                                                         "spec": {"pace": pace}}}] + ev


def test_liveness_bound_is_the_pace_the_history_records_times_the_checkers():
    """A like: probe on CPU runs at the pace its header records (ClusterSpec.pace): 31 s is within 30 s
    at pace 16 and a timeout is still a witness at any pace; without a header, or at pace 1, 31 s is not."""
    probes = [{"ev": "probe", "phase": "before", "role": "decode", "kv_used": 0},
              {"ev": "probe", "phase": "after", "role": "decode", "kv_used": 0, "ok": True}]
    slow = clean_log() + probes
    slow[[i for i, e in enumerate(slow) if e["ev"] == "end"][-1]]["latency_s"] = 31
    assert oracles.liveness(slow, bound_s=30).status == FAIL
    assert oracles.liveness(_paced(slow, 1), bound_s=30).status == FAIL
    v = oracles.liveness(_paced(slow, 16), bound_s=30)
    assert v.status == PASS and "480 s (30 s at pace 16)" in v.summary and v.stats["bound_s"] == 480, v
    over = clean_log() + probes
    over[[i for i, e in enumerate(over) if e["ev"] == "end"][-1]]["latency_s"] = 481
    v = oracles.liveness(_paced(over, 16), bound_s=30)
    assert v.status == FAIL and "480 s (30 s at pace 16)" in v.witnesses[0]["problem"], v
    hang = clean_log() + probes
    i = next(i for i, e in enumerate(hang) if e["ev"] == "end" and e["rid"] == "r3")
    hang[i] = {"ev": "end", "rid": "r3", "outcome": "timeout", "latency_s": 30}
    assert oracles.liveness(_paced(hang, 64), bound_s=30).status == FAIL


@pytest.mark.parametrize("pace", [0.5, 65, 1e9, "16", True, {}])
def test_a_history_whose_pace_would_stretch_liveness_without_limit_is_refused(pace):
    """Liveness multiplies its bound by the header's pace: a header cannot make every hang 'in time'."""
    from kvchaos.history import HistoryError, as_history
    with pytest.raises(HistoryError, match="pace must be a number from 1 to 64"):
        as_history(_paced(clean_log(), pace))


def test_exposure_by_merged_spans_is_the_pairwise_overlap():
    """Power's exposure (isolation.exposure_classes) looks windows up in merged fault spans (n log n): the
    same set as testing every window against every span."""
    from kvchaos.oracles.isolation import _overlapping

    rng = random.Random(5)
    for _ in range(300):
        spans = [(a, a + rng.uniform(0, 5)) for a in (rng.uniform(0, 100) for _ in range(rng.randint(0, 8)))]
        spans += [(rng.uniform(0, 100), math.inf)] if rng.random() < 0.2 else []
        wins = {i: (a, a + rng.uniform(0, 3)) for i, a in enumerate(rng.uniform(0, 100) for _ in range(20))}
        wins["never sent"] = None
        brute = {r for r, w in wins.items() if w and any(w[0] <= b and a <= w[1] for a, b in spans)}
        assert _overlapping(wins, spans) == brute, (spans, wins)
