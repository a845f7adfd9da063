"""The search space as a weighted grammar: :func:`generate` draws a whole scenario, :func:`mutate`
changes one part of a corpus entry, :func:`splice` joins the traffic of one entry with the nemesis of
another. Every draw comes from the ``random.Random`` it is given: the same seed, the same scenarios.

What it draws (:data:`WEIGHTS` says how often):

- **deployment** — live knobs mostly (prefill's input limit, chunked-prefill size, decode's
  deferred-release timeout and per-request reservation: free on a running cluster), restart knobs
  rarely (pool vs context, prefill's pool apart from decode's, ``--allow-auto-truncate``, decode's
  radix cache: each new combination is a cluster start, which the loop schedules);
- **traffic** — 2-12 tenants, 36-56 plans (isolation's power floor with room for faults) over every
  request kind and endpoint, shared prefixes and salts, prompt lengths at the deployment's edges
  (decode's admission edge ``pool − reservation``, prefill's input limit and pool, decode's pool, the
  context) as well as inside them, aborts and disconnects, through the router or straight to prefill and decode;
- **nemesis** — timed agent faults (delay, fail, short, hold, park, stall_status_read), proxy
  toxics on the client and server legs, process stop/kill of a role, aborts of held requests, and ops
  set off by a request's own event (its abort, or a stop or kill of a role, once prefill queued it, its
  transfer started or wrote, decode pre-allocated it, or the client read its first byte); none at all in
  some scenarios (``quiet``), where only the deployment and the traffic can break the engine.

It never arms a planted engine bug (``AGENT_MUTATIONS``): the search looks for the engine's own.
"""

from __future__ import annotations

import copy
import random

from kvchaos.shrink.scenario import kept_ops
from kvchaos.workload import Workload
from kvchaos.workload.plan import CLIENT_CUTS
from kvchaos.workload.snapshots import server_field
from kvchaos.workload.scenario import (AGENT_MUTATIONS, LIVE_KNOBS, TOXIC_TYPES, Deployment, Op, Scenario, Traffic,
                                       plan_dict)

PARK_STAGES = ("decode_prealloc", "prefill_waiting", "decode_waiting")  # faults.wire.PARK_STAGES
# the events of one request an op can wait for (Op.on): prefill queued it, its transfer started, a write
# of it ended, decode pre-allocated its pages, the client read its first byte
ON_EVENTS = (("prefill", "bootstrap_queued"), ("prefill", "transfer_start"), ("prefill", "write_end"),
             ("decode", "kv_prealloc"), ("client", "first_byte"))
FAULTS = {"delay": 5, "fail": 2, "short": 2, "hold": 2, "park": 2, "stall_status_read": 1}
TOXICS = {"latency": 3, "slicer": 1, "limit_data": 1, "reset_peer": 1, "timeout": 1, "bandwidth": 1, "slow_close": 1}
WEIGHTS = {
    "live_knob": 0.5,      # per live knob: chance it is set
    "restart_knob": 0.08,  # per restart knob: chance it differs from the base deployment
    # chance a scenario sends prompts into the bands the deployment's limits cut (Base.bands): most
    # registered findings live there (hang band, intake reject, auto-truncate, the GLM-5.3 reject path)
    "oversized": 0.5,
    # share of abort/disconnect kinds in the mix, one drawn per scenario: none in two of five, since on a
    # release where a client's cut wedges the PD pipeline (0.5.19) only an abort-free run shows the rest
    "abort": (0.0, 0.0, 0.1, 0.2, 0.3),
    "stream": 0.25,
    "salts": 0.4,          # chance tenants carry cache salts
    "via_pd": 0.25,        # straight to prefill + decode (SGLang's mini load balancer's way)
    "agent_ops": (0, 4),   # how many agent faults
    "proxy_ops": (0, 2),
    "process_op": 0.08,    # chance of a stop or kill of a role
    # chance of an op set off by a request's own event (Op.on: the choreography the suites' `during`
    # actions were), an abort of that request or, one in four, a stop or kill of a role
    "on_op": 0.15,
    "abort_held": 0.6,     # chance a request a hold or park parked is aborted while parked
    # chance a drawn scenario carries no nemesis op: the engine's own bugs under edge traffic and knobs
    # alone. A fault in the same run adds its own hung or cut requests, and a verdict two causes explain
    # is rightly left NEW by triage: a first 30-minute search (2026-12-05) drew an op-free scenario with
    # band probes about once in 50, and never saw the hang band as itself
    "quiet": 0.3,
}
# the most nemesis ops a mutated or spliced scenario carries (a drawn one has at most 4 agent, 2 proxy, 1
# process op and an abort per hold). Splicing added every op of the second parent: the fifth 30-minute
# guided search on 0.5.23 (reports/fuzz/20261205-0.5.23-pair5/) grew scenarios of up to 30 ops, whose
# faults left too few clean replies for isolation's power (UNKNOWN) and hung requests that two causes
# explain (left NEW, then confirmed and shrunk at the cost of eight runs each)
MAX_OPS = 8
MUTATORS = {"knob": 3, "op_param": 4, "op_time": 3, "add_op": 3, "drop_op": 2, "traffic": 3, "probe": 3,
            "restart_knob": 1}


