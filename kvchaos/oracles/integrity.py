"""Integrity: every reply is what it must be — the exact-reply oracle.

A probe prompt's reply is known before it is sent (:mod:`kvchaos.probe.contract`): the recital of the
canaries in its context, then EOS. So every reply of a probe request that reached the client with HTTP
200 is checked against it, and a reply that differs in one character is a FAIL — whether or not the
wrong bytes are another request's canary (isolation's rule). This sees what isolation cannot: a token
changed, a first token or a reply taken from another request, a canary dropped or garbled, a reply that
is right for a different prompt.

**What each reply must be.** ``complete`` — HTTP 200, read to its end, finished by EOS (or with no
finish reason): exactly the contract. ``prefix`` — cut short by its token limit (finish ``length``), by an
abort (``abort``), by its client (aborted, disconnected), by the network (cut) or by a timeout: what
arrived must be the contract's beginning. A prompt the engine truncated (it answers with
``prompt_tokens`` under the prompt's length: ``--allow-auto-truncate``) is held to the truncated head's
contract; one it claims to have read whole is held to the whole prompt's.

**What the engine says about it.** The reply's metadata must be the request's own: ``/generate``'s
``meta_info.id`` its rid, ``prompt_tokens`` its prompt's tokens (the probe tokenizer: one a character),
``completion_tokens`` the tokens it got (its text, plus EOS when it finished by EOS), ``output_ids`` its
text, ``cached_tokens`` within its prompt; an OpenAI reply's ``usage`` likewise; a stream's every chunk
the beginning of the final text (``/generate``) or its deltas joined the text (OpenAI), and no model
text in ``reasoning_content`` or tool calls (the probe has neither).

**Not judged, said.** Requests whose expected reply is not defined are listed with the reason and
counted: not a probe prompt (``expect_echo`` false), canaries of the context that collide (same first
character, shared trigram), a truncation that cuts a canary, an error reply (no model text), no reply.
A served model that is not a probe has no contract: its replies are judged against a clean reference
of the same prompts (``reference``: greedy, the same token ids; a first difference where the
reference's top two tokens were within ``tie_nats`` of each other is a numerical near-tie — batch
composition changes the numerics — and the reply is judged up to it), else UNKNOWN, never PASS.

**Verdict.** Any witness: FAIL (a leak checker's: a wrong reply is the engine's doing). No reply
judged, or fewer than ``min_judged`` of the replies that reached the client with text: UNKNOWN.
Else PASS. A witness names the request, the position of the first difference, expected and got (an
excerpt), and — where the wrong bytes are another request's expected reply or hold another
request's canary — that owner.
"""

from __future__ import annotations

import json
from collections import Counter

from kvchaos import canary
from kvchaos.history import History, Witness, as_history, decode_probe_ids, reads_incremental, serves_probe
from kvchaos.probe import contract

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict

PREFIX_OUTCOMES = ("aborted", "disconnected", "cut", "timeout")  # the client has part of the reply
PREFIX_FINISH = ("length", "abort")
EOS_ID = 2  # the probe tokenizer's </s> (kvchaos.probe.circuit.CONFIG eos_token_id)
EXCERPT = 48
OWNER_WINDOW = 6  # characters of another request's canary that name it as the owner of wrong bytes
MIN_JUDGED = 0.5
TIE_NATS = 0.05


