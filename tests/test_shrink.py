"""``kvchaos shrink``: a failing scenario delta-debugged to a minimal one that still fails the same way,
end to end against tests/fake_engine.py (tests/data/replay_suite), and what it refuses."""

import json
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from kvchaos import canary
from kvchaos.shrink import ShrinkError, Shrinker, shorten, shortenable, still_fails, subset, target_of, witness_kind
from kvchaos.workload import Workload
from tests.util import child_env

REPO = Path(__file__).resolve().parents[1]
INNER = REPO / "tests" / "data" / "replay_suite" / "test_replay_inner.py"
STEPS = 40  # every attempt flushes and re-mints: an owner prompt must be sent in it to count (about 30 needed)


def _original(tmp_path, **env):
    r = subprocess.run([sys.executable, "-m", "pytest", f"{INNER}::test_shrinkable", "-p", "no:cacheprovider",
                        "-o", "testpaths=", "-q", "--kvchaos-seed", "5", "--kvchaos-reports", str(tmp_path / "reports")],
                       cwd=REPO, env=child_env(KVCHAOS_RUN_ID="orig", **env), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-2000:]  # the leak: red
    return tmp_path / "reports" / "orig"


def _original_plans(res) -> list[dict]:
    from kvchaos.workload import load_events

    log = next(a for a in res["attempts"] if a["n"] == 1)["log"]  # the original, re-run from data
    return [e for e in load_events(log) if e.get("ev") == "plan"]


def _original_prompts(res) -> list[str]:
    return [p["prompt"] for p in _original_plans(res)]


def _shrink(run, *args, **env):
    return subprocess.run([sys.executable, "-m", "kvchaos", "shrink", str(run), "shrinkable", "--steps", str(STEPS), *args],
                          cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=600)


def test_a_leak_shrinks_to_victim_and_owner_at_concurrency_one_with_repro_and_bug_report(tmp_path):
    run = _original(tmp_path)
    r = _shrink(run)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # the owner's request stays: a leak of what an earlier attempt left behind is not a repro of its own
    # (at concurrency 1 a victim before the owner in plan order cannot read the owner's page: 1 or 2)
    assert "requests 24 -> 2" in r.stdout and re.search(r"concurrency 4 -> [12],", r.stdout), r.stdout[-2000:]
    assert "failed again 3/3" in r.stdout
    assert "shrink 1: the original, re-run" in r.stdout  # progress shown as it goes
    d = Path(r.stdout.split("bug report: ")[1].split()[0]).parent
    res = json.loads((d / "minimal.json").read_text())
    assert res["reproduced"] and res["original"]["requests"] == 24 and res["minimal"]["requests"] == 2
    assert res["target"]["oracle"] == "isolation" and res["steps"] <= STEPS + 3 and res["confirmed"] == 3  # + confirmations
    owner, victim = sorted(res["scenario"]["plans"], key=lambda p: p["tenant"] != "t002")
    assert owner["tenant"] == "t002" and victim["tenant"] != "t002"  # plans[2]'s canary, in another's reply
    # (the owner's own reply may hold a canary of an earlier attempt's owner prompt: unknown origin there)
    assert owner["rid"] in {w.get("owner_rid") for w in res["witnesses"]}
    assert all(a["verdicts"]["isolation"] == "fail" for a in res["attempts"] if a["fails"])
    # a victim alone still "leaks" plans[2]'s canary (minted in an earlier attempt): not counted
    assert any(a["verdicts"]["isolation"] == "fail" and not a["fails"] for a in res["attempts"])
    assert (d / "minimal.events.jsonl").exists() and (d / "repro.py").exists()
    bug = (d / "BUG.md").read_text()
    assert "isolation FAIL" in bug and "| **minimal** | **2** | **2** |" in bug and "First witness" in bug and "3 of 3 re-runs" in bug
    # prompts: this engine leaks whatever the length, so each ends at the probe's floor with its canaries whole
    assert res["minimal"]["prompt_chars"] < 0.5 * sum(len(p) for p in _original_prompts(res))
    for p in res["scenario"]["plans"]:
        assert [c for _, c in canary.find(p["prompt"])] == p["canaries"] and p["n_tokens"] == len(p["prompt"])
        assert shorten(p["prompt"]) is None and p["prompt"].endswith("[")
    assert f"**{res['minimal']['prompt_chars']}** |" in bug


