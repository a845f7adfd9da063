"""kvchaos fuzz without a cluster: the grammar (deterministic, valid, covers the space, never plants a
bug), mutation and splicing (always valid, links kept), the engine-state feedback, the corpus (keeps
only the new, resumes, refuses damage by name), triage (KNOWN / NEW / blind, dedup by mechanism), and
the loop's scheduling, confirmation and summary with a stand-in cluster."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from kvchaos.commands._common import UsageError
from kvchaos.commands.fuzz import parse_budget
from kvchaos.fuzz import loop as fuzz_loop
from kvchaos.fuzz.corpus import Corpus, CorpusError
from kvchaos.fuzz.feedback import features, request_states
from kvchaos.fuzz.grammar import FAULTS, MAX_OPS, Base, baseline, generate, mutate, rebase, splice
from kvchaos.fuzz.loop import Clusters, Fuzzer, table
from kvchaos.fuzz.triage import mechanism, signature, triage
from kvchaos.oracles import FAIL, PASS, UNKNOWN, Verdict
from kvchaos.workload import Workload
from kvchaos.workload.scenario import AGENT_MUTATIONS, Deployment, Op, Scenario, Traffic, plan_dict

BASE = Base(pool=2048, context=4096, reservation=512, input_limit=2042)


def _many(n=120, seed=7):
    rng = random.Random(seed)
    return [generate(rng, BASE, f"g{i}") for i in range(n)]


# ------------------------------------------------------------------ the grammar
def test_same_seed_same_scenarios():
    a = [s.to_dict() for s in _many(20, 3)]
    b = [s.to_dict() for s in _many(20, 3)]
    assert a == b and a != [s.to_dict() for s in _many(20, 4)]


def test_generated_scenarios_cover_the_space_and_never_plant_a_bug():
    scs = _many(200)
    kinds = {o.kind for s in scs for o in s.nemesis if o.injector == "agent"}
    assert set(FAULTS) <= kinds
    assert not kinds & set(AGENT_MUTATIONS)
    assert {o.injector for s in scs for o in s.nemesis} == {"agent", "proxy", "process", "action"}
    assert {k for s in scs for k in s.deployment.live} == {"prefill_input_limit", "chunked_prefill",
                                                          "deferred_release_timeout_s", "decode_reservation"}
    restarts = sum(bool(s.deployment.restart) for s in scs)
    assert 0 < restarts < len(scs) / 2  # deployment changes are drawn, and rarely
    assert {s.traffic.via for s in scs} == {"router", "pd"}
    assert all(p["endpoint"] == "generate" for s in scs if s.traffic.via == "pd" for p in s.traffic.plans)
    labels = {p["extra"].get("probe") for s in scs for p in s.traffic.plans if p["extra"].get("probe")}
    assert labels == {"answer", "hang_band", "reject"}
    endpoints = {p["endpoint"] for s in scs for p in s.traffic.plans}
    assert endpoints == {"generate", "completions", "chat"}
    assert {p["kind"] for s in scs for p in s.traffic.plans} >= {"plain", "stream", "abort_after", "oversized"}


def test_salted_traffic_is_checked_for_cross_salt_cache_hits():
    scs = _many(60)
    for s in scs:
        salted = any(p.get("cache_salt") for p in s.traffic.plans)
        assert salted == ("cache_isolation" in {c["name"] for c in s.checks}), s.name
    assert any("cache_isolation" in {c["name"] for c in s.checks} for s in scs)


def test_edge_labels_follow_the_deployments_limits():
    dep = Deployment({}, {"decode_reservation": 64})
    assert BASE.expect(1984, dep) == "answer" and BASE.expect(1985, dep) == "hang_band"
    assert BASE.expect(2042, dep) == "reject"
    assert BASE.expect(1537, Deployment()) == "hang_band" and BASE.expect(1536, Deployment()) == "answer"
    assert BASE.bands(Deployment()) == [(64, 1537), (1537, 2042), (2042, 2048), (2048, 4096), (4096, 8192)]


def test_a_search_starts_from_its_steady_state_and_a_resumed_one_does_not(tmp_path):
    base = Base(pool=2048, context=4096, reservation=512, input_limit=2042, restart={"engine_version": "0.5.19"})
    for seed in range(40):
        sc = baseline(random.Random(seed), base, "b")
        assert sc.nemesis == [] and sc.deployment.live == {} and sc.deployment.restart == {"engine_version": "0.5.19"}
        assert len(sc.traffic.plans) >= 20 and not any(p["extra"].get("probe") for p in sc.traffic.plans)
        assert {p.get("kind", "plain") for p in sc.traffic.plans} <= {"plain", "stream"}, seed  # no client cuts
        rids = {p["rid"] for p in sc.traffic.plans}
        assert all(p.get("after") in rids for p in sc.traffic.plans if p.get("after")), seed  # no dangling wait
        assert sc.origin == {"by": "baseline"} and Scenario.from_dict(sc.to_dict()).digest() == sc.digest()
    probed = [generate(random.Random(s), BASE, "g") for s in range(40)]
    assert any(p["extra"].get("probe") for sc in probed for p in sc.traffic.plans)  # what the baseline left out
    drawn = []

    def outcomes(sc):
        drawn.append(sc.origin["by"])
        return _log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=30.0)
    fz.run()
    assert drawn[0] == "baseline" and "baseline" not in drawn[1:]
    drawn.clear()
    fz2, _ = _fuzzer(tmp_path / "again", outcomes, budget=30.0)
    fz2.corpus = Corpus(tmp_path / "corpus")  # the first search's corpus, resumed
    assert fz2.corpus.resumed
    fz2.run()
    assert "baseline" not in drawn


def test_some_scenarios_send_no_abort_at_all():
    """On a release where one client abort wedges the PD pipeline, only an abort-free scenario can show
    anything else: the share of aborts is drawn per scenario, and zero is one of the draws."""
    aborts = [sum(p["kind"] in ("abort_after", "disconnect_before_first_token") for p in s.traffic.plans)
              for s in _many(120)]
    assert 0.25 < sum(a == 0 for a in aborts) / len(aborts) < 0.55 and max(aborts) >= 8


def test_a_drawn_abort_waits_on_a_hold_armed_before_the_traffic_and_never_healed():
    """An abort of a held request waits for its hold to park that request: the hold is armed at the
    start and not healed (armed later or healed early it missed its request, and the abort was skipped)."""
    n = 0
    for s in _many(200):
        for o in s.nemesis:
            if o.kind == "abort" and o.after is not None:
                held = s.nemesis[o.after]
                assert held.kind in ("hold", "park") and held.target == {"rid": o.rids[0]}
                assert held.at_s == 0.0 and held.heal_s is None, held
                n += 1
    assert n >= 15


def test_some_drawn_ops_are_set_off_by_a_requests_own_event():
    """The suites' choreography is in the space the grammar draws from: an abort of a request once it
    reached a stage, a stop or kill of a role once a request's transfer started (healed by an action
    that waits on it). Each names a request of its own traffic and round-trips through the schema."""
    from kvchaos.fuzz.grammar import ON_EVENTS
    aborts, procs, events = 0, 0, set()
    for s in _many(300):
        rids = {p["rid"] for p in s.traffic.plans}
        for i, o in enumerate(s.nemesis):
            if o.on is None:
                continue
            events.add((o.on["role"], o.on["ev"]))
            assert o.on["rid"] in rids
            if o.kind == "abort":
                assert o.rids == [o.on["rid"]]
                aborts += 1
            else:
                assert o.injector == "process" and o.kind in ("stop", "kill")
                assert any(h.kind == "heal" and h.after == i and h.delay_s >= 1 for h in s.nemesis), s.nemesis
                procs += 1
        assert Scenario.from_dict(json.loads(json.dumps(s.to_dict()))).digest() == s.digest()
    assert aborts >= 10 and procs >= 1 and events == set(ON_EVENTS), (aborts, procs, events)
    from kvchaos.fuzz.grammar import _on_ops
    kinds = set()
    for seed in range(200):  # the process arm directly: a stop or kill, healed by the action after it
        ops = _on_ops(random.Random(seed), ["r1", "r2"], first=3)
        if ops[0].injector == "process":
            kinds.add(ops[0].kind)
            assert len(ops) == 2 and ops[1].kind == "heal" and ops[1].after == 3 and 1 <= ops[1].delay_s <= 5
    assert kinds == {"stop", "kill"}


def test_some_scenarios_carry_no_fault_and_a_search_stops_sending_to_a_wedged_cluster():
    """The engine's own bugs show alone only where no fault adds its own hung or cut requests: about
    a third of drawn scenarios carry no op (quiet, plus draws of zero ops), the rest do; every drawn
    scenario's traffic stops sending once the cluster is seen wedged (stall_s: the driver's tests)."""
    scs = _many(200)
    quiet = sum(not s.nemesis for s in scs) / len(scs)
    assert 0.3 < quiet < 0.5, quiet
    assert {s.traffic.stall_s for s in scs} == {25.0} and {s.traffic.timeout_s for s in scs} == {30.0}
    quiet_probes = [s for s in scs if not s.nemesis and any(p.get("extra", {}).get("probe") for p in s.traffic.plans)]
    assert len(quiet_probes) >= 20  # band probes on a fault-free run: the hang band, the reject paths


def test_band_probes_go_out_shortest_first():
    """A probe past decode's admission edge can wedge the pipeline and hide every probe after it, so a
    scenario's probes (drawn, or added by the probe mutation) are sent in increasing length."""
    seen = 0
    for s in _many(150):
        sizes = [p["n_tokens"] for p in s.traffic.plans if p.get("extra", {}).get("probe") and "turn" not in p["extra"]]
        seen += len(sizes) >= 2
        assert sizes == sorted(sizes), sizes
    assert seen >= 30


