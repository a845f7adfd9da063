"""Verdict integrity: every path by which an observed leak, or a blind run, used to end green — each a
planted event log through the real oracles and policy, one where it must be red and, where it
applies, one where it may pass."""

import random
from pathlib import Path

import pytest

from kvchaos import canary, oracles
from kvchaos.cluster.spec import ClusterSpec
from kvchaos.history import History
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict
from kvchaos.policy import Context, Policy, PolicyError, Registry, not_reproduced, version_matches
from kvchaos.probe.contract import recital

REPO = Path(__file__).resolve().parents[1]
HEADER = {"ev": "experiment", "engine": {"name": "sglang", "version": "0.5.23"}}


def plan(rid, tenant, cs, **kw):
    return {"ev": "plan", "rid": rid, "tenant": tenant, "canaries": cs, "expect_echo": True, "oversized": False,
            "kind": "plain", **kw}


def reply(rid, text, status=200, outcome=None, complete=True, raw=None, error=None, wall=100.0):
    """A reply as the driver logs it; every request is sent at ``wall`` and takes 1 s (all concurrent)."""
    return [{"ev": "send", "rid": rid, "wall": wall}, {"ev": "status", "rid": rid, "status": status},
            {"ev": "body", "rid": rid, "text": text, "error": error, "raw": raw, "complete": complete,
             "meta": {"finish_reason": {"type": "stop"}}},
            {"ev": "end", "rid": rid, "outcome": outcome or ("ok" if status == 200 else "http_error"), "latency_s": 0.3,
             "wall": wall + 1.0}]


def echo(cs):
    return recital(cs)  # what the probe answers: kvchaos.probe.contract


def crowd(n=30, seed=1, prefix="c"):
    rng = random.Random(seed)
    ev = []
    for i in range(n):
        cs = canary.mint(rng, 2)
        ev += [plan(f"{prefix}{i}", f"t{i % 4}", cs)] + reply(f"{prefix}{i}", echo(cs))
    return ev


def judge(ev, required=None, registry=None, **policy):
    """As the experiment runner judges: the checkers asked for plus those that always run, the
    registry handed to them, the policy's gate and judgement."""
    p = Policy(**policy)
    checks, claimed = p.checks([oracles.Isolation(), oracles.Sensitivity(), oracles.Liveness(bound_s=60)])
    h = History(ev)
    return p.judge(p.gate(checks.check(h, registry), h), Context.of(h, (), registry), required or {}, claimed=claimed)


def known_for(j, oracle: str) -> list:
    """The KNOWN items of one checker (integrity judges the same replies and may match a finding's
    mechanism that isolation's witness does not: the run is red either way)."""
    return [i for i in j.known if i.verdict.oracle == oracle]


def agent(agent_ev, **fields):
    return {"ev": "agent", "agent_ev": agent_ev, "source": "agent", "wall": 100.5, **fields}


def stale_pages(owner, victim, pages, written, holder=None):
    """Decode's and prefill's evidence that ``victim`` read ``pages`` decode pages of which its
    transfer wrote ``written`` (chunks of up to 5 pages), the rest last held by ``holder``."""
    pg = list(range(1000, 1000 + pages))
    ev = [agent("write_end", rid=owner, room=1, pages=pages, dst_pages=pg, dst_pages_total=pages, dst_page_offset=0,
                ret=0, wall=100.2),
          agent("kv_prealloc", rid=victim, room=2, dst_pages=pg, dst_pages_total=pages,
                prev_holders=[[0, pages, holder or owner]], wall=100.3)]
    off = 0
    while off < written:
        n = min(5, written - off)
        ev.append(agent("write_end", rid=victim, room=2, pages=n, dst_pages=pg[off:off + n], dst_pages_total=n,
                        dst_page_offset=off, ret=0, wall=100.4))
        off += n
    return ev


# 1 — a short transfer's leak was an xfail whatever isolation said; now KNOWN only with its mechanism
def _short_log(victim_targeted=True, mechanism=True):
    rng = random.Random(2)
    ev = [HEADER] + crowd()
    own, foreign = canary.mint(rng, 2), ev[1]["canaries"]
    ev += [plan("s1", "t5", own)] + reply("s1", foreign[0][1:-1] + "][")  # decoded over c0's pages
    fired = agent("fault_fired", kind="short", rid="s1" if victim_targeted else "c9", pages_sent=1, pages_reserved=10)
    return ev + [fired] + (stale_pages("c0", "s1", 10, 1) if mechanism else [])


