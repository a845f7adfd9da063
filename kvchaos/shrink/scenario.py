"""A scenario as data: the plans, the faults as armed, and the steps that make it smaller."""

from __future__ import annotations

import copy
import dataclasses
import random

from kvchaos import canary
from kvchaos.probe import MIN_HEAD, MIN_TAIL, TRIGGER
from kvchaos.workload.snapshots import flush_caches


class ShrinkError(RuntimeError):
    pass


def fault_records(ex) -> list[dict]:
    """The faults this experiment armed, as data (what an attempt re-arms), from its own log's
    ``fault``/``armed`` records (the injectors have forgotten healed faults by now)."""
    out, other = [], []
    for e in ex.events:
        if e.get("ev") == "fault" and e.get("injector") == "process":  # kills and freezes: not data to re-arm
            other.append(f"{e.get('kind')} of {e.get('role')}")
            continue
        if e.get("ev") != "fault" or e.get("action") != "armed":
            continue
        if e.get("injector") == "agent":
            out.append({"injector": "agent", "role": e["role"], "kind": e["kind"], "target": dict(e.get("target") or {}),
                        "params": dict(e.get("params") or {}), "count": e.get("count")})
        elif e.get("injector") == "proxy":
            out.append({"injector": "proxy", "proxy": e["proxy"], "type": e["kind"], "stream": e["stream"],
                        "attributes": dict(e.get("attributes") or {}), "toxicity": e["toxicity"]})
        else:
            other.append(e.get("fault") or e.get("kind"))
    if other:
        raise ShrinkError(f"experiment {ex.name}: faults {sorted(set(other))} are not agent or network faults "
                          "(process kills and freezes are actions, not data to re-arm): not shrinkable")
    return out


def kept_ops(ops: list, keep: set, rids: set | None, gates: dict) -> tuple[list, dict]:
    """Nemesis ops less some (a shrink step's, ``ex.nemesis``; a search's, ``kvchaos.fuzz.grammar``): those
    of indices ``keep`` whose requests are all among ``rids`` (None: any), less every op that waits on one
    left out (followed through), renumbered; and the gates of the plans in ``rids`` on the ops kept (a
    plan whose op is gone is sent without waiting)."""
    index: dict[int, int] = {}
    out = []
    for i, o in enumerate(ops):
        if i not in keep:
            continue
        waits = [j for j in (o.after, (o.on or {}).get("op")) if j is not None]
        if any(j not in index for j in waits) or (rids is not None and any(r not in rids for r in o.named_rids())):
            continue
        on = dict(o.on, op=index[o.on["op"]]) if o.on and "op" in o.on else o.on
        index[i] = len(out)
        out.append(dataclasses.replace(o, after=None if o.after is None else index[o.after], on=on))
    return out, {r: index[g] for r, g in gates.items() if (rids is None or r in rids) and g in index}


def arm(kit, rec: dict):
    if rec["injector"] == "agent":
        return kit.agent.arm(rec["role"], rec["kind"], target=rec["target"], params=rec["params"], count=rec.get("count"))
    if rec["injector"] == "proxy":
        return kit.net.toxic(rec["proxy"], rec["type"], stream=rec["stream"], toxicity=rec["toxicity"], **rec["attributes"])
    raise ShrinkError(f"cannot arm fault record {rec!r}")


def subset(plans, keep_rids: set, prompts: dict | None = None) -> list:
    """The plans whose rid is kept, in order; a kept plan waiting for a dropped one waits for nothing;
    ``prompts`` (rid -> text) replaces the prompts of a shrink's shortened plans."""
    out = []
    for p in plans:
        if p.rid in keep_rids:
            q = copy.copy(p)
            if q.after is not None and q.after not in keep_rids:
                q.after = None
            if prompts and p.rid in prompts:
                q.prompt = prompts[p.rid]
                q.n_tokens = len(q.prompt)
            out.append(q)
    return out


def shortenable(p) -> bool:
    """A probe prompt whose length is not what the plan is about: not oversized, not a timing arm, not
    one a later turn resends (conversation) or another tenant sends verbatim (identical)."""
    return (not p.oversized and p.timing is None and p.expect_echo and p.sharing not in ("conversation", "identical")
            and p.prompt.endswith(TRIGGER))