def test_the_probe_mutation_puts_band_prompts_among_the_traffic_as_it_is(monkeypatch):
    from kvchaos.fuzz import grammar
    monkeypatch.setattr(grammar, "MUTATORS", {"probe": 1})
    rng = random.Random(3)
    window = 0
    for i, parent in enumerate(_many(60, seed=11)):
        parent.deployment.live["prefill_input_limit"] = 512
        child = mutate(rng, parent, BASE, f"p{i}")
        old = {p["rid"]: p for p in parent.traffic.plans}
        added = [p for p in child.traffic.plans if p["rid"] not in old]
        assert 1 <= len(added) <= 3 and len(child.traffic.plans) == len(parent.traffic.plans) + len(added)
        assert [p for p in child.traffic.plans if p["rid"] in old] == parent.traffic.plans  # the rest as it was
        assert len({p["tenant"] for p in added}) == 1 and all(p["extra"]["probe"] for p in added)
        assert [p["n_tokens"] for p in added] == sorted(p["n_tokens"] for p in added)  # shortest first
        victim = added[0]["tenant"]
        salt = next(p.get("cache_salt") for p in parent.traffic.plans if p["tenant"] == victim)
        assert all(p.get("cache_salt") == salt for p in added)
        for p in added:
            assert p["extra"]["probe"] == BASE.expect(p["n_tokens"], child.deployment)
            assert p["oversized"] == (p["extra"]["probe"] == "reject")
            window += 512 <= p["n_tokens"] <= 1536
        assert not {c for p in added for c in p["canaries"]} & {c for p in parent.traffic.plans for c in p["canaries"]}
        assert Scenario.from_dict(child.to_dict()).digest() == child.digest()
    assert window >= 20  # the reject path's window a lowered limit opens is reached


def test_probe_sizes_draw_bands_not_lengths_so_a_narrow_window_is_reached():
    """Where prefill's limit (570) is under decode's admission edge (1536), the prompts prefill rejects and
    decode would admit are two bands of six (570..575 and 576..1536): four in five 3-probe draws reach it;
    three lengths drawn uniformly over 64..8192 would, one time in three."""
    dep = Deployment({"prefill_pool_tokens": 576}, {})
    bands = BASE.bands(dep)
    assert (570, 576) in bands and (576, 1537) in bands and len(bands) == 6
    rng = random.Random(0)
    draws = [BASE.probe_sizes(rng, dep, 3) for _ in range(300)]
    assert all(len(d) == 3 and len({next(b for b in bands if b[0] <= n < b[1]) for n in d}) == 3 for d in draws)
    window = [d for d in draws if any(570 <= n <= 1536 for n in d)]
    assert len(window) / len(draws) > 0.7
    assert all(BASE.expect(n, dep) == "reject" for d in draws for n in d if 570 <= n <= 1536)
    assert {n for d in draws for n in d} >= {64, 570, 571, 1536, 1537, 8191}  # the edges themselves are drawn


def test_a_limit_a_live_knob_moved_is_always_probed_on_both_sides():
    """prefill's input limit lowered to 512 under decode's admission edge (1537): every drawn scenario
    with that knob sends prompts into the bands on both sides of 512, among them the band prefill
    rejects and decode would admit; one whose knobs moved no limit probes only half the time."""
    dep = Deployment({}, {"prefill_input_limit": 512})
    assert BASE.moved(dep) == {512} and BASE.moved(Deployment({}, {"chunked_prefill": 64})) == set()
    assert BASE.moved(Deployment({}, {"decode_reservation": 64})) == {2048 - 64 + 1}
    rng = random.Random(2)
    for _ in range(100):
        sizes = BASE.probe_sizes(rng, dep, 2)
        assert any(512 <= n < 1537 for n in sizes) and any(n < 512 for n in sizes), sizes
    rng = random.Random(4)
    moved = probed = quiet = quiet_probed = 0
    for i in range(300):
        sc = generate(rng, BASE, f"g{i}")
        has = any((p.get("extra") or {}).get("probe") for p in sc.traffic.plans)
        if BASE.moved(sc.deployment):
            moved += 1
            probed += has
        else:
            quiet += 1
            quiet_probed += has
    assert moved > 50 and probed == moved and 0.3 < quiet_probed / quiet < 0.7


@pytest.mark.parametrize("seed", range(5))
def test_mutations_and_splices_stay_valid_and_keep_their_links(seed):
    rng = random.Random(seed)
    pool = _many(10, seed)
    for i in range(150):
        parent = rng.choice(pool)
        child = (splice(rng, parent, rng.choice(pool), f"m{i}") if i % 5 == 0 else mutate(rng, parent, BASE, f"m{i}"))
        assert child.validate() is not None
        for j, op in enumerate(child.nemesis):
            # an abort waits on a hold or park, a heal on the stop or kill it ends
            want = {"abort": ("agent",), "heal": ("process",)}.get(op.kind, ("agent",))
            assert op.after is None or (op.after < j and child.nemesis[op.after].injector in want), (op, child.nemesis)
        assert not any(o.mutation for o in child.nemesis)
        assert child.origin["by"] in ("mutate", "splice")
        if child.origin["by"] == "splice" or child.origin.get("how") == "add_op":  # they grow: capped
            assert len(child.nemesis) <= MAX_OPS, (child.origin, len(child.nemesis))
        pool.append(child)
    assert len({s.digest() for s in pool}) > 100  # mutations change things


def test_splices_stay_within_the_op_cap_and_keep_both_parents_ops():
    """Splicing a corpus of spliced scenarios again and again: none grows past MAX_OPS (the fifth guided
    pair's splices reached 30 ops), and a splice of two op-carrying parents keeps ops of each."""
    rng = random.Random(7)
    pool = [s for s in _many(30, 7) if s.nemesis]
    both = 0
    for i in range(200):
        a, b = rng.choice(pool), rng.choice(pool)
        child = splice(rng, a, b, f"s{i}")
        assert len(child.nemesis) <= MAX_OPS
        mine = {json.dumps(o.to_dict(), sort_keys=True) for o in a.nemesis}
        kept = sum(json.dumps(o.to_dict(), sort_keys=True) in mine for o in child.nemesis)
        both += 0 < kept < len(child.nemesis)
        pool.append(child)
    assert both > 100


# ------------------------------------------------------------------ feedback
def _log(*agent, ends=()):
    recs = [{"ev": "send", "rid": r, "wall": 1.0} for r, *_ in ends]
    recs += [{"ev": "end", "rid": r, "status": st, "outcome": oc, "wall": 9.0} for r, st, oc in ends]
    recs += [{"ev": "agent", "wall": w, **a} for w, a in agent]
    return recs


def test_engine_states_name_what_happened_to_each_request():
    recs = _log((2.0, {"agent_ev": "kv_prealloc", "rid": "a", "total_prefix_len": 0, "dst_pages": [1, 2, 3]}),
                (3.0, {"agent_ev": "kv_released", "rid": "a", "room": 7, "deferred_release_enabled": False}),
                (4.0, {"agent_ev": "write_end", "rid": "a", "room": 7, "ret": 0}),
                (2.5, {"agent_ev": "fault_fired", "rid": "b", "kind": "short"}),
                (2.6, {"agent_ev": "prefix_match", "rid": "b", "cached_tokens": 64, "cache_salt": "x",
                       "lookup_salt": "y"}),
                ends=[("a", 200, "ok"), ("b", 200, "ok")])
    st = request_states(recs)
    assert "late_write=yes" in st["a"] and "release=immediate" in st["a"] and "status=2xx" in st["a"]
    assert "xfer=short" in st["b"] and "cache_hit=other_salt" in st["b"]
    f = features(recs)
    assert "late_writes_band:1" in f and "in_flight_band:2" in f and "decode_pool_band:2" in f
    assert features(recs) == f  # a function of the log


def test_a_new_state_is_a_new_feature():
    base = _log(ends=[("a", 200, "ok")])
    more = _log((2.0, {"agent_ev": "kv_retracted", "rid": "a"}), ends=[("a", 200, "ok")])
    assert features(more) - features(base)


# ------------------------------------------------------------------ the corpus
def test_the_corpus_keeps_only_what_is_new_and_resumes(tmp_path):
    c = Corpus(tmp_path / "c")
    a, b = _many(2)
    assert c.add(a, {"x", "y"}, 1.0) and not c.add(b, {"x"}, 2.0) and c.add(b, {"x", "z"}, 3.0)
    assert len(c) == 2 and set(c.seen) == {"x", "y", "z"}
    again = Corpus(tmp_path / "c")
    assert again.resumed and len(again) == 2 and set(again.seen) == {"x", "y", "z"}
    assert again.pick(random.Random(1)).digest() in {a.digest(), b.digest()}
    assert not again.add(a, {"y"}, 4.0)


def test_slow_entries_are_picked_less(tmp_path):
    c = Corpus(tmp_path / "s")
    a, b = _many(2, 9)
    c.add(a, ["fa"], 1.0, wall_s=10.0)
    c.add(b, ["fb"], 2.0, wall_s=200.0)  # a run that hung into its timeouts
    rng = random.Random(0)
    picks = [c.pick(rng).digest() for _ in range(400)]
    assert picks.count(a.digest()) > 3 * picks.count(b.digest()) > 0
    assert Corpus(tmp_path / "s").entries[b.digest()]["wall_s"] == 200.0  # kept for a resumed run