def _excerpt(s: str, at: int) -> str:
    lo = max(0, at - EXCERPT // 2)
    return ("…" if lo else "") + s[lo:at + EXCERPT // 2] + ("…" if at + EXCERPT // 2 < len(s) else "")


class _Judge:
    """One history's judgement, reply by reply (each independent of the others but for naming owners)."""

    def __init__(self, h: History, registry=None, reference=None, tie_nats: float = TIE_NATS):
        self.h, self.registry, self.reference, self.tie_nats = h, registry, reference, tie_nats
        self.probe = serves_probe(h.header)
        self.witnesses: list[Witness] = []
        self.not_judged: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.judged = self.exact = self.prefix = self.with_text = 0
        self._by_text: dict[str, list[str]] | None = None
        self._auto = None
        self._contracts: dict[str, contract.Contract] = {}

    # ------------------------------------------------------------------ per reply
    def skip(self, rid: str, why: str) -> None:
        self.not_judged[why] += 1
        self.examples.setdefault(why, rid)

    def run(self) -> None:
        for rid, p in self.h.plans.items():
            body = self.h.bodies.get(rid)
            if body is None:
                self.skip(rid, "no reply received")
                continue
            status = self.h.statuses.get(rid)
            text = self.h.reply_text(rid)
            if text:
                self.with_text += 1
            if status != 200:
                self.skip(rid, "an error reply (no model text)" if status else "no HTTP status")
                continue
            if not self.probe:
                self.against_reference(rid, p, body, text)
                continue
            if p.get("expect_echo") is False:
                self.skip(rid, "not a probe prompt (its plan says it is not built to be recited)")
                continue
            c = self.contract_of(rid, p, body)
            if not c.defined:
                self.skip(rid, c.why)
                continue
            whole = self.whole(rid, body)
            if not whole and not text:
                self.skip(rid, "nothing of the reply's text arrived")
                continue
            self.judged += 1
            self.check_text(rid, p, body, text, c, whole)
            self.check_meta(rid, p, body, text, c, whole)
            self.check_stream(rid, p, body, text, c)

    def contract_of(self, rid: str, p: dict, body: dict) -> contract.Contract:
        prompt = p.get("prompt") if isinstance(p.get("prompt"), str) else None
        meta = body.get("meta") if isinstance(body.get("meta"), dict) else {}
        used = meta.get("prompt_tokens")
        if prompt is not None and p.get("oversized") and isinstance(used, int) and 0 < used < len(prompt):
            c = contract.truncated(prompt, used)  # the engine says it read only the head
        else:
            c = contract.expected(prompt, p.get("canaries"))
        self._contracts[rid] = c
        return c

    def whole(self, rid: str, body: dict) -> bool:
        """Must the client hold the whole reply (else: its beginning)?"""
        finish = self.h.finish_reason(rid)
        return (self.h.outcome(rid) == "ok" and body.get("complete", True) is not False
                and finish not in PREFIX_FINISH)

    def check_text(self, rid, p, body, text, c, whole) -> None:
        want = c.text if whole else c.text[:len(text)]
        at = contract.first_difference(want, text)
        if at is None:
            self.exact += whole
            self.prefix += not whole
            return
        what = ("the reply differs from what its prompt must give" if whole else
                "the part of the reply that arrived differs from the beginning of what its prompt must give")
        self.witness(rid, p, at, c.text, text, what, "body.text", whole)

    def check_meta(self, rid, p, body, text, c, whole) -> None:
        meta = body.get("meta") if isinstance(body.get("meta"), dict) else None
        finish = self.h.finish_reason(rid)
        eos = 1 if whole and finish in (None, "stop") and text == c.text else 0
        if meta is not None:
            if p.get("endpoint", "generate") == "generate" and "id" in meta and meta["id"] != rid:
                self.meta_witness(rid, p, "id", rid, meta["id"], owner=meta["id"])
            used = meta.get("prompt_tokens")
            if isinstance(used, int) and c.head is not None and used != c.head:
                self.meta_witness(rid, p, "prompt_tokens", c.head, used)
            got = meta.get("completion_tokens")
            if isinstance(got, int) and (whole or finish == "length") and got != len(text) + eos:
                self.meta_witness(rid, p, "completion_tokens", len(text) + eos, got)
            cached = meta.get("cached_tokens")
            if isinstance(cached, int) and isinstance(used, int) and not 0 <= cached <= used:
                self.meta_witness(rid, p, "cached_tokens", f"0..{used}", cached)
        ids = body.get("output_ids")
        if isinstance(ids, list) and ids:
            # the EOS that ended the reply is listed in output_ids but is not text
            mine = ids[:-1] if ids[-1] == EOS_ID and len(ids) == len(text) + 1 else ids
            shown = decode_probe_ids(mine)
            if shown != text:
                at = contract.first_difference(text, shown)
                self.witness(rid, p, at, text, shown, "the reply's output_ids are not its text",
                             "body.output_ids (probe tokenizer)", whole)

    def check_stream(self, rid, p, body, text, c) -> None:
        raw = body.get("raw")
        if not isinstance(raw, str) or "data:" not in raw:
            if isinstance(raw, str) and raw.lstrip().startswith("{"):
                self.check_extra_fields(rid, p, _json(raw))
            return
        deltas, chunks, metas = [], [], []
        for line in raw.split("\n"):
            line = line.strip()
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                break  # the reply as a client reads it ends here (bytes after it are isolation's to scan)
            chunk = _json(line[5:].strip())
            if not isinstance(chunk, dict):
                continue
            self.check_extra_fields(rid, p, chunk)
            if isinstance(chunk.get("choices"), list):
                for ch in chunk["choices"]:
                    if isinstance(ch, dict):
                        t = ch.get("text")
                        if not isinstance(t, str):
                            d = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
                            t = d.get("content")
                        if isinstance(t, str):
                            deltas.append(t)
            elif isinstance(chunk.get("text"), str):
                chunks.append(chunk["text"])
                mi = chunk.get("meta_info")
                if isinstance(mi, dict):  # every chunk's metadata is the request's own, not only the last one's
                    metas.append(mi)
        for mi in metas:
            if "id" in mi and mi["id"] != rid:
                return self.meta_witness(rid, p, "id", rid, mi["id"], owner=mi["id"], view="a stream chunk's meta_info")
            used = mi.get("prompt_tokens")
            if isinstance(used, int) and c.head is not None and used != c.head:
                return self.meta_witness(rid, p, "prompt_tokens", c.head, used, view="a stream chunk's meta_info")
        inc = reads_incremental(chunks, self.h.incremental_streaming)
        if inc:  # --incremental-streaming-output: each chunk its new text only; joined, they are the reply
            deltas += chunks
        for t in chunks if not inc else ():  # the text so far: each must begin what it must be
            at = contract.first_difference(c.text[:len(t)], t)
            if at is not None:
                self.witness(rid, p, at, c.text, t, "a streamed chunk differs from the beginning of what its prompt "
                             "must give", "body.raw (a stream chunk)", False)
                return
        joined = "".join(deltas)
        if deltas:  # OpenAI streams carry deltas: joined, they are the reply (or, cut short, its beginning)
            whole = self.whole(rid, body)
            at = contract.first_difference(c.text if whole else c.text[:len(joined)], joined)
            if at is not None:
                self.witness(rid, p, at, c.text, joined, "the stream's deltas joined differ from what its prompt "
                             "must give", "body.raw (deltas joined)", whole)

    def check_extra_fields(self, rid, p, obj) -> None:
        """Model text outside the reply's content (a reasoning parser's or a tool call's field)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            return
        for ch in obj["choices"]:
            if not isinstance(ch, dict):
                continue
            for part in (ch.get("message"), ch.get("delta")):
                if not isinstance(part, dict):
                    continue
                for k in ("reasoning_content", "tool_calls", "function_call"):
                    v = part.get(k)
                    if v:
                        self.meta_witness(rid, p, f"choices[].{k}", "nothing (the probe model has no such output)",
                                          json.dumps(v)[:200] if not isinstance(v, str) else v[:200])
                        return

    # ------------------------------------------------------------------ real models: a reference
    def against_reference(self, rid, p, body, text) -> None:
        ref = (self.reference or {}).get(rid)
        if ref is None:
            self.skip(rid, "the served model is not a probe and no reference answer of this prompt exists")
            return
        self.judged += 1
        got, want = body.get("output_ids"), ref.get("output_ids")
        if not (isinstance(got, list) and isinstance(want, list)):
            got, want = text, ref.get("text") or ""
        whole = self.whole(rid, body)
        cmp_want = want if whole else want[:len(got)]
        at = contract.first_difference(cmp_want, got)
        if at is None:
            self.exact += whole
            self.prefix += not whole
            return
        margins = ref.get("top2_margin")
        if isinstance(margins, list) and at < len(margins) and isinstance(margins[at], (int, float)) \
                and margins[at] <= self.tie_nats:
            self.not_judged["judged up to a numerical near-tie of the reference"] += 1
            return
        self.witness(rid, p, at, want if isinstance(want, str) else json.dumps(want),
                     got if isinstance(got, str) else json.dumps(got),
                     "the reply differs from the clean reference's answer of the same prompt", "reference", whole)

    # ------------------------------------------------------------------ witnesses
    def witness(self, rid, p, at, want, got, what, view, whole) -> None:
        if any(w["rid"] == rid for w in self.witnesses):
            return  # one witness a reply: its first difference
        w = Witness({"rid": rid, "victim_rid": rid, "tenant": p.get("tenant"), "victim_tenant": p.get("tenant"),
                     "problem": what, "view": view, "position": at, "expected": _excerpt(want, at),
                     "got": _excerpt(got, at), "expected_len": len(want), "got_len": len(got),
                     "contract": "whole reply" if whole else "beginning of the reply",
                     "status": self.h.statuses.get(rid), "outcome": self.h.outcome(rid),
                     "finish_reason": self.h.finish_reason(rid), "endpoint": p.get("endpoint", "generate")})
        w.update(self.owner(rid, got, at))
        self.witnesses.append(w)

    def meta_witness(self, rid, p, field, want, got, owner=None, view=None) -> None:
        if any(w["rid"] == rid for w in self.witnesses):
            return
        w = Witness({"rid": rid, "victim_rid": rid, "tenant": p.get("tenant"), "victim_tenant": p.get("tenant"),
                     "problem": f"the reply's {field} is not its request's", "view": view or f"meta.{field}",
                     "field": field,
                     "expected": str(want), "got": str(got), "position": None,
                     "status": self.h.statuses.get(rid), "outcome": self.h.outcome(rid),
                     "finish_reason": self.h.finish_reason(rid), "endpoint": p.get("endpoint", "generate")})
        if owner is not None and owner in self.h.plans and owner != rid:
            w.update({"owner_rid": owner, "owner_tenant": self.h.plans[owner].get("tenant"),
                      "owner_how": f"the metadata names request {owner}"})
        self.witnesses.append(w)

    def owner(self, rid: str, got: str, at: int) -> dict:
        """Whose bytes the wrong ones are: a request whose own expected reply ``got`` is, else the request
        of a canary ``OWNER_WINDOW`` characters of which sit in ``got`` from the first difference on."""
        if self._by_text is None:
            self._by_text = {}
            for r, p in self.h.plans.items():
                c = self._contracts.get(r) or contract.expected(p.get("prompt") if isinstance(p.get("prompt"), str)
                                                                else None, p.get("canaries"))
                if c.defined and c.text:
                    self._by_text.setdefault(c.text, []).append(r)
        same = [r for r in self._by_text.get(got, ()) if r != rid]
        if same and got != (self._contracts.get(rid) or contract.Contract(None)).text:
            o = same[0]
            return {"owner_rid": o, "owner_tenant": self.h.plans[o].get("tenant"),
                    "owner_how": f"the reply is exactly what {o}'s prompt must give"}
        if self._auto is None:
            from .isolation import automaton, known_canaries  # on use: only a wrong reply pays for the matcher

            self._auto = automaton(known_canaries(self.h, self.registry), OWNER_WINDOW)
        if not len(self._auto):
            return {}
        lo = max(0, at - canary.PAYLOAD_LEN)
        for _end, (key, owners) in self._auto.iter(got[lo:]):
            foreign = [o for o in owners if not (o[0] == rid and o[4] is None)]
            if foreign and len(foreign) == len(owners):
                o = foreign[0]
                return {"owner_rid": o[0], "owner_tenant": o[1], "owner_canary": o[2],
                        "owner_how": f"the wrong bytes hold {key!r} of {o[2]}, minted for {o[0]}"}
        return {}


def _json(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


def integrity(h, registry=None, reference=None, min_judged: float = MIN_JUDGED, tie_nats: float = TIE_NATS) -> Verdict:
    """FAIL: a reply (or its metadata) is not what its prompt must give; else PASS where enough replies
    were judged, UNKNOWN where not (module doc)."""
    h = as_history(h)
    j = _Judge(h, registry, reference, tie_nats)
    j.run()
    n = len(h.plans)
    stats = {"requests": n, "judged": j.judged, "whole": j.exact, "beginning": j.prefix, "with_text": j.with_text,
             "not_judged": dict(j.not_judged), "not_judged_examples": j.examples, "probe_contract": j.probe}
    need = min_judged * j.with_text
    met = j.judged > 0 and j.judged >= need
    stats["power"] = {"met": met, "why": "" if met else (
        f"{j.judged} replies judged of {j.with_text} with text (fewer than {100 * min_judged:.0f} %)")}
    nj = ", ".join(f"{k}: {v}" for k, v in j.not_judged.most_common(4))
    if j.witnesses:
        w = j.witnesses[0]
        at = f"at position {w['position']}" if w.get("position") is not None else f"in {w.get('view')}"
        owner = f"; the wrong bytes are {w['owner_rid']}'s ({w['owner_how']})" if w.get("owner_rid") else ""
        stats["victims"] = len({x["rid"] for x in j.witnesses})
        return Verdict("integrity", FAIL,
                       f"{stats['victims']} of {j.judged} judged replies are not what their prompts must give (first: "
                       f"{w['rid']} ({w.get('tenant')}) {at}: expected {w['expected']!r}, got {w['got']!r}{owner})",
                       j.witnesses, stats)
    if not met:
        why = "no reply could be judged" if not j.judged else stats["power"]["why"]
        return Verdict("integrity", UNKNOWN, f"{why}" + (f" — not judged: {nj}" if nj else ""), [], stats)
    return Verdict("integrity", PASS, f"{j.exact} whole replies exactly what their prompts must give, {j.prefix} cut "
                   f"short and each the beginning of it" + (f"; not judged: {nj}" if nj else ""), [], stats)


class Integrity(Checker):
    """The exact-reply oracle (module doc). ``reference``: rid -> {"output_ids", "text", "top2_margin"}
    (or a callable of the event log returning that) for a served model that is not a probe."""
    name, leak, log_only = "integrity", True, True

    def __init__(self, reference=None, min_judged: float = MIN_JUDGED, tie_nats: float = TIE_NATS):
        if not 0 < min_judged <= 1:
            raise ValueError(f"min_judged must be in (0, 1], got {min_judged!r}")
        if tie_nats < 0:
            raise ValueError(f"tie_nats must be >= 0, got {tie_nats!r}")
        self.reference, self.min_judged, self.tie_nats = reference, min_judged, tie_nats

    def check(self, history, registry=None):
        h = as_history(history)
        ref = self.reference(h.records) if callable(self.reference) else self.reference
        return integrity(h, registry, ref, self.min_judged, self.tie_nats)

    def live(self, plans: dict, registry=None):
        """Each reply is judged on its own (its plan is in the part with it): a witness on part of a run is
        a witness of the whole run. A reference that is computed after the run has no live judge."""
        if callable(self.reference):
            return None
        return lambda part: integrity(part, registry, self.reference, self.min_judged, self.tie_nats)
