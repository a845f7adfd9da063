"""The experiment's live watch (kvchaos/experiment.py ``_LiveWatch``): a leak is red the moment a reply
holding another request's canary has ended, and stays red whatever the whole judgement says. It must
FAIL (tell ``leak``) on a leaking run, and stay silent on a clean one: it never says PASS."""

import json
import time

import pytest

import kvchaos.experiment
from kvchaos import canary
from kvchaos.experiment import Experiment, _keep_live
from kvchaos.history import History
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Isolation, Liveness, Verdict
from kvchaos.policy import Policy
from kvchaos.workload import Workload
from tests.fake_engine import FakeEngine
from tests.test_experiment import StandIn


def _plans(n=24, seed=3):
    return Workload(seed, n_tenants=4, prefix="lw").mix(n)


def _run(tmp_path, eng, plans, drive=None, concurrency=1):
    heard = []
    listen = lambda event, ex, **info: heard.append((event, time.time(), info))  # noqa: E731
    kvchaos.experiment.OBSERVERS.append(listen)
    try:
        with Experiment("lw", plans, [Isolation(), Liveness(bound_s=30)], cluster=StandIn(eng.url), run_dir=tmp_path,
                        settle_s=0, timeout_s=10, policy=Policy(), drive=drive, concurrency=concurrency) as ex:
            pass
    finally:
        kvchaos.experiment.OBSERVERS.remove(listen)
    return ex, heard


def test_a_leak_is_red_while_the_run_still_goes(tmp_path):
    plans = _plans(24)
    foreign = next(p for p in plans if p.canaries)
    with FakeEngine(delay_s=0.15, leak_text=canary.payload(foreign.canaries[0])) as eng:
        ex, heard = _run(tmp_path, eng, plans)
    ends = [e["t"] for e in ex.events if e["ev"] == "end"]
    (seen,) = [e for e in ex.events if e["ev"] == "leak_seen"]
    # one request at a time, 0.15 s each: the run took over 3 s, the leak was seen within about a second
    assert ends[-1] - ends[0] > 3.0 and seen["t"] < ends[-1] - 1.5, (seen["t"] - ends[0], ends[-1] - ends[0])
    assert seen["oracle"] == "isolation" and foreign.rid in seen["owners"] and seen["victims"]
    assert foreign.rid not in seen["victims"]  # its own canary in its own reply is not a leak
    (leak,) = [h for h in heard if h[0] == "leak"]
    assert leak[2]["verdict"].status == FAIL and leak[1] < next(h[1] for h in heard if h[0] == "close")
    assert ex.by["isolation"].status == FAIL and ex.live.fail is leak[2]["verdict"]
    assert 0 < ex.live.after_s < ends[-1] - ends[0]
    # the record names no reply and holds no canary: nothing of it is read as something a client received
    assert "lw" not in json.dumps(seen.get("rid")) and not canary.find(json.dumps(seen))


def test_a_clean_run_is_never_told_a_leak_and_the_watch_says_no_pass(tmp_path):
    with FakeEngine(delay_s=0.02) as eng:
        ex, heard = _run(tmp_path, eng, _plans(24), concurrency=4)
    assert [h[0] for h in heard] == ["open", "close"]
    assert ex.live.fail is None and ex.live.error is None and not [e for e in ex.events if e["ev"] == "leak_seen"]
    # 24 echoes are too few for isolation's floor: the whole run is UNKNOWN, and the watch did not make it PASS
    assert ex.by["isolation"].status == UNKNOWN


def test_a_leak_seen_live_stays_red_when_the_whole_history_cannot_be_judged(tmp_path):
    """The attack: a record written twice makes the whole log unreadable (every checker UNKNOWN), while
    a client had received another tenant's canary. What the watch saw is kept."""
    plans = _plans(24)
    foreign = plans[0]

    def drive(ex):
        ex.send(ex.plans)
        for _ in range(100):  # the watch's thread sees the leak within a tick or two (bounded)
            if ex.live.fail is not None:
                break
            time.sleep(0.1)
        dup = next(e for e in ex.log.records if e["ev"] == "end")
        ex.log.emit("end", **{k: v for k, v in dup.items() if k not in ("t", "wall", "ev")})

    with FakeEngine(delay_s=0.01, leak_text=canary.payload(foreign.canaries[0])) as eng:
        ex, _ = _run(tmp_path, eng, plans, drive=drive)
    assert ex.history is None  # HistoryError: a second end for one request
    iso = ex.by["isolation"]
    assert iso.status == FAIL and iso.witnesses, iso
    assert "seen while the run went" in iso.summary and iso.stats["whole_run"]["status"] == UNKNOWN
    assert ex.by["liveness"].status == UNKNOWN  # the rest says it could not read the log, as before