def test_a_damaged_corpus_is_refused_by_name(tmp_path):
    c = Corpus(tmp_path / "c")
    c.add(_many(1)[0], {"x"}, 1.0)
    bad = next((tmp_path / "c" / "entries").glob("*.json"))
    bad.write_text('{"scenario": {"schema": "kvchaos.scenario/9"}}')
    with pytest.raises(CorpusError, match=bad.name):
        Corpus(tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "seen.json").write_text("{")
    with pytest.raises(CorpusError, match="seen.json"):
        Corpus(tmp_path / "d")
    with pytest.raises(CorpusError, match="empty"):
        Corpus(tmp_path / "e").pick(random.Random(0))


# ------------------------------------------------------------------ triage
class _Registry:
    def __init__(self, known=None):
        self.known = known or {}

    def classify(self, v, ctx, require_power=True):
        fid = self.known.get(v.oracle)
        return (SimpleNamespace(id=fid), "matched") if fid else (None, "no finding covers it")


def _v(oracle, status, witnesses=()):
    return Verdict(oracle, status, f"{oracle} {status}", list(witnesses), {})


def test_triage_known_new_and_blind():
    w = [{"victim_rid": "r1", "owner_rid": "r2", "status": 200}]
    vs = [_v("isolation", FAIL, w), _v("liveness", FAIL, [{"rid": "r3", "outcome": "timeout"}]),
          _v("kv_lifecycle", UNKNOWN), _v("http_semantics", PASS)]
    finds = triage(vs, None, _Registry({"liveness": "sglang-pd-hang-band"}), [])
    assert [(f.oracle, f.kind, f.finding) for f in finds] == [("isolation", "new", None),
                                                              ("liveness", "known", "sglang-pd-hang-band"),
                                                              ("kv_lifecycle", "blind", None)]
    assert finds[0].why_not_known == "no finding covers it"


def test_a_known_mechanism_in_an_underpowered_run_is_known_to_triage_but_never_to_the_policy():
    """A first 36-56-plan search (2026-12-04) saw a short transfer's stale recital while a hold on one
    tenant had 4 evidence requests (class floor 5): the policy rightly refused KNOWN, and triage called
    the registered finding NEW. Triage matches the mechanism and says the run lacked power."""
    from kvchaos.policy.context import Context
    from kvchaos.policy.findings import Registry

    reg = Registry.from_dict({"finding": [{
        "id": "stale-after-short", "title": "t", "engine": "sglang", "versions": ["0.5.23"],
        "match": [{"checker": "isolation", "signature": {"fault_armed": "short"}}]}]})
    events = [{"ev": "header", "engine": "sglang", "engine_version": "0.5.23"},
              {"ev": "fault", "injector": "agent", "kind": "short", "action": "armed", "wall": 1.0}]
    ctx = Context.of(events)
    ctx.version = "0.5.23"
    w = [{"victim_rid": "r1", "owner_rid": "r2", "status": 200}]
    under = Verdict("isolation", FAIL, "leak", w, {"power": {"met": False, "classes": {}}})
    powered = Verdict("isolation", FAIL, "leak", w, {"power": {"met": True, "classes": {}}})
    assert reg.classify(under, ctx)[0] is None and "needs the power" in reg.classify(under, ctx)[1]
    (f,) = triage([under], ctx, reg, events)
    assert (f.kind, f.finding, f.power_met) == ("known", "stale-after-short", False)
    (g,) = triage([powered], ctx, reg, events)
    assert (g.kind, g.power_met) == ("known", True) and reg.classify(powered, ctx)[0].id == "stale-after-short"
    # a mechanism no finding names stays NEW, power or not
    bare = [{"ev": "header", "engine": "sglang", "engine_version": "0.5.23"}]
    (h,) = triage([under], Context.of(bare), reg, bare)
    assert h.kind == "new"


def test_traffic_gives_a_fault_room_and_a_redraw_new_request_ids():
    scs = _many(80)
    assert min(s.traffic.concurrency for s in scs) >= 4
    rng = random.Random(5)
    for s in scs[:30]:
        for i in range(6):
            m = mutate(rng, s, BASE, f"m{i}")
            # a request id never names another prompt than it did in the parent (a redraw with the same
            # seed reused ids for other prompts and canaries, and a page left by one named the other's owner)
            old = {p["rid"]: p["prompt"] for p in s.traffic.plans}
            rids = [p["rid"] for p in m.traffic.plans]
            assert len(set(rids)) == len(rids)
            assert all(old.get(p["rid"], p["prompt"]) == p["prompt"] for p in m.traffic.plans)
            if {p["rid"] for p in m.traffic.plans} - set(old) and set(old) - {p["rid"] for p in m.traffic.plans}:
                assert m.seed != s.seed  # redrawn: a new seed


def test_the_same_mechanism_on_other_victims_is_one_find():
    recs = [{"ev": "agent", "agent_ev": "fault_fired", "rid": r, "kind": "short"} for r in ("a", "c")]
    one = _v("isolation", FAIL, [{"victim_rid": "a", "owner_rid": "b", "status": 200}])
    two = _v("isolation", FAIL, [{"victim_rid": "c", "owner_rid": "d", "status": 200}])
    other = _v("isolation", FAIL, [{"victim_rid": "c", "owner_rid": None, "origin": "unknown", "status": 200}])
    assert signature(mechanism(one, recs)) == signature(mechanism(two, recs))
    assert signature(mechanism(one, recs)) != signature(mechanism(other, recs))
    assert mechanism(one, recs)["faults_on_victims"] == ["short:fired"]


def test_a_leaks_mechanism_says_what_decode_was_handed_from_the_engines_events():
    """The GLM-5.3 mechanism from the engines' own events: decode reserved a whole prompt's pages
    (kv_prealloc), prefill wrote one (write_end). A leak with a whole handoff is another find."""
    def recs(written):
        out = [{"ev": "agent", "agent_ev": "kv_prealloc", "role": "decode", "rid": "v", "dst_pages_total": 12}]
        return out + [{"ev": "agent", "agent_ev": "write_end", "role": "prefill", "rid": "v", "pages": n} for n in written]
    leak = _v("isolation", FAIL, [{"victim_rid": "v", "owner_rid": "o", "status": 200}])
    got = {w: mechanism(leak, recs(w))["victims_kv_handoff"] for w in ((1,), (6, 6), ())}
    assert got == {(1,): ["short"], (6, 6): ["whole"], (): ["reserved_only"]}
    assert mechanism(leak, [])["victims_kv_handoff"] == ["none"]
    assert signature(mechanism(leak, recs((1,)))) != signature(mechanism(leak, recs((6, 6))))
    hang = _v("liveness", FAIL, [{"rid": "v", "outcome": "timeout"}])  # no victim: no handoff said
    assert mechanism(hang, recs((1,)))["victims_kv_handoff"] == []


# ------------------------------------------------------------------ the loop, with stand-ins
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _fuzzer(tmp_path, outcomes, strategy="guided", budget=100.0):
    """A Fuzzer whose runs take 10 s of a fake clock and return ``outcomes(scenario)``: (features-making
    records, verdicts)."""
    clock = _Clock()
    started = []
    clusters = Clusters(lambda dep: started.append(dep.restart_key()) or ("cluster", "kit", "policy"),
                        lambda cur: None)
    fz = Fuzzer(clusters=clusters, base=BASE, registry=_Registry({"liveness": "sglang-pd-hang-band"}),
                out=tmp_path / "out", corpus=Corpus(tmp_path / "corpus"), seed=5, budget_s=budget,
                strategy=strategy, clock=clock, say=lambda m: None)

    def run(sc, cluster, kit, policy, run_dir):
        clock.t += 10.0
        recs, verdicts = outcomes(sc)
        return SimpleNamespace(events=recs, verdicts=verdicts, path=tmp_path / f"{sc.name}.events.jsonl",
                               context=lambda: None)
    fz._run = run
    fz.fresh = []  # confirmations, controls and shrink steps run as on a fresh cluster (its own test below)
    fz._fresh = lambda sc, cluster, tag: (fz.fresh.append(tag), sc)[1]
    return fz, started


def test_the_loop_spends_its_budget_counts_restarts_and_keeps_the_new(tmp_path):
    def outcomes(sc):
        recs = _log(*[(2.0, {"agent_ev": "fault_fired", "rid": "r", "kind": o.kind}) for o in sc.nemesis
                      if o.injector == "agent"], ends=[("r", 200, "ok")])
        return recs, [_v("isolation", PASS)]
    fz, started = _fuzzer(tmp_path, outcomes)
    s = fz.run()
    assert s["execs"] == 10 and s["elapsed_s"] == 100.0 and s["execs_per_min"] == 6.0
    assert s["cluster_restarts"] == len(started) >= 1 and 0 < s["corpus"] <= s["execs"]
    assert len(s["timeline"]) == 10 and json.loads((tmp_path / "out" / "fuzz.json").read_text())["execs"] == 10


