"""Page provenance from the engines' own events: which decode pages a request was given, which of them
its KV transfer wrote, and who held the others before it.

Evidence (in-engine agent, ``faults/agent``):

* decode's ``kv_prealloc`` — the decode pages pre-allocated to a request, in the request's page order
  (``dst_pages``, ``dst_pages_total``), and ``prev_holders``: run-length ``[first_index, count, rid]``
  of the request that last held each page on decode (its prompt written there by a transfer, or its
  generated tokens by a decode step), ``null`` when no request had since the agent started;
* prefill's ``write_end`` — each KV write into decode's pages: ``dst_page_offset`` (the chunk's first
  page in the request's page list) and ``dst_pages_total`` (pages written by it);
* prefill's ``fault_fired`` kind ``short`` — a transfer cut by the fault: ``pages_sent`` of
  ``pages_reserved``.

A page decode gave a request that no write of that request filled holds what its previous holder
left there: with that holder named by decode itself, a foreign canary recited by the request is
explained — the mechanism of the stale-page findings.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict

from kvchaos import canary
from kvchaos.history import History, as_history, layout_spec

MAX_CHAIN = 16  # holders followed back through pages a holder's own transfer left unwritten


class _Index:
    """A history's ``kv_prealloc`` and ``write_end`` events by request id and by room, built once: the
    page walk (:func:`writer_kind`) asks for them once per unwritten page, and scanning every event each
    time made judging a leak's witnesses cost pages × events."""

    def __init__(self, h: History):
        self.pre: dict = defaultdict(list)
        for e in h.agent_events("kv_prealloc"):
            self.pre[e.get("rid")].append(e)
        self.ids: dict = defaultdict(set)  # client rid -> the engine-side ids decode knew it by
        for eid, rid in h.engine_rids().items():
            self.ids[rid].add(eid)
        self.writes = h.agent_events("write_end")
        self.w_rid: dict = defaultdict(list)   # rid -> positions in self.writes
        self.w_room: dict = defaultdict(list)  # room -> positions
        for i, e in enumerate(self.writes):
            self.w_rid[e.get("rid")].append(i)
            self.w_room[e.get("room")].append(i)


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _index(h: History) -> _Index:
    ix = _INDEXES.get(h)
    if ix is None:
        ix = _INDEXES[h] = _Index(h)
    return ix


def _preallocs(h: History, rid: str) -> list[dict]:
    """Decode's ``kv_prealloc`` events of ``rid``, under its own id or one the engine gave it on an
    OpenAI route (:meth:`History.decode_ids`), in the order they were logged."""
    ix = _index(h)
    evs = list(ix.pre.get(rid, ()))
    for eid in ix.ids.get(rid, ()):
        evs += ix.pre.get(eid, ())
    if len(evs) > 1 and ix.ids.get(rid):
        order = {id(e): i for i, e in enumerate(h.agent_events("kv_prealloc"))}
        evs.sort(key=lambda e: order[id(e)])
    return evs


def writes(h: History, rid: str) -> list[dict]:
    """Prefill's ``write_end`` events for ``rid``: under its rid, or into a bootstrap room decode
    pre-allocated for it (prefill and decode share the room; on an OpenAI route each role may know the
    request by an id of its own, and decode's is named back by :meth:`History.decode_ids`)."""
    ix = _index(h)
    rooms = {e.get("room") for e in _preallocs(h, rid) if e.get("room") is not None}
    at = set(ix.w_rid.get(rid, ()))
    for room in rooms:
        at.update(ix.w_room.get(room, ()))
    return [ix.writes[i] for i in sorted(at)]


def _rooms_written(h: History, rid: str) -> list:
    return [e.get("room") for e in writes(h, rid)]


def prealloc(h: History, rid: str) -> dict | None:
    """The ``kv_prealloc`` (decode) of the pages ``rid``'s transfer wrote into: the first one of the
    room prefill wrote for it (a retracted request that resumed is pre-allocated again), else its
    first one; None without one."""
    evs = _preallocs(h, rid)
    if not evs:
        return None
    rooms = set(_rooms_written(h, rid))
    return next((e for e in evs if e.get("room") in rooms), evs[0])


