"""Leak classes by what the client's bytes look like: a complete body, a stream (whole or with the
foreign payload split between events), a stream cut mid-line, bytes after ``[DONE]`` or after a
malformed line, and a reply the client aborted, left at the headers or timed out on."""

from __future__ import annotations

from hypothesis import strategies as st

from kvchaos.workload.plan import RequestPlan

from .logs import Req
from .replay import Wire
from .replies import TIMEOUT_S, complete_body, pieces, recite, sse_events
from .scenario import Scenario, _Ctx, _leak_draw, builder, owner_kinds, reply_wire, splits

# ----------------------------------------------------------------- the classes
@st.composite
def complete_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params["endpoint"], params["owner"] = label.split("/")
    return Scenario(cls, label, params)


@builder("complete-generate")
@builder("complete-openai")
@builder("checkers-liveness")
def _b_complete(sc, leak):
    cx = _Ctx(sc, leak)
    _, p, text = cx.victim(sc.params["owner"], sc.params["endpoint"], "plain")
    return cx.place(Req(p, reply_wire(cx.m, p, text, "complete")), sc.params["owner"])


@st.composite
def stream_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params["endpoint"], params["owner"] = label.split("/")
    params["split"] = draw(splits)
    return Scenario(cls, label, params)


@builder("stream-generate")
@builder("stream-openai-split")
def _b_stream(sc, leak):
    cx = _Ctx(sc, leak)
    f, p, text = cx.victim(sc.params["owner"], sc.params["endpoint"], "stream")
    at = text.index(cx.show(f)[1:-1]) + sc.params["split"]  # a chunk boundary inside the foreign payload
    return cx.place(Req(p, reply_wire(cx.m, p, text, "stream", must_cut=[at])), sc.params["owner"])


def _stream_bytes(cx: _Ctx, p: RequestPlan, text: str, split_at=None, finish="stop", done=True) -> list[bytes]:
    return sse_events(p.endpoint, p.rid, pieces(text, cx.m.rng, [split_at] if split_at is not None else []),
                      p.n_tokens, finish, done)


@st.composite
def cut_leak(draw, cls, variant=None):
    v, params = _leak_draw(draw, cls, variant)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    return Scenario(cls, v, params)