class Base:
    """The deployment a search starts from (a running cluster's numbers: pool, context, reservation,
    input limit, page size), which the edges are computed from."""

    def __init__(self, pool: int = 2048, context: int = 4096, reservation: int = 512, input_limit: int | None = None,
                 page_size: int = 1, restart: dict | None = None, prefill_pool: int | None = None):
        self.pool, self.context, self.reservation, self.page_size = pool, context, reservation, page_size
        self.prefill_pool = prefill_pool if prefill_pool is not None else pool
        self.input_limit = input_limit if input_limit is not None else self.prefill_pool - 6
        self.restart = dict(restart or {})

    def limits(self, dep: Deployment) -> tuple[int, int, int, int, int]:
        """``(decode pool, prefill pool, context, reservation, prefill's input limit)`` under ``dep``
        (SGLang's input limit is the pool less a few tokens where the pool is under the context)."""
        pool = dep.restart.get("pool_tokens", self.pool)
        ppool = dep.restart.get("prefill_pool_tokens", pool if "pool_tokens" in dep.restart else self.prefill_pool)
        ctx = dep.restart.get("context_length", self.context)
        res = dep.live.get("decode_reservation", self.reservation)
        lim = dep.live.get("prefill_input_limit", min(self.input_limit, ppool - 6))
        return pool, ppool, ctx, res, lim

    def bands(self, dep: Deployment) -> list[tuple[int, int]]:
        """The prompt-length bands between consecutive limits (``[lo, hi)``, from 64 to twice the
        context): within one band every limit answers a prompt the same way, so each band is one class of
        engine path. Where prefill's limit is under decode's admission edge, the band between them is the
        prompts prefill rejects and decode would admit (the reject path's window)."""
        cuts = sorted(self.cuts(dep))
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b - a >= 2]

    def cuts(self, dep: Deployment) -> set[int]:
        """The prompt lengths where ``dep``'s limits change what a prompt gets (:meth:`bands`' edges)."""
        pool, ppool, ctx, res, lim = self.limits(dep)
        return {64, pool - res + 1, lim, ppool, pool, ctx, 2 * ctx} & set(range(64, 2 * ctx + 1))

    def moved(self, dep: Deployment) -> set[int]:
        """The limits ``dep``'s live knobs moved off the running deployment's own (as :meth:`bands`
        cuts: prefill's input limit, decode's admission edge ``pool − reservation + 1``)."""
        pool, _ppool, _ctx, res, lim = self.limits(dep)
        _p, _pp, _c, res0, lim0 = self.limits(Deployment(dep.restart, {}))
        return ({lim} if lim != lim0 else set()) | ({pool - res + 1} if res != res0 else set())

    def probe_sizes(self, rng: random.Random, dep: Deployment, k: int, edges: set[int] | None = None) -> list[int]:
        """``k`` prompt lengths from ``k`` different :meth:`bands` (stratified: a band is drawn, not a
        length, so a narrow band such as the reject path's window is as likely as a wide one), each at
        the band's lower edge, just above it, just under its upper edge, or anywhere inside. The bands
        on either side of a limit the live knobs moved (:meth:`moved`) come first: a knob that moves an
        edge is tested at that edge (boundary values), where the engines it splits disagree. ``edges``:
        the limits to put first instead (a restart knob's new ones)."""
        bands = self.bands(dep)
        moved = self.moved(dep) if edges is None else edges
        edge = [b for b in bands if b[0] in moved or b[1] in moved]
        rng.shuffle(edge)
        edge = edge[:k]
        rest = [b for b in bands if b not in edge]
        out = []
        for lo, hi in edge + rng.sample(rest, k=min(k - len(edge), len(rest))):
            out.append(rng.choice((lo, min(lo + 1, hi - 1), hi - 1, rng.randrange(lo, hi))))
        return out

    def expect(self, n: int, dep: Deployment) -> str:
        """What the deployment's published limits say a prompt of ``n`` tokens gets (as
        ``suites/test_oversized_prompt.py`` labels them): ``answer`` up to decode's admission edge,
        ``hang_band`` between it and prefill's input limit, ``reject`` from the limit on."""
        pool, _ppool, _ctx, res, lim = self.limits(dep)
        if n <= pool - res and n < lim:  # SGLang refuses len(input) >= max_req_input_len
            return "answer"
        return "hang_band" if n < lim else "reject"

    @classmethod
    def of_cluster(cls, cluster) -> "Base":
        """The numbers a running cluster reports (``/server_info``), not the profile's."""
        pf, dc = cluster.server_info("prefill"), cluster.server_info("decode")
        spec = cluster.spec
        return cls(pool=server_field(dc, "max_total_num_tokens"), prefill_pool=server_field(pf, "max_total_num_tokens"),
                   context=server_field(dc, "context_length"), reservation=server_field(dc, "num_reserved_decode_tokens"),
                   input_limit=min(server_field(pf, "max_req_input_len"), server_field(dc, "max_req_input_len")),
                   page_size=spec.page_size)