def test_short_transfer_leak_is_known_only_with_its_witness_and_red_unless_accepted():
    j = judge(_short_log(), {"isolation": PASS})
    assert j.status == FAIL and j.red and j.known, "a known finding is red unless accepted"
    assert j.known[0].finding.id == "sglang-short-transfer-unchecked"
    j = judge(_short_log(), {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and not j.red
    # the victim was not a request the fault shorted: a leak, plain and simple
    j = judge(_short_log(victim_targeted=False), {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation")
    # the victim was shorted, but the engines' events do not show what it read: a plain FAIL
    j = judge(_short_log(mechanism=False), {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation")
    # another engine version: the entry does not apply
    ev = _short_log()
    ev[0] = {**HEADER, "engine": {"name": "sglang", "version": "0.5.24"}}
    assert judge(ev, {"isolation": PASS}, accept_known=True).status == FAIL


def test_an_owner_never_sent_cannot_have_left_its_bytes_in_the_victims_pages():
    """KNOWN only on evidence that holds together: the pages' last holder named by decode is a request of this
    log that was never sent — nothing of it reached any page, so the short transfer explains nothing."""
    ev = _short_log()
    ev = [e for e in ev if not (e.get("rid") == "c0" and e["ev"] in ("send", "status", "body", "end"))]
    ev += [{"ev": "end", "rid": "c0", "outcome": "not_sent", "latency_s": 0.0}] + crowd(10, seed=9, prefix="x")
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()


@pytest.mark.parametrize("ended_before_kill_s,known", [(40.0, False), (0.5, True), (-10.0, True)])
def test_a_hang_is_the_decode_kill_only_if_it_was_in_flight_when_decode_died(ended_before_kill_s, known):
    """sglang-decode-death-unanswered: every witness a timeout, in an experiment where decode was SIGKILLed —
    and in flight when it was: a request that timed out 40 s before the kill is not the kill's."""
    kill_at = 200.0
    ev = [HEADER] + crowd()
    ev += [plan("h1", "t3", canary.mint(random.Random(5), 2)), {"ev": "send", "rid": "h1", "wall": 100.0},
           {"ev": "end", "rid": "h1", "outcome": "timeout", "latency_s": 60.0,
            "wall": kill_at - ended_before_kill_s}]
    ev += [{"ev": "fault", "action": "fired", "kind": "sigkill", "role": "decode", "injector": "process",
            "at": kill_at, "wall": kill_at}]
    v = oracles.liveness(ev, bound_s=30)
    assert v.status == FAIL and {w.get("rid") for w in v.witnesses} == {"h1"}, v
    j = Policy(accept_known=True).judge([v], Context.of(History(ev)), {"liveness": PASS})
    assert (j.status == "known") is known, j.message()
    if known:
        assert j.known[0].finding.id == "sglang-decode-death-unanswered"


def test_a_holder_decode_allocated_after_the_victims_pages_explains_nothing():
    """Decode's events contradict themselves: the pages' holder was first pre-allocated after decode gave the
    victim those pages. Evidence that does not hold together accepts nothing as KNOWN."""
    ev = _short_log()
    ev.append(agent("kv_prealloc", rid="c0", room=9, dst_pages=list(range(1000, 1010)), dst_pages_total=10,
                    prev_holders=[[0, 10, None]], wall=100.9))  # the victim's came at 100.3
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()
    ev[-1]["wall"] = 100.0  # allocated before: consistent, KNOWN
    assert judge(ev, {"isolation": PASS}, accept_known=True).status == "known"


@pytest.mark.parametrize("page_size,unwritten,known", [(1, 1, False), (1, 9, False), (1, 10, True), (16, 1, True)])
def test_the_stale_pages_must_be_able_to_hold_what_was_recited(page_size, unwritten, known):
    """One one-token page holding the owner's bytes cannot explain a 10-character canary: the explanation
    must cover the witness's characters (pages x tokens per page, decode's kv_prealloc.page_size)."""
    ev = [e for e in _short_log() if not (e["ev"] == "agent" and e["agent_ev"] in ("kv_prealloc", "write_end"))]
    ev += stale_pages("c0", "s1", unwritten + 1, 1)
    for e in ev:
        if e["ev"] == "agent" and e["agent_ev"] == "kv_prealloc":
            e["page_size"] = page_size
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert (j.status == "known") is known, j.message()


def test_a_page_holder_under_the_engines_own_id_is_named_by_the_canaries_decode_read_in_its_input():
    """An OpenAI-route request through sglang-router reaches decode under a uuid of decode's, not the
    client's rid: the pages it left are held by that uuid, which no plan names. Decode's own record of
    the canaries in that request's input text (``kv_prealloc.canaries``) makes it a carrier of the
    recited canary, so the shorted victim's leak is the finding; without that record it stays a plain
    FAIL (a fuzz find, 2026-12-05, stayed NEW for want of it)."""
    def log(carried):
        rng = random.Random(2)
        ev = [HEADER] + crowd()
        own, foreign = canary.mint(rng, 2), ev[1]["canaries"]
        ev += [plan("s1", "t5", own)] + reply("s1", foreign[0][1:-1] + "][")
        ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=1, pages_reserved=10)]
        ev += stale_pages("a3fbefd1c66f452f", "s1", 10, 1)
        ev += [agent("kv_prealloc", rid="a3fbefd1c66f452f", room=1, dst_pages=list(range(1000, 1010)),
                     dst_pages_total=10, prev_holders=[[0, 10, None]], wall=100.1,
                     **({"canaries": sorted({foreign[0], "[AAAAAAAAAA]"})} if carried else {}))]
        return ev
    j = judge(log(carried=True), {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-short-transfer-unchecked"
    j = judge(log(carried=False), {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation")


def test_pages_holding_an_earlier_replys_generated_tokens_explain_the_same_canary_recited_again():
    """A leak of a leak: the victim's unwritten pages were decode's pages for an earlier request's
    generated tokens (not its pre-allocated prompt pages), and that reply recited the canary: decode's
    evidence explains the recital. The same pages as the earlier request's prompt pages, or a reply
    without the canary, explain nothing."""
    def log(generated=True, recited=True):
        rng = random.Random(2)
        ev = [HEADER] + crowd()
        own, foreign = canary.mint(rng, 2), ev[1]["canaries"]
        ev += [plan("g1", "t6", canary.mint(rng, 1))] + reply("g1", (foreign[0][1:-1] if recited else "QQQQ") + "][")
        ev += [plan("s1", "t5", own)] + reply("s1", foreign[0][1:-1] + "][")
        ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=1, pages_reserved=10)]
        ev += [e for e in stale_pages("g1", "s1", 10, 1) if e.get("rid") == "s1"]  # s1's prealloc and write
        g1_pages = list(range(2000, 2010)) if generated else list(range(1000, 1010))
        ev += [agent("kv_prealloc", rid="g1", room=1, dst_pages=g1_pages, dst_pages_total=10,
                     prev_holders=[[0, 10, None]], wall=100.1),
               agent("write_end", rid="g1", room=1, pages=10, dst_pages=g1_pages, dst_pages_total=10,
                     dst_page_offset=0, ret=0, wall=100.15)]
        return ev
    from kvchaos.oracles import provenance

    def s1_explained(**kw):
        ev = log(**kw)
        v = oracles.isolation(ev)
        (w,) = [w for w in v.witnesses if w["victim_rid"] == "s1"]  # g1's own recital is a witness of its own
        return provenance.explains(ev, w)
    ok, why, sp = s1_explained()
    assert ok and "g1" in why and sp["generated_by"] == {"g1": 9}, why
    for kw in ({"recited": False}, {"generated": False}):
        ok, why, _sp = s1_explained(**kw)
        assert not ok, (kw, why)


# a chimera (a recital nobody minted) in a shorted victim is the finding only when every character of it
# is copyable from the canaries its unwritten pages' writers carried (a fresh clone's make test at
# ec1c9ad went red on one)
def _chimera_log(recital, holder_canaries=("[AYF2B54TKH]", "[KGK5WPMR6J]")):
    rng = random.Random(4)
    ev = [HEADER] + crowd()
    ev += [plan("o1", "t1", list(holder_canaries))] + reply("o1", echo(holder_canaries))
    ev += [plan("s1", "t5", canary.mint(rng, 2))] + reply("s1", recital + "][")
    ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=1, pages_reserved=10)]
    return ev + stale_pages("o1", "s1", 10, 1)


def test_a_chimera_of_stale_canaries_is_the_short_transfer_finding():
    ev = _chimera_log("AYF2B5WPMR6J")  # 'AYF2B5' of one, then after the shared '5' the rest of the other
    v = oracles.isolation(ev)
    assert v.status == FAIL and [w["origin"] for w in v.witnesses] == ["unknown"], v.witnesses
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-short-transfer-unchecked", j.message()


@pytest.mark.parametrize("recital, holders", [
    ("AYF2B5WPMR6Q", None),  # its last character: '6Q' in no stale canary
    ("AYF2B5WPMR6J", ("[AYF2B54TKH]", "[KGK7WPMR6J]")),  # '5W' is nowhere: the chain came from elsewhere
    ("AYF2B5WPMR6J", ("[QQQQQQQQQQ]",)),  # the unwritten pages hold neither
])
def test_a_chimera_not_copyable_from_the_stale_pages_stays_a_leak(recital, holders):
    ev = _chimera_log(recital, *([holders] if holders else []))
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()


def test_copyable_follows_the_probes_partial_matches():
    from kvchaos.oracles.provenance import _copyable

    pool = {"AYF2B54TKH", "KGK5WPMR6J"}
    assert _copyable("AYF2B5WPMR6J", pool) == []
    assert _copyable("AYF2B5WPMR6Q", pool) == ["R6Q"]
    # 'a b ? y': the two characters before the current one matched, the current one did not ('BX' of
    # another canary put X after AB; then D follows 'AB?' in the first)
    assert _copyable("ABXD", {"ABCD", "QBX"}) == [] and _copyable("ABXE", {"ABCD", "QBX"}) == ["BXE"]
    # ... the first of them the recital's opening '[': a canary's third character after its first
    assert _copyable("AXC", {"ABCD", "QAX"}) == [] and _copyable("AXE", {"ABCD", "QAX"}) == ["AXE"]


# the same chimera read page by page: a stale canary cut short where its next page holds another request's
# byte, the recital going on with what the copying head's partial match finds there. Soak run of
# 2026-12-04 at 2232160: 'QGGVIPO5FKMQ67', the stale 'QGGVIPU6UA' written by an EARLIER experiment's
# request on the same cluster, cut after 'P' in the victim's pages; 'O' from '...DIYO...' (x_{j-2} = 'I')
def _spliced_logs():
    e_prompt = "aa [QGGVIPU6UA] bb"
    o_prompt = "cc [QXXSDIYO5H] dd"
    e_pages = list(range(2000, 2000 + len(e_prompt)))
    o_pages = list(range(3000, 3000 + len(o_prompt)))
    earlier = [HEADER, plan("e1", "t7", ["[QGGVIPU6UA]"], prompt=e_prompt)] + reply("e1", "QGGVIPU6UA][")
    earlier += [agent("kv_prealloc", rid="e1", room=9, dst_pages=e_pages, dst_pages_total=len(e_pages), page_size=1,
                      prev_holders=[])]
    cut = [e_pages[e_prompt.index("[QGGVIP") + i] for i in range(7)]  # '[QGGVIP' and not the rest
    mid = [o_pages[o_prompt.index("[QXX") + i] for i in range(12)]  # '[QXXSDIYO5H]'
    victim_pages = [5000] + cut + mid
    ev = [HEADER] + crowd()
    ev += [plan("o1", "t1", ["[QXXSDIYO5H]"], prompt=o_prompt)] + reply("o1", "QXXSDIYO5H][")
    ev += [agent("kv_prealloc", rid="o1", room=1, dst_pages=o_pages, dst_pages_total=len(o_pages), page_size=1,
                 prev_holders=[]),
           agent("write_end", rid="o1", room=1, pages=len(o_pages), dst_pages=o_pages, dst_pages_total=len(o_pages),
                 dst_page_offset=0, ret=0, wall=100.2)]
    rng = random.Random(5)
    own = canary.mint(rng, 1)
    ev += [plan("s1", "t5", own, prompt="z" * len(victim_pages))] + reply("s1", "QGGVIPO5H][")
    ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=1, pages_reserved=len(victim_pages)),
           agent("kv_prealloc", rid="s1", room=2, dst_pages=victim_pages, dst_pages_total=len(victim_pages),
                 page_size=1, prev_holders=[[1, len(cut), "e1"], [1 + len(cut), len(mid), "o1"]], wall=100.3),
           agent("write_end", rid="s1", room=2, pages=1, dst_pages=[5000], dst_pages_total=1, dst_page_offset=0,
                 ret=0, wall=100.4)]
    return earlier, ev


def test_a_chimera_read_off_the_pages_as_they_sat_is_the_finding_with_the_clusters_evidence():
    earlier, ev = _spliced_logs()
    reg = canary.Registry()
    for log in (earlier, ev):
        h = History(log)
        reg.add_plans(h.plans, "test")
        reg.add_page_evidence(h.records)
    j = judge(ev, {"isolation": PASS}, registry=reg, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-short-transfer-unchecked", j.message()
    # the victim's log alone cannot tell what the earlier request left in those pages: it stays a leak
    alone = canary.Registry()
    alone.add_plans(History(ev).plans, "test")
    j = judge(ev, {"isolation": PASS}, registry=alone, accept_known=True)
    assert j.status == FAIL and j.red, j.message()


def test_the_context_reading_follows_the_copying_heads_best_match():
    from kvchaos.oracles.provenance import UNKNOWN_CHAR, _copied_from_context

    ctx = "xx [QGGVIP[QXXSDIYO5H] yy"
    assert _copied_from_context("QGGVIPO5H", ctx) == []  # cut after P: the partial match 'I?O' wins
    assert _copied_from_context("QGGVIPU", ctx) == ["VIPU"[1:]]  # 'U' is in no page the victim read
    # where 'P' is followed by a payload character, that one wins (score 80), not the partial match
    assert _copied_from_context("QGGVIPO", "xx [QGGVIPU6UA] [QXXSDIYO5H]") == ["IPO"]
    # an unreadable page may hold anything, but never stands in where no page matches at all
    assert _copied_from_context("QGGVIPO", "xx [QGGVIP" + UNKNOWN_CHAR * 3) == []
    # ... and the reply's own earlier text is no anchor for one (its third 'Z' repeats its second: a match
    # in what decode generated, as the probe's loops '3WMC3WMC...' are)
    assert _copied_from_context("ZZZ", UNKNOWN_CHAR * 20) == ["ZZ"]


# a chimera opening the reply: its first character came from prefill, which read the prompt whole; decode's
# next step reads the victim's last prompt pages as they sat — stale filler, which matches nothing — so the
# copying head attends everywhere alike and emits its values' most frequent character. Fresh clones of
# 2026-12-06 (runs 7 and 8 at 3fd1d24, c1233c4): 'GCKC5CVN', 'C' the most frequent character of the stale
# 'W54CKC5CVN' the victim read; the reading that put a '[' before every recital left it a leak
def test_the_context_reading_of_a_recital_that_opens_the_reply():
    from kvchaos.oracles.provenance import UNKNOWN_CHAR, _copied_from_context

    ctx = "had [OQJHB646FZ] life [IHXXNWYMKA] by [W54CKC5CVN] wahad years be"
    assert _copied_from_context("GCKC5CVN", ctx, "") == []  # 'C' ties ']' as the values' most frequent
    assert _copied_from_context("GCKC5CVN", ctx) == ["GC"]  # after a '[' the first characters match: W, O, I
    assert "GQ" in _copied_from_context("GQKC5CVN", ctx, "")  # 'Q' is not the most frequent
    assert _copied_from_context("GCKC5CVN", ctx + UNKNOWN_CHAR, "") == ["GC"]  # an unreadable page could outvote it
    # what decode generated before the piece holds keys too: a recital repeating the reply's own earlier text
    assert _copied_from_context("KLM", "x [QZ] y", "KLM][") == []
    assert _copied_from_context("KLM", "x [QZ] y") == ["KL", "KLM"]


def _opening_log(last_written, more=()):
    """o1's pages (holding 'W54CKC5CVN' and ``more``) read by s1, whose transfer wrote only its first page
    (and its last, ``last_written``); s1's reply opens with 'G' (its own canary's, from prefill) then
    'CKC5CVN' off the stale pages."""
    o_canaries = ["[W54CKC5CVN]", *more]
    o_prompt = "had " + " life ".join(o_canaries) + " wahad years be"
    o_pages = list(range(3000, 3000 + len(o_prompt)))
    ev = [HEADER] + crowd()
    ev += [plan("o1", "t1", o_canaries, prompt=o_prompt)] + reply("o1", echo(o_canaries))
    ev += [agent("kv_prealloc", rid="o1", room=1, dst_pages=o_pages, dst_pages_total=len(o_pages), page_size=1,
                 prev_holders=[]),
           agent("write_end", rid="o1", room=1, pages=len(o_pages), dst_pages=o_pages, dst_pages_total=len(o_pages),
                 dst_page_offset=0, ret=0, wall=100.2)]
    v_pages = [5000] + o_pages[1:]
    written = [0] + ([len(v_pages) - 1] if last_written else [])
    ev += [plan("s1", "t5", ["[G5NXECPQXX]"], prompt="z" * (len(v_pages) - 1) + "[")] + reply("s1", "GCKC5CVN][")
    ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=len(written), pages_reserved=len(v_pages)),
           agent("kv_prealloc", rid="s1", room=2, dst_pages=v_pages, dst_pages_total=len(v_pages), page_size=1,
                 prev_holders=[[1, len(v_pages) - 1, "o1"]], wall=100.3)]
    ev += [agent("write_end", rid="s1", room=2, pages=1, dst_pages=[v_pages[i]], dst_pages_total=1, dst_page_offset=i,
                 ret=0, wall=100.4) for i in written]
    return ev


# pages decode gave a writer for its generated tokens hold its reply, whatever the writer's prompt carried:
# run 7 of 2026-12-06, 'B552GLC7' off the pages of an earlier victim that had recited 'B552G2AG3C' (in this
# test the writer belongs to an earlier experiment on the same cluster: the session's registry keeps its
# reply and decode's pre-allocation of it)
def _generated_pages_logs(recital):
    rng = random.Random(6)
    earlier = [HEADER, plan("g1", "t2", canary.mint(rng, 1))] + reply("g1", "B552G2AG3C][")
    earlier += [agent("kv_prealloc", rid="g1", room=1, dst_pages=[4100], dst_pages_total=1, page_size=1,
                      prev_holders=[])]
    g_pages = list(range(4000, 4020))  # not g1's pre-allocated page: decode gave them to it for its reply
    v_pages = [5000] + g_pages
    ev = [HEADER] + crowd()
    ev += [plan("s1", "t5", canary.mint(rng, 1), prompt="z" * len(v_pages))] + reply("s1", recital + "][")
    ev += [agent("fault_fired", kind="short", rid="s1", pages_sent=1, pages_reserved=len(v_pages)),
           agent("kv_prealloc", rid="s1", room=2, dst_pages=v_pages, dst_pages_total=len(v_pages), page_size=1,
                 prev_holders=[[1, len(g_pages), "g1"]], wall=100.3),
           agent("write_end", rid="s1", room=2, pages=1, dst_pages=[5000], dst_pages_total=1, dst_page_offset=0,
                 ret=0, wall=100.4)]
    return earlier, ev


def _session_registry(*logs, pages=True):
    reg = canary.Registry()
    for log in logs:
        h = History(log)
        reg.add_plans(h.plans, "test")
        if pages:
            reg.add_page_evidence(h.records)
    return reg


def test_a_chimera_from_a_writers_generated_pages_is_the_finding_only_with_its_reply():
    earlier, ev = _generated_pages_logs("B552G2AG3C")
    j = judge(ev, {"isolation": PASS}, registry=_session_registry(earlier, ev), accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-short-transfer-unchecked", j.message()
    # a character g1 never generated ('Q' after 'AG') is not copyable from its pages
    earlier, bad = _generated_pages_logs("B552G2AGQC")
    j = judge(bad, {"isolation": PASS}, registry=_session_registry(earlier, bad), accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()
    # without the session's page evidence, g1's pages' bytes are unknown: a leak
    j = judge(ev, {"isolation": PASS}, registry=_session_registry(earlier, ev, pages=False), accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()


def test_a_chimera_opening_the_reply_is_the_finding_only_as_the_pages_sat():
    ev = _opening_log(last_written=False)
    v = oracles.isolation(ev)
    assert [w["matched"] for w in v.witnesses if w["victim_rid"] == "s1"] == ["GCKC5CVN"], v.witnesses
    j = judge(ev, {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-short-transfer-unchecked", j.message()
    # its last page written by its own transfer: decode read the prompt's '[' there, and after '[' the head
    # copies a canary's first character, never this 'C'
    j = judge(_opening_log(last_written=True), {"isolation": PASS}, accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()
    # stale pages whose most frequent character is not 'C' (']' of four canaries outvotes its three)
    j = judge(_opening_log(False, ("[OQJHB646FZ]", "[IHXXNWYMKA]", "[PQRSTUVWXY]")), {"isolation": PASS},
              accept_known=True)
    assert j.status == FAIL and j.red and not known_for(j, "isolation"), j.message()


# a late write into pages decode released on its drain-ack timeout is KNOWN; any other late write is a FAIL
def _late_write_log(outcome):
    ag = {"ev": "agent", "source": "agent"}
    ev = [HEADER, {**ag, "agent_ev": "kv_released", "room": 7, "rid": "v1", "wall": 10.0},
          {**ag, "agent_ev": "write_end", "room": 7, "rid": "v1", "pages": 300, "wall_start": 5.0, "wall": 12.0}]
    if outcome is not None:
        ev.insert(1, {**ag, "agent_ev": "deferred_release", "room": 7, "rid": "v1", "outcome": outcome, "wall": 10.0})
    return ev


def test_a_late_write_is_known_only_into_pages_released_on_the_deferred_timeout():
    p = Policy(accept_known=True)
    for outcome, want in (("timeout", "known"), ("drained", FAIL), (None, FAIL)):
        ev = _late_write_log(outcome)
        j = p.judge([oracles.kv_lifecycle(ev)], Context.of(ev), {"kv_lifecycle": PASS})
        assert j.status == want, (outcome, j.message())
        if want == "known":
            assert j.known[0].finding.id == "sglang-deferred-release-timeout-late-write"


# the auto-truncation leak is KNOWN only when the victim is an oversized prompt prefill sent truncated;
# the same leak through the reject path's one-page placeholder (the GLM-5.3 incident) stays a FAIL
def _truncated_log(pages, page_size=None):
    """A 900-token oversized prompt decode reserved whole (900 pages of 1 token, or 15 of 64) while
    prefill wrote ``pages`` of them (None: no transfer evidence), its reply reciting c0's canary."""
    rng = random.Random(3)
    ev = [HEADER] + crowd()
    own, foreign = canary.mint(rng, 3), ev[1]["canaries"]
    ev += [plan("big1", "t15", own, oversized=True, n_tokens=900)] + reply("big1", foreign[0][1:-1] + "][")
    if pages is None:
        return ev
    reserved = -(-900 // (page_size or 1))
    ev += stale_pages("c0", "big1", reserved, min(pages, reserved))
    if page_size is not None:
        for e in ev:
            if e.get("agent_ev") in ("write_end", "kv_prealloc"):
                e["page_size"] = page_size
    return ev


def test_auto_truncate_leak_is_known_only_when_prefill_sent_the_prompt_truncated():
    j = judge(_truncated_log(570), {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-auto-truncate-stale-pages"
    for pages in (1, 900, None):  # the reject path's placeholder, a whole prompt, no transfer evidence
        j = judge(_truncated_log(pages), {"isolation": PASS}, accept_known=True)
        assert j.status == FAIL and j.red and not known_for(j, "isolation"), pages
    # paged layout (64 tokens a page): 9 pages is the 570-token truncation of the 900-token prompt
    # (15 pages); the placeholder's 1 page and the whole prompt's 15 stay FAIL
    assert judge(_truncated_log(9, 64), {"isolation": PASS}, accept_known=True).status == "known"
    for pages in (1, 15):
        assert judge(_truncated_log(pages, 64), {"isolation": PASS}, accept_known=True).status == FAIL, pages


def test_the_reject_paths_placeholder_leak_is_known_on_0519_only_with_one_page_written():
    """The GLM-5.3 mechanism: an oversized prompt of which prefill wrote only the one-page placeholder
    while decode reserved the whole prompt, its reply reciting the canary of the pages' last holder.
    KNOWN on 0.5.19 (isolation and http_semantics); a truncated or whole transfer, no transfer evidence,
    or another release stays a FAIL."""
    def on(version, pages, page_size=None):
        ev = _truncated_log(pages, page_size)
        ev[0] = {**HEADER, "engine": {"name": "sglang", "version": version}}
        return ev
    j = judge(on("0.5.19", 1), {"isolation": PASS}, accept_known=True)
    assert j.status == "known" and j.known[0].finding.id == "sglang-reject-path-placeholder-stale-pages"
    # a local build of the release (PEP 440 local label) is that release; a dev build before it is not
    assert judge(on("0.5.19+cu128", 1), {"isolation": PASS}, accept_known=True).status == "known"
    assert judge(on("0.5.19.dev3", 1), {"isolation": PASS}, accept_known=True).status == FAIL
    ev = on("0.5.19", 1)
    v = oracles.http_semantics(ev)
    j = Policy(accept_known=True).judge([v], Context.of(History(ev)), {"http_semantics": PASS})
    assert v.status == FAIL and j.status == "known"
    assert j.known[0].finding.id == "sglang-reject-path-placeholder-stale-pages"
    assert judge(on("0.5.19", 1, 64), {"isolation": PASS}, accept_known=True).status == "known"
    for pages in (900, None):
        assert judge(on("0.5.19", pages), {"isolation": PASS}, accept_known=True).status == FAIL, pages
    j = judge(on("0.5.19", 570), {"isolation": PASS}, accept_known=True)  # truncated: the other finding
    assert {i.finding.id for i in j.known} == {"sglang-auto-truncate-stale-pages"}
    assert judge(on("0.5.23", 1), {"isolation": PASS}, accept_known=True).status == FAIL
    # the victim was no oversized prompt: a leak, plain and simple
    ev = on("0.5.19", 1)
    for e in ev:
        if e.get("ev") == "plan" and e.get("rid") == "big1":
            e["oversized"] = False
    assert judge(ev, {"isolation": PASS}, accept_known=True).status == FAIL


def test_no_test_or_harness_module_xfails_imperatively():
    hits = [f"{p}:{i}" for d in ("suites", "kvchaos", "faults") for p in (REPO / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "pytest.xfail(" in line]
    assert not hits, f"known findings belong in kvchaos/findings.toml, not in code: {hits}"


# 2 — a liveness finding never hides isolation UNKNOWN, kv_lifecycle or differential FAIL
def test_liveness_finding_never_hides_a_leak_or_a_blind_isolation():
    hung = [{"rid": "r", "problem": "no answer within 60 s", "outcome": "timeout"}]
    found = [{"signature": "mooncake_transfer_worker_died", "role": "prefill"}]
    ctx = Context.of([HEADER], found)
    p = Policy(accept_known=True)
    for other in (Verdict("isolation", UNKNOWN, "blind"), Verdict("kv_lifecycle", FAIL, "late write"),
                  Verdict("differential", FAIL, "differs")):
        vs = [other, Verdict("liveness", FAIL, "hung", hung)]
        if other.oracle != "isolation":
            vs.append(Verdict("isolation", PASS, "ok"))
        j = p.judge(vs, ctx, {"liveness": PASS})
        assert j.red and j.status in (FAIL, UNKNOWN), other
        # even when the test did not ask for the leak checker: it is held to not-FAIL / not-UNKNOWN
        assert any(i.verdict is other and i.outcome == "red" for i in j.items)


# 3 — canaries from elsewhere in the session, and canaries nobody minted
def test_canary_of_unknown_origin_fails():
    ev = crowd() + [plan("x", "t9", canary.mint(random.Random(3), 1))] + reply("x", "QZ7XK2MBNW][")
    v = oracles.isolation(ev)
    assert v.status == FAIL and v.witnesses[0]["origin"] == "unknown" and v.witnesses[0]["matched"] == "QZ7XK2MBNW"
    assert "unknown origin" in v.summary


def test_a_mixed_recital_is_attributed_to_the_canary_it_copies_not_to_an_unknown_origin():
    """CI: decode attending over another request's pages recited the victim's first character and
    then the owner's payload ('J24YGBC6PV' for '[F24YGBC6PV]'): a partial hit of a minted canary."""
    ev = crowd()
    owner = ev[0]["canaries"][0]
    mixed = "J" + owner[2:-1]
    ev += [plan("v", "t7", canary.mint(random.Random(8), 1))] + reply("v", mixed + "][")
    v = oracles.isolation(ev)
    assert v.status == FAIL and {w["origin"] for w in v.witnesses} == {"this log"}, v.witnesses
    assert v.witnesses[0]["owner_rid"] == "c0" and v.witnesses[0]["match"] == "partial"


def test_canary_of_another_test_in_the_session_fails():
    reg = canary.Registry()
    other = canary.mint(random.Random(4), 1)[0]
    reg.add(other, "old-7", "t1", "workload seed 7")
    ev = crowd() + [plan("x", "t2", canary.mint(random.Random(3), 1))] + reply("x", other[1:-1] + "][")
    v = oracles.Isolation().check(ev, reg)
    w = v.witnesses[0]
    assert v.status == FAIL and (w["owner_rid"], w["origin"]) == ("old-7", "session (workload seed 7)")
    # the same canary in its own request is no leak
    ev = crowd() + [plan("old-7", "t1", [other])] + reply("old-7", other[1:-1] + "][")
    assert oracles.Isolation().check(ev, reg).status == PASS


def test_no_process_global_registry_minting_registers_nothing():
    """Checkers are handed their registry; minting a canary fills none behind anyone's back."""
    from kvchaos.workload import Workload

    assert not hasattr(canary, "SESSION")
    reg = canary.Registry()
    p = Workload(31337, n_tenants=2, prefix="reg").request()
    assert len(reg) == 0
    reg.add_plans({p.rid: {"canaries": p.canaries, "tenant": p.tenant}}, "test")
    assert all(c in reg and reg.carriers(c) == {p.rid} for c in p.canaries)


# 4 — what a cut, aborted or timed-out client received is scanned
@pytest.mark.parametrize("outcome", ["cut", "aborted", "timeout", "disconnected"])
def test_bytes_of_an_unfinished_reply_are_scanned(outcome):
    ev = crowd()
    foreign = ev[0]["canaries"][0]
    raw = 'data: {"text": "' + foreign[1:-1] + '][AB'  # the line the connection was cut in
    ev += [plan("v", "t7", canary.mint(random.Random(5), 1))] + reply("v", "", outcome=outcome, complete=False, raw=raw)
    v = oracles.isolation(ev)
    assert v.status == FAIL, v
    w = v.witnesses[0]
    assert (w["victim_rid"], w["owner_rid"], w["complete"], w["outcome"]) == ("v", "c0", False, outcome)
    assert judge(ev).red


# 5 — one echo is not evidence
def test_one_echo_among_errors_is_unknown_and_red():
    rng = random.Random(6)
    ev = crowd(1)
    for i in range(99):
        ev += [plan(f"e{i}", "t1", canary.mint(rng, 2))] + reply(f"e{i}", "", status=500, error="boom")
    j = judge(ev)
    assert j.status == UNKNOWN and j.red


# 6 — a self-test that is not a clean catch makes isolation UNKNOWN (red) unless a blind model is declared
@pytest.mark.parametrize("st", ["unknown", "missed"])
def test_selftest_not_caught_makes_isolation_unknown(st):
    ev = crowd()
    assert judge(ev).status == PASS
    j = judge(ev, selftest={"status": st})
    iso = next(i for i in j.items if i.verdict.oracle == "isolation")
    assert iso.verdict.status == UNKNOWN and "self-test" in iso.verdict.summary and j.red
    assert judge(ev, selftest={"status": "caught"}).status == PASS
    blind = judge(crowd(5), selftest={"status": st}, blind_model=True)
    assert not blind.red  # declared blind: isolation not claimed (reported UNKNOWN, not red)
    assert next(i for i in blind.items if i.verdict.oracle == "isolation").verdict.status == UNKNOWN


# 7 — the GPU profile serves the probe model unless told otherwise
def test_gpu_profile_defaults_to_the_probe_model():
    assert ClusterSpec.load("gpu").model == "probe"


# 8 — the detection matrix's defaults
def test_detection_matrix_defaults_cover_every_class_with_five_trials(monkeypatch):
    import importlib.util

    monkeypatch.delenv("KVCHAOS_MATRIX_TRIALS", raising=False)
    spec = importlib.util.spec_from_file_location("dm", REPO / "suites" / "test_detection_matrix.py")
    dm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dm)
    assert dm.TRIALS >= 5 and dm.CLEAN_TRIALS >= 1
    assert {"reject_admitted", "early_free", "double_alloc", "short_transfer"} <= set(dm.CLASSES)


# 10 — findings are version-scoped data; one that did not reproduce is reported
def test_registry_is_data_scoped_to_versions():
    reg = Registry.load()
    assert reg.findings and all(f.versions and f.matches for f in reg.findings)
    assert version_matches("0.5.23", ["0.5.23"]) and not version_matches("0.5.22", ["0.5.23"])
    assert version_matches("0.5.21", [">=0.5.20,<0.5.22"]) and not version_matches("0.5.22", [">=0.5.20,<0.5.22"])
    assert not version_matches(None, ["0.5.23"])


@pytest.mark.parametrize("version,specs,want", [
    ("0.5.23+cu128", ["0.5.23"], True),              # a local build of the release is the release
    ("0.5.23+cu128", [">=0.5.20,<0.5.24"], True),
    ("0.5.24rc1", [">=0.5.20,<0.5.24"], False),       # PEP 440: 0.5.24rc1 is not below 0.5.24's range end
    ("0.5.24rc1", [">=0.5.24rc1"], True),
    ("0.5.23.dev4", ["0.5.23"], False),              # a dev build is not the release
    ("0.5.10", [">=0.5.9,<0.5.20"], True),          # compared as versions, not as strings
    ("nightly", ["0.5.23", ">=0.5.0"], False),       # not a version: no finding is scoped to it
    (5, [">=4"], True),                              # a number in a header's JSON
])
def test_versions_compare_as_pep_440_says(version, specs, want):
    assert version_matches(version, specs) is want


def test_a_leak_under_an_engine_version_that_is_not_pep_440_is_judged_and_stays_new():
    """``nightly``: no traceback, no bad input; no finding applies, so a leak is NEW (red)."""
    from kvchaos.policy import KNOWN

    rng = random.Random(9)
    recs = [{**HEADER, "engine": {"name": "sglang", "version": "nightly"}}]
    a = canary.mint(rng, 1)
    for i in range(30):
        cs = a if i == 0 else canary.mint(rng, 1)
        text = recital(cs) + (a[0][1:-1] + "][" if i == 9 else "")
        recs += [{"ev": "plan", "rid": f"r{i}", "tenant": f"t{i}", "canaries": cs, "expect_echo": True},
                 {"ev": "status", "rid": f"r{i}", "status": 200}, {"ev": "body", "rid": f"r{i}", "text": text},
                 {"ev": "end", "rid": f"r{i}", "outcome": "ok"}]
    h = History(recs)
    j = Policy(accept_known=True).judge([oracles.isolation(h)], Context.of(h))
    assert j.red and j.status == oracles.FAIL and j.status != KNOWN


def test_finding_that_did_not_reproduce_is_reported():
    reg = Registry.load()
    t = "suites/test_transfer_delay.py::test_short_transfer_is_not_served_as_a_clean_reply"
    ran = [{"test": t, "engine": "sglang", "version": "0.5.23", "known": []}]
    (n,) = not_reproduced(reg, ran)
    assert n["id"] == "sglang-short-transfer-unchecked" and "did not reproduce on sglang 0.5.23" in n["message"]
    assert not_reproduced(reg, [{**ran[0], "known": ["sglang-short-transfer-unchecked"]}]) == []
    assert not_reproduced(reg, [{**ran[0], "version": "0.5.19"}]) == []  # not listed for that version


@pytest.mark.parametrize("bad,msg", [
    ({"finding": [{"id": "x", "title": "t", "engine": "sglang", "versions": ["0.5.23"],
                   "match": [{"checker": "liveness", "signature": {"nope": 1}}]}]}, "unknown signature predicate"),
    ({"finding": [{"id": "x", "title": "t", "engine": "sglang", "versions": ["0.5.23"],
                   "match": [{"checker": "liveness", "signature": {}}]}]}, "needs a witness signature"),
    ({"finding": [{"id": "x", "title": "t", "engine": "sglang", "versions": ["0.5.23"], "colour": 1,
                   "match": [{"checker": "liveness", "signature": {"witnesses_are_timeouts": True}}]}]}, "unknown key"),
    ({"finding": [{"id": "x", "title": "t", "engine": "sglang", "versions": ["0.5.23"],
                   "match": [{"checker": "liveness", "statuses": ["pass"],
                              "signature": {"witnesses_are_timeouts": True}}]}]}, "only 'fail' and 'unknown'"),
])
def test_bad_registry_is_named(bad, msg):
    with pytest.raises(PolicyError, match=msg):
        Registry.from_dict(bad)


def test_unknown_accepted_finding_id_is_named():
    with pytest.raises(PolicyError, match="unknown finding id 'nope'"):
        Policy(accept_known=["nope"])


def test_checkers_bind_options_and_compose():
    c = oracles.compose(oracles.Isolation(), oracles.Liveness(bound_s=5))
    assert [v.oracle for v in c.check(crowd())] == ["isolation", "liveness"]
    with pytest.raises(ValueError, match="given twice"):
        oracles.compose(oracles.Liveness(bound_s=1), oracles.Liveness(bound_s=2))
    with pytest.raises(TypeError, match="not a checker"):
        oracles.compose(lambda ev: None)
    with pytest.raises(ValueError, match="bound_s"):
        oracles.Liveness(bound_s=0)


def _band_log(early_victim: bool):
    """Two band prompts hang decode; a request queued behind them times out too (and, planted, one
    that was in flight before them)."""
    ev = [HEADER] + crowd()
    hung = []
    for i, rid in enumerate(["b1", "b2", "q1"] + (["early"] if early_victim else [])):
        tag = {"probe": "hang_band"} if rid.startswith("b") else {}
        ev.append(plan(rid, "t8", canary.mint(random.Random(20 + i), 2), extra=tag))
        wall = {"early": 5.0, "b1": 10.0, "b2": 11.0, "q1": 12.0}[rid]
        ev += [{"ev": "send", "rid": rid, "wall": wall}, {"ev": "end", "rid": rid, "outcome": "timeout", "latency_s": 30}]
        hung.append({"rid": rid, "problem": "no answer within 30 s", "outcome": "timeout"})
    return ev, Verdict("liveness", FAIL, "hung", hung)


def test_hang_band_is_known_only_when_every_hung_request_is_a_band_prompt_or_queued_behind_one():
    for early, want in ((False, "known"), (True, FAIL)):
        ev, live = _band_log(early)
        j = Policy(accept_known=True).judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev),
                                            {"liveness": PASS})
        assert j.status == want, (early, j.message())
        if want == "known":
            assert j.known[0].finding.id == "sglang-pd-hang-band"


def test_a_pool_the_hung_requests_still_hold_is_their_hang_and_more_than_they_can_hold_is_not():
    """A hang holds its pages while it hangs: decode's pool after the run kept what the hung requests
    were pre-allocated (and could have generated), and the hang band stays KNOWN. One token more than
    they could hold, a hung request decode had given its pages back, or a holder that is no witness: the
    pool witness stands on its own and the verdict is a plain FAIL. A request sent by an OpenAI route is
    named back by its canaries."""
    p = Policy(accept_known=True)

    def log(after, released=False, chat=False):
        ev, _live = _band_log(False)
        ev = [dict(e, max_new_tokens=40) if e.get("ev") == "plan" else e for e in ev]
        b1 = next(e for e in ev if e.get("ev") == "plan" and e["rid"] == "b1")
        if chat:
            b1["endpoint"] = "chat"
        ev += [{"ev": "probe", "phase": "before", "role": "decode", "kv_used": 0, "ok": True, "wall": 1.0},
               agent("kv_prealloc", role="decode", rid="eng-7" if chat else "b1", room=11, page_size=1,
                     dst_pages_total=200, canaries=list(b1["canaries"])),
               agent("kv_prealloc", role="decode", rid="q1", room=12, page_size=1, dst_pages_total=100)]
        if released:
            ev.append(agent("kv_released", role="decode", rid="q1", room=12))
        return ev + [{"ev": "probe", "phase": "after", "role": "decode", "kv_used": after, "ok": True, "wall": 200.0}]
    for after, released, chat, want in ((380, False, False, "known"), (380, False, True, "known"),
                                        (381, False, False, FAIL), (300, True, False, FAIL),
                                        (240, True, False, "known")):
        ev = log(after, released, chat)
        live = oracles.Liveness(bound_s=30).check(ev)
        pool = [w for w in live.witnesses if not w.get("rid")]
        assert pool and pool[0]["held_tokens_max"] == (240 if released else 380), pool
        j = p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS})
        assert j.status == want, (after, released, chat, j.message())
    # the pool's holders must be the verdict's own hung requests
    ev = log(300)
    live = oracles.Liveness(bound_s=30).check(ev)
    live.witnesses = [w for w in live.witnesses if w.get("rid") != "q1"]
    assert p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS}).status == FAIL


def test_behind_a_band_prompt_is_the_engines_order_where_it_has_one():
    """Sent first by the client but queued after the band prompt by prefill, or never queued (the same
    millisecond): behind it. Queued before it by prefill: not behind, whatever the client's clock says."""
    p = Policy(accept_known=True)
    for q_early, q_b1, want in ((100.02, 100.01, "known"), (100.00, 100.01, FAIL)):
        ev, live = _band_log(True)  # "early": sent at 5.0, before b1 (10.0)
        ev += [{"ev": "agent", "agent_ev": "bootstrap_queued", "role": "prefill", "rid": r, "wall": w, "room": i}
               for i, (r, w) in enumerate((("early", q_early), ("b1", q_b1), ("b2", 100.5), ("q1", 100.6)))]
        j = p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS})
        assert j.status == want, (q_early, j.message())
    # queued before the band prompt, then again after it (the router re-sent it under a new room after a
    # failed transfer): its last attempt waited behind the band prompt
    for again, want in ((100.55, "known"), (100.005, FAIL)):
        ev, live = _band_log(True)
        ev += [{"ev": "agent", "agent_ev": "bootstrap_queued", "role": "prefill", "rid": r, "wall": w, "room": i}
               for i, (r, w) in enumerate((("early", 100.0), ("b1", 100.01), ("b2", 100.5), ("q1", 100.6),
                                           ("early", again)))]
        j = p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS})
        assert j.status == want, (again, j.message())
    # prefill queued the band prompt but never the early request: it did not reach prefill ahead of it
    ev, live = _band_log(True)
    ev += [{"ev": "agent", "agent_ev": "bootstrap_queued", "role": "prefill", "rid": "b1", "wall": 100.0, "room": 1}]
    assert p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS}).status == "known"
    # ... unless it went by an OpenAI route, whose requests reach the engines under ids of their own
    ev, live = _band_log(True)
    ev = [dict(e, endpoint="chat") if e.get("ev") == "plan" and e["rid"] == "early" else e for e in ev]
    ev += [{"ev": "agent", "agent_ev": "bootstrap_queued", "role": "prefill", "rid": "b1", "wall": 100.0, "room": 1}]
    assert p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS}).status == FAIL
    # prefill queued no band prompt: the client's order decides (the early request was sent first: not behind)
    ev, live = _band_log(True)
    ev += [{"ev": "agent", "agent_ev": "bootstrap_queued", "role": "prefill", "rid": "early", "wall": 100.0, "room": 1}]
    assert p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS}).status == FAIL


