"""Leak classes about accepted known findings (a short transfer's stale pages: a blind model still
shows the canary; the owner sent after the victim ended) and a canary recited cut short."""

from __future__ import annotations

from hypothesis import strategies as st

from kvchaos import canary
from kvchaos.workload.plan import RequestPlan

from .clean import PLAN_KIND
from .logs import Req
from .replay import Wire
from .replies import pieces, sse_events
from .scenario import Scenario, _Ctx, _label, _leak_draw, builder, reply_wire

# ----------------------------------------------------------------- known-finding shapes
def _short_fault(victim: RequestPlan) -> tuple[list, list]:
    fault = {"action": "armed", "fault": "short-1", "kind": "short", "role": "prefill", "target": {"rid": victim.rid},
             "params": {"pages": 1}, "count": 1, "injector": "agent", "at": ("sent", victim.rid)}
    fired = {"agent_ev": "fault_fired", "wall": ("sent", victim.rid), "seq": 17, "pid": 4242, "role": "prefill",
             "source": "agent", "fault": "short-1", "kind": "short", "room": 4417, "rid": victim.rid, "pages_sent": 1,
             "pages_reserved": victim.n_tokens, "page_size": 1, "dst_pages": [3], "dst_pages_total": 1,
             "dst_page_offset": 0,
             "note": "success reported; remaining decode pages unwritten"}
    return [fault], [fired]


@st.composite
def short_blind_leak(draw, cls, variant=None):
    label = _label(draw, cls, variant)
    params = {"seed": draw(st.integers(0, 2**16)), "n_blind": draw(st.integers(20, 40)),
              "delivery": label, "at": draw(st.integers(1, 40))}
    return Scenario(cls, params["delivery"], params, accept_known=True, twin_green=False)


@builder("short-blind-known")
def _b_short_blind(sc, leak):
    cx = _Ctx(sc, leak)
    for _ in range(sc.params["n_blind"]):  # a model that cannot echo: every reply empty
        p = cx.m.plan("generate", "plain")
        cx.reqs.append(Req(p, reply_wire(cx.m, p, "", "complete")))
    at = min(sc.params["at"], len(cx.reqs))
    f = cx.m.rng.choice([c for r in cx.reqs[:at] for c in r.plan.canaries if c[1] != canary.ALPHABET[-1]])
    cx.planted = f
    p = cx.victim_plan("generate", PLAN_KIND[sc.params["delivery"]], f)
    text = cx.show(f)[1:-1] + "]["  # the short transfer's stale pages: the blind model still shows it
    cx.insert(at, Req(p, reply_wire(cx.m, p, text, sc.params["delivery"])))
    faults, agents = _short_fault(p)
    return cx.logs("log", faults=faults, agents=agents)


@st.composite
def short_after_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(delivery=label, gap=draw(st.integers(0, 5)))
    return Scenario(cls, params["delivery"], params, accept_known=True)


@builder("short-owner-after-victim")
def _b_short_after(sc, leak):
    cx = _Ctx(sc, leak)
    at = min(sc.params["at"], 15)
    # the owner is sent after the victim ended: in a later wave of requests (LogSpec.concurrency 16)
    owner = cx.reqs[(at // 16 + 1) * 16 - 1 + sc.params["gap"]]
    f = next(c for c in owner.plan.canaries if c[1] != canary.ALPHABET[-1])
    cx.planted = f
    p = cx.victim_plan("generate", PLAN_KIND[sc.params["delivery"]], f)
    cx.insert(at, Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])))
    faults, agents = _short_fault(p)
    return cx.logs("log", faults=faults, agents=agents)


# ----------------------------------------------------------------- a canary recited cut short
@st.composite
def cut_short_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(owner=label, how=draw(st.sampled_from(("aborted", "cut"))),
                  endpoint=draw(st.sampled_from(("generate", "completions", "chat"))))
    return Scenario(cls, params["owner"], params)


@builder("cut-short-recital")
def _b_cut_short(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    kind = "abort_after" if sc.params["how"] == "aborted" else "stream"
    f, p, text = cx.victim(owner, sc.params["endpoint"], kind)
    fpay = cx.show(f)[1:-1]
    upto = text.index(fpay) + 9  # nine characters of the foreign payload, no closing bracket
    evs = sse_events(p.endpoint, p.rid, pieces(text[:upto], cx.m.rng, [text.index(fpay)]), p.n_tokens, None, False)
    w = Wire(200, b"".join(evs), "abort" if kind == "abort_after" else "cut", cx.m.lat(), after_ms=p.abort_after_ms)
    return cx.place(Req(p, w), owner)
