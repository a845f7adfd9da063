"""Prefix-cache isolation checkers without a cluster: ``cache_isolation`` and ``timing_isolation`` on
synthetic event logs (each must FAIL, PASS and say UNKNOWN where it should) and the
``sglang-router-drops-cache-salt`` finding's signature in the policy."""

from __future__ import annotations

import asyncio

import pytest

from kvchaos.oracles import (
    FAIL,
    PASS,
    UNKNOWN,
    CacheIsolation,
    TimingIsolation,
    Verdict,
    cache_isolation,
    timing_isolation,
)
from kvchaos.policy import KNOWN, Context, Policy, Registry, is_leak_checker
from tests.prefix_cache_logs import (
    ARMS,
    FAST,
    FINDING,
    HEADER,
    SA,
    SB,
    SLOW,
    Req,
    block,
    check,
    clean_run,
    event_log,
    judge,
    lcp,
    prefix_match,
    salt_leak_log,
    timing_run,
)


# --------------------------------------------------------------------------- cache_isolation
def test_clean_run_passes_with_its_evidence_counted():
    v = check(clean_run())
    assert v.status == PASS, v
    assert (v.stats["judged"], v.stats["hits"], v.stats["hit_chances"], v.stats["cross_salt_chances"]) == (9, 7, 7, 3), \
        v.stats
    assert v.stats["salts_lost"] == 0 and v.stats["page_size"] == 1 and not v.witnesses
    assert CacheIsolation().check(event_log(clean_run().values())).status == PASS  # the checker is the function


def test_another_salts_prefix_in_cached_tokens_fails_and_names_owner_and_victim():
    reqs = clean_run()
    b2, a2 = reqs["b2"], reqs["a2"]
    b2.cached = lcp(b2.prompt, a2.prompt)  # a's longer prefix, which salt-b never sent
    assert b2.cached >= 260
    v = check(reqs)
    assert v.status == FAIL, v
    (w,) = v.witnesses
    assert (w["victim_rid"], w["victim_tenant"], w["victim_salt"]) == ("b2", "tb", SB)
    assert (w["owner_rid"], w["owner_tenant"], w["owner_salt"]) == ("a2", "ta", SA)
    assert w["cached_tokens"] == b2.cached == w["common_prefix"]
    assert w["same_salt_prefix"] == lcp(b2.prompt, reqs["b1"].prompt) < b2.cached
    assert w["engine_salt"] == "(no agent evidence)" and "another salt" in w["problem"]
    assert "b2" in v.summary and "a2" in v.summary


def test_cached_tokens_beyond_every_earlier_prompt_is_a_collision_without_owner():
    reqs = clean_run()
    stray = block("stray", 150)  # shares nothing with anything sent before it
    reqs["c1"] = Req("c1", "ta", stray, SA, cached=64, send=20.0)
    v = check(reqs)
    assert v.status == FAIL, v
    (w,) = v.witnesses
    assert w["victim_rid"] == "c1" and w["owner_rid"] is None and w["owner_salt"] is None and w["owner_tenant"] is None
    assert w["cached_tokens"] == 64 and w["same_salt_prefix"] < 64 and w["common_prefix"] < 64
    assert "collision" in w["problem"] and "no prefix in this log" in v.summary


def test_a_request_sent_after_the_victim_ended_explains_nothing():
    head = block("head", 120)
    victim = Req("v", "ta", head + block("v", 60), SA, cached=120, send=0.0, end=1.0)
    later_same = Req("s", "ta", head + block("s", 60), SA, cached=0, send=2.0)  # the same salt, too late
    later_other = Req("o", "tb", head + block("o", 60), SB, cached=0, send=3.0)  # another salt, too late
    v = cache_isolation(event_log([victim, later_same, later_other]))
    assert v.status == FAIL, v
    (w,) = v.witnesses
    assert w["victim_rid"] == "v" and w["same_salt_prefix"] == 0 and w["owner_rid"] is None, w
    # control: the same-salt prompt sent while the victim was still in flight may have been cached for it
    later_same.send = 0.5
    v = cache_isolation(event_log([victim, later_same, later_other]))
    assert v.status != FAIL and not v.witnesses, v