def written_pages(h: History, rid: str) -> set[int] | None:
    """Indices (in the request's page list) of the pages prefill's writes for ``rid`` filled; None
    when a write does not say where it wrote (an agent too old to report it)."""
    out: set[int] = set()
    for e in writes(h, rid):
        off, total = e.get("dst_page_offset"), e.get("dst_pages_total")
        if not isinstance(off, int) or not isinstance(total, int):
            return None
        if e.get("ret") not in (0, "handles", None):
            continue  # a write that failed filled nothing
        out.update(range(off, off + total))
    return out


def holders(pre: dict) -> list:
    """The previous holder of each page of a ``kv_prealloc`` (request page order)."""
    total = pre.get("dst_pages_total")
    if not isinstance(total, int):
        total = len(pre.get("dst_pages") or [])
    out: list = [None] * total
    for run in pre.get("prev_holders") or []:
        try:
            first, count, who = int(run[0]), int(run[1]), run[2]
        except (TypeError, ValueError, IndexError):
            continue
        for i in range(max(0, first), min(total, first + count)):
            out[i] = who
    return out


def writer(h: History, page: int | None, holder, depth: int = 0, registry=None):
    """Whose bytes decode page ``page`` holds, given that ``holder`` held it last: the holder's own
    (its transfer wrote that page, or decode wrote its generated tokens there) — unless its transfer
    left that page unwritten, and then its previous holder's (followed back). A holder whose pages
    this history does not show (an earlier experiment's request) is taken as the writer."""
    return writer_kind(h, page, holder, depth, registry)[0]


def writer_kind(h: History, page: int | None, holder, depth: int = 0, registry=None) -> tuple:
    """:func:`writer` and what of the writer's the page holds: ``prompt`` (its transfer wrote the page),
    ``generated`` (decode gave it the page for its generated tokens: not one of its pre-allocated
    ones), or ``unknown`` (a holder neither this history nor the registry shows, or none). A holder of
    an earlier experiment on the same cluster is told by decode's pre-allocation of it as the registry
    kept it (:meth:`kvchaos.canary.Registry.page_record`): a page outside it held its generated tokens,
    one inside it its prompt (whether its own transfer wrote that page is not kept: not followed back)."""
    if holder is None or page is None or depth >= MAX_CHAIN:
        return holder, "unknown"
    pre = prealloc(h, holder)
    if pre is None:
        rec = (registry.page_record(holder).get("prealloc") if registry is not None
               and hasattr(registry, "page_record") else None) or {}
        if not rec.get("dst_pages") or (rec.get("dst_pages_total") or 0) > len(rec["dst_pages"]):
            return holder, "unknown"  # nothing kept, or a page list the agent cut short
        return holder, ("prompt" if page in rec["dst_pages"] else "generated")
    pages = pre.get("dst_pages") or []
    if page not in pages:
        return holder, "generated"
    j = pages.index(page)
    done = written_pages(h, holder)
    if done is None or j in done:
        return holder, "prompt"
    return writer_kind(h, page, holders(pre)[j], depth + 1, registry)


def stale_pages(h, rid: str, registry=None) -> dict | None:
    """What ``rid`` read but its transfer never wrote: ``{reserved, written, unwritten, writers}``
    (``writers``: request whose bytes they hold -> how many of those pages, following holders back
    through pages their own transfers left unwritten), or None without the evidence (no
    ``kv_prealloc`` of decode for it, or writes that do not say where)."""
    h = as_history(h)
    pre = prealloc(h, rid)
    done = written_pages(h, rid)
    if pre is None or done is None:
        return None
    held = holders(pre)
    pages = list(pre.get("dst_pages") or [])
    unwritten = [i for i in range(len(held)) if i not in done]
    writers, generated = Counter(), Counter()
    for i in unwritten:
        w, kind = writer_kind(h, pages[i] if i < len(pages) else None, held[i], registry=registry)
        if w is not None:
            writers[w] += 1
            generated[w] += kind == "generated"
    return {"reserved": len(held), "written": len([i for i in done if i < len(held)]), "unwritten": len(unwritten),
            "writers": dict(writers), "unknown_writer": len(unwritten) - sum(writers.values()),
            # writer -> how many of those pages hold its generated tokens (decode's own step evidence)
            "generated_by": {w: n for w, n in generated.items() if n},
            "prealloc_wall": pre.get("wall"), "page_size": _page_size(h, pre)}


