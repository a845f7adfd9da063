"""Detection matrix: does each suite catch the engine bug it exists for?

For every engine mutation the in-engine agent provides (``faults/agent/``: re-opened bugs, not
faults a correct engine should survive) and for the short transfer, the scenario of the matching
suite runs with the bug armed and must be caught — by the right oracle, with a witness that names
the bug's victim — in EVERY trial. The clean arm runs the same scenario down the same engine path
with the bug off and must PASS every oracle (no false alarm, and enough echo evidence for isolation
to PASS at all). ``KVCHAOS_MATRIX_TRIALS`` trials per class (default 5) and ``KVCHAOS_MATRIX_CLEAN_TRIALS``
per clean arm (default 2; every other suite of the run is a clean control too). Per class and arm:
detection rate, time to first detection and the per-trial results are printed and written to
``<run dir>/detection_matrix.json``.

=============== ================================== ============== ==================================
class            scenario (suite)                   oracle         witness / clean arm
=============== ================================== ============== ==================================
reject_admitted  oversized prompts among 8 tenants  isolation      the oversized request got another
(GLM-5.3 class)  (test_oversized_prompt, glm53)                    request's canary, HTTP 200. The
                                                                   FIRST oversized request is caught in
                                                                   every trial — answered 200 from pages
                                                                   it never had (http_semantics names
                                                                   it); whether its reply also shows
                                                                   foreign canaries depends on what its
                                                                   stale pages held (CI: 4 of 5 trials;
                                                                   once they held none and the reply was
                                                                   "["), so that is a measured rate. Clean:
                                                                   prompts over the engine's own input
                                                                   limit take the same reject path
                                                                   (``is_unadmitted_reject``) and
                                                                   must get 400s
early_free       write held in flight, request      kv_lifecycle   the aborted request's room: its
                 aborted (test_mid_transfer_abort)                 write landed after decode freed
                                                                   the pages. Clean: same choreography
double_alloc     A's write parked; B (other tenant) page_          the engines' own ledger: B handed
                 pre-allocated meanwhile and handed ownership      pages A holds (A holder, B the new
                 390 of A's live pages                             one), in this experiment, whatever
                                                                   the replies show (isolation /
                                                                   differential: a measured rate).
                                                                   Clean: same hold
short_transfer   three requests' KV sends stop      isolation /    a shorted request answered over
                 after one page (test_transfer_      differential  pages nobody wrote. Clean: the
                 delay)                                            same requests, sends whole
salt_ignored     four prompts resent by a tenant    cache_         the resender, cached tokens of the
                 of another salt once the first     isolation      first sender's prefix (another
                 ended (test_prefix_cache)                         salt). Clean: the same, salts kept
prefix_collision four pairs part at a canary (page  isolation      the pair's second request recites
                 boundary, mid-page); the second                   the first's canary. Clean: the same
                 looked up once the first ended                    pairs, lookups honest
token_flip       three tenants' replies, one token  integrity      each victim, at exactly its position
                 changed by decode's output stream                 (first, middle, last: each delivered
                 at the first, a middle and the                    another way, /generate or completions,
                 last position                                     whole or streamed). Clean: nothing
                                                                   flipped
meta_swap        six long streamed replies decoded  integrity      the swapped ones, by the metadata
                 side by side, two at a time with                  field (prompt_tokens /
                 their prompt and cached token                     cached_tokens). Clean: nothing
                 counts exchanged                                  swapped
=============== ================================== ============== ==================================
"""

from __future__ import annotations

import json
import os
import re

import pytest

from kvchaos import canary
from kvchaos.experiment import FAIL, PASS
from kvchaos.oracles import (CacheIsolation, Differential, HttpSemantics, Integrity, Isolation, KVLifecycle, Liveness,
                             PageOwnership)
from kvchaos.probe import contract
from kvchaos.suite import abort_in_flight_ops, in_flight_outcomes, server_field, single_server_reference
from kvchaos.workload import SHARED_MIX, Workload
from kvchaos.workload.scenario import Op

