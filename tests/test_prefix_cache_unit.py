"""Prefix-cache isolation, without a cluster: the ``cache_isolation`` and ``timing_isolation``
checkers on synthetic event logs (each must FAIL, PASS and say UNKNOWN where it should), the
``sglang-router-drops-cache-salt`` finding's signature, the shared-prefix workload (salts,
diverging pairs, conversations, identical prompts, the timing probe) and the driver's
``cache_salt`` / ``after`` / ``pd_direct`` behaviour against tiny loopback servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from aiohttp import web

from kvchaos import canary
from kvchaos.oracles import FAIL, PASS, UNKNOWN, CacheIsolation, TimingIsolation, Verdict, cache_isolation, \
    timing_isolation
from kvchaos.policy import KNOWN, Context, Policy, Registry, is_leak_checker
from kvchaos.workload import Driver, EventLog, Workload, run_plans
from kvchaos.workload.plan import DEFAULT_SHARING, SHARED_MIX
from tests.fake_engine import FakeEngine

FINDING = "sglang-router-drops-cache-salt"
HEADER = {"t": -10.0, "ev": "experiment", "engine": {"name": "sglang", "version": "0.5.23"}}
SA, SB = "salt-a", "salt-b"


# --------------------------------------------------------------------------- synthetic event logs
@dataclass
class Req:
    """One request of a synthetic log: what was sent, when, and what the engine reported."""
    rid: str
    tenant: str
    prompt: str | None  # None: the plan carries no prompt text (an old log)
    salt: str | None = None
    cached: int | None = 0  # meta cached_tokens; None: the reply does not report it
    send: float = 0.0
    end: float | None = None  # default: send + 0.5
    text: str = ""  # the reply
    timing: str | None = None  # the timing probe's arm
    ttft: float | None = None  # seconds from send to the first streamed byte
    prompt_tokens: int | None = None  # default: len(prompt) (characters are tokens)


def event_log(reqs, *extra) -> list[dict]:
    """The driver's events for ``reqs`` (plan, send, first_byte, status, body, end), in time order,
    then ``extra`` events (agent evidence, a cache flush, an experiment header)."""
    ev = []
    for r in reqs:
        end = r.send + 0.5 if r.end is None else r.end
        plan = {"t": -1.0, "ev": "plan", "rid": r.rid, "tenant": r.tenant, "kind": "stream" if r.timing else "plain",
                "canaries": [c for _o, c in canary.find(r.prompt or "")], "cache_salt": r.salt, "timing": r.timing,
                "oversized": False, "expect_echo": True}
        if r.prompt is not None:
            plan["prompt"] = r.prompt
        ev.append(plan)
        ev.append({"t": r.send, "ev": "send", "rid": r.rid})
        if r.ttft is not None:
            ev.append({"t": r.send + r.ttft, "ev": "first_byte", "rid": r.rid})
        meta = {"prompt_tokens": len(r.prompt or "") if r.prompt_tokens is None else r.prompt_tokens}
        if r.cached is not None:
            meta["cached_tokens"] = r.cached
        ev += [{"t": end, "ev": "status", "rid": r.rid, "status": 200},
               {"t": end, "ev": "body", "rid": r.rid, "text": r.text, "meta": meta, "complete": True},
               {"t": end, "ev": "end", "rid": r.rid, "outcome": "ok", "latency_s": end - r.send}]
    ev.sort(key=lambda e: e["t"])  # stable: a request's events keep their order
    return ev + list(extra)


def prefix_match(rid, engine_salt) -> dict:
    """The in-engine agent's evidence: the salt the engine's prefix lookup used for ``rid``."""
    return {"t": 0.0, "ev": "agent", "agent_ev": "prefix_match", "rid": rid, "cache_salt": engine_salt}


def lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def honest(prompt: str, *earlier: str) -> int:
    """What a correct cache reports: the longest prefix shared with an earlier prompt of the same
    salt, short of the last token (the engine always computes that one)."""
    return min(max((lcp(prompt, e) for e in earlier), default=0), len(prompt) - 1)


def block(tag: str, n: int) -> str:
    """``n`` characters of filler that no other tag's block shares more than a character or two of."""
    return (tag.upper() + " " + canary.filler(random.Random(tag), n))[:n]


PUB = block("public", 200)  # a system prompt both tenants send first