def test_the_loop_never_runs_one_scenario_twice(tmp_path, monkeypatch):
    """A draw that repeats a scenario the search ran (the same digest) is drawn again, counted in
    ``repeats``; a search whose every draw repeats still runs (bounded: REDRAWS)."""
    from kvchaos.fuzz import loop
    ran = []

    def outcomes(sc):
        ran.append(sc.digest())
        return _log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=60.0)
    a, b = _many(2, seed=21)
    draws = iter([a, a, b, a, b, b, a] + _many(10, seed=22))
    monkeypatch.setattr(fz, "_next", lambda: Scenario.from_dict(next(draws).to_dict()))
    s = fz.run()
    assert len(ran) == len(set(ran)) == 6 and ran[:2] == [a.digest(), b.digest()]
    assert s["repeats"] == 5
    monkeypatch.setattr(loop, "REDRAWS", 3)
    fz, _ = _fuzzer(tmp_path / "2", outcomes, budget=20.0)
    monkeypatch.setattr(fz, "_next", lambda: Scenario.from_dict(a.to_dict()))
    assert fz.run()["execs"] == 2  # each after 3 redraws


def test_a_new_find_is_confirmed_by_reruns_and_a_control_and_written_up(tmp_path):
    leak = [{"victim_rid": "v", "owner_rid": "o", "status": 200}]

    def outcomes(sc):  # the leak needs the faults: the control (no ops) does not show it
        bad = bool(sc.nemesis) or bool(sc.deployment.live)
        return _log(ends=[("v", 200, "ok")]), [_v("isolation", FAIL if bad else PASS, leak if bad else [])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=30.0)
    s = fz.run()
    (sig, rec), = s["new"].items()
    assert rec["confirmed"] and rec["reproduced"] == "2/3" and rec["control_shows_it"] is False and rec["leak"]
    d = tmp_path / "out" / "finds" / f"new-{sig}"
    assert (d / "BUG.md").read_text().startswith("# NEW") and Scenario.load(d / "scenario.json")
    assert json.loads((d / "find.json").read_text())["why_not_known"] == "no finding covers it"
    assert fz.fresh[:2] == ["confirm1", "control"] and all(t.startswith("shrink") for t in fz.fresh[2:])


def test_the_control_is_labelled_by_its_own_limits(tmp_path):
    """The control drops the live knobs: a prompt only a lowered input limit refused is an ordinary
    prompt there, not a rejected-size one (a control that kept the label judged ordinary 200s FAIL)."""
    leak = [{"victim_rid": "v", "owner_rid": "o", "status": 200}]
    controls = []

    def outcomes(sc):
        if sc.name.endswith("-control"):
            controls.append(sc)
        return _log(ends=[("v", 200, "ok")]), [_v("isolation", FAIL, leak)]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=30.0)
    parent = baseline(random.Random(3), BASE, "p")
    parent.deployment.live["prefill_input_limit"] = 256
    from kvchaos.fuzz.grammar import rebase
    rebase(parent, BASE, {})
    assert any(p["oversized"] for p in parent.traffic.plans)
    fz._confirm(next(iter(triage([_v("isolation", FAIL, leak)], None, _Registry({}), []))), parent,
                "cluster", "kit", "policy", tmp_path)
    (ctrl,) = controls
    assert not ctrl.deployment.live and not any(p.get("oversized") for p in ctrl.traffic.plans)


def test_a_confirmation_runs_as_on_a_fresh_cluster(tmp_path, monkeypatch):
    """Caches flushed on both roles and canaries of its own; a cluster that will not flush stops it by name."""
    from kvchaos.fuzz.loop import FuzzError
    from tests.data.known_suite.test_known_inner import StandIn
    from tests.fake_engine import FakeEngine

    fz = Fuzzer(clusters=Clusters(None, None), base=BASE, registry=_Registry(), out=tmp_path, corpus=Corpus(tmp_path / "c"),
                seed=1, budget_s=1)
    sc = _many(1)[0]
    with FakeEngine() as eng:
        new = fz._fresh(sc, StandIn(eng.url), "confirm1")
        assert eng.flushes == 4  # settled (what the run before left aborted), then flushed for this run
    old_c = [c for p in sc.traffic.plans for c in p["canaries"]]
    new_c = [c for p in new.traffic.plans for c in p["canaries"]]
    assert len(new_c) == len(old_c) and not set(new_c) & set(old_c)
    assert [p["rid"] for p in new.traffic.plans] == [p["rid"] for p in sc.traffic.plans] and new.nemesis == sc.nemesis
    monkeypatch.setattr(fuzz_loop, "FLUSH_TIMEOUT_S", 1.0)
    monkeypatch.setattr(fuzz_loop, "SETTLE_TIMEOUT_S", 0.3)
    with pytest.raises(FuzzError, match="could not be flushed"):
        fz._fresh(sc, StandIn("http://127.0.0.1:9"), "confirm2")


def test_a_new_find_on_a_cluster_that_no_longer_answers_is_confirmed_on_a_fresh_one(tmp_path):
    leak = [{"victim_rid": "v", "owner_rid": "o", "status": 200}]

    class Dead:
        def generate(self, **kw):
            raise ConnectionError("decode is gone")

    def outcomes(sc):
        return _log(ends=[("v", 200, "ok")]), [_v("isolation", FAIL, leak)]
    fz, started = _fuzzer(tmp_path, outcomes, budget=5.0)
    fz.clusters._start = lambda dep: started.append(dep.restart_key()) or (Dead(), "kit", "policy")
    s = fz.run()
    assert len(started) == 2 and s["cluster_restarts"] == 2  # the first, and the fresh one for confirming
    assert list(s["new"].values())[0]["reproduced"] == "2/3"


def test_a_cluster_a_run_left_busy_is_settled_or_replaced_and_the_state_is_a_feature(tmp_path, monkeypatch):
    """After every run the engines are brought back to idle (what the run left aborted): that they held
    requests their clients gave up on is an engine state of its own; a cluster that stays busy is
    replaced before the next run, not left to time out every later one."""
    outcomes_seen = []

    def outcomes(sc):
        return _log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    for answer, restarts, stuck in (((False, None), 1, 0), ((True, None), 1, 3), ((True, {"decode": "busy"}), 3, 3)):
        monkeypatch.setattr(fuzz_loop, "settle", lambda c, a=answer: (outcomes_seen.append(c), a)[1])
        fz, started = _fuzzer(tmp_path / f"{restarts}{stuck}", outcomes, budget=30.0)
        s = fz.run()
        assert s["execs"] == 3 and s["cluster_restarts"] == len(started) == restarts and s["stuck"] == stuck, s
        assert ("after_run:requests_left_in_engine" in fz.corpus.seen) == bool(stuck)
    assert outcomes_seen and set(outcomes_seen) == {"cluster"}


@pytest.mark.parametrize("leak", [True, False])
def test_only_a_new_leak_is_confirmed_past_the_budgets_end(tmp_path, leak):
    witness = ({"victim_rid": "v", "owner_rid": "o", "status": 200} if leak
               else {"rid": "v", "status": 503, "problem": "x"})
    oracle = "isolation" if leak else "http_semantics"

    def outcomes(sc):  # each run 10 s of the fake clock; the budget leaves 5 s after the second
        bad = sc.origin.get("by") != "baseline" and not sc.name.endswith("-control")
        return _log(ends=[("v", 200, "ok")]), [_v(oracle, FAIL if bad else PASS, [witness] if bad else [])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=15.0)
    s = fz.run()
    (rec,) = s["new"].values()
    if leak:
        assert rec["confirmed"] and fz.fresh[:2] == ["confirm1", "control"] and s["elapsed_s"] > 15.0
    else:
        assert rec["confirmed"] is None and "too little of the budget" in rec["reproduced"] and fz.fresh == []
        assert s["elapsed_s"] <= 20.0


def _faulty_runs_answer_503(names: list):
    """Outcomes where a run with an op or a live knob gets a 503 (one NEW non-leak signature); ``names``
    collects the scenarios run, in order."""
    def outcomes(sc):
        names.append(sc.name)
        bad = bool(sc.nemesis) or bool(sc.deployment.live)
        w = {"rid": "v", "status": 503, "problem": "x"}
        return _log(ends=[("v", 200, "ok")]), [_v("http_semantics", FAIL if bad else PASS, [w] if bad else [])]
    return outcomes


def test_a_new_find_that_is_no_leak_is_confirmed_at_the_end_of_the_search_not_in_its_middle(tmp_path):
    """The search runs on until only the pending finds' expected cost is left of the budget; then they are
    confirmed, the most often seen first, and one the budget has no room for is written up unconfirmed."""
    names = []
    outcomes = _faulty_runs_answer_503(names)
    fz, _ = _fuzzer(tmp_path, outcomes, budget=200.0)
    s = fz.run()
    (sig, rec), = s["new"].items()
    assert rec["seen"] >= 2 and rec["confirmed"] and rec["reproduced"] == "2/3" and rec["control_shows_it"] is False
    # the search went on past the find; its reruns and control ran in the reserve (3 runs of 10 s) at the end
    first_confirm = next(i for i, n in enumerate(names) if n.endswith("-confirm1"))
    assert rec["t"] < 50 and first_confirm >= 14, names
    found_by = names[first_confirm][:-len("-confirm1")]
    assert all(n.startswith(found_by) for n in names[first_confirm:]), names  # the search had ended
    assert fz.fresh[:2] == ["confirm1", "control"] and s["elapsed_s"] <= 200.0 + 10.0
    find = json.loads((tmp_path / "out" / "finds" / f"new-{sig}" / "find.json").read_text())
    assert find["confirmed"] and find["reproduced"] == "2/3"  # the write-up made pending was brought up to date