def shorten(text: str, keep: int = 0) -> str | None:
    """``text`` with each run of filler after its first ``keep`` characters cut to half (the first
    half kept), never below the probe's head before the first canary or its tail before the
    trigger; every canary, the space on either side of it, and the trigger stay. ``None`` when
    nothing is left to cut. The canaries come out the same, in the same order."""
    if not text.endswith(TRIGGER):
        return None
    body_end = len(text) - len(TRIGGER)
    found = canary.find(text)
    for o, c in found:  # a shared prefix that ends inside a canary (a diverging pair) keeps that canary whole
        if o < keep < o + len(c):
            keep = o + len(c)
    guard = [(0, keep)] + [(max(0, o - 1), min(body_end, o + len(c) + 1)) for o, c in found] + [(body_end, len(text))]
    guard.sort()
    merged = [list(guard[0])]
    for a, b in guard[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    first_canary = found[0][0] if found else body_end
    out = [text[merged[0][0]:merged[0][1]]]
    for (_, a), (b, e) in zip(merged, merged[1:]):
        gap = text[a:b]
        floor = 1
        if b == body_end:
            floor = MIN_TAIL
        if a < first_canary:
            floor = max(floor, MIN_HEAD - a)
        out.append(gap[:max(floor, len(gap) // 2)])  # a gap at or under its floor stays whole
        out.append(text[b:e])
    new = "".join(out)
    if len(new) >= len(text):
        return None
    assert [c for _, c in canary.find(new)] == [c for _, c in found], "shorten lost or split a canary"
    return new


REMINT_TRIES = 10_000  # draws for one canary before the plans are refused (a context of > 32 canaries)


def remint(plans, rng: random.Random) -> list:
    """The plans with every canary replaced by a fresh one (same opening character: a context's
    canaries keep their distinct first characters), the same way in every prompt that carries it (a
    conversation's later turn repeats the earlier's). A run on a reused cluster whose plans carry the
    canaries of an earlier run could read that run's KV in a stale page and credit it to this one's
    owner: with fresh canaries it reads as an earlier experiment's, and only this run's own traffic can
    make the leak it is judged by.

    As :func:`kvchaos.canary.mint` does, no trigram of a new canary occurs twice among the canaries of
    any prompt it is in: the probe copies by trigram, and two canaries of one prompt sharing one (a
    fuzz control, 2026-12-05: ``[TQFLTVTG2H]`` beside ``[GMX2LTVNZP]``) made it recite a chimera of the
    two, ``[TQFLTVNZP]``, which isolation rightly counts as a canary nobody minted: a red run with
    nothing leaked."""
    old = sorted({c for p in plans for c in (p.canaries or [])})
    beside: dict[str, set] = {c: set() for c in old}  # canary -> the canaries sharing a prompt with it
    for p in plans:
        ctx = set(p.canaries or []) | {c for _at, c in canary.find(p.prompt or "") if c in beside}
        for c in ctx:
            beside[c] |= ctx - {c}
    taken = set(old)
    new: dict[str, str] = {}
    grams: dict[str, set] = {}
    for c in old:
        near = set().union(*(grams[n] for n in beside[c] if n in grams))
        for _ in range(REMINT_TRIES):
            d = canary.START + c[len(canary.START)] + "".join(
                rng.choice(canary.ALPHABET) for _ in range(canary.PAYLOAD_LEN - 1)) + canary.END
            g = [d[j:j + 3] for j in range(len(d) - 2)]
            if d not in taken and len(set(g)) == len(g) and not near.intersection(g):
                break
        else:
            raise ShrinkError(f"no fresh canary for {c} with trigrams apart from the {len(beside[c])} canaries "
                              f"beside it in {REMINT_TRIES} draws")
        taken.add(d)
        new[c], grams[c] = d, set(g)
    out = []
    for p in plans:
        q = copy.copy(p)
        text = q.prompt
        for c in old:  # its own canaries, and an earlier turn's inside this prompt
            text = text.replace(c, new[c])
        q.prompt, q.canaries = text, [new[c] for c in q.canaries or []]
        out.append(q)
    return out


def as_on_a_fresh_cluster(cluster, plans, rng: random.Random, timeout_s: float = 30.0) -> list:
    """``plans`` to run as if on a fresh cluster: both roles' caches flushed (SGLang's ``/flush_cache``:
    prefix trees emptied, the KV allocators' free lists back in their start order) and canaries of their
    own (:func:`remint`), so what earlier runs left in the pages reads as theirs. Raises
    :class:`ShrinkError` naming the roles that would not flush within ``timeout_s``."""
    flushed = flush_caches(cluster, timeout_s=timeout_s)
    bad = {r: v for r, v in flushed.items() if v is not True}
    if bad:
        raise ShrinkError(f"the caches could not be flushed: {bad}")
    return remint(plans, rng)