def _knobs(rng: random.Random, base: Base, restart_p: float, live_p: float) -> Deployment:
    live = {}
    for k in LIVE_KNOBS:
        if rng.random() < live_p:
            live[k] = {"prefill_input_limit": lambda: rng.choice((256, 512, 1024, base.input_limit - 256)),
                       "chunked_prefill": lambda: base.page_size * rng.choice((16, 64, 128, 256)),
                       "deferred_release_timeout_s": lambda: rng.choice((0.5, 1.0, 3.0)),
                       "decode_reservation": lambda: rng.choice((16, 64, 128, 256))}[k]()
    restart = dict(base.restart)
    if rng.random() < restart_p:
        restart["allow_auto_truncate"] = not restart.get("allow_auto_truncate", False)
    if rng.random() < restart_p:
        restart["decode_radix_cache"] = not restart.get("decode_radix_cache", False)
    if rng.random() < restart_p:
        restart["pool_tokens"] = rng.choice((1024, 2048, 3072))
    if rng.random() < restart_p:  # prefill's pool below the context and decode's pool
        restart["prefill_pool_tokens"] = rng.choice((576, 1024))
    if restart.get("prefill_pool_tokens", 0) >= restart.get("pool_tokens", base.pool):
        restart.pop("prefill_pool_tokens", None)  # only ever the smaller pool: that is the deployment it names
    return Deployment(restart, live)


def _traffic(rng: random.Random, base: Base, dep: Deployment, seed: int) -> Traffic:
    n_tenants = rng.randint(2, 12)
    # salts from the scenario's seed, not Workload's per-object nonce: the same seed draws the same scenario
    salts = {f"t{i:03d}": f"fz{seed}-{i}" for i in range(n_tenants)} if rng.random() < WEIGHTS["salts"] else None
    wl = Workload(seed, n_tenants=n_tenants, prefix=f"fz{seed % 100000}-", salts=salts, page_size=base.page_size)
    # the share of aborts and disconnects is drawn per scenario, none in some: on a release where a
    # client abort wedges the PD pipeline (0.5.19, 2026-12-05: every request after the first abort timed
    # out), only an abort-free scenario can show anything else
    ab = rng.choice(WEIGHTS["abort"])
    weights = {"plain": 1 - ab - WEIGHTS["stream"], "stream": WEIGHTS["stream"], "abort_after": ab / 2,
               "disconnect_before_first_token": ab / 2}
    # enough plain echo evidence for isolation's floor (20 requests, 59 canaries at 95 %) beside whatever
    # the faults break: a first real search (2026-12-04) drew 6-40 plans and every run was blind
    n = rng.randint(36, 56)
    pool, _ppool, _ctx, res, lim = base.limits(dep)
    hi = max(128, min(pool - res, lim, 900))  # the ordinary traffic fits every limit; the edges come below
    via = "pd" if rng.random() < WEIGHTS["via_pd"] else "router"
    # straight to prefill + decode the driver speaks /generate only (the OpenAI routes need the router)
    endpoints = ("generate",) if via == "pd" else ("generate", "generate", "completions", "chat")
    plans = wl.mix(n, weights=weights, lengths=(64, hi), endpoints=endpoints)
    # a scenario whose live knobs moved a limit always probes it (Base.probe_sizes): the knob is drawn to
    # test that edge, and without probes a moved limit changes nothing the traffic reaches
    if rng.random() < WEIGHTS["oversized"] or base.moved(dep):
        victim = rng.choice(wl.tenants)
        _place(rng, plans, _probes(rng, wl, victim, base, dep, k=rng.choice((2, 3, 4))), lambda p: p.n_tokens)
        _fix_order(plans)
    # at least 4 in flight: a fault's exposure class is the requests it acted on and those in flight beside
    # them, and at 2 a fault on one tenant saw 4 evidence requests, under the class floor of 5 (a first
    # 36-56-plan search, 2026-12-04: every run with such a fault was blind)
    # a run whose cluster wedged stops sending at its first timeout with nothing answered for 25 s: on
    # 0.5.19 a wedge otherwise cost every later plan its 30 s timeout, 4-7 minutes of a 10-minute search.
    # Under the client timeout, so the first request that times out (sent a moment after the last reply
    # byte) stops it, before the slots its timeout frees send a second wave into the wedge
    # a conversation's later turns grow past the limits: labelled as the edges are
    return Traffic(_label_plans([plan_dict(p) for p in plans], base, dep), concurrency=rng.choice((4, 8, 8, 16)),
                   timeout_s=30.0, via=via, stall_s=25.0)


