"""Synthetic event logs of prefix-cache runs (what the engines report of each request) for the
cache_isolation / timing_isolation checker tests and the router finding's policy tests."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from kvchaos import canary
from kvchaos.oracles import Verdict, cache_isolation
from kvchaos.policy import Context, Policy

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
