"""The shared-prefix workload (salts, diverging pairs, conversations, identical prompts, the timing
probe) and the driver's ``cache_salt`` / ``after`` / ``pd_direct`` behaviour against tiny loopback
servers, without a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter

import pytest
from aiohttp import web

from kvchaos import canary
from kvchaos.workload import Driver, EventLog, Workload, run_plans
from kvchaos.workload.plan import DEFAULT_SHARING, SHARED_MIX
from tests.fake_engine import FakeEngine
from tests.prefix_cache_logs import ARMS, lcp


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
