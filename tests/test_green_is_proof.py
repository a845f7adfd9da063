"""The four design flaws by which a leak, or a run that could not have seen one, ended green — each as
an event log on disk through ``kvchaos judge`` (the same policy as the suites), red now.

1. an accepted KNOWN finding hid a blind run;
2. a finding's signature named the victim, not the mechanism;
3. the reply budget left no room for a foreign canary that sorts after the victim's own;
4. the power floor counted requests, not the class that was exercised.

Each test builds the log the red team built (with the project's own ``EventLog``) and asserts what
the judgement must be; run against the code before issue 29 each one ends green."""

from __future__ import annotations

import random

import pytest

from kvchaos import canary, probe
from kvchaos.cli import main
from kvchaos.workload import EventLog

HEADER = {"engine": {"name": "sglang", "version": "0.5.23", "roles": {}}, "schema": 2}


def judge(tmp_path, write, *flags) -> int:
    """Write a log with ``write(log)`` and return ``kvchaos judge``'s exit status."""
    path = tmp_path / f"log{len(list(tmp_path.iterdir()))}.jsonl"
    with EventLog(path) as log:
        log.emit("experiment", id="x", name="x", **HEADER)
        write(log)
    try:
        return main(["judge", str(path), *flags])
    except SystemExit as e:
        return int(e.code)


def request(log, rid, tenant, cs, reply, wall, status=200, finish="stop", n_tokens=300):
    """One request as the driver logs it: plan, send, status, body, end (sent at ``wall``, 1 s long)."""
    log.emit("plan", rid=rid, tenant=tenant, kind="plain", endpoint="generate", canaries=cs, n_tokens=n_tokens,
             max_new_tokens=probe.max_new_tokens(len(cs)), expect_echo=True, oversized=False, wall=wall)
    log.emit("send", rid=rid, url="http://r/generate", stream=False, wall=wall)
    log.emit("status", rid=rid, status=status, wall=wall + 0.9)
    log.emit("body", rid=rid, text=reply, output_ids=None, error=None, chunks=None, complete=True,
             meta={"finish_reason": {"type": finish}}, raw='{"text": "%s"}' % reply, wall=wall + 0.9)
    log.emit("end", rid=rid, outcome="ok" if status == 200 else "http_error", latency_s=1.0, status=status,
             bytes_received=40, wall=wall + 1.0)


def recital(cs) -> str:
    return "".join(canary.payload(c) + "][" for c in sorted(cs, key=lambda c: canary.ALPHABET.index(c[1])))


def crowd(log, n, rng, reply=recital, t0=100.0, prefix="c"):
    out = []
    for i in range(n):
        cs = canary.mint(rng, 2)
        request(log, f"{prefix}{i}", f"t{i % 4}", cs, reply(cs), t0 + 0.1 * i)
        out.append(cs)
    return out


def agent(log, agent_ev, **fields):
    log.emit("agent", agent_ev=agent_ev, source="agent", **fields)


def stale_leak(log, owner_rid, victim_rid, foreign, t_owner, t_victim, pages=13, sent=1, holder=None):
    """The short-transfer mechanism as the engines report it: the owner's transfer wrote decode pages
    100..112 (one token each: enough unwritten ones to hold the 12 characters of a canary), decode then
    pre-allocated them to the victim (their previous holder: ``holder``, the owner by default), a short
    fault sent ``sent`` of ``pages`` pages, and the victim's reply recites the owner's canary."""
    pg = list(range(100, 100 + pages))
    agent(log, "write_end", rid=owner_rid, room=1, pages=pages, dst_pages=pg, dst_pages_total=pages,
          dst_page_offset=0, ret=0, wall_start=t_owner, page_size=1)
    own = canary.mint(random.Random(victim_rid), 1)
    agent(log, "kv_prealloc", rid=victim_rid, room=2, page_size=1, fill_len=pages, total_prefix_len=0,
          dst_pages=pg, dst_pages_total=pages, prev_holders=[[0, pages, holder or owner_rid]], wall=t_victim)
    agent(log, "fault_fired", kind="short", fault="short-1", rid=victim_rid, room=2, pages_sent=sent,
          pages_reserved=pages, page_size=1)
    agent(log, "write_end", rid=victim_rid, room=2, pages=sent, dst_pages=pg[:sent], dst_pages_total=sent,
          dst_page_offset=0, ret=0, wall_start=t_victim, page_size=1)
    request(log, victim_rid, "t7", own, canary.payload(foreign) + "][", t_victim)


# --------------------------------------------------------------------------- 1
def test_1_an_accepted_known_finding_never_covers_a_blind_run(tmp_path):
    """Every reply empty (sensitivity 0/80), one shorted request showing a foreign canary with the
    whole mechanism on record: the FAIL matches the short-transfer finding's signature, but a run
    that could not have seen a leak cannot call one KNOWN."""
    def write(log):
        rng = random.Random(1)
        owners = crowd(log, 80, rng, reply=lambda cs: "")
        stale_leak(log, "c0", "v1", owners[0][0], 100.0, 104.0)

    assert judge(tmp_path, write, "--accept-known") != 0

    def powered(log):  # the same leak in a run with power: KNOWN, accepted
        rng = random.Random(1)
        owners = crowd(log, 80, rng)
        stale_leak(log, "c0", "v1", owners[0][0], 100.0, 104.0)

    assert judge(tmp_path, powered, "--accept-known") == 0
    assert judge(tmp_path, powered) == 1  # KNOWN, not accepted: red (the leak is a FAIL)


# --------------------------------------------------------------------------- 2
@pytest.mark.parametrize("case", ["owner_sent_after", "every_page_sent", "holder_is_someone_else",
                                  "no_page_evidence"])