def _fix_order(plans) -> None:
    """A plan that waits for another (``after``) must come after it: move the waiting one there."""
    seen = set()
    i = 0
    while i < len(plans):
        p = plans[i]
        if p.after is not None and p.after not in seen:
            j = next(k for k, q in enumerate(plans) if q.rid == p.after)
            plans.insert(j + 1, plans.pop(i))
            continue
        seen.add(p.rid)
        i += 1


def _agent_op(rng: random.Random, rids: list[str], tenants: list[str], horizon: float) -> Op:
    kind = rng.choices(list(FAULTS), list(FAULTS.values()))[0]
    role = "decode" if kind == "park" and rng.random() < 0.7 else "prefill"
    if kind in ("hold", "park") and rng.random() < 0.6:  # one request held: what an abort can be aimed at
        target = {"rid": rng.choice(rids)}
    else:
        target = rng.choice(({"rid": rng.choice(rids)}, {"tenant": rng.choice(tenants)}, None))
    params = {"delay": lambda: {"ms": rng.choice((20, 100, 300, 1000)), "jitter_ms": rng.choice((0, 50))},
              "fail": dict, "short": lambda: {"pages": rng.choice((0, 1, 2))},
              "hold": lambda: {"max_hold_s": rng.choice((1, 3, 10))},
              "park": lambda: {"stage": rng.choice(PARK_STAGES)},
              "stall_status_read": lambda: {"ms": rng.choice((50, 200))}}[kind]()
    if kind == "park":
        role = {"decode_prealloc": "decode", "decode_waiting": "decode", "prefill_waiting": "prefill"}[params["stage"]]
    at = 0.0 if rng.random() < 0.5 else round(rng.uniform(0, horizon), 2)
    heal = round(at + rng.uniform(0.5, horizon), 2) if rng.random() < 0.3 else None
    count = rng.choice((None, 1, 3)) if target is not None else rng.choice((None, 2))
    return Op(at_s=at, heal_s=heal, injector="agent", role=role, kind=kind, target=target, params=params, count=count)


def _proxy_op(rng: random.Random, horizon: float) -> Op:
    kind = rng.choices(list(TOXICS), list(TOXICS.values()))[0]
    params = {a: rng.choice({"latency": (50, 200), "jitter": (0, 50), "rate": (64, 512), "delay": (10, 100),
                             "timeout": (200, 1000), "bytes": (200, 2000), "average_size": (16, 256),
                             "size_variation": (0, 8)}[a]) for a in TOXIC_TYPES[kind]}
    at = round(rng.uniform(0, horizon / 2), 2)
    return Op(at_s=at, heal_s=round(at + rng.uniform(1, horizon), 2), injector="proxy", kind=kind,
              proxy=rng.choice(("client", "client", "prefill", "decode")), stream=rng.choice(("downstream", "upstream")),
              toxicity=rng.choice((0.1, 0.3, 1.0)), params=params)


def _nemesis(rng: random.Random, traffic: Traffic, seed: int = 0) -> list[Op]:
    # faults aim at requests that reach a KV transfer (a prompt over the limit is rejected first, an
    # abort or disconnect may end before one): a hold on one that never transfers only waits out its bound
    rids = [p["rid"] for p in traffic.plans if p.get("kind", "plain") in ("plain", "stream") and not p.get("oversized")]
    rids = rids or [p["rid"] for p in traffic.plans]
    tenants = sorted({p["tenant"] for p in traffic.plans})
    horizon = 2.0 + len(rids) * 0.3
    ops = [_agent_op(rng, rids, tenants, horizon) for _ in range(rng.randint(*WEIGHTS["agent_ops"]))]
    ops += [_proxy_op(rng, horizon) for _ in range(rng.randint(*WEIGHTS["proxy_ops"]))]
    if rng.random() < WEIGHTS["process_op"]:
        at = round(rng.uniform(0.5, horizon), 2)
        kind = rng.choice(("stop", "kill"))
        ops.append(Op(at_s=at, heal_s=round(at + rng.uniform(1, 5), 2), injector="process", kind=kind,
                      role=rng.choice(("prefill", "decode"))))
    # from a stream of its own (the scenario's seed): added after the others, it leaves every other draw a
    # seed makes as it was, so a corpus and the searches measured before it draw the same scenarios
    orng = random.Random(seed * 7919 + 17)
    if orng.random() < WEIGHTS["on_op"]:
        ops += _on_ops(orng, rids, len(ops))
    for i, op in enumerate(list(ops)):  # abort some requests a hold or park has parked
        if op.kind in ("hold", "park") and op.target and "rid" in op.target and rng.random() < WEIGHTS["abort_held"]:
            # armed before the traffic and never healed, as the abort suites do it: armed later (or healed
            # early), the hold missed its request and the abort waiting on it was skipped. 13 of the final
            # 30-minute guided search's 42 runs on 0.5.23 carried such an abort and one sent it (fz00009's
            # park was armed at 11.1 s, its request sent at 4.8 s)
            op.at_s, op.heal_s = 0.0, None
            ops.append(Op(at_s=0.0, injector="action", kind="abort", rids=[op.target["rid"]], after=i))
    return ops