def _page_size(h: History, pre: dict) -> int | None:
    """Tokens per decode page: decode's ``kv_prealloc`` says, else the header's layout; None unknown."""
    for ps in (pre.get("page_size"), layout_spec(h.header).get("page_size")):
        if isinstance(ps, int) and not isinstance(ps, bool) and ps > 0:
            return ps
    return None


def shorted(h, rid: str) -> list[dict]:
    """The ``short`` firings for ``rid`` that sent fewer pages than the chunk had reserved."""
    h = as_history(h)
    out = []
    for e in h.agent_events("fault_fired"):
        if e.get("kind") != "short" or e.get("rid") != rid:
            continue
        sent, res = e.get("pages_sent"), e.get("pages_reserved")
        if isinstance(sent, int) and isinstance(res, int) and sent < res:
            out.append(e)
    return out


def carriers(h: History, c: str | None, registry=None) -> set:
    """Every request known to have carried canary ``c`` in its prompt: this history's plans and the
    registry's (a conversation's turns and a tenant's system prompt carry the same canary), and every
    decode request whose own input text held it (``kv_prealloc.canaries``: under the engine's id, which
    a page's holder is named by where the router did not pass the client's rid on)."""
    if not c:
        return set()
    out = {rid for rid, p in h.plans.items() if c in (p.get("canaries") or [])}
    out |= {e["rid"] for e in h.agent_events("kv_prealloc") if e.get("rid") and c in (e.get("canaries") or ())}
    if registry is not None:
        out |= registry.carriers(c)
    return out


def carried_by(h: History, rid: str, registry=None) -> set:
    """The canaries ``rid`` carried in its prompt (its plan here, decode's record of its input text, the
    registry's record)."""
    p = h.plans.get(rid)
    out = set(p.get("canaries") or []) if p else set()
    for e in h.agent_events("kv_prealloc"):
        if e.get("rid") == rid:
            out |= set(e.get("canaries") or ())
    if registry is not None:
        out |= registry.carried_by(rid)
    return out


def explains(h, witness: dict, registry=None) -> tuple[bool, str, dict | None]:
    """Does decode's own page evidence explain this isolation witness as stale KV: the victim read
    pages its transfer never wrote, holding the bytes of a request that carried the canary (sent
    before the victim's pages were handed over)? A recital of a canary nobody minted (a chimera) is
    explained when each of its characters after the first is one the probe's copying head can have
    taken from canaries the writers of those pages (or the victim) carried (:func:`_copyable`), or
    from the victim's pages read as they sat (:func:`context_text`, :func:`_copied_from_context`), and
    at least one trigram of it comes from a stale page's canary."""
    h = as_history(h)
    victim = witness.get("victim_rid")
    if witness.get("match") == "unknown-origin":
        return _explains_chimera(h, witness, registry)
    who = carriers(h, witness.get("canary"), registry) | ({witness["owner_rid"]} if witness.get("owner_rid") else set())
    if not who:
        return False, "the canary's owner is unknown: nothing can have left it in a page", None
    sp = stale_pages(h, victim, registry)
    if sp is None:
        return False, f"no decode page evidence for {victim} (kv_prealloc / write_end with page lists)", None
    if not sp["unwritten"]:
        return False, f"every one of the {sp['reserved']} pages decode gave {victim} was written by its transfer", sp
    hit = sorted(who & set(sp["writers"]))
    if not hit:
        # a leak of a leak: pages decode gave an earlier request for its generated tokens, a reply that
        # itself recited the canary (an earlier victim of the same stale pages: 0.5.19, 2026-12-05)
        hit = sorted(r for r in sp.get("generated_by", {}) if _recited(h, r, witness.get("canary"), registry))
    if not hit:
        return False, (f"none of the {sp['unwritten']} pages of {victim} its transfer left unwritten holds the bytes "
                       f"of a request that carried {witness.get('canary')} (they hold {sorted(sp['writers'])[:5]}'s, "
                       f"{sp['unknown_writer']} unknown)"), sp
    # a request of this log that was never sent left nothing anywhere (one of an earlier experiment, known from
    # the registry, has no send here: its pages are what this log's requests can inherit)
    unsent = [r for r in hit if r in h.plans and r not in h.sends]
    if unsent and len(unsent) == len(hit):
        return False, f"{unsent[0]} was never sent: it cannot have left bytes in {victim}'s pages", sp
    hit = [r for r in hit if r not in unsent]
    at = sp.get("prealloc_wall") or float("inf")
    late = [r for r in hit if (h.sends.get(r) or {}).get("wall", 0) > at]
    if late and len(late) == len(hit):
        return False, f"{late[0]} was sent after decode gave {victim} its pages: it cannot have left bytes there", sp
    # decode's own events must agree with themselves: a holder whose pages decode first allocated after it gave
    # the victim those pages cannot be what the victim read
    after = [r for r in hit if min((e.get("wall") for e in _preallocs(h, r) if isinstance(e.get("wall"), (int, float))),
                                   default=-float("inf")) > at]
    if after and len(after) == len(hit):
        return False, (f"decode allocated {after[0]}'s pages after it gave {victim} its pages: its events contradict "
                       "themselves, and explain nothing"), sp
    # the explanation must cover what was recited: pages of so few tokens cannot have held the characters
    ps, shown = sp.get("page_size"), str(witness.get("matched") or "").strip("[]")
    have = sum(sp["writers"].get(r, 0) for r in hit)  # their pages among the unwritten (prompt or generated)
    if ps and shown and have * ps < len(shown):
        return False, (f"the {have} unwritten page(s) of {ps} token(s) holding {', '.join(hit[:3])}'s bytes cannot hold "
                       f"the {len(shown)} characters {victim} recited"), sp
    return True, (f"{victim} read {sp['unwritten']} of {sp['reserved']} pages its transfer never wrote; "
                  f"{sum(sp['writers'][r] for r in hit)} of them hold the bytes of {', '.join(hit[:3])}, "
                  f"which carried {witness.get('canary')}"), sp


