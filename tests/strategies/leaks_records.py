"""Leak classes carried by what else a log holds: an HTTP error's body, a body record without ``raw``,
the pd_direct prefill leg's error, another log's canary, nobody's canary, and the malformed-record
shapes (a body record twice, a JSON key twice, a last line cut short)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from kvchaos import canary

from .clean import DELIVERIES, PLAN_KIND, clean_request
from .logs import LogSpec, Req
from .replay import Wire
from .replies import EOS, ERROR_STATUSES, _compact, error_body, ids_of, pieces, recite, sse_events
from .scenario import Scenario, _Ctx, _leak_draw, builder, owner_kinds, reply_wire

@st.composite
def http_error_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    klass, shape = label.split("/")
    params.update(status=draw(st.sampled_from([s for s in ERROR_STATUSES if f"{s // 100}xx" == klass])), shape=shape,
                  endpoint=draw(st.sampled_from(("generate", "completions", "chat"))),
                  kind=draw(st.sampled_from(("plain", "stream"))), owner=draw(owner_kinds))
    return Scenario(cls, label, params)


@builder("http-error")
def _b_http_error(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    sse_error = sc.params["shape"] == "sse-error-event"
    # an error event after HTTP 200 ends the stream "ok" with the reply cut short: not a probe reply to count
    p = cx.m.plan(sc.params["endpoint"], "stream" if sse_error else sc.params["kind"], expect_echo=not sse_error)
    msg = (f"KV transfer failed for bootstrap room 4417: decode read {cx.show(f)} from a page it did not "
           f"receive")
    if sc.params["shape"] == "sse-error-event":  # HTTP 200, then the stream's error event
        text = recite(p.canaries)
        evs = sse_events(p.endpoint, p.rid, pieces(text[:12], cx.m.rng), p.n_tokens, None, False)
        err = b"data: " + _compact({"error": {"message": msg, "type": "InternalServerError",
                                              "code": sc.params["status"]}}) + b"\n\n"
        w = Wire(200, b"".join(evs + [err, b"data: [DONE]\n\n"]), "eof", cx.m.lat())
    else:
        w = Wire(sc.params["status"], error_body(sc.params["shape"], sc.params["status"], msg), "eof", cx.m.lat())
    return cx.place(Req(p, w), owner)


@st.composite
def raw_missing_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    where, raw = label.split("/")
    params.update(variant=where, raw=raw, owner=draw(owner_kinds))
    return Scenario(cls, label, params)


class _NoRaw(LogSpec):
    """A log whose victim's body record lacks ``raw`` (absent or null): an older driver, another tool."""

    victim: str = ""
    how: str = "absent"
    fields: dict = None

    def _write(self, log, path):
        outer = self

        class Strip:
            def emit(self, ev, **f):
                if ev == "body" and f.get("rid") == outer.victim:
                    f.update(outer.fields)
                    if outer.how == "absent":
                        f.pop("raw", None)
                    else:
                        f["raw"] = None
                return log.emit(ev, **f)

            def close(self):
                pass

        super()._write(Strip(), path)


@builder("raw-missing")
def _b_raw_missing(sc, leak):
    cx = _Ctx(sc, leak)
    v, owner = sc.params["variant"], sc.params["owner"]
    f = cx.foreign(owner)
    shown = cx.show(f)
    if v == "text":
        p = cx.victim_plan("generate", "plain", f)
        text = cx.displaced(p, f)
        w, fields = reply_wire(cx.m, p, text, "complete"), {}
    elif v == "meta":  # the stop string that matched: a foreign canary
        p = cx.m.plan("generate", "plain")
        w = reply_wire(cx.m, p, recite(p.canaries), "complete",
                       meta_extra={"finish_reason": {"type": "stop", "matched": shown}})
        fields = {}
    elif v == "output_ids":  # --skip-tokenizer-init: no text, the reply is its token ids
        p = cx.victim_plan("generate", "plain", f, expect_echo=False)
        ids = ids_of(cx.displaced(p, f)) + [EOS]
        body = json.dumps({"text": "", "output_ids": ids, "meta_info": {
            "id": p.rid, "finish_reason": {"type": "stop", "matched": EOS}, "prompt_tokens": p.n_tokens,
            "completion_tokens": len(ids), "cached_tokens": 0}}).encode()
        w, fields = Wire(200, body, "eof", cx.m.lat()), {}
    else:
        p = cx.m.plan("generate", "plain")
        msg = f"KV transfer failed: decode read {shown} from a page it did not receive"
        w, fields = Wire(500, error_body("sglang", 500, msg), "eof", cx.m.lat()), {}
    cx.insert(sc.params["at"], Req(p, w))
    spec = _NoRaw("main", cx.reqs, meta=cx.meta(owner))
    spec.victim, spec.how, spec.fields = p.rid, sc.params["raw"], fields
    out = [spec]
    if cx.other_reqs:
        out.append(LogSpec("other", cx.other_reqs))
    return out