def _on_ops(rng: random.Random, rids: list[str], first: int) -> list[Op]:
    """An op set off by one request's own event (:data:`ON_EVENTS`), some delay after it: the abort of
    that request, or a stop or kill of a role healed 1-5 s later by a ``heal`` action (a stopped role
    continued, a killed one restarted). The suites' own choreography: abort at a stage, kill decode
    once a transfer started, freeze it. ``first``: the index the first op gets."""
    rid = rng.choice(rids)
    role, ev = rng.choice(ON_EVENTS)
    on = {"role": role, "ev": ev, "rid": rid}
    delay = rng.choice((0.0, 0.05, 0.3))
    if rng.random() < 0.75:
        return [Op(at_s=0.0, injector="action", kind="abort", rids=[rid], on=on, delay_s=delay)]
    kind = rng.choice(("stop", "kill"))
    op = Op(at_s=0.0, injector="process", kind=kind, role=rng.choice(("prefill", "decode")), on=on, delay_s=delay)
    return [op, Op(at_s=0.0, injector="action", kind="heal", after=first, delay_s=round(rng.uniform(1, 5), 2))]


def generate(rng: random.Random, base: Base, name: str, restart_p: float | None = None) -> Scenario:
    """A whole scenario drawn from the grammar."""
    seed = rng.randrange(1, 2**31)
    dep = _knobs(rng, base, WEIGHTS["restart_knob"] if restart_p is None else restart_p, WEIGHTS["live_knob"])
    traffic = _traffic(rng, base, dep, seed)
    nemesis = [] if rng.random() < WEIGHTS["quiet"] else _nemesis(rng, traffic, seed)
    sc = Scenario(name=name, seed=seed, deployment=dep, traffic=traffic, nemesis=nemesis,
                  checks=default_checks(traffic, dep), origin={"by": "generate"})
    return sc.validate()


def baseline(rng: random.Random, base: Base, name: str) -> Scenario:
    """The steady state a search starts from (Chaos Toolkit's hypothesis; AFL's seed input): a drawn
    scenario's ordinary traffic on the base deployment, with no nemesis op, no live knob, no client that
    aborts or disconnects, and none of the prompts probing the limits' bands (nor what waits on them).
    What the engines do here is what they do with nothing broken; its run must be powered, or no later run
    can see a leak either. (A client's cut is a fault of its own: on 0.5.19 one wedges the PD pipeline,
    and a 10-minute search whose steady state drew four lost five minutes of its budget to it.)"""
    sc = generate(rng, base, name, restart_p=0.0)
    gone = set()
    for p in sc.traffic.plans:  # in order: a plan waits only on one before it (_fix_order)
        if p.get("extra", {}).get("probe") or p.get("after") in gone or p.get("kind") in CLIENT_CUTS:
            gone.add(p["rid"])
    sc.traffic.plans = [p for p in sc.traffic.plans if p["rid"] not in gone]
    sc.nemesis = []
    sc.deployment = Deployment(dict(base.restart), {})
    sc.checks = default_checks(sc.traffic, sc.deployment)
    sc.origin = {"by": "baseline"}
    return sc.validate()


def default_checks(traffic: Traffic, dep: Deployment | None = None) -> list[dict]:
    """Every oracle that needs nothing but the log (the policy adds the leak checkers that always run).
    ``http_semantics`` (a prompt past prefill's limit gets a 4xx) not where ``dep`` runs
    ``--allow-auto-truncate``: there SGLang truncates such a prompt and answers it by design, and a leak
    that truncation lets through is isolation's to see (``sglang-auto-truncate-stale-pages``). Both 30-minute
    guided searches on 0.5.23 (pairs 5 and 6) confirmed and shrank that 200 as NEW ``6612e1693fc0``, eight
    runs each."""
    bound = traffic.timeout_s + 5
    truncates = bool(dep is not None and dep.restart.get("allow_auto_truncate"))
    out = [{"name": "isolation"}] + ([] if truncates else [{"name": "http_semantics"}]) + \
        [{"name": "liveness", "bound_s": bound}, {"name": "kv_lifecycle"}, {"name": "abort_semantics"}]
    if any(p.get("cache_salt") for p in traffic.plans):  # salted tenants sharing prefixes: whose cache hit whom
        out.append({"name": "cache_isolation"})
    return out