def test_a_leak_that_needs_a_long_prompt_keeps_the_victims_length(tmp_path):
    run = _original(tmp_path, INNER_LEAK_MIN_CHARS="300")
    r = _shrink(run, "--steps", "60", INNER_LEAK_MIN_CHARS="300")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    d = Path(r.stdout.split("bug report: ")[1].split()[0]).parent
    res = json.loads((d / "minimal.json").read_text())
    assert res["confirmed"] == 3 and res["minimal"]["requests"] == 2
    owner, victim = sorted(res["scenario"]["plans"], key=lambda p: p["tenant"] != "t002")
    original = {p["rid"]: p for p in _original_plans(res)}
    # the owner's prompt is free to shrink; the victim's cannot go below what the leak needs
    assert len(owner["prompt"]) < len(original[owner["rid"]]["prompt"]) and shorten(owner["prompt"]) is None
    assert 300 <= len(victim["prompt"]) and shorten(victim["prompt"]) is not None
    assert any(a["why"].startswith("shorten") and not a["fails"] for a in res["attempts"])  # refused cuts are tried


def test_a_failure_that_does_not_re_run_is_not_shrunk(tmp_path):
    run = _original(tmp_path, INNER_LEAK_FIRST="24")  # the engine leaks in the original only
    r = _shrink(run, INNER_LEAK_FIRST="24")
    assert r.returncode == 1 and "did not FAIL isolation the same way when re-run" in r.stdout, r.stdout[-2000:]
    res = json.loads(Path(r.stdout.split("see ")[-1].split()[0]).read_text())
    assert not res["reproduced"] and res["steps"] == 1 and res["minimal"]["requests"] == 24


def test_a_scenario_that_passes_this_time_is_refused_with_the_reason(tmp_path):
    run = _original(tmp_path)
    r = _shrink(run, INNER_LEAK_FIRST="0")  # the engine no longer leaks at all
    assert r.returncode == 1 and "not shrunk — experiment shrinkable: no leak checker FAILed" in r.stdout, r.stdout[-2000:]
    r = _shrink(run, "--checker", "sensitivity")  # a checker that did not fail is named
    assert r.returncode == 1 and "sensitivity did not FAIL with a witness" in r.stdout, r.stdout[-2000:]


def test_what_shrink_refuses_and_its_predicates():
    ex = types.SimpleNamespace(name="x", drive_fn=lambda e: None, _during=None)
    with pytest.raises(ShrinkError, match="custom drive"):
        Shrinker(ex, Path("/nonexistent"))
    v = types.SimpleNamespace(oracle="isolation", status="pass", witnesses=[])
    ex = types.SimpleNamespace(name="y", drive_fn=None, _during=None, verdicts=[v])
    with pytest.raises(ShrinkError, match="nothing to shrink"):
        Shrinker(ex, Path("/nonexistent"))
    w = {"owner_tenant": "t001", "victim_tenant": "t002", "status": 200}
    target = ("isolation", {witness_kind("isolation", w)})
    fail = types.SimpleNamespace(oracle="isolation", status="fail", witnesses=[w])
    assert still_fails([fail], target)
    other = types.SimpleNamespace(oracle="isolation", status="fail", witnesses=[{**w, "status": 500}])
    assert not still_fails([other], target)  # a witness of another kind is another failure
    stale = types.SimpleNamespace(oracle="isolation", status="fail", witnesses=[{**w, "origin": "session (seed 1)"}])
    assert not still_fails([stale], target)  # another run's data in the pool: not this scenario's leak
    both = types.SimpleNamespace(oracle="isolation", status="fail", witnesses=[*stale.witnesses, {**w, "origin": "this log"}])
    assert target_of([both]) == target  # the original leaked both: the scenario's own leak is the one kept
    assert target_of([stale])[1] == {witness_kind("isolation", stale.witnesses[0])}  # nothing else: that one
    wl = Workload(3, n_tenants=2, prefix="ss")
    a, b = wl.conversation(wl.tenants[0], turns=2)
    kept = subset([a, b], {b.rid})
    assert kept[0].after is None and b.after == a.rid  # the copy waits for nothing; the original is untouched