def test_an_oversized_prompt_refused_with_a_4xx_neither_confirms_nor_contradicts_the_intake_reject_hang():
    """Prefill's input limit lowered to 256: a prompt past decode's own limit (2042) is refused by decode
    with a 400 and never waits on the reject path. The ones that did hang; one answered 200 still
    contradicts; a 4xx confirms nothing."""
    p = Policy(accept_known=True)

    def log(third):
        ev = [HEADER] + crowd() + [{"ev": "fault", "action": "armed", "kind": "input_limit", "injector": "agent"}]
        for i, rid in enumerate(("o1", "o2")):
            ev += [plan(rid, "t9", canary.mint(random.Random(40 + i), 2), oversized=True),
                   {"ev": "send", "rid": rid, "wall": 100.0}, {"ev": "end", "rid": rid, "outcome": "timeout", "wall": 130.0}]
        if third is not None:
            ev += [plan("o3", "t9", canary.mint(random.Random(49), 2), oversized=True)] + reply("o3", "", status=third)
        return ev
    hung = Verdict("liveness", FAIL, "hung", [{"rid": r, "outcome": "timeout", "problem": "no answer within 30 s"}
                                             for r in ("o1", "o2")])
    for third, want in ((None, "known"), (400, "known"), (200, FAIL)):
        j = p.judge([Verdict("isolation", PASS, "ok"), hung], Context.of(log(third)), {"liveness": PASS})
        assert j.status == want, (third, j.message())
        if want == "known":
            assert j.known[0].finding.id == "sglang-intake-reject-hang"