# ------------------------------------------------------------------ mutation
def mutate(rng: random.Random, sc: Scenario, base: Base, name: str) -> Scenario:
    """One change to ``sc``: a knob, an op's parameter or time, an op added or dropped, the traffic
    redrawn in part, rarely a restart knob."""
    new = Scenario.from_dict(copy.deepcopy(sc.to_dict()))
    how = rng.choices(list(MUTATORS), list(MUTATORS.values()))[0]
    if how in ("op_param", "op_time", "drop_op") and not new.nemesis:
        how = "add_op"
    new.name, new.origin = name, {"by": "mutate", "parent": sc.digest(), "how": how}
    if how == "knob":
        k = rng.choice(list(LIVE_KNOBS))
        if k in new.deployment.live and rng.random() < 0.4:
            del new.deployment.live[k]
        else:
            new.deployment.live[k] = _knobs(random.Random(rng.random()), base, 0.0, 1.0).live[k]
        _relabel(new, base)  # a limit moved: what each prompt gets moved with it
        if base.moved(new.deployment) - base.moved(sc.deployment):
            # a limit moved to where none was: probe it there (Base.probe_sizes puts its bands first), as a
            # drawn scenario does. Without probes the move changes nothing the traffic reaches: a 0.5.19
            # search (2026-12-05, seed 3) lowered prefill's limit to 1024 on its steady state twice, opening
            # the GLM-5.3 reject path's window, and sent no prompt into it
            _add_probes(rng, new, base, k=rng.choice((2, 3)))
    elif how == "restart_knob":
        rebase(new, base, _knobs(rng, base, 1.0, 0.0).restart)
        edges = base.cuts(new.deployment) - base.cuts(sc.deployment)
        if edges:
            # limits a new deployment moved are probed there, as the live knobs' are: the sixth 30-minute
            # guided search on 0.5.23 found auto-truncate's stale pages only from a scenario that reached
            # the truncation band, and the final one moved prefill's pool under decode's (1024 of 2048)
            # with --allow-auto-truncate and sent that deployment nothing but its parent's probes (2047,
            # 2048, 5733 tokens), past every band it had opened
            _add_probes(rng, new, base, k=rng.choice((2, 3)), edges=edges)
    elif how == "op_param":
        i = rng.randrange(len(new.nemesis))
        op = new.nemesis[i]
        rids = [p["rid"] for p in new.traffic.plans]
        if op.injector == "agent":
            new.nemesis[i] = _keep_links(op, _agent_op(rng, rids, sorted({p["tenant"] for p in new.traffic.plans}), 10.0))
        elif op.injector == "proxy":
            new.nemesis[i] = _keep_time(op, _proxy_op(rng, 10.0))
    elif how == "op_time":
        op = new.nemesis[rng.randrange(len(new.nemesis))]
        op.at_s = round(max(0.0, op.at_s * rng.choice((0.0, 0.5, 2.0)) + rng.uniform(0, 1)), 2)
        if op.heal_s is not None and op.heal_s <= op.at_s:
            op.heal_s = round(op.at_s + 1.0, 2)
    elif how == "drop_op":
        _drop(new, rng.randrange(len(new.nemesis)))
    elif how == "probe":
        _add_probes(rng, new, base)
    elif how == "add_op":
        _cap(rng, new, room=1)
        new.nemesis.append(_agent_op(rng, [p["rid"] for p in new.traffic.plans],
                                     sorted({p["tenant"] for p in new.traffic.plans}), 10.0))
    else:  # traffic: redraw it, keeping the ops whose targets survive
        # a fresh seed: the same seed would mint the same request ids for other prompts and canaries, and
        # a page left by one would name the other's owner
        new.seed = rng.randrange(1, 2**31)
        t = _traffic(rng, base, new.deployment, new.seed)
        keep = {p["rid"] for p in t.plans}
        new.traffic = t
        new.nemesis = [o for o in new.nemesis if not _names_missing(o, keep)]
        _reindex(new)
        new.checks = default_checks(t, new.deployment)
    return new.validate()


# ops that cannot hold a request by themselves: each delays, fails or shortens one step and lets it go on
BOUNDED_OPS = ("delay", "fail", "short", "latency")


def traits(plan: dict, base: Base, dep: Deployment) -> set[str]:
    """The traffic traits a wedge is blamed on (:func:`wedge_traits`): ``cut`` (the client aborts or
    disconnects), ``past_decode_edge`` (longer than decode's admission edge, pool − reservation: decode
    can never pre-allocate it), ``refused_within_decode_edge`` (prefill's limit refuses it, decode would
    admit it: the reject path's window)."""
    pool, _ppool, _ctx, res, lim = base.limits(dep)
    n = plan.get("n_tokens") or 0
    out = {"cut"} if plan.get("kind") in CLIENT_CUTS else set()
    if n > pool - res:
        out.add("past_decode_edge")
    elif n >= lim:
        out.add("refused_within_decode_edge")
    return out