# a default run (CI) puts it on the profile's other layouts — MLA, paged, bf16 — and not again on the
# profile's own (committed results: reports/); --kvchaos-layouts / make test-layouts run it on any layout
pytestmark = [pytest.mark.cluster, pytest.mark.every_layout(own=False)]
TRIALS = int(os.environ.get("KVCHAOS_MATRIX_TRIALS", "5"))
CLEAN_TRIALS = int(os.environ.get("KVCHAOS_MATRIX_CLEAN_TRIALS", "2"))
PREFILL_LIMIT = 512
BOUND_S = 60
# the prefix-cache classes: few requests in flight, so a 2048-token pool keeps a finished prompt cached
# until its pair-mate looks it up (more, and eviction decides what the clean arm's control sees)
CACHE_CONCURRENCY = 2
def background(mutate: bool) -> int:
    """Other tenants' requests per trial: a clean arm must give isolation the sensitivity floor (it
    must PASS); a mutated arm is judged by its detector only, so it stays small (CI time)."""
    return 20 if mutate else 64
RESULTS: dict[tuple[str, str], list[dict]] = {}


def _judge(ex, cls: str, mutate: bool, detector: str):
    """Mutated arm: a planted bug that ``detector`` must catch (the test also checks the witness
    names the bug's victim). Clean arm: every oracle it was given must PASS (the leak checkers that
    always run are held to the policy's rule: no FAIL)."""
    if mutate:
        return ex.judge(planted=f"detection matrix: {cls} armed", **{detector: FAIL})
    return ex.judge(**{o: PASS for o in ex.claimed_verdicts})


def _first_end(ex, rids) -> float | None:
    ends = {e["rid"]: e["wall"] for e in ex.events if e.get("ev") == "end"}
    got = [ends[r] for r in rids if r in ends]
    return min(got) - ex.t_start if got else None


