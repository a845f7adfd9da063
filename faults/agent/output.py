"""Decode's output stream: what the scheduler hands the detokenizer for each request, and two planted
engine bugs there (the detection matrix's; a correct engine never does either):

* ``token_flip`` (targeted: ``{"rid": ...}``, ``rid_regex``, ``tenant``; ``params.at``: the output
  token index, 0 the first; ``params.to``: the token id written, default the id next to it): the
  targeted request's output token at ``at`` is replaced before it is first sent, once a request. The
  model goes on from the token it really chose, so exactly one token of the reply differs — what a
  reply's first token taken from another request's slot (SGLang #22716's class) or a corrupted token
  look like to the client.
* ``meta_swap`` (targeted: the requests it may swap between): whenever two targeted requests are sent
  in one batch, their ``prompt_tokens`` and ``cached_tokens`` are exchanged — metadata of another
  request, each reply's text its own.

SGLang 0.5.23 (read in the installed source): ``managers/scheduler_components/output_streamer.py``
``_GenerationStreamAccumulator.accept(*, req)`` appends a request's unsent output
(``req.output_ids[req.send_token_offset:]``) and its metadata (``prompt_tokens`` from
``len(req.origin_input_ids)``, ``cached_tokens``, ``completion_tokens``) to the batch it sends, and
``to_payload()`` builds the ``BatchTokenIDOutput`` from those lists. A token flipped in
``req.output_ids`` before ``accept`` reads it is what the detokenizer decodes (text and ids agree);
the decode batch's next input is its own tensor (``ScheduleBatch.output_ids``), so generation does not
see the flip. 0.5.19 has no such class: these kinds are refused there by name (``absent``).
"""

from __future__ import annotations

from . import control as _ctl
from .control import _hook_class, _target_ok, register_fault

_ARMED = {"token_flip": 0, "meta_swap": 0}  # armed faults of each kind: the per-request hot path reads an int
EOS_IDS = (1, 2)  # the probe tokenizer's <s> and </s>: a flip never writes them (it would end the reply)


def _count(kind: str, d: int):
    def fn(agent, f):
        _ARMED[kind] = max(0, _ARMED[kind] + d)
    return fn


def _flip_check(params: dict) -> None:
    at = params.get("at")
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        raise ValueError(f"token_flip: params.at must be an output token index >= 0, got {at!r}")
    to = params.get("to")
    if to is not None and (not isinstance(to, int) or isinstance(to, bool) or to < 0):
        raise ValueError(f"token_flip: params.to must be a token id >= 0, got {to!r}")


register_fault("token_flip", unlimited=True, on=_count("token_flip", 1), off=_count("token_flip", -1),
               check=_flip_check)
register_fault("meta_swap", unlimited=True, on=_count("meta_swap", 1), off=_count("meta_swap", -1))


def _flip(req) -> None:
    A = _ctl.AGENT
    flipped = A.state("token_flip.done", dict)
    rid = getattr(req, "rid", None)
    if rid is None or rid in flipped:
        return
    out_ids = req.output_ids
    sent = int(getattr(req, "send_token_offset", 0) or 0)

    def due(f):
        at = int(f["params"]["at"])
        return sent <= at < len(out_ids)

    f = A.match("token_flip", rid=rid, where=due)
    if f is None:
        return
    at = int(f["params"]["at"])
    old = int(out_ids[at])
    new = f["params"].get("to")
    if new is None:
        new = old ^ 1 if (old ^ 1) not in EOS_IDS else old ^ 4
    out_ids[at] = int(new)
    flipped[rid] = at
    if len(flipped) > 50000:
        for r in list(flipped)[:25000]:
            flipped.pop(r, None)
    A.emit("fault_fired", fault=f["id"], kind="token_flip", rid=rid, at=at, old=old, new=int(new))


def _make_accept(orig):
    def accept(self, *a, **k):
        if _ARMED["token_flip"] and _ctl.ROLE != "prefill":
            req = k.get("req", a[0] if a else None)
            try:
                if req is not None:
                    _flip(req)
            except Exception as e:  # noqa: BLE001 - a planted bug must never break the engine by accident
                _ctl.AGENT.emit("hook_error", hook="output.accept", error=repr(e))
        return orig(self, *a, **k)
    return accept


def _swap(acc) -> None:
    A = _ctl.AGENT
    with A.lock:
        faults = [f for f in A.faults.values() if f["kind"] == "meta_swap"]
    rids = list(getattr(acc, "rids", ()))
    for f in faults:
        hit = [i for i, rid in enumerate(rids) if _target_ok(f["target"], None, rid)]
        if len(hit) < 2:
            continue
        i, j = hit[0], hit[1]
        if A.match("meta_swap", rid=rids[i], where=lambda x: x["id"] == f["id"]) is None:
            continue  # its count is spent
        was = {}
        for field in ("prompt_tokens", "cached_tokens"):
            vals = getattr(acc, field, None)
            if isinstance(vals, list) and len(vals) > max(i, j):
                was[field] = [vals[i], vals[j]]
                vals[i], vals[j] = vals[j], vals[i]
        A.emit("fault_fired", fault=f["id"], kind="meta_swap", rid=rids[i], other=rids[j], swapped=was)


def _make_to_payload(orig):
    def to_payload(self, *a, **k):
        if _ARMED["meta_swap"] and _ctl.ROLE != "prefill":
            try:
                _swap(self)
            except Exception as e:  # noqa: BLE001 - a planted bug must never break the engine by accident
                _ctl.AGENT.emit("hook_error", hook="output.to_payload", error=repr(e))
        return orig(self, *a, **k)
    return to_payload


def _hook_output(mod):
    _hook_class(mod, "_GenerationStreamAccumulator", optional={"accept": _make_accept, "to_payload": _make_to_payload})


HOOKS = {
    "sglang.srt.managers.scheduler_components.output_streamer": _hook_output,
}