def clean_run() -> dict[str, Req]:
    """A run a correct, salted prefix cache produces — cache_isolation PASS with its default
    thresholds: tenant a (salt-a) sends 6 prompts on the public prefix (5 same-salt hits); tenant b
    (salt-b) then sends 3 prompts each sharing 260 characters with one of a's — another salt's
    longer prefix, cached before it (3 cross-salt chances) — and reports only its own salt's prefix."""
    reqs, t = {}, 0.0
    for i in range(6):
        p = PUB + block(f"a{i}", 100)
        reqs[f"a{i}"] = Req(f"a{i}", "ta", p, SA, honest(p, *(r.prompt for r in reqs.values())), send=t)
        t += 1
    for i in (1, 2, 3):
        p = reqs[f"a{i}"].prompt[:260] + block(f"b{i}", 80)
        own = [r.prompt for r in reqs.values() if r.salt == SB]
        reqs[f"b{i}"] = Req(f"b{i}", "tb", p, SB, honest(p, *own), send=t)
        t += 1
    return reqs


def check(reqs: dict[str, Req], *extra, **kw) -> Verdict:
    return cache_isolation(event_log(reqs.values(), *extra), **kw)


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
ARMS = ("same_salt_hit", "same_salt_miss", "cross_salt", "never_cached")


def timing_run(hit, miss, cross, never, n=20, seed=7) -> list[Req]:
    """``n`` timed requests per arm, one at a time; each arm's TTFT drawn from ``(mean, sd)`` seconds
    with a seeded generator. Tenant a (salt-a) sends the same-salt arms, b (salt-b) the others."""
    rng = random.Random(seed)
    dist = dict(zip(ARMS, (hit, miss, cross, never)))
    order = [arm for arm in ARMS for _ in range(n)]
    rng.shuffle(order)
    out = []
    for i, arm in enumerate(order):
        a = arm.startswith("same")
        mean, sd = dist[arm]
        out.append(Req(f"r{i:03d}", "ta" if a else "tb", block(f"tp{i}", 60), SA if a else SB, cached=0,
                       send=float(i), end=i + 0.9, timing=arm, ttft=max(0.001, rng.gauss(mean, sd))))
    return out


FAST, SLOW = (0.040, 0.004), (0.120, 0.012)


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
def judge(verdict: Verdict, events: list[dict], accept_known=False):
    p = Policy(accept_known=accept_known)
    return p.judge([verdict], Context.of(events), {})


def salt_leak_log(engine_salt="lost", version="0.5.23"):
    """clean_run with b2 served a's prefix, the engine's view of every salt given by ``engine_salt``:
    "lost" (None), "kept" (the salt sent) or "none" (no agent evidence)."""
    reqs = clean_run()
    reqs["b2"].cached = lcp(reqs["b2"].prompt, reqs["a2"].prompt)
    agent = {"lost": [prefix_match(rid, None) for rid in reqs],
             "kept": [prefix_match(rid, r.salt) for rid, r in reqs.items()], "none": []}[engine_salt]
    return event_log(reqs.values(), *agent, {**HEADER, "engine": {"name": "sglang", "version": version}})


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


# --------------------------------------------------------------------------- workload
def _fingerprint(plans):
    return [(p.rid, p.tenant, p.kind, p.prompt, p.canaries, p.sharing, p.shared_chars, p.group, p.after, p.timing)
            for p in plans]


def _plans(wl):
    return (wl.mix(40) + wl.conversation("t001", turns=3) + wl.diverging("t000", "t002")
            + wl.identical(["t001", "t003"]) + wl.timing_probe("t000", "t001", n_per_arm=2, prefix=200, suffix=60))


def test_workload_is_deterministic_but_tenant_salts_are_a_fresh_nonce():
    a, b = Workload(9, n_tenants=4, salts="tenant"), Workload(9, n_tenants=4, salts="tenant")
    pa, pb = _plans(a), _plans(b)
    assert _fingerprint(pa) == _fingerprint(pb)
    assert set(a.salts) == set(b.salts) == {"t000", "t001", "t002", "t003"}
    assert all(a.salts[t] != b.salts[t] for t in a.salts), "a replay must not find the first run's cache entries"
    assert len(set(a.salts.values())) == 4, "each tenant its own salt"
    assert all(p.cache_salt == a.salts[p.tenant] for p in pa) and all(p.cache_salt == b.salts[p.tenant] for p in pb)
    assert _fingerprint(Workload(10, n_tenants=4, salts="tenant").mix(40)) != _fingerprint(a.mix(40))


def test_salt_dict_tenants_left_out_or_none_send_no_salt():
    wl = Workload(3, n_tenants=3, salts={"t000": "alpha", "t001": None})
    plans = [wl.request(wl.tenant(t)) for t in ("t000", "t001", "t002")]
    assert [p.cache_salt for p in plans] == ["alpha", None, None]
    assert all(p.cache_salt is None for p in Workload(3, n_tenants=3).mix(10))