# ------------------------------------------------------------------ scenarios
def scenario_oversized(experiment, seeds, faults, cluster, trial, mutate):
    wl = Workload(seeds(700 + trial), n_tenants=9, prefix=f"xo{'m' if mutate else 'c'}{trial}")
    victim, others = wl.tenants[-1], wl.tenants[:-1]
    bg = [wl.request(others[i % 8], "plain", n_tokens=others[i % 8].rng.randrange(200, 480)) for i in range(background(mutate))]
    if mutate:  # under the engine's limit: only the mutation's lowered prefill limit rejects them
        sizes = (700, 1100)
    else:  # over the engine's own input limit: the same reject path, the mutation off -> 400
        lim = server_field(cluster.server_info("prefill"), "max_req_input_len")
        sizes = (lim + 58, (lim + server_field(cluster.server_info("decode"), "context_length")) // 2)
    big = [wl.request(victim, "oversized", n_tokens=n, n_canaries=3) for n in sizes]
    plans = bg[:12] + [big[0], bg[12], big[1]] + bg[13:]
    checks = [Isolation(), HttpSemantics(), Liveness(bound_s=BOUND_S)]
    with experiment(f"matrix_reject_admitted_{'mut' if mutate else 'clean'}_{trial}", plans, checks,
                    seed=wl.seed, timeout_s=BOUND_S) as ex:
        if mutate:
            faults.agent.arm("prefill", "reject_admitted", target={"tenant": victim.name},
                             params={"prefill_max_input_len": PREFILL_LIMIT}, count=len(big))
    iso, http = ex.by["isolation"], ex.by["http_semantics"]
    vrids = {p.rid for p in big}
    wit = iso.witnesses
    ok_witness = bool(wit) and all(w["victim_rid"] in vrids and w["owner_rid"] not in vrids and w["status"] == 200
                                   for w in wit)
    served = {w["rid"] for w in http.witnesses if w.get("status") == 200}
    return {"detected": iso.status == FAIL, "oracle": "isolation", "witness_ok": ok_witness,
            # the bug on the first oversized request: answered 200 from pages it never had (http_semantics
            # names it); whether its reply also SHOWS foreign data depends on what the stale pages held
            "first_request_caught": big[0].rid in served | {w["victim_rid"] for w in wit},
            "first_request_leak_shown": big[0].rid in {w["victim_rid"] for w in wit},
            "time_to_detection_s": _first_end(ex, {w["victim_rid"] for w in wit}),
            "rejected_4xx": sum(400 <= (ex.run.statuses.get(p.rid) or 0) < 500 for p in big),
            "judgement": _judge(ex, "reject_admitted", mutate, "isolation").status,
            "verdicts": ex.claimed_verdicts, "witness": wit[:1]}


def scenario_abort_in_flight(experiment, seeds, faults, cluster, trial, mutate):
    wl = Workload(seeds(720 + trial), n_tenants=8, prefix=f"xa{'m' if mutate else 'c'}{trial}")
    plans = wl.mix(background(mutate) + 8, lengths=(200, 500))
    victims = [p for p in plans if p.tenant == "t003"][:2]
    with experiment(f"matrix_early_free_{'mut' if mutate else 'clean'}_{trial}", plans,
                    [Isolation(), KVLifecycle(), Liveness(bound_s=BOUND_S)], seed=wl.seed,
                    concurrency=6, timeout_s=BOUND_S) as ex:
        early = [Op(at_s=0, injector="agent", role="decode", kind="early_free")] if mutate else []
        ex.nemesis(early + abort_in_flight_ops(victims, first=len(early)))
    chor = in_flight_outcomes(ex, victims)
    life = ex.by["kv_lifecycle"]
    vic = {p.rid for p in victims}
    ok_witness = bool(life.witnesses) and all(w["rid"] in vic for w in life.witnesses)
    t = min((w["write_end"] for w in life.witnesses), default=None)
    return {"detected": life.status == FAIL, "oracle": "kv_lifecycle", "witness_ok": ok_witness,
            "time_to_detection_s": (t - ex.t_start) if t else None,
            "choreography": [{k: r.get(k) for k in ("rid", "room_status_at_write", "error")} for r in chor],
            "judgement": _judge(ex, "early_free", mutate, "kv_lifecycle").status,
            "verdicts": ex.claimed_verdicts, "witness": life.witnesses[:1]}


def _spliced_from_other(w: dict, plans: dict, run: int = 5, aligned: int = 3) -> bool:
    """An unknown-origin recital in one of the pair holding ``run`` characters in a row of a canary of the
    other one's, characters no canary of the victim's own has in a row; or an aligned splice: one of the
    victim's canaries up to a point and one of the other's from there on (or the reverse), position for
    position, with at least ``aligned`` characters only the other's carries there — decode read the
    canary's first pages from one request's KV and the rest from the other's (fresh clone of 2026-12-07:
    A recited 'MMTZ2G3' of its own 'MMTZ2G3WTD', then 'DZ2' where B's 'EZUFTGBDZ2' has it)."""
    if w.get("origin") != "unknown" or w.get("victim_rid") not in plans:
        return False
    piece = w.get("matched") or ""
    own = [canary.payload(c) for c in plans[w["victim_rid"]].canaries]
    other = [canary.payload(c) for r, p in plans.items() if r != w["victim_rid"] for c in p.canaries]
    runs = {piece[i:i + run] for i in range(len(piece) - run + 1)}
    if any(r in c for r in runs for c in other if not any(r in o for o in own)):
        return True
    for o in own:
        for c in other:
            if not len(piece) == len(o) == len(c):
                continue
            theirs = sum(x == y != z for x, y, z in zip(piece, c, o))
            if theirs >= aligned and any(piece in (o[:k] + c[k:], c[:k] + o[k:]) for k in range(1, len(piece))):
                return True
    return False


def scenario_shared_pages(experiment, seeds, faults, cluster, trial, mutate, reference_server):
    """A's KV write is parked in prefill (hold) after decode pre-allocated A's pages; B (another
    tenant, same prompt length) is pre-allocated meanwhile — with the mutation, 390 of A's pages are
    handed to B too. A's write lands, then B's lands on the shared pages; A decodes over B's KV."""
    wl = Workload(seeds(740 + trial), n_tenants=8, prefix=f"xs{'m' if mutate else 'c'}{trial}")
    a = wl.request(wl.tenants[0], "plain", n_tokens=400, n_canaries=3)
    b = wl.request(wl.tenants[1], "plain", n_tokens=400, n_canaries=3)
    tail = [wl.request(wl.tenants[2 + i % 6], "plain", n_tokens=300) for i in range(background(mutate))]
    # as data (each plan's gate: the op it waits for): A's write held (op 0); B sent once it is parked and,
    # mutated, pre-allocated over A's pages (the planted double_alloc fires once); six other tenants'
    # requests once it fired (the hold's exposure class: the requests beside the one it acted on have
    # evidence of their own, kvchaos.oracles.isolation.power); the write let go 0.5 s after that; the rest
    # after the release
    ops = [Op(at_s=0, injector="agent", role="prefill", kind="hold", target={"rid": a.rid}, params={"max_hold_s": 30})]
    if mutate:
        ops += [Op(at_s=0, injector="agent", role="decode", kind="double_alloc", params={"pages": 390}, count=1),
                Op(at_s=0, injector="action", kind="heal", after=1, on={"role": "decode", "ev": "fault_fired"}),
                Op(at_s=0, injector="action", kind="release", after=0, delay_s=0.5,
                   on={"role": "decode", "ev": "fault_fired", "op": 1})]
        beside, release = 2, 3
    else:
        ops += [Op(at_s=0, injector="action", kind="release", after=0, delay_s=1.0)]
        beside, release = 0, 1
    gates = {b.rid: 0, **{p.rid: beside for p in tail[:6]}, **{p.rid: release for p in tail[6:]}}

    checks = [Isolation(), Liveness(bound_s=BOUND_S), PageOwnership(),
              Differential(single_server_reference(reference_server, [a, b, *tail[:4]]))]
    with experiment(f"matrix_double_alloc_{'mut' if mutate else 'clean'}_{trial}", [a, b, *tail], checks,
                    seed=wl.seed, timeout_s=BOUND_S) as ex:
        ex.nemesis(ops, gates)
    iso, diff, own = ex.by["isolation"], ex.by["differential"], ex.by["page_ownership"]
    pair = {a.rid, b.rid}
    # the engines' own ledger, in this experiment: B was handed pages A held (A holder, B the new one), and
    # nothing else conflicted — whatever the replies went on to show
    two = [w for w in own.witnesses if w["conflict"] == "two_holders"]
    own_ok = (bool(two) and all((w["holder"], w["to"]) == (a.rid, b.rid) for w in two)
              and all(w["conflict"] in ("two_holders", "double_assign") for w in own.witnesses))
    # the A/B pair named, and nothing outside it: a reply decoded over the two requests' mixed KV can
    # also splice a canary neither minted (unknown origin, seen twice in CI), still in a victim of the
    # pair; such a splice names the pair when a run of it is the other one's canary (fresh clone of
    # 2026-12-06: A recited 'ZCEF' of its own 'ZCEFUDKP7X', then 'TGBDZ2' of B's 'EZUFTGBDZ2'), or when
    # it is one of A's canaries and one of B's joined where they stand (_spliced_from_other)
    plans = {a.rid: a, b.rid: b}
    ok_witness = (any({w["victim_rid"], w["owner_rid"]} == pair or _spliced_from_other(w, plans) for w in iso.witnesses)
                  and all(w["victim_rid"] in pair and (w["owner_rid"] in pair or w.get("origin") == "unknown")
                          for w in iso.witnesses) if iso.witnesses
                  else bool(diff.witnesses) and all(w.get("rid") in pair for w in diff.witnesses))
    first = min((w["wall"] for w in two if isinstance(w.get("wall"), (int, float))), default=None)
    return {"detected": own.status == FAIL, "oracle": "page_ownership", "witness_ok": own_ok,
            "replies_show_it": iso.status == FAIL or diff.status == FAIL,
            "replies_oracle": "isolation" if iso.witnesses else ("differential" if diff.witnesses else None),
            "replies_witness_ok": ok_witness,
            "time_to_detection_s": (first - ex.t_start) if first else None,
            "judgement": _judge(ex, "double_alloc", mutate, "page_ownership").status,
            "verdicts": ex.claimed_verdicts, "witness": own.witnesses[:1] or (iso.witnesses or diff.witnesses)[:1]}


def scenario_short_transfer(experiment, seeds, faults, cluster, trial, mutate, reference_server):
    wl = Workload(seeds(760 + trial), n_tenants=8, prefix=f"xt{'m' if mutate else 'c'}{trial}")
    plans = wl.mix(background(mutate) + 8, lengths=(200, 500))
    shorted = [p for p in plans if p.tenant == "t005"][:3]
    checks = [Isolation(), Liveness(bound_s=BOUND_S), Differential(single_server_reference(reference_server, shorted))]
    with experiment(f"matrix_short_transfer_{'mut' if mutate else 'clean'}_{trial}", plans, checks,
                    seed=wl.seed, timeout_s=BOUND_S) as ex:
        if mutate:  # every KV send of these requests stops after one page
            fs = [faults.agent.arm("prefill", "short", target={"rid": p.rid}, params={"pages": 1}, count=100)
                  for p in shorted]
    if mutate:
        for f in fs:
            f.verify()
    iso, diff = ex.by["isolation"], ex.by["differential"]
    srids = {p.rid for p in shorted}
    wit = iso.witnesses or diff.witnesses
    ok_witness = bool(wit) and all((w.get("victim_rid") or w.get("rid")) in srids for w in wit)
    oracle = "isolation" if iso.witnesses else "differential"
    return {"detected": iso.status == FAIL or diff.status == FAIL, "oracle": oracle, "witness_ok": ok_witness,
            "time_to_detection_s": _first_end(ex, {w.get("victim_rid") or w.get("rid") for w in wit}),
            "judgement": _judge(ex, "short_transfer", mutate, oracle).status, "verdicts": ex.claimed_verdicts,
            "witness": wit[:1]}


def _pairs(ex_plans_a, ex_plans_b):
    return {b.rid: a.rid for a, b in zip(ex_plans_a, ex_plans_b)}


def scenario_salt_ignored(experiment, seeds, faults, cluster, trial, mutate):
    """Four tenants each send a prompt another tenant (another salt) sends again once it ended: with
    the mutation the second reuses the first's cached prefix. Driven past the router (which drops
    salts: sglang-router-drops-cache-salt), as SGLang's mini load balancer does."""
    wl = Workload(seeds(780 + trial), n_tenants=8, prefix=f"xk{'m' if mutate else 'c'}{trial}", salts="tenant",
                  page_size=cluster.spec.page_size)
    firsts, seconds, again = [], [], []
    for i in range(4):  # a sends, b (another salt) sends the same once a ended, then a again (the control)
        a, b, c = wl.identical([wl.tenants[i], wl.tenants[i + 4], wl.tenants[i]], n_tokens=300)
        b.after, c.after = a.rid, b.rid
        firsts.append(a)
        seconds.append(b)
        again.append(c)
    plans = [*firsts, *seconds, *again, *wl.mix(background(mutate) // 2, lengths=(200, 500), sharing=SHARED_MIX)]
    with experiment(f"matrix_salt_ignored_{'mut' if mutate else 'clean'}_{trial}", plans,
                    [Isolation(), CacheIsolation(), Liveness(bound_s=BOUND_S)], seed=wl.seed,
                    concurrency=CACHE_CONCURRENCY, timeout_s=BOUND_S, via="pd") as ex:
        if mutate:
            faults.agent.arm("prefill", "salt_ignored")
    cache = ex.by["cache_isolation"]
    pairs = _pairs(firsts, seconds)
    wit = cache.witnesses
    # the pairs named, and every witness a reuse across salts (the bug's only effect)
    ok_witness = (any(pairs.get(w["victim_rid"]) == w["owner_rid"] for w in wit)
                  and all(w["owner_rid"] and w["owner_salt"] != w["victim_salt"] for w in wit))
    return {"detected": cache.status == FAIL, "oracle": "cache_isolation", "witness_ok": ok_witness,
            "time_to_detection_s": _first_end(ex, {w["victim_rid"] for w in wit}),
            "judgement": _judge(ex, "salt_ignored", mutate, "cache_isolation").status,
            "verdicts": ex.claimed_verdicts, "witness": wit[:1]}


def scenario_prefix_collision(experiment, seeds, faults, cluster, trial, mutate):
    """Four pairs of tenants whose prompts share a long prefix and part at a canary (page boundary
    and mid-page); the second of a pair is sent once the first ended. With the mutation the
    second's prefix lookup is handed the first's KV past the divergence, as a colliding block hash
    would: its context then holds the first's canary. Pair-mates share a salt (else no lookup of
    one could reach the other's prefix)."""
    names = [f"t{i:03d}" for i in range(8)]
    nonce = os.urandom(3).hex()  # a namespace of this trial's own: no earlier sequence can be a candidate
    salts = {n: f"xc{trial}-{nonce}-{i % 4}" for i, n in enumerate(names)}
    wl = Workload(seeds(800 + trial), n_tenants=8, prefix=f"xc{'m' if mutate else 'c'}{trial}", salts=salts,
                  page_size=cluster.spec.page_size)
    firsts, seconds = [], []
    for i in range(4):
        a, b = wl.diverging(wl.tenants[i], wl.tenants[i + 4], shared=300, at=("page", "mid")[i % 2])
        b.after = a.rid
        firsts.append(a)
        seconds.append(b)
    # the mutated arm is the pairs alone (the colliding lookup picks the latest cached sequence that
    # parts where the request's own match stops: only the pair-mate); the clean arm adds the background
    # and three prompts resent under another salt once the first ended: cache_isolation's cross-salt
    # chances (>= 3) whatever the background draws (a soak seed of 2026-12-04 drew 2: UNKNOWN, red)
    cross = []
    for i in range(0 if mutate else 3):
        a, b = wl.identical([wl.tenants[i], wl.tenants[i + 1]], n_tokens=240)  # salts i % 4 and (i + 1) % 4
        b.after = a.rid
        cross += [a, b]
    plans = [*firsts, *seconds, *cross,
             *([] if mutate else wl.mix(background(False) // 2, lengths=(200, 500), sharing=SHARED_MIX))]
    with experiment(f"matrix_prefix_collision_{'mut' if mutate else 'clean'}_{trial}", plans,
                    [Isolation(), CacheIsolation(), Liveness(bound_s=BOUND_S)], seed=wl.seed,
                    concurrency=CACHE_CONCURRENCY, timeout_s=BOUND_S, via="pd") as ex:
        if mutate:
            f = faults.agent.arm("prefill", "prefix_collision",
                                 target={"rid_regex": "|".join(re.escape(b.rid) for b in seconds)})
    if mutate:
        f.verify(at_least=1)
    iso = ex.by["isolation"]
    pairs = _pairs(firsts, seconds)
    wit = iso.witnesses
    ok_witness = (bool(wit) and all(w["victim_rid"] in pairs for w in wit)
                  and any(pairs[w["victim_rid"]] == w["owner_rid"] for w in wit))
    return {"detected": iso.status == FAIL, "oracle": "isolation", "witness_ok": ok_witness,
            "time_to_detection_s": _first_end(ex, {w["victim_rid"] for w in wit}),
            "cache_isolation": ex.by["cache_isolation"].status,
            "judgement": _judge(ex, "prefix_collision", mutate, "isolation").status,
            "verdicts": ex.claimed_verdicts, "witness": wit[:1]}


FLIP_AT = ("first", "middle", "last")


def scenario_token_flip(experiment, seeds, faults, cluster, trial, mutate):
    """Three tenants' replies, each with one token changed by the engine (``token_flip``: decode's output
    stream) at the first, a middle and the last position of what it must be, each delivered another way:
    integrity names each victim at exactly its position. Clean: the same requests, nothing flipped."""
    wl = Workload(seeds(820 + trial), n_tenants=8, prefix=f"xf{'m' if mutate else 'c'}{trial}")
    # the victims' deliveries rotate with the trial: /generate and /v1/completions, whole and streamed (an
    # OpenAI chat request reaches decode under an id of the router's, which no rid target can name: the
    # chat replies of the background traffic are judged all the same)
    shapes = [("generate", "plain"), ("completions", "stream"), ("generate", "stream"), ("completions", "plain")]
    victims = [wl.request(wl.tenants[i], shapes[(i + trial) % 4][1], n_tokens=300, n_canaries=3,
                          endpoint=shapes[(i + trial) % 4][0]) for i in range(3)]
    at = {v.rid: _flip_index(v, where) for v, where in zip(victims, FLIP_AT)}
    plans = wl.mix(background(mutate), lengths=(200, 500), endpoints=("generate", "completions", "chat"))
    plans = plans[:4] + victims + plans[4:]
    with experiment(f"matrix_token_flip_{'mut' if mutate else 'clean'}_{trial}", plans,
                    [Isolation(), Integrity(), Liveness(bound_s=BOUND_S)], seed=wl.seed, timeout_s=BOUND_S) as ex:
        if mutate:
            fs = [faults.agent.arm("decode", "token_flip", target={"rid": v.rid}, params={"at": at[v.rid]})
                  for v in victims]
    if mutate:
        for f in fs:
            f.verify()
    integ = ex.by["integrity"]
    got = {w["rid"]: w.get("position") for w in integ.witnesses}
    per = {where: got.get(v.rid) == at[v.rid] for v, where in zip(victims, FLIP_AT)}
    ok_witness = bool(integ.witnesses) and all(per.values()) and set(got) == set(at)
    return {"detected": integ.status == FAIL, "oracle": "integrity", "witness_ok": ok_witness,
            "positions_caught": per, "expected_positions": at,
            "time_to_detection_s": _first_end(ex, set(got)),
            "judgement": _judge(ex, "token_flip", mutate, "integrity").status,
            "verdicts": ex.claimed_verdicts, "witness": integ.witnesses[:1]}


def _flip_index(p, where: str) -> int:
    n = len(contract.expected(p.prompt).text)
    return {"first": 0, "middle": n // 2, "last": n - 1}[where]


def scenario_meta_swap(experiment, seeds, faults, cluster, trial, mutate):
    """Six tenants' long streamed replies decoded side by side while the engine exchanges the metadata of
    two sent in one batch (``meta_swap``: prompt and cached token counts, decode's output stream):
    integrity names them, by the metadata field, and nothing else. Clean: the same six, nothing swapped."""
    wl = Workload(seeds(840 + trial), n_tenants=8, prefix=f"xw{'m' if mutate else 'c'}{trial}")
    # six long streams of six tenants, each of another length, first in line: decode writes ~0.3 s of
    # tokens for a 3-canary reply on the CI layouts and pre-allocates a request only once prefill has it,
    # so two streams of 10 canaries (121 tokens) each are what overlap there (one pair of 3-canary streams
    # did not: 2026-12-07)
    pair = [wl.request(wl.tenants[i], "stream", n_tokens=260 + 23 * i, n_canaries=10) for i in range(6)]
    plans = pair + wl.mix(background(mutate), lengths=(200, 500))
    with experiment(f"matrix_meta_swap_{'mut' if mutate else 'clean'}_{trial}", plans,
                    [Isolation(), Integrity(), Liveness(bound_s=BOUND_S)], seed=wl.seed, timeout_s=BOUND_S) as ex:
        if mutate:
            f = faults.agent.arm("decode", "meta_swap", target={"rid_regex": "|".join(re.escape(p.rid) for p in pair)})
    if mutate:
        f.verify(at_least=1)
    integ = ex.by["integrity"]
    rids = {p.rid for p in pair}
    ok_witness = (bool(integ.witnesses) and {w["rid"] for w in integ.witnesses} <= rids
                  and all(w.get("field") in ("prompt_tokens", "cached_tokens") for w in integ.witnesses))
    return {"detected": integ.status == FAIL, "oracle": "integrity", "witness_ok": ok_witness,
            "victims_named": sorted({w["rid"] for w in integ.witnesses}),
            "time_to_detection_s": _first_end(ex, {w["rid"] for w in integ.witnesses}),
            "judgement": _judge(ex, "meta_swap", mutate, "integrity").status,
            "verdicts": ex.claimed_verdicts, "witness": integ.witnesses[:1]}


CLASSES = {
    "reject_admitted": scenario_oversized,
    "early_free": scenario_abort_in_flight,
    "double_alloc": scenario_shared_pages,
    "short_transfer": scenario_short_transfer,
    "salt_ignored": scenario_salt_ignored,
    "prefix_collision": scenario_prefix_collision,
    "token_flip": scenario_token_flip,
    "meta_swap": scenario_meta_swap,
}
NEEDS_REFERENCE = {"double_alloc", "short_transfer"}


def _run(request, experiment, seeds, faults, cluster, run_dir, cls, mutate, trials):
    fn = CLASSES[cls]
    out = []
    for trial in range(trials):
        extra = (request.getfixturevalue("reference_server"),) if cls in NEEDS_REFERENCE else ()
        r = fn(experiment, seeds, faults, cluster, trial, mutate, *extra)
        faults.log.emit("matrix_trial", cls=cls, mutate=mutate, trial=trial, **r)
        print(cls, "mutated" if mutate else "clean", trial, json.dumps(r, default=str)[:400])
        out.append(r)
    RESULTS[(cls, "mutated" if mutate else "clean")] = out
    _write(run_dir)
    return out


def _write(run_dir):
    rows = []
    for (cls, arm), trials in sorted(RESULTS.items()):
        det = [t for t in trials if t["detected"]]
        ttd = [t["time_to_detection_s"] for t in det if t["time_to_detection_s"] is not None]
        row = {"class": cls, "arm": arm, "trials": len(trials), "detected": len(det),
               "rate": len(det) / len(trials), "witness_ok": sum(bool(t["witness_ok"]) for t in det),
               "time_to_first_detection_s": min(ttd) if ttd else None,
               "per_trial": [t["detected"] for t in trials], "judgements": [t["judgement"] for t in trials]}
        if cls == "reject_admitted" and arm == "mutated":
            row["first_request_caught"] = sum(bool(t["first_request_caught"]) for t in trials)
            row["first_request_leak_shown"] = sum(bool(t["first_request_leak_shown"]) for t in trials)
        if cls == "token_flip" and arm == "mutated":  # each position, caught at exactly its index
            row["positions_caught"] = {w: sum(bool((t.get("positions_caught") or {}).get(w)) for t in trials)
                                       for w in FLIP_AT}
        if cls == "double_alloc" and arm == "mutated":  # what the replies went on to show (not the detector)
            row["replies_show_it"] = sum(bool(t.get("replies_show_it")) for t in trials)
        rows.append(row)
    (run_dir / "detection_matrix.json").write_text(json.dumps(rows, indent=2, default=str))
    print("\nclass            arm      detected  rate   witness  first detection")
    for r in rows:
        t = f"{r['time_to_first_detection_s']:.1f} s" if r["time_to_first_detection_s"] is not None else "-"
        print(f"{r['class']:16s} {r['arm']:8s} {r['detected']}/{r['trials']}       {r['rate']:.2f}   "
              f"{r['witness_ok']}/{r['detected']}      {t}")


@pytest.mark.parametrize("cls", list(CLASSES))
def test_mutation_is_detected(request, experiment, seeds, faults, cluster, kvchaos_run_dir, cls):
    trials = _run(request, experiment, seeds, faults, cluster, kvchaos_run_dir, cls, True, TRIALS)
    for t in trials:
        assert t["detected"], f"{cls}: trial missed by every oracle: {t}"
        assert t["witness_ok"], f"{cls}: detected, but the witness does not name the bug's victim: {t['witness']}"
        if cls == "reject_admitted":  # the GLM-5.3 class: caught on the first oversized request
            assert t["first_request_caught"], f"first oversized request not caught: {t}"
    if cls == "reject_admitted":
        rate = sum(t["first_request_leak_shown"] for t in trials) / len(trials)
        faults.log.emit("observed", first_request_leak_shown_rate=rate)
        print(f"reject_admitted: the first oversized reply showed foreign canaries in {rate:.0%} of trials")


# behind -m slow for CI's time (make test-matrix runs 2 per class): a clean arm pays the sensitivity
# floor's 64 background requests, ~195 CPU-s of CI's for the six; CI keeps every mutated arm (caught,
# with a witness naming the planted victim) and the clean control suites
@pytest.mark.slow
@pytest.mark.parametrize("cls", list(CLASSES))
def test_no_mutation_no_alarm(request, experiment, seeds, faults, cluster, kvchaos_run_dir, cls):
    trials = _run(request, experiment, seeds, faults, cluster, kvchaos_run_dir, cls, False, CLEAN_TRIALS)
    for t in trials:
        assert not t["detected"], f"{cls}: false alarm on the unmutated engine: {t}"
        bad = {k: s for k, s in t["verdicts"].items() if s != PASS}
        assert not bad, f"{cls}: unmutated scenario not PASS on every oracle: {bad}"
        if cls == "reject_admitted":
            assert t["rejected_4xx"] == 2, f"the clean arm's oversized prompts did not take the reject path: {t}"