def test_reply_text_extends_an_earlier_requests_prefix():
    first = block("conv", 150) + "["
    reply = "QZ7XK2MBNW]["
    nxt = first + reply + block("turn2", 80)
    a = Req("a", "ta", first, SA, cached=0, send=0.0, text=reply)
    b = Req("b", "ta", nxt, SA, cached=len(first) + len(reply), send=1.0)  # prompt + output cached
    v = cache_isolation(event_log([a, b]))
    assert not v.witnesses and v.status != FAIL, v
    a.text = ""  # without the reply, 12 of b's cached tokens are explained by nothing
    v = cache_isolation(event_log([a, b]))
    assert v.status == FAIL and v.witnesses[0]["same_salt_prefix"] == len(first), v


def test_page_size_does_not_loosen_the_bound():
    head = block("paged", 100)
    a = Req("a", "ta", head + block("pa", 100), SA, cached=0, send=0.0)
    b = Req("b", "ta", head + block("pb", 100), SA, cached=128, send=1.0)  # rounded up to a whole 64-token page
    paged = {"t": 0.0, "ev": "agent", "agent_ev": "transfer_start", "rid": "a", "page_size": 64}
    v = cache_isolation(event_log([a, b], paged))
    assert v.stats["page_size"] == 64
    assert v.status == FAIL and v.witnesses[0]["same_salt_prefix"] == lcp(a.prompt, b.prompt) < 128, v


def test_no_hits_is_unknown_cache_not_exercised():
    reqs = clean_run()
    for r in reqs.values():
        r.cached = 0
    v = check(reqs)
    assert v.status == UNKNOWN and "not exercised" in v.summary, v
    assert v.stats["hits"] == 0 and v.stats["hit_chances"] == 7


def test_no_cross_salt_chance_is_unknown():
    reqs = {k: r for k, r in clean_run().items() if r.salt == SA}  # one salt only
    v = check(reqs)
    assert v.status == UNKNOWN and "cross-salt reuse was not tried" in v.summary, v
    assert v.stats["hits"] == 5 and v.stats["cross_salt_chances"] == 0


def test_min_hits_and_min_cross_are_the_thresholds():
    assert check(clean_run(), min_hits=7, min_cross=3).status == PASS
    assert check(clean_run(), min_hits=8).status == UNKNOWN
    assert check(clean_run(), min_cross=4).status == UNKNOWN


def test_no_reply_reporting_cached_tokens_is_unknown():
    reqs = clean_run()
    for r in reqs.values():
        r.cached = None
    v = check(reqs)
    assert v.status == UNKNOWN and "cached_tokens" in v.summary and "--enable-cache-report" in v.summary, v


def test_characters_that_are_not_tokens_make_it_unknown():
    reqs = clean_run()
    reqs["b2"].cached = lcp(reqs["b2"].prompt, reqs["a2"].prompt)  # would FAIL, but the bound cannot be computed
    reqs["a3"].prompt_tokens = len(reqs["a3"].prompt) // 3  # a BPE tokenizer
    v = check(reqs)
    assert v.status == UNKNOWN and "characters are not tokens" in v.summary and "a3" in v.summary, v


def test_plans_without_prompt_text_make_it_unknown():
    reqs = clean_run()
    reqs["a4"].prompt = None
    v = check(reqs)
    assert v.status == UNKNOWN and "no prompt text" in v.summary, v


def test_salts_lost_before_the_engine_make_a_clean_run_unknown():
    reqs = clean_run()
    lost = [prefix_match(rid, None) for rid in reqs]
    v = check(reqs, *lost)
    assert v.status == UNKNOWN and "did not reach the engine" in v.summary, v
    assert v.stats["salts_lost"] == len(reqs)
    # control: the engine received every salt it was sent
    kept = [prefix_match(rid, r.salt) for rid, r in reqs.items()]
    assert check(reqs, *kept).status == PASS


def test_salts_lost_with_a_violation_fail_and_say_what_the_engine_got():
    reqs = clean_run()
    reqs["b2"].cached = lcp(reqs["b2"].prompt, reqs["a2"].prompt)
    v = check(reqs, *[prefix_match(rid, None) for rid in reqs])
    assert v.status == FAIL and v.witnesses[0]["engine_salt"] is None, v
    assert "reached the engine with another" in v.summary