def wedge_traits(sc: Scenario, events: list[dict], base: Base) -> set[str]:
    """What a run that wedged the cluster (the driver's ``stall`` record) is blamed on: the first request
    that then hung (timed out), where it has a trait of its own; else the traits of the requests sent no
    later than it, except those answered (a prompt that got its reply did not wedge the pipeline: on
    0.5.19 the reject path's window answers HTTP 200, and blaming it for the cuts sent beside it would
    keep the search out of that window). Empty when it did not stall, or when the run carried an op
    that can hold requests by itself (anything but :data:`BOUNDED_OPS`: a hold, a park, a stalled status
    read, a process stopped or killed, a toxic other than latency): the fault explains the wedge as well
    as the traffic (a first guided search on 0.5.23 blamed a run of six ops on its cuts, which do not
    wedge that release)."""
    if not any(e.get("ev") == "stall" for e in events) or any(o.kind not in BOUNDED_OPS for o in sc.nemesis):
        return set()
    sends = {e["rid"]: e.get("wall", 0.0) for e in events if e.get("ev") == "send" and e.get("rid")}
    ends = {e["rid"]: e.get("outcome") for e in events if e.get("ev") == "end" and e.get("rid")}
    hung = [sends[r] for r, o in ends.items() if o == "timeout" and r in sends]
    if not hung:
        return set()
    first = min(hung)
    # the first request that hung, if it has a trait of its own, is the likelier culprit than a cut sent
    # before it (a cut never gets an answer, by design): on 0.5.23 a prompt in the reject window hangs
    # and the cuts sent before it do not wedge; on 0.5.19 a cut does, and what hung first is plain
    hung_itself = set()
    for p in sc.traffic.plans:
        if ends.get(p["rid"]) == "timeout" and sends.get(p["rid"]) == first:
            hung_itself |= traits(p, base, sc.deployment) - {"cut"}
    if hung_itself:
        return hung_itself
    out = set()
    for p in sc.traffic.plans:
        if p["rid"] in sends and sends[p["rid"]] <= first and ends.get(p["rid"]) not in ("ok", "http_error"):
            out |= traits(p, base, sc.deployment)
    return out


def avoid(sc: Scenario, base: Base, wedges: set[str]) -> Scenario:
    """``sc`` without the traits that already wedged this search's cluster: a cut becomes the same
    request with no cut, a prompt with another such trait is dropped (and what waits on it). Each wedge
    costs a cluster restart and hides the rest of its run, and one already seen shows nothing new
    (AFL keeps a hang once). ``origin["avoided"]`` says what was taken out."""
    if not wedges:
        return sc
    gone, cut = set(), 0
    for p in sc.traffic.plans:  # in order: a plan waits only on one before it
        t = traits(p, base, sc.deployment) & wedges
        if p.get("after") in gone or t - {"cut"}:
            gone.add(p["rid"])
        elif "cut" in t:
            p["kind"], cut = "plain", cut + 1
            p.pop("abort_after_ms", None)
    if not gone and not cut:
        return sc
    sc.traffic.plans = [p for p in sc.traffic.plans if p["rid"] not in gone]
    targets = {p["rid"] for p in sc.traffic.plans}
    while (i := next((i for i, o in enumerate(sc.nemesis) if _names_missing(o, targets)), None)) is not None:
        _drop(sc, i)  # an op aimed at a dropped request (and what waits on it)
    sc.origin = {**sc.origin, "avoided": sorted(wedges)}
    return _relabel(sc, base)


def rebase(sc: Scenario, base: Base, restart: dict) -> Scenario:
    """``sc`` on another deployment's restart knobs (its live knobs kept): every plan is labelled again
    with what that deployment's limits say it gets, so a prompt the new limits refuse is judged as
    oversized and one they admit is not."""
    sc.deployment = Deployment(dict(restart), sc.deployment.live)
    return _relabel(sc, base)


def _relabel(sc: Scenario, base: Base) -> Scenario:
    """Every plan labelled again with what ``sc``'s deployment's limits say it gets."""
    _label_plans(sc.traffic.plans, base, sc.deployment)
    sc.checks = default_checks(sc.traffic, sc.deployment)
    return sc.validate()


def _label_plans(plans: list[dict], base: Base, dep: Deployment) -> list[dict]:
    """Label each plan (in place) with what ``dep``'s limits say it gets: ``extra.probe`` where that is
    not an answer (a probe keeps its label, "answer" included), ``oversized`` where prefill's limit
    refuses it and the client waits for the answer (a plan the client cuts is judged by no rejection
    rule: it keeps its label only)."""
    for p in plans:
        label = base.expect(p["n_tokens"], dep) if p.get("n_tokens") else "answer"
        extra = dict(p.get("extra") or {})
        if label != "answer" or "probe" in extra:
            extra["probe"] = label
        p["extra"] = extra
        p["oversized"] = label == "reject" and p.get("kind", "plain") in ("plain", "stream", "oversized")
    return plans


def _add_probes(rng: random.Random, sc: Scenario, base: Base, k: int | None = None,
                edges: set[int] | None = None) -> None:
    """AFL's interesting values for this search: 1-3 prompts into the bands the scenario's deployment cuts
    (:meth:`Base.probe_sizes`), from one of its tenants (with that tenant's salt), put among the
    traffic as it is, so the earlier traffic that fills the pages stays."""
    tenants = sorted({p["tenant"] for p in sc.traffic.plans})
    victim = rng.choice(tenants)
    salt = next((p.get("cache_salt") for p in sc.traffic.plans if p["tenant"] == victim), None)
    seed = rng.randrange(1, 2**31)  # its own rids and canaries: none of the scenario's are reused
    wl = Workload(seed, n_tenants=int(max(tenants)[1:]) + 1, prefix=f"fz{seed % 100000}-", page_size=base.page_size)
    probes = _probes(rng, wl, wl.tenant(victim), base, sc.deployment, k=k or rng.choice((1, 2, 3)), edges=edges)
    for p in probes:
        p.cache_salt = salt
    _place(rng, sc.traffic.plans, [plan_dict(p) for p in probes], lambda p: p["n_tokens"])
    sc.checks = default_checks(sc.traffic, sc.deployment)