def _reply(h: History, rid: str, registry=None) -> str | None:
    """``rid``'s reply text: this history's, else the registry's record of it; None when neither has it."""
    text = (h.bodies.get(rid) or {}).get("text")
    if not isinstance(text, str) and registry is not None and hasattr(registry, "page_record"):
        text = registry.page_record(rid).get("output")
    return text if isinstance(text, str) else None


def _recited(h: History, rid: str, c: str | None, registry=None) -> bool:
    """Whether ``rid``'s reply (:func:`_reply`) holds canary ``c``."""
    text = _reply(h, rid, registry)
    return bool(c) and text is not None and canary.payload(c) in text


def _copyable(piece: str, pool: set) -> list[str]:
    """The characters of ``piece`` (after the first, which the probe's selection head picks) that its
    copying head cannot have taken from the payloads in ``pool``, each with its two predecessors.

    The head (:mod:`kvchaos.probe.circuit`, ``G_IND``) scores a source position by its predecessors:
    40 for the current character, 20 each for the two before it, and emits the source's next
    character. The full three-character context wins when the pages hold it; when they do not (the
    source canary's next page was overwritten, or never written), the best partial match wins. So a
    character ``y`` after ``... a b x`` is copyable when some payload holds ``x y`` (the current
    character matched: score >= 40), or ``a b ? y`` (both earlier ones matched: 40), where ``a`` may
    be the recital's opening ``[``. A chimera passes between two stale canaries where they share a
    character ('AYF2B5' of 'AYF2B54TKH', then 'WPMR6J' after the '5' of 'KGK5WPMR6J', a fresh
    clone's make test at ec1c9ad). A character from anywhere else is not copyable."""
    return [_label(piece, k) for k in _not_copyable(piece, pool)]


def _label(piece: str, k: int) -> str:
    """The character at ``k`` of ``"[" + piece`` with its two predecessors (how a miss is named)."""
    s = "[" + piece
    return s[max(1, k - 2):k + 1]


def _not_copyable(piece: str, pool: set) -> list[int]:
    """:func:`_copyable`'s misses, as positions in ``"[" + piece``."""
    s, srcs = "[" + piece, ["[" + p for p in pool]
    bad = []
    for k in range(2, len(s)):  # s[k] is piece[k - 1]
        if any(s[k - 1:k + 1] in p for p in srcs):
            continue
        if k >= 3 and any(p[i:i + 2] == s[k - 3:k - 1] and p[i + 3] == s[k] for p in srcs
                          for i in range(len(p) - 3)):
            continue
        bad.append(k)
    return bad