@pytest.mark.parametrize("salts,msg", [
    ({"t000": 7}, r"cache_salt of tenant t000 must be a non-empty str .* int 7"),
    ({"t000": ""}, r"cache_salt of tenant t000 must be a non-empty str"),
    ({"t009": "x"}, r"tenants this workload does not have: \['t009'\]"),
    ("per-tenant", r"None, 'tenant' or a dict"),
])
def test_bad_salts_are_named(salts, msg):
    with pytest.raises(ValueError, match=msg):
        Workload(1, n_tenants=2, salts=salts)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("at", ["page", "mid"])
def test_diverging_pair_parts_at_each_ones_canary_on_or_inside_a_page(seed, at):
    wl = Workload(seed, n_tenants=4, page_size=64)
    a, b = wl.diverging("t000", "t001", shared=300, at=at)
    i = lcp(a.prompt, b.prompt)
    assert i == a.extra["diverge_at"] == b.extra["diverge_at"] == a.shared_chars == b.shared_chars, \
        (i, a.extra, a.canaries[0], b.canaries[0])
    assert (i % 64 == 0) if at == "page" else (i % 64 == 32), (at, i)
    for p in (a, b):
        c = p.canaries[0]
        assert p.prompt[i - 1:i - 1 + len(c)] == c, "the first differing character starts the plan's own canary"
        assert p.prompt[i] == c[1]
    assert a.group == b.group and a.sharing == b.sharing == "diverge" and (a.tenant, b.tenant) == ("t000", "t001")
    with pytest.raises(ValueError, match="'page'"):
        wl.diverging("t000", "t001", at="edge")


@pytest.mark.parametrize("seed", range(60))
def test_diverging_pair_canaries_never_share_their_first_character(seed):
    """Seed 4 once gave two canaries with one first character: the prompts parted one past diverge_at."""
    for at in ("page", "mid"):
        a, b = Workload(seed, n_tenants=4, page_size=64).diverging("t000", "t001", shared=300, at=at)
        assert a.canaries[0][1] != b.canaries[0][1], (a.canaries[0], b.canaries[0])
        assert lcp(a.prompt, b.prompt) == a.extra["diverge_at"]
        assert (a.extra["diverge_at"] % 64 == 0) == (at == "page")


def test_conversation_turns_resend_the_previous_prompt_and_wait_for_it():
    wl = Workload(5, n_tenants=3)
    turns = wl.conversation("t002", turns=4)
    sys_text, sys_cs = wl.tenant_sys["t002"]
    assert turns[0].prompt.startswith(wl.public + sys_text) and turns[0].after is None
    assert set(sys_cs) <= set(turns[0].canaries)
    for k in range(1, 4):
        prev, cur = turns[k - 1], turns[k]
        assert cur.prompt.startswith(prev.prompt[:-1]) and not cur.prompt.startswith(prev.prompt), \
            "the previous prompt, its trailing '[' dropped"
        assert cur.shared_chars == len(prev.prompt) - 1
        assert cur.after == prev.rid
        assert cur.canaries[:len(prev.canaries)] == prev.canaries and len(cur.canaries) > len(prev.canaries)
    assert {t.group for t in turns} != {None} and len({t.group for t in turns}) == 1
    assert [t.extra["turn"] for t in turns] == [1, 2, 3, 4] and {t.sharing for t in turns} == {"conversation"}


def test_identical_gives_every_tenant_the_same_prompt():
    wl = Workload(6, n_tenants=4)
    plans = wl.identical(["t000", "t001", "t003"])
    assert len({p.prompt for p in plans}) == 1 and [p.tenant for p in plans] == ["t000", "t001", "t003"]
    assert len({p.rid for p in plans}) == 3 and len({p.group for p in plans}) == 1
    assert all(p.shared_chars == len(p.prompt) - 1 and p.sharing == "identical" for p in plans)
    with pytest.raises(ValueError, match=">= 2 tenants"):
        wl.identical(["t000"])


def test_every_plan_carries_its_canaries_with_distinct_first_characters():
    wl = Workload(7, n_tenants=4, salts="tenant", page_size=16)
    plans = _plans(wl) + wl.mix(60, lengths=(200, 600))
    for p in plans:
        firsts = [c[1] for c in p.canaries]
        assert p.canaries and len(set(firsts)) == len(firsts), (p.rid, p.sharing, p.canaries)
        assert all(c in p.prompt for c in p.canaries), (p.rid, p.sharing)
        assert sorted(c for _o, c in canary.find(p.prompt)) == sorted(p.canaries), (p.rid, p.sharing)