def test_pending_finds_take_at_most_their_share_of_the_budget(tmp_path):
    """Many NEW non-leak signatures: the reserve is capped (CONFIRM_RESERVE), the ones left out say why."""
    n = {"i": 0}

    def outcomes(sc):  # every faulty run a NEW signature of its own (a new problem text each time)
        n["i"] += 1
        bad = bool(sc.nemesis) or bool(sc.deployment.live)
        w = {"rid": "v", "status": 503 + n["i"] % 90, "problem": f"p{n['i']}"}
        return _log(ends=[("v", 200, "ok")]), [_v("http_semantics", FAIL if bad else PASS, [w] if bad else [])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=400.0)
    s = fz.run()
    recs = list(s["new"].values())
    assert len(recs) >= 3 and s["elapsed_s"] <= 410.0
    assert any(r["confirmed"] is None and "too little of the budget" in r["reproduced"] for r in recs)
    assert not any(r["reproduced"].startswith("pending") for r in recs)  # every one is settled either way
    confirming = [t for t in fz.fresh if t in ("confirm1", "confirm2", "control")]
    assert 10.0 * len(confirming) <= fuzz_loop.CONFIRM_RESERVE * 400.0 + 30.0


def test_a_find_whose_confirmation_would_not_fit_the_reserve_never_interrupts_the_search(tmp_path):
    """Three 10 s runs do not fit what a quarter of a 60 s budget leaves: the search runs to its end and
    the find is written up unconfirmed, saying why (a 0.5.19 wedge's confirmation took a 10-minute
    search's place)."""
    names = []
    outcomes = _faulty_runs_answer_503(names)
    fz, _ = _fuzzer(tmp_path, outcomes, budget=60.0)
    s = fz.run()
    (rec,) = s["new"].values()
    assert rec["confirmed"] is None and "too little of the budget" in rec["reproduced"] and fz.fresh == []
    assert s["execs"] == 6 and not [n for n in names if "-" in n]


def _wedge_scenario():
    """A drawn scenario with client cuts, one prompt past decode's admission edge and an op aimed at it."""
    from kvchaos.workload.scenario import Op
    rng = random.Random(11)
    while True:
        sc = generate(rng, BASE, "w")
        cuts = [p for p in sc.traffic.plans if p.get("kind") in ("abort_after", "disconnect_before_first_token")]
        if cuts:
            break
    big = dict(sc.traffic.plans[-1], rid="big-1", n_tokens=1800)
    sc.traffic.plans.append(big)
    sc.nemesis = [Op(at_s=0.0, injector="agent", role="prefill", kind="hold", target={"rid": "big-1"}),
                  Op(at_s=0.0, injector="action", kind="abort", rids=["big-1"], after=0)]
    return sc.validate(), cuts


def test_a_wedge_is_blamed_on_what_was_sent_before_the_first_request_that_hung():
    from kvchaos.fuzz.grammar import wedge_traits
    from kvchaos.workload.scenario import Op
    held, cuts = _wedge_scenario()  # it holds a request itself (its hold op)
    sc = Scenario.from_dict(held.to_dict())
    sc.nemesis = []
    plain = next(p for p in sc.traffic.plans if p.get("kind", "plain") == "plain" and p["n_tokens"] < 900)

    def log(order, stall=True, answered=()):
        ev = [{"ev": "send", "rid": r, "wall": float(i)} for i, r in enumerate(order)]
        ev += [{"ev": "end", "rid": plain["rid"], "outcome": "timeout", "wall": 40.0}]
        ev += [{"ev": "end", "rid": r, "outcome": "ok", "wall": 3.0} for r in answered]
        return ev + ([{"ev": "stall", "wall": 40.0}] if stall else [])
    assert wedge_traits(sc, log([cuts[0]["rid"], plain["rid"], "big-1"]), BASE) == {"cut"}
    assert wedge_traits(sc, log(["big-1", plain["rid"], cuts[0]["rid"]]), BASE) == {"past_decode_edge"}
    # the first request that hung has a trait of its own: it is blamed, not the cut sent before it (a cut
    # is never answered); one that hung after the first did not wedge anything
    hung_big = log([cuts[0]["rid"], "big-1", plain["rid"]]) + [{"ev": "end", "rid": "big-1", "outcome": "timeout"}]
    assert wedge_traits(sc, hung_big, BASE) == {"past_decode_edge"}
    later_big = log([cuts[0]["rid"], plain["rid"], "big-1"]) + [{"ev": "end", "rid": "big-1", "outcome": "timeout"}]
    assert wedge_traits(sc, later_big, BASE) == {"cut"}
    # answered before the wedge: not what wedged it (0.5.19's reject window answers 200 beside the cuts)
    assert wedge_traits(sc, log(["big-1", cuts[0]["rid"], plain["rid"]], answered=["big-1"]), BASE) == {"cut"}
    assert wedge_traits(sc, log([cuts[0]["rid"], plain["rid"]], stall=False), BASE) == set()  # no wedge
    # a scenario that holds a request itself: the fault explains the wedge as well as the traffic; a
    # delay lets every request go on, and the traffic is blamed as without it
    assert any(o.kind == "hold" for o in held.nemesis)
    assert wedge_traits(held, log([cuts[0]["rid"], plain["rid"]]), BASE) == set()
    sc.nemesis = [Op(at_s=0.0, injector="agent", role="prefill", kind="delay", params={"ms": 100})]
    assert wedge_traits(sc, log([cuts[0]["rid"], plain["rid"]]), BASE) == {"cut"}


def test_what_wedged_the_cluster_is_left_out_of_later_scenarios():
    from kvchaos.fuzz.grammar import avoid, traits
    sc, cuts = _wedge_scenario()
    n = len(sc.traffic.plans)
    out = avoid(Scenario.from_dict(sc.to_dict()), BASE, {"cut", "past_decode_edge"})
    kinds = {p.get("kind", "plain") for p in out.traffic.plans}
    assert not kinds & {"abort_after", "disconnect_before_first_token"} and len(out.traffic.plans) < n
    assert "big-1" not in {p["rid"] for p in out.traffic.plans}
    assert not any(traits(p, BASE, out.deployment) & {"cut", "past_decode_edge"} for p in out.traffic.plans)
    assert out.nemesis == [] and out.origin["avoided"] == ["cut", "past_decode_edge"]  # the op aimed at it too
    assert Scenario.from_dict(out.to_dict()).digest() == out.digest()
    assert avoid(sc, BASE, set()) is sc
    # the reject path's window (prefill refuses, decode would admit) is one trait of its own
    dep = Deployment({}, {"prefill_input_limit": 512})
    assert traits({"n_tokens": 700}, BASE, dep) == {"refused_within_decode_edge"}
    assert traits({"n_tokens": 1537}, BASE, dep) == {"past_decode_edge"} and traits({"n_tokens": 500}, BASE, dep) == set()


@pytest.mark.parametrize("strategy", ["guided", "random"])
def test_only_the_guided_search_learns_what_wedges(tmp_path, strategy):
    from kvchaos.fuzz.grammar import traits

    def outcomes(sc):  # a cut wedges the cluster: the ordinary requests sent after it hang, the rest not sent
        plans = sc.traffic.plans
        ev = [{"ev": "send", "rid": p["rid"], "wall": float(i)} for i, p in enumerate(plans)]
        cut = [i for i, p in enumerate(plans) if p.get("kind") in ("abort_after", "disconnect_before_first_token")]
        if cut:
            ev += [{"ev": "stall", "wall": 60.0}] + [
                {"ev": "end", "rid": p["rid"], "wall": 60.0,
                 "outcome": "not_sent" if traits(p, BASE, sc.deployment) else "timeout"}
                for p in plans[cut[0] + 1:]]
        return ev, [_v("isolation", PASS)]
    fz, _ = _fuzzer(tmp_path, outcomes, strategy=strategy, budget=400.0)
    drawn = []
    run = fz._run
    fz._run = lambda sc, *a: (drawn.append(sc), run(sc, *a))[1]
    s = fz.run()
    with_cuts = [any(p.get("kind") in ("abort_after", "disconnect_before_first_token") for p in sc.traffic.plans)
                 for sc in drawn]
    first = with_cuts.index(True)
    if strategy == "guided":
        # a cut is the engine's front end: once it wedged one deployment, no scenario on any carries one
        assert s["wedges_avoided"] == {"*": ["cut"]} and not any(with_cuts[first + 1:])
        entry = next(e for e in fz.corpus.entries.values() if e["scenario"]["name"] == drawn[first].name)
        assert entry["wall_s"] is None  # picked as often as a fast one: its mutations will not wedge
    else:
        assert s["wedges_avoided"] == {} and sum(with_cuts[first + 1:]) >= 5


def test_the_guided_search_learns_which_way_of_making_scenarios_pays():
    """Thompson sampling over generate / mutate / splice: a way that keeps paying is drawn most."""
    ops = fuzz_loop.Operators()
    rng = random.Random(1)
    for _ in range(200):
        way = ops.pick(rng)
        ops.paid(way, way == "generate")
    runs = {w: n for w, (n, _k) in ops.record.items()}
    assert runs["generate"] > 150 and runs["mutate"] < 30 and runs["splice"] < 30
    ops2 = fuzz_loop.Operators()
    assert {ops2.pick(random.Random(i), splice=False) for i in range(50)} == {"generate", "mutate"}
    ops2.paid("baseline", True)  # a way the search does not choose is not counted
    assert ops2.record == fuzz_loop.Operators().record


def test_the_summary_says_how_each_way_paid(tmp_path):
    def outcomes(sc):
        return _log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=200.0)
    s = fz.run()
    assert set(s["operators"]) == {"generate", "mutate", "splice"}
    assert sum(o["runs"] for o in s["operators"].values()) == s["execs"] - 1  # all but the steady state
    assert all(0 <= o["paid"] <= o["runs"] for o in s["operators"].values())