def test_shorten_keeps_canaries_shared_prefix_head_and_tail():
    from kvchaos.probe import MIN_HEAD, MIN_TAIL

    wl = Workload(3, n_tenants=3, prefix="sp", page_size=4)
    alone = wl.request(wl.tenants[0], n_tokens=500)
    sys_ = wl.request(wl.tenants[1], sharing="tenant")
    pair = wl.diverging("t000", "t001", at="mid")
    for p in [alone, sys_, *pair]:
        assert shortenable(p)
        text, lengths = p.prompt, [len(p.prompt)]
        while (s := shorten(text, p.shared_chars)) is not None:
            assert s[:p.shared_chars] == p.prompt[:p.shared_chars]  # what other plans share by design stays
            text = s
            lengths.append(len(text))
        assert lengths == sorted(lengths, reverse=True) and len(lengths) > 2, lengths
        assert [c for _, c in canary.find(text)] == p.canaries  # every canary, in order
        found = canary.find(text)
        assert found[0][0] >= MIN_HEAD and len(text) - 1 - (found[-1][0] + len(found[-1][1])) >= MIN_TAIL
    assert len(text) < len(pair[1].prompt) and text[:pair[1].shared_chars] == pair[0].prompt[:pair[1].shared_chars]
    assert shorten(alone.prompt)[-1] == "[" and len(shorten(alone.prompt)) < 0.6 * len(alone.prompt)
    # prompts whose length or text is the point are never cut
    conv = wl.conversation(wl.tenants[2], turns=2)
    same = wl.identical(["t000", "t001"])
    big = wl.request(wl.tenants[0])
    assert not any(shortenable(p) for p in [*conv, *same])
    big.oversized = True
    assert not shortenable(big)
    assert shorten("no trigger here") is None


def test_a_minimal_step_that_fails_again_by_chance_backs_off_to_the_step_kept_before_it():
    sh = object.__new__(Shrinker)  # the confirmation alone: attempts stubbed by what each scenario does
    sh.ex, sh.say, said = types.SimpleNamespace(name="x"), None, []
    sh.say = said.append
    steps = [{"rids": list("abcd"), "faults": [], "concurrency": 2, "prompts": {}},
             {"rids": list("ab"), "faults": [], "concurrency": 1, "prompts": {}},
             {"rids": ["a"], "faults": [], "concurrency": 1, "prompts": {"a": "short"}}]
    runs = []

    def attempt(rids, faults, concurrency, why, prompts=None, confirm=False):
        assert confirm and prompts is not None
        runs.append(("".join(rids), why))
        return rates["".join(rids)].pop(0)

    sh.attempt = attempt
    sh.accepted = steps
    rates = {"a": [True, False, False], "ab": [True, True, False], "abcd": [True, True, True]}
    assert sh.confirm() == 2 and sh.best is steps[1] and sh.backed_off == 1
    assert [r for r, _ in runs] == ["a"] * 3 + ["ab"] * 3 and "confirm 1/3 (1 step(s) back)" in runs[3][1]
    assert said and "failed again 1/3 only" in said[0]
    runs.clear()
    rates = {"a": [True, True, False]}  # the smallest step re-fails in most runs: kept, nothing else run
    assert sh.confirm() == 2 and sh.best is steps[2] and sh.backed_off == 0 and len(runs) == 3
    rates = {"a": [False] * 3, "ab": [False] * 3, "abcd": [True, False, False]}  # none in most: the best seen
    assert sh.confirm() == 1 and sh.best is steps[0] and sh.backed_off == 2