def test_shared_mix_shares_prefixes_and_none_turns_it_off():
    plans = Workload(12, n_tenants=6).mix(120, sharing=SHARED_MIX)
    modes = Counter(p.sharing for p in plans)
    assert sum(n for m, n in modes.items() if m != "none") > len(plans) / 2, modes
    assert set(modes) == set(SHARED_MIX), modes
    assert all(p.shared_chars > 0 and p.group for p in plans if p.sharing != "none")
    # pairs: the second is sent once the first ended (its prefix is cached by then)
    by = {p.rid: p for p in plans}
    assert all(by[p.after].group == p.group for p in plans if p.after and p.sharing in ("diverge", "identical"))
    assert DEFAULT_SHARING == SHARED_MIX  # every suite's traffic exercises the prefix cache
    default = Counter(p.sharing for p in Workload(12, n_tenants=6).mix(120))
    assert sum(n for m, n in default.items() if m != "none") > 60, default
    flat = Workload(12, n_tenants=6).mix(60, sharing={"none": 1})
    assert {p.sharing for p in flat} == {"none"} and all(p.group is None and p.shared_chars == 0 for p in flat)


@pytest.mark.parametrize("sharing", [None, SHARED_MIX, {"conversation": 1}, {"diverge": 1, "identical": 1}, {"none": 1}])
def test_mix_returns_exactly_n_plans(sharing):
    for n in (1, 2, 3, 4, 7, 25):
        plans = Workload(13, n_tenants=3).mix(n, sharing=sharing)
        assert len(plans) == n, (sharing, n, len(plans))
        rids = {p.rid for p in plans}
        assert all(p.after is None or p.after in rids for p in plans), "an after link into a trimmed plan"


@pytest.mark.parametrize("salts", [None, {"t000": "same", "t001": "same"}, {"t000": "only-a"}])
def test_timing_probe_needs_two_different_salts(salts):
    with pytest.raises(ValueError, match="two tenants with different salts"):
        Workload(20, n_tenants=2, salts=salts).timing_probe("t000", "t001")


def test_timing_probe_chains_every_request_with_a_warm_up_before_each_timed_one():
    wl = Workload(21, n_tenants=2, salts="tenant")
    plans = wl.timing_probe("t000", "t001", n_per_arm=6, prefix=200, suffix=60)
    assert len(plans) == 2 * 4 * 6
    assert plans[0].after is None and all(p.after == q.rid for q, p in zip(plans, plans[1:])), "one at a time"
    timed = [p for p in plans if p.timing]
    assert Counter(p.timing for p in timed) == {arm: 6 for arm in ARMS}
    for warm, t in zip(plans[0::2], plans[1::2]):
        assert warm.timing is None and warm.tenant == "t000" and warm.kind == "plain", "an untimed warm-up of a"
        assert t.timing in ARMS and t.kind == "stream"
        assert t.tenant == ("t000" if t.timing.startswith("same") else "t001")
        assert t.cache_salt == wl.salts[t.tenant]
        shared = lcp(warm.prompt, t.prompt)
        if t.timing in ("same_salt_hit", "cross_salt"):
            assert shared >= 200, (t.timing, shared)  # the warm-up cached the timed prompt's prefix
        else:
            assert shared < 32, (t.timing, shared)  # another prefix
    with pytest.raises(ValueError, match="n_per_arm"):
        wl.timing_probe("t000", "t001", n_per_arm=0)


# --------------------------------------------------------------------------- driver
def _sglang_reply(text: str, body: dict) -> dict:
    return {"text": text, "output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}, "cached_tokens": 0,
                                                          "prompt_tokens": len(body.get("text") or "")}}