def _place(rng: random.Random, plans: list, probes: list, size) -> None:
    """Put ``probes`` among ``plans`` at random places, the shorter probes first: a prompt past decode's
    admission edge can wedge a release's PD pipeline (0.5.19: decode's FIFO pre-allocation waits for it
    forever) and hide every band probe sent after it, so the band a wedge would hide is sent first (a
    0.5.19 search, 2026-12-05: the GLM-5.3 window's 1025-token probe was never sent, behind a 1793)."""
    at = sorted(rng.randrange(len(plans) + 1) for _ in probes)
    for i, (pos, p) in enumerate(zip(at, sorted(probes, key=size))):
        plans.insert(pos + i, p)


def _probes(rng: random.Random, wl: Workload, tenant, base: Base, dep: Deployment, k: int,
            edges: set[int] | None = None) -> list:
    """``k`` plans of ``tenant`` into the bands ``dep``'s limits cut, each labelled with what the limits
    say it gets (``oversized`` where prefill's limit refuses it)."""
    out = []
    for size in base.probe_sizes(rng, dep, k=k, edges=edges):
        label = base.expect(size, dep)
        p = wl.request(tenant, "oversized" if label == "reject" else "plain", n_tokens=size, n_canaries=3)
        p.extra["probe"] = label
        out.append(p)
    return out


def _keep_links(old: Op, new: Op) -> Op:
    new.at_s, new.heal_s = old.at_s, old.heal_s
    if old.kind in ("hold", "park") and new.kind not in ("hold", "park"):
        return old  # an abort waits on this op: keep its kind
    return new


def _keep_time(old: Op, new: Op) -> Op:
    new.at_s, new.heal_s = old.at_s, old.heal_s
    return new


def _names_missing(op: Op, rids: set) -> bool:
    return any(r not in rids for r in op.named_rids())


def _drop(sc: Scenario, i: int) -> None:
    """Remove op ``i`` and every op that waits for it; the rest keep pointing at the same ops."""
    gone = {i} | {j for j, o in enumerate(sc.nemesis) if o.after == i or (o.on or {}).get("op") == i}
    sc.nemesis = [o if j not in gone else None for j, o in enumerate(sc.nemesis)]
    _reindex(sc)


def _reindex(sc: Scenario) -> None:
    """Drop ``None`` entries and the ops that wait on a dropped one; renumber the rest and the plans' gates
    (a plan gated on a dropped op is sent without waiting)."""
    keep = {j for j, o in enumerate(sc.nemesis) if o is not None}
    sc.nemesis, sc.traffic.gates = kept_ops(sc.nemesis, keep, None, sc.traffic.gates)


def splice(rng: random.Random, a: Scenario, b: Scenario, name: str) -> Scenario:
    """``a``'s deployment and traffic with ``b``'s agent and proxy ops retargeted onto ``a``'s requests,
    within :data:`MAX_OPS` (:func:`_cap`)."""
    new = Scenario.from_dict(copy.deepcopy(a.to_dict()))
    new.name, new.origin = name, {"by": "splice", "parents": [a.digest(), b.digest()]}
    rids = [p["rid"] for p in new.traffic.plans]
    tenants = sorted({p["tenant"] for p in new.traffic.plans})
    ops = [o for o in b.nemesis if o.injector in ("agent", "proxy") and not o.mutation and o.kind not in AGENT_MUTATIONS]
    if len(ops) > MAX_OPS // 2:  # half the room at most: the spliced scenario stays ``a``'s as much as ``b``'s
        ops = rng.sample(ops, MAX_OPS // 2)
    _cap(rng, new, room=len(ops))
    for o in ops:
        o = copy.deepcopy(o)
        o.after = None  # b's ops it waited on are not spliced (aborts are not), nor at those places
        if o.target and "rid" in o.target:
            o.target = {"rid": rng.choice(rids)}
        elif o.target and "tenant" in o.target:
            o.target = {"tenant": rng.choice(tenants)}
        new.nemesis.append(o)
    return new.validate()


def _cap(rng: random.Random, sc: Scenario, room: int) -> None:
    """Drop ``sc``'s ops at random (with what waits on them) until ``room`` more fit within
    :data:`MAX_OPS`."""
    while sc.nemesis and len(sc.nemesis) + room > MAX_OPS:
        _drop(sc, rng.randrange(len(sc.nemesis)))