def test_unsalted_requests_are_judged_only_after_a_cache_flush():
    head = block("open", 100)
    a = Req("a", "ta", head + block("ua", 100), None, cached=0, send=0.0)
    b = Req("b", "tb", block("ub", 200), None, cached=90, send=1.0)  # nothing in this log explains it
    v = cache_isolation(event_log([a, b]))
    assert v.status == UNKNOWN and "no request could be judged" in v.summary, v
    assert v.stats["unsalted_skipped"] == 2 and v.stats["judged"] == 0
    # with the cache flushed first, everything it holds was sent in this log
    v = cache_isolation(event_log([a, b], {"t": -5.0, "ev": "cache_flushed"}))
    assert v.status == FAIL and v.stats["cache_flushed"] is True, v
    assert v.witnesses[0]["victim_rid"] == "b" and v.witnesses[0]["owner_rid"] is None


def test_cache_isolation_checker_rejects_a_control_that_cannot_fail():
    with pytest.raises(ValueError, match="min_hits and min_cross must be >= 1"):
        CacheIsolation(min_hits=0)
    with pytest.raises(ValueError, match="min_hits and min_cross must be >= 1"):
        CacheIsolation(min_cross=0)
    c = CacheIsolation(min_hits=2, min_cross=1)
    assert (c.name, c.leak, c.min_hits, c.min_cross) == ("cache_isolation", True, 2, 1)


# --------------------------------------------------------------------------- timing_isolation
def test_timing_passes_when_only_the_own_salt_hit_is_faster():
    v = timing_isolation(event_log(timing_run(FAST, SLOW, SLOW, SLOW)))
    assert v.status == PASS, v
    s = v.stats
    assert s["alpha"] == 1e-3 and s["n"] == {a: 20 for a in ARMS}
    assert s["control"]["D"] == 1.0 and s["control"]["p"] < 1e-3
    assert s["cross"]["p"] >= 1e-3 and 0 <= s["cross"]["D"] < 1
    assert 30 < s["median_ms"]["same_salt_hit"] < 50 and 100 < s["median_ms"]["cross_salt"] < 140, s["median_ms"]
    assert s["salted"] == 80 and s["salts_lost"] is None  # no agent evidence: not counted


def test_timing_fails_when_another_salts_prefix_answers_as_fast_as_a_hit():
    v = timing_isolation(event_log(timing_run(FAST, SLOW, FAST, SLOW)))
    assert v.status == FAIL and "TIMING SIDE CHANNEL" in v.summary, v
    (w,) = v.witnesses
    assert w["arms"] == ["cross_salt", "never_cached"] and w["n"] == [20, 20] and w["p"] < 1e-3 and w["D"] == 1.0
    assert w["median_ms"][0] < w["median_ms"][1]


def test_timing_without_power_is_unknown():
    v = timing_isolation(event_log(timing_run(SLOW, SLOW, SLOW, SLOW)))
    assert v.status == UNKNOWN and "no power" in v.summary, v
    assert v.stats["control"]["p"] >= 1e-3


def test_timing_with_too_few_samples_is_unknown():
    v = timing_isolation(event_log(timing_run(FAST, SLOW, FAST, SLOW, n=10)))
    assert v.status == UNKNOWN and "too few timed requests" in v.summary, v
    assert v.stats["n"] == {a: 10 for a in ARMS}
    assert TimingIsolation(min_n=5).check(event_log(timing_run(FAST, SLOW, FAST, SLOW, n=10))).status == FAIL


def test_timing_counts_salts_lost_from_agent_evidence():
    reqs = timing_run(FAST, SLOW, SLOW, SLOW)
    lost = timing_isolation(event_log(reqs, *[prefix_match(r.rid, None) for r in reqs]))
    assert (lost.stats["salts_lost"], lost.stats["salted"]) == (80, 80)
    kept = timing_isolation(event_log(reqs, *[prefix_match(r.rid, r.salt) for r in reqs]))
    assert (kept.stats["salts_lost"], kept.stats["salted"]) == (0, 80)
    # arms that look alike say nothing when the salts never reached the engine: UNKNOWN, never PASS
    assert kept.status == PASS and lost.status == UNKNOWN and "without the cache_salt" in lost.summary, lost


def test_timing_unknown_for_lost_salts_is_known_only_with_the_finding_signature():
    reqs = timing_run(FAST, SLOW, SLOW, SLOW)
    for agent, want in (([prefix_match(r.rid, None) for r in reqs], KNOWN),
                        ([prefix_match(r.rid, None if i % 2 else r.salt) for i, r in enumerate(reqs)], UNKNOWN)):
        ev = event_log(reqs, *agent, HEADER)
        v = timing_isolation(ev)
        assert v.status == UNKNOWN, v
        j = Policy(accept_known=True).judge([v], Context.of(ev), {"timing_isolation": PASS})
        assert (KNOWN if j.known and not j.red else UNKNOWN) == want, (want, j.message())