@contextlib.asynccontextmanager
async def serve(handler):
    """An aiohttp server on a free loopback port answering POST /generate with ``handler``."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("endpoint", ["generate", "completions", "chat"])
def test_cache_salt_reaches_the_server_only_when_set(endpoint):
    wl = Workload(30, n_tenants=2, salts={"t000": "salt-of-a"})
    salted, plain = wl.request(wl.tenant("t000"), endpoint=endpoint), wl.request(wl.tenant("t001"), endpoint=endpoint)
    with FakeEngine() as eng, EventLog() as log:
        ends = run_plans(eng.url, [salted, plain], log, timeout_s=10)
        bodies = {b["rid"]: b for _path, b in eng.requests}
    assert [e["outcome"] for e in ends] == ["ok", "ok"]
    assert bodies[salted.rid]["cache_salt"] == "salt-of-a"
    assert "cache_salt" not in bodies[plain.rid], bodies[plain.rid]


def test_a_plan_with_after_is_sent_only_once_the_earlier_one_ended():
    wl = Workload(31, n_tenants=3)
    first, independent = wl.request(wl.tenant("t000")), wl.request(wl.tenant("t001"))
    second = wl.request(wl.tenant("t002"))
    second.after = first.rid
    arrived, replied = {}, {}

    async def handler(request):
        body = await request.json()
        arrived[body["rid"]] = time.monotonic()
        if body["rid"] == first.rid:
            await asyncio.sleep(0.4)  # the earlier request is slow
        replied[body["rid"]] = time.monotonic()
        return web.json_response(_sglang_reply("ok", body))

    async def main():
        async with serve(handler) as url:
            log = EventLog()
            ends = await Driver(url, log, concurrency=8, timeout_s=10).run([second, independent, first])
            return log, ends

    log, ends = asyncio.run(main())
    assert {e["outcome"] for e in ends} == {"ok"}
    assert arrived[second.rid] >= replied[first.rid], "the later turn arrived while the earlier one was in flight"
    assert arrived[independent.rid] < replied[first.rid], "a plan without after is not held back"
    t = {(e["ev"], e["rid"]): e["t"] for e in log.records if e.get("rid")}
    assert t[("send", second.rid)] >= t[("end", first.rid)]


def _pd_run(prefill_status=200):
    wl = Workload(32, n_tenants=2, salts={"t000": "salt-pd"})
    plans = [wl.request(wl.tenant("t000")), wl.request(wl.tenant("t001"))]
    got = {"prefill": {}, "decode": {}}

    def role(name, status):
        async def handler(request):
            body = await request.json()
            got[name][body["rid"]] = body
            if status != 200:
                return web.json_response({"error": {"message": f"{name} refused"}}, status=status)
            return web.json_response(_sglang_reply(f"{name} says {body['rid']}", body))
        return handler

    async def main():
        async with serve(role("prefill", prefill_status)) as pf, serve(role("decode", 200)) as dc:
            log = EventLog()
            pd = {"prefill": pf, "decode": dc, "bootstrap_host": "10.1.2.3", "bootstrap_port": 8998}
            ends = await Driver(_dead_url(), log, timeout_s=10, pd_direct=pd).run(plans)
            return log, ends

    log, ends = asyncio.run(main())
    return plans, got, log, ends


def test_pd_direct_sends_the_same_body_and_bootstrap_to_prefill_and_decode():
    plans, got, log, ends = _pd_run()
    assert [e["outcome"] for e in ends] == ["ok", "ok"], ends  # nothing went to base_url (nobody listens)
    rooms = set()
    for p in plans:
        pre, dec = got["prefill"][p.rid], got["decode"][p.rid]
        assert pre == dec, "prefill and decode get the same body"
        assert (dec["bootstrap_host"], dec["bootstrap_port"]) == ("10.1.2.3", 8998)
        assert isinstance(dec["bootstrap_room"], int) and dec["text"] == p.prompt
        assert dec.get("cache_salt") == p.cache_salt and ("cache_salt" in dec) == (p.cache_salt is not None)
        rooms.add(dec["bootstrap_room"])
        (body,) = [e for e in log.records if e["ev"] == "body" and e["rid"] == p.rid]
        assert body["text"] == f"decode says {p.rid}", "the reply logged is decode's"
        (leg,) = [e for e in log.records if e["ev"] == "prefill_leg" and e["rid"] == p.rid]
        assert leg["status"] == 200 and leg["error"] is None
    assert len(rooms) == 2, "a bootstrap room per request"


def test_pd_direct_logs_a_failed_prefill_leg_beside_decodes_reply():
    plans, _got, log, ends = _pd_run(prefill_status=503)
    assert [e["outcome"] for e in ends] == ["ok", "ok"]
    legs = [e for e in log.records if e["ev"] == "prefill_leg"]
    assert len(legs) == 2 and all(e["status"] == 503 and "prefill refused" in e["error"] for e in legs), legs


def test_after_a_rid_not_in_the_run_is_refused_before_anything_is_sent():
    p = Workload(33).request()
    p.after = "nobody-0001"
    log = EventLog()
    with pytest.raises(ValueError, match="not in this run"):
        run_plans(_dead_url(), [p], log)
    assert log.records == []