def test_a_cluster_a_run_left_dead_is_replaced_whatever_the_run_found(tmp_path):
    """A KNOWN engine failure (the transfer thread's death) leaves a cluster that answers nothing: the
    next run gets a fresh one, not a dead one."""
    class Dead:
        def generate(self, **kw):
            raise ConnectionError("the transfer thread is dead")

    def outcomes(sc):
        return _log(ends=[("r", None, "timeout")]), [_v("liveness", FAIL, [{"rid": "r", "outcome": "timeout"}])]
    fz, started = _fuzzer(tmp_path, outcomes, budget=30.0)
    fz.clusters._start = lambda dep: started.append(dep.restart_key()) or (Dead(), "kit", "policy")
    s = fz.run()
    assert list(s["known"]) == ["sglang-pd-hang-band"] and not s["new"]
    assert s["execs"] == 3 and len(started) == 3 == s["cluster_restarts"]


def test_a_short_search_confirms_only_new_leaks(tmp_path):
    def outcomes(sc):
        return _log(ends=[("v", 200, "ok")]), [_v("http_semantics", FAIL, [{"rid": "v", "status": 503, "problem": "x"}])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=20.0)
    fz.confirm_all = False
    s = fz.run()
    (rec,) = s["new"].values()
    assert rec["confirmed"] is None and "leaks only" in rec["reproduced"] and fz.fresh == []  # no rerun made
    assert s["execs"] == 2  # the budget went to the search


def test_a_known_finding_is_timed_once(tmp_path):
    def outcomes(sc):
        return _log(ends=[("r", None, "timeout")]), [_v("liveness", FAIL, [{"rid": "r", "outcome": "timeout"}])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=50.0)
    s = fz.run()
    assert list(s["known"]) == ["sglang-pd-hang-band"] and s["known"]["sglang-pd-hang-band"]["t"] == 0.0
    assert (tmp_path / "out" / "finds" / "known-sglang-pd-hang-band" / "BUG.md").exists() and not s["new"]


def test_a_known_finding_found_with_no_fault_op_is_timed_apart(tmp_path):
    """The acceptance counts findings injected faults alone do not cause: the first find by a scenario
    with no nemesis op is recorded (and written up) apart from the first find of all."""
    def outcomes(sc):
        return _log(ends=[("r", None, "timeout")]), [_v("liveness", FAIL, [{"rid": "r", "outcome": "timeout"}])]
    fz, _ = _fuzzer(tmp_path, outcomes, budget=200.0)
    s = fz.run()
    first, quiet = s["known"]["sglang-pd-hang-band"], s["known_without_faults"]["sglang-pd-hang-band"]
    assert quiet["ops"] == [] and quiet["t"] >= first["t"]
    assert first["t"] == quiet["t"] == 0.0  # the steady state (no op) found it first
    side = table([s, {**s, "strategy": "random", "known_without_faults": {}}])
    assert "found with no fault op" in side and "with no fault op" in side.split("first sglang-pd-hang-band")[1]


def test_every_scenario_of_a_search_has_a_name_of_its_own(tmp_path, monkeypatch):
    """Scenarios queued for another deployment run later than they were drawn: each still has its own
    name (a find's write-up and the search's output name the scenario)."""
    monkeypatch.setattr(fuzz_loop, "SWITCH_AFTER", 2)
    names = []

    def outcomes(sc):
        names.append(sc.name)
        return _log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    fz, started = _fuzzer(tmp_path, outcomes, strategy="random", budget=600.0)
    fz.run()
    assert len(set(started)) >= 2  # deployments changed, so scenarios waited in queues
    assert len(names) == len(set(names)) == 60, names


def test_random_never_draws_from_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(Corpus, "pick", lambda self, rng: pytest.fail("random strategy picked from the corpus"))
    fz, _ = _fuzzer(tmp_path, lambda sc: (_log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]), strategy="random")
    assert fz.run()["execs"] == 10


def test_deployment_changes_wait_in_a_queue(tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz_loop, "SWITCH_AFTER", 2)
    fz, started = _fuzzer(tmp_path, lambda sc: (_log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]), budget=300)
    fz.run()
    # every switch was queued for first; never one restart per odd scenario
    assert len(started) <= 1 + fz.stats.execs // 2


def test_a_deployment_waiting_in_a_queue_gets_the_cluster_once_the_running_one_had_its_share(tmp_path, monkeypatch):
    """Restart knobs are drawn rarely, so a queue may never reach SWITCH_AFTER and the running
    deployment may keep finding new states: after AMORTIZE starts' worth of time on it, the longest
    queue gets the cluster anyway (a start then costs at most 1/AMORTIZE of the search)."""
    monkeypatch.setattr(fuzz_loop, "SWITCH_AFTER", 1000)
    monkeypatch.setattr(fuzz_loop, "STALE_AFTER", 1000)
    from kvchaos.fuzz import grammar
    monkeypatch.setattr(grammar, "WEIGHTS", {**grammar.WEIGHTS, "restart_knob": 0.3})
    fz, started = _fuzzer(tmp_path, lambda sc: (_log(ends=[("r", 200, "ok")]), [_v("isolation", PASS)]), budget=1000)
    s = fz.run()  # runs of 10 s: a switch is due every 8 x 30 s (the start-cost floor) at most
    assert 2 <= len(started) <= 1 + 1000 // (fuzz_loop.AMORTIZE * fuzz_loop.START_COST_FLOOR_S) + 1, started
    assert len(set(started)) >= 2 and s["execs"] == 100


def test_a_switched_to_deployment_runs_the_corpus_mutated_and_labels_follow_its_limits(tmp_path, monkeypatch):
    """Once the search switched to another deployment, corpus entries mutated there run on it (relabelled
    by its limits) instead of queueing back for the one it left; a restart-knob mutation still queues."""
    monkeypatch.setattr(fuzz_loop, "SWITCH_AFTER", 1000)
    monkeypatch.setattr(fuzz_loop, "STALE_AFTER", 1000)
    from kvchaos.fuzz import grammar
    monkeypatch.setattr(grammar, "WEIGHTS", {**grammar.WEIGHTS, "restart_knob": 0.3})
    ran = []

    def outcomes(sc):
        ran.append(sc)
        return _log(*[(2.0, {"agent_ev": "fault_fired", "rid": "r", "kind": o.kind}) for o in sc.nemesis
                      if o.injector == "agent"], ends=[("r", 200, "ok")]), [_v("isolation", PASS)]
    fz, started = _fuzzer(tmp_path, outcomes, budget=1500)
    fz.run()
    assert len(set(started)) >= 2, started
    elsewhere = [sc for sc in ran if sc.deployment.restart and sc.origin.get("by") == "mutate"]
    assert elsewhere, "no mutation ran on a deployment the search switched to"
    for sc in elsewhere:  # labelled by the deployment it ran on
        for p in sc.traffic.plans:
            label = BASE.expect(p["n_tokens"], sc.deployment)
            assert (p.get("extra") or {}).get("probe") in ((None, "answer") if label == "answer" else (label,))
            assert p.get("oversized", False) == (label == "reject" and p.get("kind", "plain") in ("plain", "stream", "oversized"))


def test_a_knob_mutation_relabels_the_traffic_by_the_limits_it_moved(monkeypatch):
    """Lowering prefill's input limit makes the longer ordinary prompts ones it must refuse: they are
    judged as oversized from then on, not as ordinary replies."""
    from kvchaos.fuzz import grammar
    monkeypatch.setattr(grammar, "MUTATORS", {"knob": 1})
    rng, moved = random.Random(9), 0
    for i, parent in enumerate(_many(40, seed=13)):
        child = mutate(rng, parent, BASE, f"k{i}")
        for p in child.traffic.plans:
            label = BASE.expect(p["n_tokens"], child.deployment)
            assert p.get("oversized", False) == (label == "reject" and p.get("kind", "plain") in ("plain", "stream", "oversized"))
            moved += label == "reject" and BASE.expect(p["n_tokens"], parent.deployment) != "reject"
    assert moved >= 10


def test_a_knob_mutation_that_moves_a_limit_probes_it_on_both_sides(monkeypatch):
    """A knob mutation of the steady state (no probes in it) that lowers prefill's input limit under
    decode's admission edge sends prompts into the window it opened (prefill refuses, decode would admit:
    the GLM-5.3 reject path) and under it; one that moves no limit adds none. A 0.5.19 search lowered
    the limit to 1024 on its steady state twice and probed nothing."""
    from kvchaos.fuzz import grammar
    monkeypatch.setattr(grammar, "MUTATORS", {"knob": 1})
    rng, moved = random.Random(11), 0
    for i in range(200):
        parent = baseline(random.Random(i), BASE, f"b{i}")
        assert not any((p.get("extra") or {}).get("probe") for p in parent.traffic.plans)
        child = mutate(rng, parent, BASE, f"k{i}")
        probes = [p["n_tokens"] for p in child.traffic.plans if (p.get("extra") or {}).get("probe")]
        lim = child.deployment.live.get("prefill_input_limit")
        if not BASE.moved(child.deployment):
            assert not probes, probes
            continue
        moved += 1
        if lim is not None and lim < 2048 - 512 + 1:
            assert any(lim <= n < 1537 for n in probes) and any(n < lim for n in probes), (lim, probes)
        else:
            assert probes
    assert moved >= 50


