"""Plans and clean replies: a log's plans (:class:`Mint`), the complete reply reciting a plan's own
canaries in either delivery, and the noise — requests that did not complete normally, or were
rejected, with nothing foreign in them."""

from __future__ import annotations

import random

from kvchaos import canary
from kvchaos.probe import max_new_tokens, prompt as probe_prompt
from kvchaos.workload.plan import RequestPlan

from .logs import Req
from .replay import Wire
from .replies import ERROR_SHAPES, ERROR_STATUSES, complete_body, error_body, pieces, recite, sse_events

# --------------------------------------------------------------------------- building plans and clean replies
class Mint:
    """Plans of one log: rids ``<prefix>7-<n>-<tenant>``, probe prompts with the plan's canaries."""

    def __init__(self, name: str, seed: int):
        self.rng = random.Random(f"{name}/{seed}")
        self.prefix = name[:3]
        self.n = 0

    def plan(self, endpoint="generate", kind="plain", ncan=3, canaries=None, expect_echo=True, tenant=None,
             oversized=False, n_tokens=None) -> RequestPlan:
        self.n += 1
        tenant = tenant or f"t{self.rng.randrange(8):03d}"
        cs = list(canaries) if canaries is not None else canary.mint(self.rng, ncan)
        need = sum(len(c) + 2 for c in cs) + 1 + 24
        n = max(n_tokens or self.rng.randrange(64, 160), need)
        text = probe_prompt(self.rng, n, cs)
        return RequestPlan(rid=f"{self.prefix}7-{self.n:06d}-{tenant}", tenant=tenant, kind=kind, endpoint=endpoint,
                           prompt=text, canaries=cs, n_tokens=len(text), max_new_tokens=max_new_tokens(len(cs)),
                           abort_after_ms=(self.rng.uniform(5, 200) if kind == "abort_after" else None),
                           expect_echo=expect_echo, oversized=oversized)

    def lat(self) -> float:
        return round(self.rng.uniform(0.05, 2.5), 4)


def reply_wire(m: Mint, p: RequestPlan, text: str, delivery: str, finish: str = "stop", must_cut=(),
               meta_extra=None) -> Wire:
    """A complete 200 reply with ``text``: one JSON body, or an SSE stream to ``[DONE]``."""
    if delivery == "complete":
        return Wire(200, complete_body(p.endpoint, p.rid, text, p.n_tokens, finish, meta_extra), "eof", m.lat())
    evs = sse_events(p.endpoint, p.rid, pieces(text, m.rng, must_cut), p.n_tokens, finish)
    return Wire(200, b"".join(evs), "eof", m.lat())


DELIVERIES = ("complete", "stream")
PLAN_KIND = {"complete": "plain", "stream": "stream"}  # the plan kind of a delivery


def clean_request(m: Mint, endpoint: str, delivery: str, ncan: int) -> Req:
    p = m.plan(endpoint, PLAN_KIND[delivery], ncan)
    return Req(p, reply_wire(m, p, recite(p.canaries), delivery))


NOISE = ("http_error", "cut", "aborted", "disconnected", "malformed", "after_done", "oversized", "leg_error")


def noise_request(m: Mint, what: str, endpoint: str, pd: bool) -> Req:
    """A request that did not complete normally, or was rejected — with nothing foreign in it."""
    rng = m.rng
    if pd:
        endpoint = "generate"
    if what == "http_error":
        status = rng.choice(ERROR_STATUSES)
        p = m.plan(endpoint, rng.choice(("plain", "stream")))
        msg = rng.choice(("Service Unavailable: the server is overloaded", "upstream request timeout",
                          "Internal server error: KV transfer failed", "Too many requests in the queue"))
        return Req(p, Wire(status, error_body(rng.choice(ERROR_SHAPES), status, msg), "eof", m.lat(),
                           leg=(status, msg, "early") if pd else None))
    if what == "oversized":
        p = m.plan(endpoint, "oversized", n_tokens=2100, oversized=True)
        msg = "The input (2100 tokens) is longer than the model's context length (2048 tokens)."
        return Req(p, Wire(400, error_body("sglang", 400, msg), "eof", m.lat(),
                           leg=(400, msg, "early") if pd else None))
    if what == "leg_error":  # pd_direct only: prefill's half failed, decode answered an error
        p = m.plan(endpoint, "plain")
        return Req(p, Wire(500, error_body("sglang", 500, "Decode transfer failed"), "eof", m.lat(),
                           leg=(500, "Internal Server Error", rng.choice(("early", "late")))))
    if what in ("cut", "aborted"):
        kind = "abort_after" if what == "aborted" else rng.choice(("plain", "stream"))
        p = m.plan(endpoint, kind)
        text = recite(p.canaries)
        stop = rng.randrange(1, len(text))
        if kind == "plain":
            body = complete_body(p.endpoint, p.rid, text, p.n_tokens)
            body = body[:rng.randrange(1, len(body))]
        else:
            evs = sse_events(p.endpoint, p.rid, pieces(text[:stop], rng), p.n_tokens, finish=None, done=False)
            body = b"".join(evs)
            if what == "cut" and rng.random() < 0.5:
                body = body[:-rng.randrange(3, 12)]  # cut mid-line
        return Req(p, Wire(200, body, "cut" if what == "cut" else "abort", m.lat(),
                           after_ms=p.abort_after_ms, leg=(200, None, "late") if pd else None))
    if what == "disconnected":
        p = m.plan(endpoint, "disconnect_before_first_token")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        body = b"".join(evs[:rng.randrange(0, 2)])
        return Req(p, Wire(200, body, "disconnect", m.lat(), leg=(200, None, "late") if pd else None))
    if what == "malformed":
        p = m.plan(endpoint, "stream")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        k = rng.randrange(0, len(evs))
        bad = rng.choice((b"data: <html>502 bad gateway</html>\n\n", b"data: 42\n\n", b'data: {"text": "ab\n\n'))
        return Req(p, Wire(200, b"".join(evs[:k] + [bad] + evs[k:]), "eof", m.lat(),
                           leg=(200, None, "late") if pd else None))
    if what == "after_done":  # a complete stream, then bytes after [DONE] (its own last event again)
        p = m.plan(endpoint, "stream")
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text, rng), p.n_tokens)
        return Req(p, Wire(200, b"".join(evs + [evs[-2], b": keep-alive\n\n"]), "eof", m.lat(),
                           leg=(200, None, "late") if pd else None))
    raise AssertionError(what)