UNKNOWN_CHAR = "\x00"


def _chars_at(h: History, rid: str, registry=None) -> dict | None:
    """decode page -> the character ``rid``'s KV holds there (page size 1: a page is a token, and the
    probe's tokens are characters): its prompt's, then its reply's, in the order of decode's
    ``kv_prealloc`` of it. From this history, else from the registry (an earlier experiment's request
    on the same cluster); None when neither has its pages and its prompt."""
    rec = registry.page_record(rid) if registry is not None and hasattr(registry, "page_record") else {}
    pre = prealloc(h, rid) or rec.get("prealloc")
    plan = h.plans.get(rid) or {}
    prompt = plan.get("prompt") if isinstance(plan.get("prompt"), str) else rec.get("prompt")
    if not pre or not isinstance(prompt, str) or (pre.get("page_size") or 1) != 1:
        return None
    text = prompt + ((h.bodies.get(rid) or {}).get("text") or rec.get("output") or "")
    return {page: text[k] for k, page in enumerate(pre.get("dst_pages") or []) if k < len(text)}


def context_text(h, rid: str, registry=None) -> str | None:
    """What ``rid`` attended over, page by page in its own page order (page size 1): its prompt where its
    transfer wrote, and where it did not, the character the page's writer (:func:`writer`, decode's own
    holder evidence) left there; ``UNKNOWN_CHAR`` where that cannot be told. Pages of a fragmented pool
    put pieces of different requests side by side, so a stale canary can be read cut short and followed
    by another's characters: the text as it sat in the pages, not the canaries as they were sent. None
    without the evidence."""
    h = as_history(h)
    pre = prealloc(h, rid)
    done = written_pages(h, rid)
    plan = h.plans.get(rid) or {}
    if pre is None or done is None or (pre.get("page_size") or 1) != 1 or not isinstance(plan.get("prompt"), str):
        return None
    pages, held, own = list(pre.get("dst_pages") or []), holders(pre), plan["prompt"]
    cache: dict = {}
    out = []
    for i, page in enumerate(pages):
        if i in done:
            out.append(own[i] if i < len(own) else UNKNOWN_CHAR)
            continue
        w = writer(h, page, held[i] if i < len(held) else None, registry=registry)
        if w not in cache:
            cache[w] = _chars_at(h, w, registry) if w is not None else None
        out.append((cache[w] or {}).get(page, UNKNOWN_CHAR))
    return "".join(out)


G_IND = (40, 20, 20)  # kvchaos.probe.circuit: the copying head's weights (current, previous, the one before)


def _copied_from_context(piece: str, ctx: str, prior: str = "[") -> list[str]:
    return [_label(piece, k) for k in _not_from_context(piece, ctx, prior)]