def test_driver_slots_serve_waiting_plans_by_priority():
    """A plan that waited for another (priority 0) is served before queued plans (priority 1)."""
    from kvchaos.workload.driver import _Slots

    async def go():
        slots, got = _Slots(1), []
        await slots.acquire((1, 0))

        async def waiter(prio, tag):
            await slots.acquire(prio)
            got.append(tag)
            slots.release()

        ts = [asyncio.ensure_future(waiter((1, i), f"queued{i}")) for i in (1, 2)]
        await asyncio.sleep(0)
        ts.append(asyncio.ensure_future(waiter((0, 9), "next-turn")))
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*ts)
        return got, slots.free

    got, free = asyncio.run(go())
    assert got == ["next-turn", "queued1", "queued2"] and free == 1, got


@pytest.mark.parametrize("kw,msg", [({"alpha": 0.7}, "alpha must be in"), ({"alpha": 0.0}, "alpha must be in"),
                                    ({"min_n": 2}, "min_n must be >= 5")])
def test_timing_checker_rejects_settings_without_meaning(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TimingIsolation(**kw)


# --------------------------------------------------------------------------- policy
def test_salt_dropped_before_the_engine_is_the_known_router_finding():
    ev = salt_leak_log("lost")
    v = cache_isolation(ev)
    assert v.status == FAIL and all(w["engine_salt"] is None for w in v.witnesses)
    j = judge(v, ev)
    assert j.known[0].finding.id == FINDING, j.message()
    assert j.red and j.status == FAIL, "a known finding is red unless accepted"
    j = judge(v, ev, accept_known=[FINDING])
    assert not j.red and j.status == KNOWN


@pytest.mark.parametrize("engine_salt", ["kept", "none"])
def test_salt_leak_the_engine_did_see_or_cannot_vouch_for_stays_red(engine_salt):
    ev = salt_leak_log(engine_salt)
    v = cache_isolation(ev)
    want = SB if engine_salt == "kept" else "(no agent evidence)"
    assert v.status == FAIL and v.witnesses[0]["engine_salt"] == want, v.witnesses
    j = judge(v, ev, accept_known=True)
    assert j.status == FAIL and j.red and not j.known, j.message()
    ok, why = Registry.load().get(FINDING).match(v, Context.of(ev))
    assert not ok and "salt the engine did receive" in why


def test_router_finding_is_scoped_to_its_version():
    ev = salt_leak_log("lost", version="0.5.24")
    j = judge(cache_isolation(ev), ev, accept_known=True)
    assert j.status == FAIL and j.red and not j.known


def test_timing_leak_is_known_only_when_every_timed_salt_was_lost():
    reqs = timing_run(FAST, SLOW, FAST, SLOW)
    for agent, want in (([prefix_match(r.rid, None) for r in reqs], KNOWN),
                        ([prefix_match(r.rid, None if i % 2 else r.salt) for i, r in enumerate(reqs)], FAIL),
                        ([], FAIL)):
        ev = event_log(reqs, *agent, HEADER)
        v = timing_isolation(ev)
        assert v.status == FAIL, v
        j = judge(v, ev, accept_known=True)
        assert j.status == want, (want, v.stats["salts_lost"], j.message())


def test_prefix_cache_checkers_are_leak_checkers_red_even_when_not_required():
    assert is_leak_checker("cache_isolation") and is_leak_checker("timing_isolation")
    ctx = Context([HEADER], "sglang", "0.5.23")
    for oracle in ("cache_isolation", "timing_isolation"):
        w = {"victim_rid": "x", "victim_salt": SB, "engine_salt": SB}  # the engine got the salt: no finding
        j = Policy().judge([Verdict(oracle, FAIL, "leak", [w])], ctx, {})
        assert j.status == FAIL and j.red, oracle
        assert not Policy().judge([Verdict(oracle, UNKNOWN, "unexercised")], ctx, {}).red, oracle
    # control: a checker that judges no leak is informational unless required
    assert not Policy().judge([Verdict("http_semantics", FAIL, "200 to an oversized prompt")], ctx, {}).red