@builder("stream-cut-mid-line")
def _b_cut(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    ep = "generate" if v.startswith("generate") or v == "complete-body-cut" else sc.params["endpoint"]
    f, p, text = cx.victim(owner, ep, "plain" if v == "complete-body-cut" else "stream")
    fpay = cx.show(f)[1:-1]
    fend = text.index(fpay) + len(fpay) + 1  # just after the foreign canary's "]"
    if v == "complete-body-cut":  # the JSON body cut after the leaked text
        body = complete_body(ep, p.rid, text, p.n_tokens)
        at = body.index(fpay.encode()) + len(fpay) + 1
        w = Wire(200, body[:at + 3], "cut", cx.m.lat())
    elif v == "reset-after-chunk":  # whole events, then the connection reset (no line cut)
        evs = _stream_bytes(cx, p, text[:fend], finish=None, done=False)
        w = Wire(200, b"".join(evs), "cut", cx.m.lat())
    else:
        if v == "openai-split-into-cut-line":  # first part in the last whole event, the rest in the cut line
            split = text.index(fpay) + sc.params["split"]
            evs = sse_events(ep, p.rid, [text[:split], text[split:fend]], p.n_tokens, None, False)
        elif v in ("generate-chunk-before-cut",):  # the foreign canary in a whole event, a later line cut
            evs = sse_events(ep, p.rid, [text[:fend], text[fend:fend + 4] or "x"], p.n_tokens, None, False)
        else:  # the foreign canary only in the cut line
            evs = sse_events(ep, p.rid, [text[:text.index(fpay)], text[text.index(fpay):fend]], p.n_tokens, None, False)
        last = evs[-1]
        if v == "generate-chunk-before-cut":
            tail = last[:-6]
        else:  # the line ends just after the foreign canary's closing bracket and one more byte
            rest = (fpay[sc.params["split"]:] if v == "openai-split-into-cut-line" else fpay).encode()
            tail = last[:last.index(rest) + len(rest) + 2]
        w = Wire(200, b"".join(evs[:-1]) + tail, "eof" if sc.params["seed"] % 2 else "cut", cx.m.lat())
    return cx.place(Req(p, w), owner)


@st.composite
def after_done_leak(draw, cls, variant=None):
    v, params = _leak_draw(draw, cls, variant)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    if cls == "stream-after-malformed-line":
        params["malformed_kind"] = draw(st.sampled_from(tuple(MALFORMED_LINES)))
    return Scenario(cls, v, params)


def _trailing_events(cx, p_ep, rid, n_tokens, f_text, variant, split):
    """Events of the reply that arrives after the victim's own (keep-alive desync, interleaving): the
    owner's recitation carrying the foreign canary — split across two events, or whole."""
    if variant == "generate-cumulative":
        return sse_events("generate", rid, [f_text[:split], f_text[split:]], n_tokens)
    if variant == "openai-whole":
        return sse_events(p_ep, rid, [f_text], n_tokens)
    return sse_events(p_ep, rid, [f_text[:split], f_text[split:]], n_tokens)


def _after_own(sc, leak, own):
    """The victim's own stream (``own(cx, p)``: its events, and the part of its recitation still to come),
    then the owner's recitation carrying the foreign canary: in the victim's stream, or a whole other reply."""
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    ep = "generate" if v == "generate-cumulative" else sc.params["endpoint"]
    p = cx.m.plan(ep, "stream")
    head, rest = own(cx, p)
    f_text = cx.show(f)[1:-1] + "]["
    if v == "another-reply":  # a whole other reply (its own JSON events) follows
        trail = sse_events(ep, "other", pieces(f_text, cx.m.rng, [sc.params["split"]]), 77)
    else:
        trail = _trailing_events(cx, ep, p.rid, p.n_tokens, rest + f_text, v, len(rest) + sc.params["split"])
    return cx.place(Req(p, Wire(200, b"".join(head + trail), "eof", cx.m.lat())), owner)


@builder("stream-after-done")
def _b_after_done(sc, leak):
    def own(cx, p):  # the victim's own complete stream, to [DONE]
        return _stream_bytes(cx, p, recite(p.canaries)), ""

    return _after_own(sc, leak, own)


MALFORMED_LINES = {"html": b"data: <html><body>502 Bad Gateway</body></html>\n\n", "number": b"data: 42\n\n",
                   "cut-json": b'data: {"text": "the of and\n\n', "array": b'data: ["x"]\n\n'}


@builder("stream-after-malformed-line")
def _b_malformed(sc, leak):
    def own(cx, p):  # the first half of the victim's own stream, then a line that is not a JSON object
        text = recite(p.canaries)
        k = max(1, len(text) // 2)
        head = sse_events(p.endpoint, p.rid, pieces(text[:k], cx.m.rng), p.n_tokens, None, False)
        return head + [MALFORMED_LINES[sc.params["malformed_kind"]]], text[k:]

    return _after_own(sc, leak, own)


@st.composite
def after_malformed_leak(draw, cls, variant=None):
    return draw(after_done_leak(cls, variant))


@st.composite
def abort_leak(draw, cls, variant=None):
    v, params = _leak_draw(draw, cls, variant)
    params.update(variant=v, endpoint=draw(st.sampled_from(("completions", "chat"))), split=draw(splits),
                  owner=draw(owner_kinds))
    # a timeout is a liveness FAIL by itself: each one comes with decode SIGKILLed, so the timeouts are the
    # accepted known finding sglang-decode-death-unanswered and only the leak can make the log red
    return Scenario(cls, v, params, accept_known=(cls == "timeout"))


@builder("aborted")
@builder("disconnected")
@builder("timeout")
def _b_abort(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    ep = "generate" if v.startswith("generate") or v == "complete-body-partial" else sc.params["endpoint"]
    kind = {"aborted": "abort_after", "disconnected": "disconnect_before_first_token"}.get(sc.cls, "stream")
    if v == "complete-body-partial":
        kind = "plain"
    f, p, text = cx.victim(owner, ep, kind)
    fpay = cx.show(f)[1:-1]
    i = text.index(fpay)
    fend = i + len(fpay) + 1
    end = {"aborted": "abort", "disconnected": "disconnect"}.get(sc.cls, "timeout")
    faults, agents = [], []
    if v == "no-response-yet":  # aborted before the headers: the reply the client saw is nothing ...
        w = Wire(None, b"", "abort", cx.m.lat(), after_ms=p.abort_after_ms)
        cx.insert(sc.params["at"], Req(p, w))
        # ... so the leak is in another request's reply: an aborted stream of the same log
        q = cx.victim_plan(ep, "abort_after", f)
        t2 = cx.displaced(q, f)
        evs = sse_events(ep, q.rid, pieces(t2[:t2.index(fpay) + len(fpay) + 1], cx.m.rng), q.n_tokens, None, False)
        cx.insert(sc.params["at"] + 1, Req(q, Wire(200, b"".join(evs), "abort", cx.m.lat(), after_ms=q.abort_after_ms)))
        return cx.logs(owner)
    if v == "complete-body-partial":
        body = complete_body(ep, p.rid, text, p.n_tokens)
        w = Wire(200, body[:body.index(fpay.encode()) + len(fpay) + 4], end, 60.0 + cx.m.lat())
    elif "split" in v:  # the foreign payload split between a whole event and the partial line after it
        split = i + sc.params["split"]
        evs = sse_events(ep, p.rid, [text[:split], text[split:fend]], p.n_tokens, None, False)
        if sc.cls == "disconnected":
            body = b"".join(evs)
        else:
            body = b"".join(evs[:-1]) + evs[-1][:evs[-1].index(text[split:fend].encode()) + (fend - split) + 2]
        w = Wire(200, body, end, cx.m.lat(), after_ms=p.abort_after_ms)
    else:
        evs = sse_events(ep, p.rid, pieces(text[:fend], cx.m.rng), p.n_tokens, None, False)
        if sc.cls == "disconnected":
            evs = sse_events(ep, p.rid, [text[:fend]], p.n_tokens, None, False)
        w = Wire(200, b"".join(evs), end, cx.m.lat(), after_ms=p.abort_after_ms)
    if sc.cls == "timeout":
        w.latency_s = TIMEOUT_S + 5 + cx.m.lat()
    at = sc.params["at"]
    if sc.cls == "timeout":  # decode SIGKILLed: the timeouts are sglang-decode-death-unanswered
        faults.append({"injector": "process", "action": "fired", "kind": "sigkill", "role": "decode",
                       "pids": [4242], "at": ("sent", p.rid), "survivors": []})
        at = min(at, 15)  # early enough that the requests after the kill are many (the kill's power)
    cx.insert(at, Req(p, w))
    return cx.logs(owner, faults=faults, agents=agents)