def test_remint_gives_fresh_canaries_the_same_way_in_every_prompt_that_carries_them():
    import random as _random

    from kvchaos.shrink.scenario import remint

    wl = Workload(11, n_tenants=3, prefix="rm")
    plans = [wl.request(wl.tenants[i % 3], n_canaries=2) for i in range(4)]
    turn2 = subset(plans, {plans[0].rid})[0]
    turn2.rid, turn2.prompt = "turn2", plans[0].prompt + " more words " + plans[1].prompt  # a later turn repeats both
    turn2.canaries = plans[0].canaries + plans[1].canaries
    new = remint(plans + [turn2], _random.Random(3))
    old_all = {c for p in plans for c in p.canaries}
    for p, q in zip(plans + [turn2], new):
        assert [c for _, c in canary.find(q.prompt)] == q.canaries and len(q.prompt) == len(p.prompt)
        assert [c[:2] for c in q.canaries] == [c[:2] for c in p.canaries]  # the opening character kept
        assert not set(q.canaries) & old_all
        assert canary.find(p.prompt) and p.canaries[0] in p.prompt  # the originals untouched
    assert new[4].canaries == new[0].canaries + new[1].canaries
    assert remint(plans, _random.Random(3))[0].canaries != remint(plans, _random.Random(4))[0].canaries


def test_reminted_canaries_of_one_prompt_share_no_trigram():
    """The probe copies by trigram: two canaries of one prompt that share one make it recite a chimera
    of both, which isolation counts as a canary nobody minted (a fuzz control went red so, 2026-12-05).
    Remint keeps mint's rule in every prompt, a conversation's later turns (their earlier turns'
    canaries repeated) included."""
    import random as _random

    from kvchaos.shrink.scenario import remint

    wl = Workload(5, n_tenants=4, prefix="tg")
    plans = [p for t in wl.tenants for p in wl.conversation(t, turns=4)]
    plans += [wl.request(wl.tenants[i % 4], n_canaries=3, sharing="tenant") for i in range(40)]
    for seed in range(60):
        for q in remint(plans, _random.Random(seed)):
            cs = [c for _at, c in canary.find(q.prompt)]
            grams = [c[j:j + 3] for c in dict.fromkeys(cs) for j in range(len(c) - 2)]
            assert len(grams) == len(set(grams)), (seed, q.rid, cs)


def test_caches_are_flushed_on_both_roles_and_a_refusal_is_named():
    from kvchaos.workload.snapshots import flush_caches
    from tests.data.known_suite.test_known_inner import StandIn
    from tests.fake_engine import FakeEngine

    with FakeEngine() as eng:
        assert flush_caches(StandIn(eng.url)) == {"prefill": True, "decode": True} and eng.flushes == 2
    dead = StandIn("http://127.0.0.1:9")  # nothing listens: every try refused, bounded by the timeout
    got = flush_caches(dead, timeout_s=1.0)
    assert set(got) == {"prefill", "decode"} and all(isinstance(v, str) and "Connect" in v for v in got.values())


def test_settle_aborts_what_a_run_left_in_the_engines_and_names_what_stays():
    """After a run the engines go back to idle with flushed caches; requests their clients gave up on
    are aborted first; an engine that stays busy even then is named, for its cluster to be replaced."""
    from kvchaos.workload.snapshots import settle
    from tests.data.known_suite.test_known_inner import StandIn
    from tests.fake_engine import FakeEngine

    with FakeEngine() as eng:
        c = StandIn(eng.url)
        assert settle(c, timeout_s=1.0) == (False, None) and eng.flushes == 2
        assert not [b for p, b in eng.requests if p == "/abort_request"]  # an idle engine: nothing aborted
        eng.held = "abortable"
        assert settle(c, timeout_s=0.5) == (True, None) and eng.flushes == 4 and eng.held is None
        assert [b for p, b in eng.requests if p == "/abort_request"][0] == {"rid": "", "abort_all": True}
        eng.held = "stuck"
        aborted, left = settle(c, timeout_s=0.5)
        assert aborted and set(left) == {"prefill", "decode"} and eng.flushes == 4
        assert all("idle state" in v and "after abort_all: True" in v for v in left.values())