def test_2_a_finding_matches_its_mechanism_not_its_victim(tmp_path, case):
    """A shorted request showing a foreign canary is the short-transfer finding only when decode's own
    events show it read pages its transfer never wrote, holding the bytes of the canary's carrier."""
    def write(log):
        rng = random.Random(2)
        owners = crowd(log, 80, rng)
        if case == "owner_sent_after":
            # the owner was sent after the victim ended: it cannot have left KV the victim read
            request(log, "late", "t9", ["[ZQ7KD3MXAP]"], "ZQ7KD3MXAP][", 500.0)
            stale_leak(log, "late", "v1", "[ZQ7KD3MXAP]", 500.0, 104.0)
        elif case == "every_page_sent":
            stale_leak(log, "c0", "v1", owners[0][0], 100.0, 104.0, sent=13)
        elif case == "holder_is_someone_else":
            stale_leak(log, "c0", "v1", owners[0][0], 100.0, 104.0, holder="c5")
        else:  # the old signature's evidence only: a short fault fired on the victim
            agent(log, "fault_fired", kind="short", fault="short-1", rid="v1", room=2, pages_sent=1,
                  pages_reserved=10)
            request(log, "v1", "t7", canary.mint(random.Random(3), 1), canary.payload(owners[0][0]) + "][", 104.0)

    assert judge(tmp_path, write, "--accept-known") == 1


# --------------------------------------------------------------------------- 3
def test_3_every_reply_budget_has_room_for_two_foreign_canaries():
    """The probe recites in first-character order: a foreign canary sorting after the victim's own
    needs budget beyond the victim's own recital. Every plan leaves room for two."""
    from faults.request import plant_leak
    from kvchaos.workload import Workload

    for n in range(1, 6):
        assert probe.max_new_tokens(n) >= (n + 2) * canary.LENGTH + 2
    wl = Workload(7, n_tenants=4)
    plans = wl.mix(40)
    assert all(p.max_new_tokens >= (len(p.canaries) + 2) * canary.LENGTH + 2 for p in plans)
    # the self-test plants with exactly the budget a real victim of that shape gets
    victim, donor = plans[0], plans[1]
    budget = victim.max_new_tokens
    plant_leak(victim, donor)
    assert victim.max_new_tokens == budget


def test_3_a_reply_cut_by_its_budget_is_evidence_only_with_its_recital_complete():
    """Replies that end on ``length`` are flagged; they are echo evidence only with their own recital
    complete (a budget that ran out mid-recital could have cut a foreign canary off too)."""
    from kvchaos.oracles import power

    def log(complete_recital):
        ev = EventLog()
        rng = random.Random(4)
        for i in range(80):
            cs = canary.mint(rng, 2)
            cut = i % 4 == 0
            text = recital(cs) if not cut or complete_recital else recital(cs)[:14]
            request(ev, f"c{i}", f"t{i % 4}", cs, text, 100.0 + i, finish="length" if cut else "stop")
        return ev.records

    pw = power(log(complete_recital=False))
    assert pw["classes"]["all"]["evidence"] == 60 and len(pw["hit_limit"]) == 20
    assert not any(h["evidence"] for h in pw["hit_limit"])
    pw = power(log(complete_recital=True))
    assert pw["classes"]["all"]["evidence"] == 80 and all(h["evidence"] for h in pw["hit_limit"])


# --------------------------------------------------------------------------- 4
def test_4_the_power_floor_counts_evidence_of_the_class_not_requests(tmp_path):
    def no_canaries(log):  # 18 requests without a canary and 2 with many
        rng = random.Random(5)
        for i in range(18):
            request(log, f"n{i}", "t0", [], "", 100.0 + i)
        for i in range(2):
            cs = canary.mint(rng, 30, distinct_first=False)
            request(log, f"m{i}", "t1", cs, "".join(canary.payload(c) for c in cs), 130.0 + i)

    def mostly_503(log):  # 200 of 220 replies 503
        rng = random.Random(6)
        crowd(log, 20, rng)
        for i in range(200):
            request(log, f"e{i}", "t2", canary.mint(rng, 2), "", 200.0 + i, status=503)

    def fault_broke_most(log):  # a delay fault acted on 80 requests; every one of them failed
        rng = random.Random(7)
        crowd(log, 20, rng, t0=100.0)
        for i in range(80):
            request(log, f"d{i}", "t3", canary.mint(rng, 2), "", 100.0 + 0.1 * i, status=500)
            agent(log, "fault_fired", kind="delay", fault="delay-1", rid=f"d{i}", ms=250)

    for write in (no_canaries, mostly_503, fault_broke_most):
        assert judge(tmp_path, write) == 3, write.__name__


def test_a_killed_node_breaks_what_it_served_on_purpose_and_the_rest_holds_the_power(tmp_path):
    """A process kill fails every request in flight while the role is down: those are broken on
    purpose (never served, so nothing could show a leak); the whole workload's power stands. A delay
    fault that broke most of what it touched is not excused that way."""
    from kvchaos.oracles import power

    def killed(log):
        rng = random.Random(8)
        crowd(log, 60, rng, t0=100.0)
        log.emit("fault", action="fired", kind="sigkill", role="prefill", injector="process", at=110.0, wall=110.0)
        for i in range(20):
            request(log, f"k{i}", "t3", canary.mint(rng, 2), "", 110.0 + i, status=503)
        log.emit("fault", action="healed", kind="restart", role="prefill", injector="process", at=140.0, wall=140.0)

    assert judge(tmp_path, killed) == 0
    path = sorted(tmp_path.iterdir())[-1]
    from kvchaos.history import load

    pw = power(load(path))
    assert pw["classes"]["process:sigkill:prefill"]["thin"] and pw["met"]