def test_keep_live_never_takes_a_fail_back_and_never_adds_one_unseen():
    live = Verdict("isolation", FAIL, "LEAK: x", [{"victim_rid": "a", "owner_rid": "b"}], {"responses": 1})
    whole_fail = Verdict("isolation", FAIL, "LEAK: y", [{"victim_rid": "a"}, {"victim_rid": "c"}])
    assert _keep_live([whole_fail], live) == [whole_fail]  # the whole run's FAIL has every witness
    for st in (PASS, UNKNOWN):
        other = Verdict("liveness", PASS, "ok")
        kept = _keep_live([Verdict("isolation", st, "whole"), other], live)
        assert kept[0].status == FAIL and kept[0].witnesses == live.witnesses and kept[1] is other
        assert kept[0].stats["whole_run"] == {"status": st, "summary": "whole"}
    vs = [Verdict("isolation", PASS, "no foreign canary")]
    assert _keep_live(vs, None) is vs


def _part(plans, replies):
    """A history holding the plans' records and ``replies`` (rid -> text) as ended replies."""
    recs = [{"t": 0.0, "wall": 0.0, "ev": "experiment", "id": "x"}]
    for p in plans:
        recs.append({"t": 0.0, "wall": 0.0, "ev": "plan", "rid": p.rid, "tenant": p.tenant, "canaries": p.canaries})
    for rid, text in replies.items():
        recs += [{"t": 1.0, "wall": 1.0, "ev": "body", "rid": rid, "text": text},
                 {"t": 1.0, "wall": 1.0, "ev": "end", "rid": rid, "outcome": "ok", "status": 200}]
    return History(recs)


def test_isolation_live_judge_fails_on_a_foreign_canary_only():
    plans = [p for p in _plans(12) if p.canaries]
    a, b = plans[0], plans[1]
    judge = Isolation().live({p.rid: {"canaries": p.canaries, "tenant": p.tenant} for p in plans})
    own = _part([], {a.rid: "".join(canary.payload(c) for c in a.canaries)})
    assert judge(own).status != FAIL  # the plans are known to the judge: its own canaries are not foreign
    v = judge(_part([], {a.rid: canary.payload(b.canaries[0])}))
    assert v.status == FAIL and v.witnesses[0]["owner_rid"] == b.rid
    nobody = "[NBV3KPLT7R]"
    assert judge(_part([], {a.rid: f"text {nobody} more"})).status == FAIL  # a canary nobody minted: unknown origin
    # what a judge that was not told the plans would call unknown origin, a whole-run check calls own
    blind = Isolation().live({})
    assert blind(own).status == FAIL and Isolation().check(_part(plans, {a.rid: own.bodies[a.rid]["text"]})).status != FAIL


def test_only_isolation_judges_live():
    from kvchaos.oracles import HttpSemantics, Liveness, Sensitivity

    assert Isolation().live({}) is not None
    assert all(c.live({}) is None for c in (Liveness(bound_s=30), HttpSemantics(), Sensitivity()))


@pytest.mark.parametrize("lead", [0, 8, 76])
def test_the_leaking_modes_traffic_sends_lead_background_requests_then_the_oversized(lead):
    from kvchaos import releases as R

    full, victim = R.glm53_plans(53)
    short, v2 = R.glm53_plans(53, lead=lead)
    assert v2 == victim and len(full) == 84 and len(short) == lead + 8
    bg = [p.rid for p in full if not p.oversized]
    assert [p.rid for p in short if not p.oversized] == bg[:lead + 4]  # the same requests, fewer of them
    assert [p.oversized for p in short[lead:]] == [True, False] * 4
    assert [p.n_tokens for p in short if p.oversized] == list(R.OVERSIZED)
    with pytest.raises(ValueError, match="lead=77"):
        R.glm53_plans(53, lead=77)