def _not_from_context(piece: str, ctx: str, prior: str = "[") -> list[int]:
    """The characters of ``piece`` (after the first) the copying head would not have emitted reading
    ``ctx``, the victim's pages as they were (:func:`context_text`), then ``prior`` (what decode generated
    before the piece), then the piece itself — each miss as its position in ``"[" + piece``.

    The head scores each position ``j`` by how its predecessors match the query's last three
    characters (``G_IND``: 40 for the current one, payload characters only; 20 each for the two before,
    payload or ``[``) and emits the best-scoring position's character. Where a stale canary is cut short
    (its next page holds another request's byte), no position scores 40 and a partial match of 20 wins:
    the recital goes on with that character. Where the piece opens the reply (``prior`` empty), its first
    character came from prefill, which read the prompt whole, and the query after it reads the victim's
    last prompt pages as they sat — stale filler there matches nothing. Where no position matches at all,
    the head attends to every position alike and emits the character its values hold most often (a tie
    may go either way). ``UNKNOWN_CHAR`` pages could hold anything: they may match and may be emitted
    where a known page matches as well (the bound is taken in the recital's favour only there; a match in
    the reply's own text is no such anchor), but never stand in where no known page matches, and an
    unmatched step over them is not explained."""
    full = ctx + prior + piece
    base = len(ctx) + len(prior)  # full[base] is piece[0]
    payload, starts = set(canary.ALPHABET), set(canary.ALPHABET) | {"["}
    bad = []
    for k in range(1, len(piece)):
        i = base + k  # the character emitted; the query sits at i - 1
        q = [(G_IND[0], full[i - 1] if full[i - 1] in payload else None)]
        q += [(w, full[i - d] if i - d >= 0 and full[i - d] in starts else None) for w, d in zip(G_IND[1:], (2, 3))]
        best, on_pages, cands, wild = 0, 0, set(), False
        scored = []
        for j in range(3, i):  # the keys decode holds when it emits full[i]: the pages and what it generated
            y = full[j]
            if y not in payload and y != UNKNOWN_CHAR:
                continue
            lo = hi = 0
            for (w, b), d in zip(q, (1, 2, 3)):
                a = full[j - d]
                if b is None:
                    continue
                if a == b:
                    lo += w
                    hi += w
                elif a == UNKNOWN_CHAR:
                    hi += w
            if hi:
                scored.append((lo, hi, y))
                best = max(best, lo)
                if j < len(ctx):
                    on_pages = max(on_pages, lo)
        for lo, hi, y in scored:
            if hi >= best and best > 0:
                if y != UNKNOWN_CHAR:
                    cands.add(y)
                elif on_pages:  # an unreadable page stands in only beside a known page's match
                    wild = True
        if not scored and UNKNOWN_CHAR not in full[:i]:  # no position matches at all
            counts = Counter(c for c in full[:i] if c in payload or c == "]")
            top = max(counts.values(), default=0)
            cands = {c for c, n in counts.items() if n == top and top > 0}
        if not (full[i] in cands or wild):
            bad.append(k + 1)
    return bad


def _before(h: History, witness: dict) -> str:
    """What decode generated before the witness's piece: the reply's text up to it (empty where the
    piece opens the reply); ``[`` where the witness is not a place in the reply's text (the recital
    opens after a ``[`` of its own)."""
    text = _reply(h, witness.get("victim_rid"))
    at, piece = (witness.get("offsets") or [None])[0], witness.get("matched") or ""
    if witness.get("view") != "body.text" or text is None or not isinstance(at, int) \
            or text[at:at + len(piece)] != piece:
        return "["
    return text[:at]


def _explains_chimera(h: History, witness: dict, registry=None) -> tuple[bool, str, dict | None]:
    victim, piece = witness.get("victim_rid"), witness.get("matched") or ""
    sp = stale_pages(h, victim, registry)
    if sp is None:
        return False, f"no decode page evidence for {victim} (kv_prealloc / write_end with page lists)", None
    if not sp["unwritten"]:
        return False, f"every one of the {sp['reserved']} pages decode gave {victim} was written by its transfer", sp
    stale = {canary.payload(c) for w in sp["writers"] for c in carried_by(h, w, registry)}
    # pages decode gave a writer for its generated tokens hold its reply: each page's key its own
    # predecessors there, wherever the page sits in the victim's list
    stale |= {t for w in sp.get("generated_by", {}) if (t := _reply(h, w, registry))}
    own = {canary.payload(c) for c in carried_by(h, victim, registry)}
    # the text as it sat in the victim's pages (a stale canary cut short and followed by another
    # request's characters is read that way), beside the canaries as their writers sent them
    ctx = context_text(h, victim, registry)
    miss = _not_copyable(piece, stale | own)
    if miss and ctx and ctx.strip(UNKNOWN_CHAR):  # a character either reading explains is explained
        miss = sorted(set(miss) & set(_not_from_context(piece, ctx, _before(h, witness))))
    missing = [_label(piece, k) for k in miss]
    # and the copying went through a stale page: some trigram of it after the first is a stale canary's
    if missing or not any(piece[i:i + 3] in p for i in range(1, len(piece) - 2) for p in stale):
        return False, (f"{piece!r} is not made of the canaries carried (or replies generated) by the requests whose "
                       f"bytes {victim}'s unwritten pages hold ({len(stale)} texts; not copyable from them: "
                       f"{missing[:5]}{'' if missing else ', and no trigram of a stale one'})"), sp
    return True, (f"{victim} read {sp['unwritten']} of {sp['reserved']} pages its transfer never wrote; {piece!r} is "
                  f"made of the canaries carried (or replies generated) by the requests whose bytes they hold "
                  f"({len(stale)} texts)"), sp