def test_rebase_relabels_a_scenario_by_the_new_deployments_limits():
    from kvchaos.fuzz.grammar import rebase
    sc = baseline(random.Random(3), BASE, "b")
    assert not any(p.get("oversized") for p in sc.traffic.plans)
    big = max(p["n_tokens"] for p in sc.traffic.plans)
    out = rebase(Scenario.from_dict(sc.to_dict()), BASE, {"prefill_pool_tokens": 576})
    assert out.deployment.restart == {"prefill_pool_tokens": 576} and out.deployment.live == sc.deployment.live
    over = [p for p in out.traffic.plans if p.get("oversized")]
    assert big >= 570 and over and all(p["n_tokens"] >= 570 and p["extra"]["probe"] == "reject" for p in over)
    back = rebase(out, BASE, {})
    assert not any(p.get("oversized") for p in back.traffic.plans)
    assert {p["extra"].get("probe") for p in back.traffic.plans} <= {None, "answer"}


def test_the_side_by_side_table_says_who_is_ahead():
    g = {"strategy": "guided", "execs": 10, "execs_per_min": 2.0, "features": 40, "corpus": 9, "cluster_restarts": 1,
         "known": {"a": {"t": 5.0}, "b": {"t": 9.0}}, "new": {}}
    r = {**g, "strategy": "random", "features": 30, "known": {"a": {"t": 7.0}}}
    t = table([g, r])
    assert "ahead on distinct findings: guided (2 vs 1)" in t and "ahead on coverage: guided (40 vs 30 features)" in t
    t = table([g, {**r, "known": {"a": {"t": 1.0}, "b": {"t": 2.0}, "c": {"t": 3.0}}}])
    assert "ahead on distinct findings: random (3 vs 2)" in t and "ahead on coverage: guided (40 vs 30 features)" in t
    assert "ahead on distinct findings: neither (2 each)" in table([g, {**r, "known": g["known"]}])


def test_budget_parsing(capsys):
    assert parse_budget("30m") == 1800 and parse_budget("90s") == 90 and parse_budget("1.5h") == 5400
    assert parse_budget("45") == 45
    for bad in ("0s", "-1m", "soon", "3 days"):
        with pytest.raises(UsageError) as e:
            parse_budget(bad)
        assert e.value.code == 2 and f"--budget {bad!r}" in capsys.readouterr().err


# ------------------------------------------------------------------ shrinking
def test_shrink_keeps_what_the_find_needs_and_drops_the_rest():
    from kvchaos.fuzz.shrink import shrink
    rng = random.Random(11)
    sc = next(s for s in (generate(rng, BASE, f"s{i}") for i in range(200))
              if len(s.traffic.plans) >= 12 and any(o.kind == "hold" and o.target and "rid" in (o.target or {})
                                                    for o in s.nemesis))
    hold = next(o for o in sc.nemesis if o.kind == "hold" and o.target and "rid" in o.target)
    filler = [p["rid"] for p in sc.traffic.plans[:3]]  # the "earlier traffic that filled the pages"

    def shows(cand):  # the find needs the hold and the three first plans
        rids = {p["rid"] for p in cand.traffic.plans}
        return any(o.kind == "hold" and o.target == hold.target for o in cand.nemesis) and set(filler) <= rids
    small, stats = shrink(sc, shows, max_attempts=400, budget_s=1e9)
    assert shows(small) and set(filler) <= {p["rid"] for p in small.traffic.plans}
    assert len(small.traffic.plans) < len(sc.traffic.plans) and len(small.nemesis) <= len(sc.nemesis)
    assert not small.deployment.live and stats["after"]["plans"] == len(small.traffic.plans)
    assert small.origin["by"] == "shrink" and small.validate()


def test_shrink_keeps_the_plan_whose_event_an_op_waits_for():
    """An abort on a request's first byte (abort_at_stages' decoding stage as data): the plan steps keep
    that request as they keep the ones an op aborts or targets."""
    from kvchaos.fuzz.shrink import shrink
    plans = [plan_dict(p) for p in Workload(4, n_tenants=3, prefix="ev").mix(12)]
    rid = plans[7]["rid"]
    sc = Scenario(name="on", seed=4, traffic=Traffic(plans, 4, 10.0),
                  nemesis=[Op(at_s=0, injector="action", kind="abort", rids=[plans[2]["rid"]],
                              on={"role": "client", "ev": "first_byte", "rid": rid})]).validate()
    seen = []

    def shows(cand):  # shows it while the op is there; records every plan set it was run with
        seen.append({p["rid"] for p in cand.traffic.plans})
        return bool(cand.nemesis)
    small, _ = shrink(sc, shows, max_attempts=200, budget_s=1e9)
    assert all(rid in s for s in seen) and rid in {p["rid"] for p in small.traffic.plans}
    assert len(small.traffic.plans) < len(plans) and small.nemesis == sc.nemesis


def test_shrink_keeps_nothing_a_flaky_run_did_not_confirm():
    from kvchaos.fuzz.shrink import shrink
    sc = _many(1, 3)[0]
    calls = {"n": 0}

    def flaky(cand):  # shows the find every other run: no step may be accepted on one lucky run
        calls["n"] += 1
        return calls["n"] % 2 == 1
    small, stats = shrink(sc, flaky, runs_per_attempt=2, max_attempts=60, budget_s=1e9)
    assert small.digest() == sc.digest() and stats["accepted"] == []


def test_shrink_stops_at_its_bounds():
    from kvchaos.fuzz.shrink import shrink
    sc = _many(1, 4)[0]
    _small, stats = shrink(sc, lambda c: True, max_attempts=3, budget_s=1e9)
    assert stats["attempts"] == 3


def test_a_failure_the_scenarios_own_faults_explain_is_expected_but_a_leak_never_is():
    recs = [{"ev": "plan", "rid": "cut", "kind": "abort_after", "abort_after_ms": 50},
            {"ev": "send", "rid": "k", "wall": 1.0}, {"ev": "end", "rid": "k", "wall": 5.0},
            {"ev": "send", "rid": "late", "wall": 20.0}, {"ev": "end", "rid": "late", "wall": 21.0},
            {"ev": "fault", "injector": "process", "action": "fired", "kind": "sigkill", "role": "decode", "at": 2.0},
            {"ev": "fault", "injector": "process", "action": "healed", "kind": "restart", "role": "decode", "at": 9.0},
            {"ev": "agent", "agent_ev": "fault_fired", "rid": "f", "kind": "fail"}]
    reg = _Registry()
    live = _v("liveness", FAIL, [{"rid": "k", "outcome": "error"}, {"rid": "cut", "outcome": "cut"},
                                 {"rid": "f", "outcome": "error"}])
    assert [f.kind for f in triage([live], None, reg, recs)] == ["expected"]
    after = _v("liveness", FAIL, [{"rid": "late", "outcome": "timeout"}])  # sent after the restart: not explained
    assert [f.kind for f in triage([after], None, reg, recs)] == ["new"]
    leak = _v("isolation", FAIL, [{"victim_rid": "k", "owner_rid": "f", "status": 200}])
    assert [f.kind for f in triage([leak], None, reg, recs)] == ["new"]  # a leak is never the fault's doing
    no_rid = _v("liveness", FAIL, [{"problem": "cluster did not answer after the run"}])
    assert [f.kind for f in triage([no_rid], None, reg, recs)] == ["expected"]  # a role was killed
    assert [f.kind for f in triage([no_rid], None, reg, recs[:5])] == ["new"]  # nothing was


def test_a_refused_scenario_costs_no_restart_but_a_broken_cluster_is_replaced(tmp_path):
    class Kit:
        def __init__(self, left):
            self.left = left

        def heal_all(self):
            return self.left
    for left, restarts in (([], 1), (["an engine process died"], 3)):
        clock = _Clock()
        clusters = Clusters(lambda dep: ("cluster", Kit(left), "policy"), lambda cur: None)
        fz = Fuzzer(clusters=clusters, base=BASE, registry=_Registry(), out=tmp_path / f"o{restarts}",
                    corpus=Corpus(tmp_path / f"c{restarts}"), seed=1, budget_s=30, clock=clock, say=lambda m: None)

        def refuse(*a, **k):
            clock.t += 10
            raise RuntimeError("op 1 waits for op 0: nothing parked")
        fz._run = refuse
        s = fz.run()
        assert s["errors"] == 3 and s["cluster_restarts"] == restarts, s


def test_a_prefill_pool_below_the_context_moves_the_edges_and_the_ordinary_traffic():
    dep = Deployment({"prefill_pool_tokens": 576}, {})
    pool, ppool, ctx, res, lim = BASE.limits(dep)
    assert (pool, ppool, lim) == (2048, 576, 570)
    assert {(64, 570), (570, 576), (576, 1537), (1537, 2048)} <= set(BASE.bands(dep))
    assert BASE.expect(570, dep) == "reject" and BASE.expect(569, dep) == "answer"
    scs = _many(400)
    small = [s for s in scs if s.deployment.restart.get("prefill_pool_tokens")]
    assert small and all(s.deployment.restart["prefill_pool_tokens"] < s.deployment.restart.get("pool_tokens", 2048)
                         for s in small)
    for s in small:  # nothing but the edge probes goes over prefill's limit
        lim = BASE.limits(s.deployment)[4]
        assert all(p.get("n_tokens", 0) < lim for p in s.traffic.plans if not p["extra"].get("probe")), s.name
        assert all(p["oversized"] for p in s.traffic.plans if p["extra"].get("probe") == "reject"
                   and p["kind"] in ("plain", "stream", "oversized")), s.name
        assert not any(p["oversized"] for p in s.traffic.plans if p["kind"] in ("abort_after", "disconnect_before_first_token"))