def test_an_experiment_with_nemesis_ops_shrinks_its_ops_and_plans(tmp_path):
    """An experiment that ran its faults as ops (ex.nemesis) is shrunk, not refused: each step re-runs the
    ops it keeps (and the gates of the plans kept); ops the leak does not need are dropped."""
    r = subprocess.run([sys.executable, "-m", "pytest", f"{INNER}::test_shrinkable_ops", "-p", "no:cacheprovider",
                        "-o", "testpaths=", "-q", "--kvchaos-seed", "5", "--kvchaos-reports", str(tmp_path / "reports")],
                       cwd=REPO, env=child_env(KVCHAOS_RUN_ID="ops"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-2000:]
    s = subprocess.run([sys.executable, "-m", "kvchaos", "shrink", str(tmp_path / "reports" / "ops"), "shrinkable_ops",
                        "--steps", str(STEPS)], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert s.returncode == 0, s.stdout[-3000:] + s.stderr[-2000:]
    d = Path(s.stdout.split("bug report: ")[1].split()[0]).parent
    res = json.loads((d / "minimal.json").read_text())
    assert res["reproduced"] and res["original"]["faults"] == 2 and res["minimal"]["faults"] == 0, res["minimal"]
    assert res["scenario"]["nemesis"] is True and res["scenario"]["faults"] == [] and res["scenario"]["gates"] == {}
    assert any(a["why"].startswith("drop fault") and a["fails"] for a in res["attempts"])


def test_kept_ops_follow_what_waits_and_the_plans_kept():
    from kvchaos.shrink import kept_ops
    from kvchaos.workload.scenario import Op

    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": "a"}),
           Op(at_s=0, injector="agent", role="decode", kind="double_alloc", count=1),
           Op(at_s=0, injector="action", kind="abort", rids=["a"], after=0),
           Op(at_s=0, injector="action", kind="release", after=0, on={"role": "decode", "ev": "fault_fired", "op": 1}),
           Op(at_s=0, injector="action", kind="abort", rids=["c"], on={"role": "prefill", "ev": "transfer_start", "rid": "c"})]
    gates = {"b": 0, "c": 3, "d": 1}
    got, g = kept_ops(ops, {0, 1, 2, 3, 4}, {"a", "b", "c", "d"}, gates)
    assert got == ops and g == gates
    got, g = kept_ops(ops, {1, 2, 3, 4}, {"a", "b", "c", "d"}, gates)  # the hold dropped: what waits on it goes
    assert [o.kind for o in got] == ["double_alloc", "abort"] and got[1].rids == ["c"] and g == {"d": 0}
    got, g = kept_ops(ops, {0, 1, 2, 3, 4}, {"b", "c", "d"}, gates)  # plan a dropped: the ops naming it go
    assert [o.kind for o in got] == ["double_alloc", "abort"] and g == {"d": 0}
    got, g = kept_ops(ops, {0, 2, 3, 4}, {"a", "b", "c", "d"}, gates)  # the event's op dropped: the release goes
    assert [(o.kind, o.after) for o in got] == [("hold", None), ("abort", 0), ("abort", None)] and g == {"b": 0}


def test_the_leaking_engine_waits_for_its_runs_owner_whatever_the_send_skew():
    """The shrink tests' engine (LeakFirst) leaks the owner's canary into a reply that overlaps the owner's
    request: a victim sent 0.3 s before the owner (a loaded client's skew; CI saw one past 50 ms) still
    gets the owner's canary of this run, not a stale one of the run before the flush."""
    import threading

    import requests

    from tests.data.replay_suite.test_replay_inner import LeakFirst

    wl = Workload(7, n_tenants=2, prefix="sk")
    victim, owner, earlier = (wl.request(wl.tenants[i % 2], n_canaries=2) for i in range(3))
    marker = "the owner's "
    owner_text, earlier_text = marker + owner.prompt, marker + earlier.prompt  # the owner's, then and now
    with LeakFirst(marker, 100) as eng:
        eng.delay_s = 0.05
        post = lambda t: requests.post(f"{eng.url}/generate", json={"text": t}, timeout=10).json()["text"]  # noqa: E731
        post(earlier_text)  # a run before: its pages stay behind
        requests.post(f"{eng.url}/flush_cache", timeout=10)
        got = {}
        t = threading.Thread(target=lambda: got.update(victim=post(victim.prompt)))
        t.start()
        time.sleep(0.3)
        post(owner_text)
        t.join(10)
    assert canary.payload(owner.canaries[0]) in got["victim"], got
    assert canary.payload(earlier.canaries[0]) not in got["victim"], got