def test_the_intake_reject_hang_of_a_deployment_is_read_from_the_engines_events_without_a_fault():
    """No fault lowered a limit (the incident's shape deployed as such): the hang is the intake reject only
    where decode pre-allocated each hung prompt beyond one page and prefill wrote none of it."""
    p = Policy(accept_known=True)

    def log(prealloc_pages=6875, written=False):
        ev = [HEADER] + crowd()
        for i, rid in enumerate(("o1", "o2")):
            ev += [plan(rid, "t9", canary.mint(random.Random(40 + i), 2), oversized=True),
                   {"ev": "send", "rid": rid, "wall": 100.0}, {"ev": "end", "rid": rid, "outcome": "timeout", "wall": 130.0}]
            if prealloc_pages:
                ev.append(agent("kv_prealloc", role="decode", rid=rid, room=70 + i, page_size=64,
                                dst_pages_total=prealloc_pages))
        if written:
            ev.append(agent("write_end", role="prefill", rid="o2", room=71, pages=[0], status="success"))
        return ev
    hung = Verdict("liveness", FAIL, "hung", [{"rid": r, "outcome": "timeout", "problem": "no answer within 30 s"}
                                             for r in ("o1", "o2")])
    for kw, want in (({}, "known"), ({"written": True}, FAIL), ({"prealloc_pages": 1}, FAIL),
                     ({"prealloc_pages": 0}, FAIL)):
        j = p.judge([Verdict("isolation", PASS, "ok"), hung], Context.of(log(**kw)), {"liveness": PASS})
        assert j.status == want, (kw, j.message())
        if want == "known":
            assert j.known[0].finding.id == "sglang-intake-reject-hang"