def test_replay_and_shrink_take_a_scenario_file_and_name_bad_input(tmp_path, capsys):
    from kvchaos.cli import main

    good = tmp_path / "x.scenario.json"
    _many(1)[0].save(good)
    for argv, msg in ((["replay", str(tmp_path / "nope.json")], "no such scenario file"),
                      (["replay", str(good), "glm53"], "replayed whole"),
                      (["replay", str(good), "--times", "0"], "--times 0"),
                      (["shrink", str(good), "glm53"], "shrunk whole"),
                      (["shrink", str(tmp_path / "bad.json")], "no such scenario file"),
                      (["shrink", str(tmp_path)], "name the scenario to shrink")):
        with pytest.raises(UsageError) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


@pytest.mark.parametrize("shows, verified", [(9, True), (8, False)])
def test_a_shrunk_find_becomes_the_minimal_repro_only_when_9_of_10_fresh_runs_show_it(tmp_path, monkeypatch, shows,
                                                                                    verified):
    """``kvchaos fuzz --verify``: the shrunk scenario run 10 times, each on a fresh cluster; minimal.json
    is written only where 9 of them show the find's mechanism (the issue's bar for a committed minimal
    repro), and a stale one is removed where they do not. A run that raises counts as not showing it."""
    import kvchaos.experiment as experiment
    from kvchaos.commands import fuzz as cmd
    leak = [{"victim_rid": "v", "owner_rid": "o", "status": 200}]
    want = signature(mechanism(_v("isolation", FAIL, leak), []))
    d = tmp_path / "find"
    d.mkdir()
    sc = _many(1)[0]
    sc.save(d / "shrunk.json")
    (d / "find.json").write_text(json.dumps({"oracle": "isolation", "signature": want}))
    (d / "minimal.json").write_text("{}")  # an earlier verification's
    started, stopped, n = [], [], {"i": 0}

    def run(factory, s, kit, c):
        n["i"] += 1
        if n["i"] == 10:
            raise RuntimeError("the cluster died")
        bad = n["i"] <= shows
        vs = [_v("isolation", FAIL, leak) if bad else _v("isolation", PASS)]
        return SimpleNamespace(verdicts=vs, events=[], path=tmp_path / f"{n['i']}.events.jsonl", context=lambda: None)
    monkeypatch.setattr(experiment, "run_scenario", run)
    monkeypatch.setattr("kvchaos.policy.Registry.load", classmethod(lambda cls, *a, **k: _Registry()))
    args = SimpleNamespace(times=10, profile="cpu", layout=None)
    rc = cmd.verify(d, args, tmp_path / "out", start_stop=(lambda dep: started.append(dep) or ("c", "kit", "pol"),
                                                           stopped.append))
    rec = json.loads((d / "verify.json").read_text())
    assert len(started) == len(stopped) == 10  # each run on a cluster of its own
    assert rec["shown"] == min(shows, 9) and rec["verified"] is verified and rc == (0 if verified else 1)
    assert "error" in rec["runs"][9] and not rec["runs"][9]["shows"]
    assert (d / "minimal.json").exists() is verified
    if verified:
        assert Scenario.load(d / "minimal.json").digest() == sc.digest()


def test_every_committed_minimal_repro_was_shown_in_9_of_10_fresh_runs():
    """A fuzz find's minimal.json is committed only with the verify.json that made it one: the same
    scenario, shown in at least 9 of at least 10 runs, each on a fresh cluster (issue 28's bar)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "reports" / "fuzz"
    for m in root.rglob("minimal.json"):
        v = m.parent / "verify.json"
        assert v.is_file(), f"{m}: a minimal repro without its verification (kvchaos fuzz --verify {m.parent})"
        rec = json.loads(v.read_text())
        assert rec["verified"] and rec["times"] >= 10 and rec["shown"] >= 0.9 * rec["times"], (m, rec["shown"])
        assert rec["scenario"] == Scenario.load(m).digest(), f"{m}: not the scenario {v} verified"
        assert sum(r["shows"] for r in rec["runs"]) == rec["shown"] and len(rec["runs"]) == rec["times"]


def test_a_truncating_deployment_is_not_judged_for_answering_what_it_truncates():
    """--allow-auto-truncate answers a prompt past prefill's limit by design: no http_semantics there
    (pairs 5 and 6 confirmed that 200 as NEW), and every other checker stays; elsewhere it is judged."""
    rng = random.Random(11)
    seen = {True: 0, False: 0}
    for i in range(300):
        sc = generate(rng, BASE, f"g{i}")
        t = bool(sc.deployment.restart.get("allow_auto_truncate"))
        names = [c["name"] for c in sc.checks]
        assert ("http_semantics" in names) is (not t), (sc.deployment.restart, names)
        assert {"isolation", "liveness", "kv_lifecycle", "abort_semantics"} <= set(names)
        seen[t] += 1
        # a knob rebase follows: a truncating scenario moved to a deployment that does not is judged again
        back = rebase(Scenario.from_dict(sc.to_dict()), BASE, {"allow_auto_truncate": not t})
        assert ("http_semantics" in [c["name"] for c in back.checks]) is t
    assert seen[True] > 10 and seen[False] > 100


def test_a_search_without_deployment_changes_labels_each_draw_for_the_base_deployment(tmp_path):
    """fuzz smoke (deployments=False): a draw's restart knobs are replaced by the base's, and its plans
    and checks relabelled for it — a plan labelled oversized by a smaller prefill pool than the cluster
    runs would be judged for an answer it is right to give."""
    fz = Fuzzer(clusters=Clusters(None, None), base=BASE, registry=_Registry(), out=tmp_path, corpus=Corpus(tmp_path / "c"),
                seed=5, budget_s=1, deployments=False)
    fz.stats.execs = 1  # past the baseline
    for _ in range(40):
        sc = fz._next()
        assert sc.deployment.restart == BASE.restart
        want = rebase(Scenario.from_dict(sc.to_dict()), BASE, BASE.restart)
        assert [p.get("oversized") for p in sc.traffic.plans] == [p.get("oversized") for p in want.traffic.plans]
        assert sc.checks == want.checks


def test_part_of_a_failure_the_faults_explain_leaves_the_rest_to_the_registry_but_never_for_a_leak():
    """A park held one request to its timeout while another hung behind a band prompt: the registry is
    asked about the one the scenario did not break, and a leak is never judged on part of its witnesses."""
    recs = [{"ev": "agent", "agent_ev": "fault_fired", "rid": "parked", "kind": "park", "phase": "held"}]

    class Reg:
        """KNOWN only when no witness is the parked request (what a hang-band signature would say)."""
        def classify(self, v, ctx, require_power=True):
            rids = {w.get("rid") or w.get("victim_rid") for w in v.witnesses}
            return (SimpleNamespace(id="sglang-pd-hang-band"), "matched") if "parked" not in rids else (None, "parked")
    both = _v("liveness", FAIL, [{"rid": "parked", "outcome": "timeout"}, {"rid": "band", "outcome": "timeout"}])
    [f] = triage([both], None, Reg(), recs)
    assert (f.kind, f.finding) == ("known", "sglang-pd-hang-band") and "broke on purpose" in f.summary
    assert [f.kind for f in triage([both], None, Reg(), [])] == ["new"]  # nothing parked it: the whole verdict
    leak = _v("isolation", FAIL, [{"victim_rid": "parked", "owner_rid": "x"}, {"victim_rid": "band", "owner_rid": "x"}])
    assert [f.kind for f in triage([leak], None, Reg(), recs)] == ["new"]
    # a pool witness whose holders the scenario all broke goes with them, unless the pool kept more
    for after, want in ((300, "known"), (301, "new")):
        pool = {"problem": "decode KV pool did not return to its idle baseline", "kv_used_before": 0,
                "kv_used_after": after, "held_by": ["parked"], "held_tokens_max": 300}

        class PoolReg(Reg):
            def classify(self, v, ctx, require_power=True):
                if any(not (w.get("rid")) for w in v.witnesses):
                    return None, "a pool witness"
                return super().classify(v, ctx, require_power)
        v = _v("liveness", FAIL, [{"rid": "parked", "outcome": "timeout"}, {"rid": "band", "outcome": "timeout"}, pool])
        assert [f.kind for f in triage([v], None, PoolReg(), recs)] == [want], after


def test_a_new_deployment_from_a_restart_knob_is_probed_at_the_limits_it_moved(monkeypatch):
    from kvchaos.fuzz import grammar
    parent = generate(random.Random(5), BASE, "p", restart_p=0.0)
    parent.deployment = Deployment({}, {})
    grammar._relabel(parent, BASE)
    monkeypatch.setattr(grammar, "MUTATORS", {"restart_knob": 1})
    seen = 0
    for seed in range(60):
        child = mutate(random.Random(seed), parent, BASE, f"c{seed}")
        edges = BASE.cuts(child.deployment) - BASE.cuts(parent.deployment)
        new = [p for p in child.traffic.plans if p["rid"] not in {q["rid"] for q in parent.traffic.plans}]
        if not edges:
            assert not new
            continue
        seen += 1
        assert 2 <= len(new) <= 3
        # the first probe is in a band on either side of a moved limit
        bands = [b for b in BASE.bands(child.deployment) if b[0] in edges or b[1] in edges]
        assert any(lo <= p["n_tokens"] < hi for p in new for lo, hi in bands), (child.deployment.restart, new)
    assert seen > 20