@st.composite
def leg_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(leg_status=draw(st.sampled_from((400, 500, 502, 503))), when=draw(st.sampled_from(("early", "late"))),
                  decode=label.split("-", 1)[1], owner=draw(owner_kinds))
    return Scenario(cls, f"decode-{params['decode']}", params)


@builder("prefill-leg-error")
def _b_leg(sc, leak):
    cx = _Ctx(sc, leak, pd=True)
    for r in cx.reqs:
        r.wire.leg = (200, None, "late")
    owner = sc.params["owner"]
    f = cx.foreign(owner)
    p = cx.m.plan("generate", "plain")
    err = json.dumps({"object": "error", "message": f"Prefill failed: bootstrap room reused, KV of {cx.show(f)} "
                                                      "still queued", "type": "InternalServerError", "param": None,
                      "code": sc.params["leg_status"]})[:500]
    if sc.params["decode"] == "ok":
        w = reply_wire(cx.m, p, recite(p.canaries), "complete")
    else:
        w = Wire(500, error_body("sglang", 500, "Decode transfer failed"), "eof", cx.m.lat())
    w.leg = (sc.params["leg_status"], err, sc.params["when"])
    return cx.place(Req(p, w), owner)


@st.composite
def cross_log_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(endpoint=draw(st.sampled_from(("generate", "completions", "chat"))),
                  delivery=draw(st.sampled_from(DELIVERIES)), order=label)
    return Scenario(cls, params["order"], params)


@builder("cross-log")
def _b_cross(sc, leak):
    cx = _Ctx(sc, leak)
    # log B is a powered clean log of its own; the victim in A recites one of B's canaries
    for _ in range(36):
        cx.other_reqs.append(clean_request(cx.other, "generate", "complete", 3))
    owner = cx.other.rng.choice(cx.other_reqs)
    f = next(c for c in owner.plan.canaries if c[1] != canary.ALPHABET[-1])
    cx.planted = f
    p = cx.victim_plan(sc.params["endpoint"], PLAN_KIND[sc.params["delivery"]], f)
    cx.insert(sc.params["at"], Req(p, reply_wire(cx.m, p, cx.displaced(p, f), sc.params["delivery"])))
    a, b = LogSpec("A", cx.reqs, meta=cx.meta("other-log")), LogSpec("B", cx.other_reqs)
    return [a, b] if sc.params["order"] == "A,B" else [b, a]


@st.composite
def unknown_origin_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params["endpoint"], params["delivery"] = label.split("/")
    params["owner"] = "nobody"
    return Scenario(cls, params["endpoint"] + "/" + params["delivery"], params)


@builder("unknown-origin")
def _b_unknown(sc, leak):
    cx = _Ctx(sc, leak)
    _, p, text = cx.victim("nobody", sc.params["endpoint"], PLAN_KIND[sc.params["delivery"]])
    return cx.place(Req(p, reply_wire(cx.m, p, text, sc.params["delivery"])), "nobody")


@st.composite
def duplicate_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(delivery=label, owner=draw(owner_kinds))
    if cls == "duplicate-json-key":
        params["keys"] = draw(st.sampled_from(("text,raw", "every-field")))
    return Scenario(cls, params["delivery"], params, malformed=True, twin_green=False)


@builder("duplicate-body-record")
@builder("duplicate-json-key")
def _b_dup(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    _, p, text = cx.victim(owner, "generate", PLAN_KIND[sc.params["delivery"]])
    w = reply_wire(cx.m, p, text, sc.params["delivery"])
    clean = reply_wire(cx.m, p, recite(p.canaries), sc.params["delivery"])
    special = "dup_body" if sc.cls == "duplicate-body-record" else "dup_key"
    return cx.place(Req(p, w, special=special, clean_wire=clean, dup_keys=sc.params.get("keys", "")), owner)


@st.composite
def cut_last_leak(draw, cls, variant=None):
    label, params = _leak_draw(draw, cls, variant)
    params.update(delivery=label, owner=draw(owner_kinds))
    return Scenario(cls, params["delivery"], params, malformed=True, twin_green=False)


@builder("cut-last-line")
def _b_cut_last(sc, leak):
    cx = _Ctx(sc, leak)
    owner = sc.params["owner"]
    _, p, text = cx.victim(owner, "generate", PLAN_KIND[sc.params["delivery"]])
    cx.reqs.append(Req(p, reply_wire(cx.m, p, text, sc.params["delivery"]), special="cut_last"))
    cx.victims.append(p.rid)
    return cx.logs(owner)