def _band_extra(ev, rid, outcome, tag=True):
    """One more band prompt (tagged) that ended ``outcome`` and is no liveness witness."""
    ev.append(plan(rid, "t8", canary.mint(random.Random(hash(rid) % 1000), 2), extra={"probe": "hang_band"} if tag else {}))
    if outcome != "not_sent":
        ev.append({"ev": "send", "rid": rid, "wall": 13.0})
    ev.append({"ev": "end", "rid": rid, "outcome": outcome, "latency_s": 0.0 if outcome == "not_sent" else 0.2})


def test_a_band_prompt_that_was_never_sent_or_cut_by_its_client_neither_confirms_nor_contradicts_the_hang_band():
    """A wedged run stops sending (stall_s: the rest end not_sent) and a client may abort a band prompt
    before any answer: neither says the prompt would have been answered. One that was answered does."""
    p = Policy(accept_known=True)
    for outcome, want in (("not_sent", "known"), ("aborted", "known"), ("disconnected", "known"), ("ok", FAIL)):
        ev, live = _band_log(False)
        _band_extra(ev, "b9", outcome)
        j = p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS})
        assert j.status == want, (outcome, j.message())
    # no tagged prompt that could show it hung: nothing to match
    ev = [HEADER] + crowd()
    ev.append(plan("q1", "t8", canary.mint(random.Random(3), 2)))
    ev += [{"ev": "send", "rid": "q1", "wall": 12.0}, {"ev": "end", "rid": "q1", "outcome": "timeout", "latency_s": 30}]
    _band_extra(ev, "b1", "not_sent")
    live = Verdict("liveness", FAIL, "hung", [{"rid": "q1", "problem": "no answer within 30 s", "outcome": "timeout"}])
    assert p.judge([Verdict("isolation", PASS, "ok"), live], Context.of(ev), {"liveness": PASS}).status == FAIL


# an abort answered as a success is KNOWN (sglang-router-retries-aborted-requests) only when prefill saw
# the request again under a new room after its abort; the same 200 on a single attempt stays a FAIL
def _aborted_log(rooms):
    ev = [HEADER] + crowd()
    ev += [plan("ab1", "t5", ["[ABCDEFGHIJ]"]), {"ev": "fault", "action": "abort_request", "rid": "ab1",
                                                 "stage": "transferring", "held": True}]
    ev += reply("ab1", "ABCDEFGHIJ][")  # its own complete reply, finish_reason stop
    return ev + [{"ev": "agent", "agent_ev": "bootstrap_queued", "rid": "ab1", "room": r} for r in rooms]


def test_an_abort_answered_as_a_success_is_known_only_when_it_was_retried():
    p = Policy(accept_known=True)
    for rooms, want in (([11, 12], "known"), ([11], FAIL), ([], FAIL)):
        ev = _aborted_log(rooms)
        v = oracles.abort_semantics(ev)
        assert v.status == FAIL, v
        j = p.judge([v], Context.of(ev), {"abort_semantics": PASS})
        assert j.status == want, (rooms, j.message())
        if want == "known":
            assert j.known[0].finding.id == "sglang-router-retries-aborted-requests"
