"""Isolation: no client receives a canary minted for another request — and the evidence that it would
have been seen (power, per exercised class).

**What is scanned.** Every view of every byte each client received (``History.client_views``): the
parsed text, errors, raw bodies, streams re-read leniently (deltas joined; data after a malformed line
or ``[DONE]``), metadata strings, output ids decoded, a prefill leg's error body. A cut stream, an
aborted or timed-out reply and an error body are scanned like a complete one.

**One matching rule.** A reply shows a canary when it holds the canary's payload or any
``partial_len``-character window of it — for every canary the judgement knows, wherever it was
minted: this log's plans and the ``registry`` handed to the checker (the session's canaries, or every
log given to ``kvchaos judge``). A canary minted for this request in this log is its own. Canaries
nobody known minted are found by the same length: a run of at least ``partial_len`` characters of the
canary alphabet, anchored the way a recital is (after ``[``, before ``]``, or opening the model's
text), that no known canary explains, is a canary of unknown origin — a leak too.

**Power** (:func:`power`). Isolation may PASS only where a leak would have shown. The evidence is a
request that carries canaries, was built to echo them, completed normally with HTTP 200 and, if it
hit its token limit, still recited all of its own. Requests a fault broke on purpose (``short``,
``fail``, ...), requests the workload cut or aborted on purpose and oversized prompts are neither
evidence nor counted against it; everything else that did not complete (errors, cuts, timeouts,
replies cut by the token limit before their recital ended) counts against it. The floor holds per
*exercised class*: the workload as a whole (``all``), and for every fault that acted, the requests it
acted on and the requests in flight beside them (or in flight while a fault without a target was
active). Each class needs enough evidence requests, a one-sided Clopper-Pearson lower bound on its
canaries' echo rate, and at least ``min_observed`` of its candidates observed.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import ahocorasick

from kvchaos import canary
from kvchaos.history import History, Witness, as_history

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict

ECHO_RATE = 0.99
CORRUPTING_FAULTS = ("short", "fail", "reject_admitted", "prefix_collision")  # break their target on purpose
NODE_FAULTS = ("process", "k8s")  # kill / stop a role: what it was serving while down fails on purpose
WORKLOAD_CUT = ("abort_after", "disconnect_before_first_token")  # plans the client itself cuts short
TEXT_VIEWS = ("body.text", "body.raw as server-sent events", "body.output_ids")  # the model's own text
RUN = re.compile(r"(?<![A-Z2-7])[A-Z2-7]+(?![A-Z2-7])")


# --------------------------------------------------------------------------- power
@dataclass(frozen=True)
class SensitivityFloor:
    """When a class of requests counts as able to show a leak. ``all`` (the whole workload): at least
    ``min_samples`` evidence requests and a ``confidence`` lower bound >= ``min_rate`` on their
    canaries' echo rate — the model's recital rate, established. Each fault's exposure class:
    ``class_min_samples`` evidence requests and a lower bound >= ``class_min_rate`` — that the recital
    held where the fault acted. A class of at least ``class_min_samples`` evidence requests that recited
    every canary is met whatever the bound (5 requests x 2 canaries, 10/10, bound only 0.741; from
    11/11 on the bound is >= 0.762 anyway); one unrecited canary of 10, 12 or 15 (bound 0.606, 0.661,
    0.721) is not. Every class: at least
    ``min_observed`` of its candidate requests observed (evidence)."""
    min_samples: int = 20
    min_rate: float = 0.95
    confidence: float = 0.95
    class_min_samples: int = 5
    class_min_rate: float = 0.75
    min_observed: float = 0.5

    def __post_init__(self):
        for k in ("min_samples", "class_min_samples"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"SensitivityFloor.{k} must be an int >= 1, got {getattr(self, k)!r}")
        for k in ("min_rate", "confidence", "class_min_rate", "min_observed"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"SensitivityFloor.{k} must be in (0, 1], got {getattr(self, k)!r}")

    def lower_bound(self, k: int, n: int) -> float:
        return binomial_lower_bound(k, n, self.confidence)


DEFAULT_FLOOR = SensitivityFloor()


def binomial_lower_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper-Pearson) lower confidence bound of a rate seen as k of n: the p at
    which P(X >= k | n, p) = 1 - confidence. 0 for k == 0."""
    if n <= 0 or k <= 0:
        return 0.0
    alpha = 1.0 - confidence

    def tail(p):  # P(X >= k), term by term in log space (no overflow for large n)
        lp, lq = math.log(p), math.log1p(-p)
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                   for i in range(k, n + 1))

    if k == n:
        return alpha ** (1.0 / n)
    lo, hi = 1e-12, k / n
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) < alpha:
            lo = mid
        else:
            hi = mid
    return lo


def _fired(h: History) -> list[dict]:
    """Every act of a fault: the agents' ``fault_fired`` and the harness's ``fault`` records (fired,
    aborts sent), as (class name, rid or None, wall, fault id, corrupting)."""
    out, seen = [], set()
    for e in h.agent_events("fault_fired"):
        kind = e.get("kind")
        key = (e.get("fault"), e.get("rid"), kind)
        seen.add(key)
        out.append({"cls": f"agent:{kind}", "rid": e.get("rid"), "wall": e.get("wall"), "fault": e.get("fault"),
                    "corrupting": kind in CORRUPTING_FAULTS})
    for e in h.fault_records():
        act, kind = e.get("action"), e.get("kind")
        if act == "abort_request":
            out.append({"cls": "abort_request", "rid": e.get("rid"), "wall": e.get("at", e.get("wall")),
                        "fault": e.get("fault"), "aborted": True})
        elif act == "fired":
            inj = e.get("injector") or "fault"
            if inj == "agent":
                if (e.get("fault"), e.get("rid"), kind) in seen:
                    continue  # the agent's own event is in the log too
                out.append({"cls": f"agent:{kind}", "rid": e.get("rid"), "wall": e.get("at", e.get("wall")),
                            "fault": e.get("fault"), "corrupting": kind in CORRUPTING_FAULTS})
            else:
                role = e.get("role")
                out.append({"cls": f"{inj}:{kind}" + (f":{role}" if role else ""), "rid": e.get("rid"),
                            "wall": e.get("at", e.get("wall")), "fault": e.get("fault"), "role": role,
                            # a node killed or frozen fails what it was serving: broken on purpose
                            "node_down": inj in NODE_FAULTS})
    for e in h.agent_events("mutation_on"):
        out.append({"cls": f"agent:{e.get('kind')}", "rid": None, "wall": e.get("wall"), "fault": e.get("fault"),
                    "corrupting": False})
    return out


def _healed_at(h: History, act: dict) -> float:
    """When the fault of ``act`` stopped acting (its heal), else never (the end of the history)."""
    fid, t0 = act.get("fault"), act.get("wall") or 0
    best = math.inf
    for e in h.fault_records("healed"):
        w = e.get("at", e.get("wall"))
        if not isinstance(w, (int, float)) or w < t0:
            continue
        if (fid and e.get("fault") == fid) or (not fid and act.get("role") and e.get("role") == act["role"]):
            best = min(best, w)
    for e in h.agent_events("healed"):
        if fid and e.get("fault") == fid and isinstance(e.get("wall"), (int, float)) and e["wall"] >= t0:
            best = min(best, e["wall"])
    return best


def exposure_classes(h: History) -> dict[str, dict]:
    """Class name -> {acted: rids a fault acted on, exposed: those and every request in flight beside
    them (or while a fault without a target was active), corrupted, aborted}."""
    windows = {rid: h.window(rid) for rid in h.plans}
    classes: dict[str, dict] = {}
    for a in _fired(h):
        c = classes.setdefault(a["cls"], {"acted": set(), "spans": [], "corrupted": set(), "aborted": set(),
                                          "node_down": False})
        rid = a.get("rid")
        if rid:
            c["acted"].add(rid)
            if a.get("corrupting"):
                c["corrupted"].add(rid)
            if a.get("aborted"):
                c["aborted"].add(rid)
            if windows.get(rid):
                c["spans"].append(windows[rid])
        elif isinstance(a.get("wall"), (int, float)):
            c["spans"].append((a["wall"], _healed_at(h, a)))
            c["node_down"] = c["node_down"] or bool(a.get("node_down"))
    for c in classes.values():
        c["exposed"] = set(c["acted"]) | _overlapping(windows, c["spans"])
        if c["node_down"]:  # in flight while the role was down and not answered: broken on purpose
            c["corrupted"] |= {r for r in c["exposed"] if not (h.outcome(r) == "ok" and h.statuses.get(r) == 200)}
        del c["spans"]
    return classes


def _overlapping(windows: dict, spans: list) -> set:
    """The rids whose window overlaps any of ``spans`` (closed intervals): the spans merged once and each
    window looked up by bisection, so a fault acting on every request of a long log costs n log n, not
    n squared."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [m[0] for m in merged]
    out = set()
    for rid, w in windows.items():
        if not w:
            continue
        i = bisect.bisect_right(starts, w[1]) - 1  # the last merged span starting at or before the window's end
        if i >= 0 and merged[i][1] >= w[0]:
            out.add(rid)
    return out


def power(h, floor: SensitivityFloor = DEFAULT_FLOOR, echo_rate: float = ECHO_RATE) -> dict:
    """Per exercised class, the evidence that a leak would have been seen (module doc). Returns
    ``{"met": bool, "classes": {name: {...figures, "met", "why"}}, "hit_limit": [...], "misses": [...]}``."""
    h = as_history(h)
    classes = exposure_classes(h)
    corrupted = set().union(*(c["corrupted"] for c in classes.values())) if classes else set()
    aborted = set().union(*(c["aborted"] for c in classes.values())) if classes else set()
    per: dict[str, dict] = {}  # rid -> its standing
    misses, hit_limit = [], []
    for rid, p in h.plans.items():
        cs = p.get("canaries") or []
        if not cs or not p.get("expect_echo", True) or p.get("oversized") or p.get("kind") in WORKLOAD_CUT \
                or rid in aborted or rid in corrupted:
            per[rid] = None  # not a candidate: cannot be evidence by design
            continue
        text = h.reply_text(rid)
        echoed = sum(canary.payload(c) in text for c in cs)
        body = h.bodies.get(rid) or {}
        finish = h.finish_reason(rid)
        ok = (h.outcome(rid) == "ok" and h.statuses.get(rid) == 200 and body.get("complete", True)
              and finish != "abort")
        if ok and finish == "length":
            hit_limit.append({"rid": rid, "own_recited": f"{echoed}/{len(cs)}", "evidence": echoed == len(cs)})
            ok = echoed == len(cs)  # cut by its budget: evidence only with its own recital complete
        per[rid] = (len(cs), echoed) if ok else False
        if ok and echoed < len(cs) and len(misses) < 10:
            misses.append({"rid": rid, "missing": [c for c in cs if canary.payload(c) not in text],
                           "reply": text[:120]})
    out = {"all": _class_figures("all", set(h.plans), per, floor, echo_rate, all_class=True)}
    for name, c in sorted(classes.items()):
        broken = len(c["exposed"] & (c["corrupted"] | c["aborted"]))
        fig = _class_figures(name, c["exposed"], per, floor, echo_rate, broken=broken)
        fig.update({"acted": len(c["acted"]), "corrupted": len(c["corrupted"]), "aborted": len(c["aborted"])})
        out[name] = fig
    return {"met": all(f["met"] for f in out.values()), "classes": out, "hit_limit": hit_limit, "misses": misses,
            "floor": {k: getattr(floor, k) for k in floor.__dataclass_fields__}, "echo_rate": echo_rate}


def _class_figures(name, rids, per, floor, echo_rate, all_class=False, broken=0) -> dict:
    """Figures of one class and whether its floor is met. ``broken``: how many of its requests a fault
    broke (or the workload aborted) on purpose. A class with fewer candidates than its floor asks for
    only because the fault broke the rest on purpose — a node down fails what it served — is met when
    every candidate it left was observed reciting all of its own canaries (none at all: nothing was
    served that could show a leak); the whole workload's power stands for the run."""
    cands = [r for r in rids if per.get(r) is not None]
    ev = [per[r] for r in cands if per[r]]
    n_can = sum(n for n, _ in ev)
    n_echo = sum(k for _, k in ev)
    lb = floor.lower_bound(n_echo, n_can)
    rate = n_echo / n_can if n_can else 0.0
    observed = len(ev) / len(cands) if cands else 0.0
    need_n, need_rate = (floor.min_samples, floor.min_rate) if all_class else (floor.class_min_samples, floor.class_min_rate)
    thin = (not all_class and broken and len(cands) < need_n and len(ev) == len(cands)
            and all(k == n for n, k in ev))
    why = []
    if not thin:
        if len(ev) < need_n:
            why.append(f"{len(ev)} evidence requests (with canaries, completed with HTTP 200): fewer than {need_n}")
        if lb < need_rate and (all_class or n_echo < n_can):  # a small fault class that recited everything is met
            why.append(f"echo lower bound {lb:.3f} < {need_rate:.2f}")
        if all_class and rate < echo_rate:
            why.append(f"echo rate {100 * rate:.1f} % < {100 * echo_rate:.0f} %")
        if cands and observed < floor.min_observed:
            why.append(f"only {len(ev)} of {len(cands)} candidate requests observed "
                       f"({100 * observed:.0f} % < {100 * floor.min_observed:.0f} %)")
        if not cands:
            why.append("no request that could show a leak")
    return {"broken": broken, "thin": bool(thin), "requests": len(rids), "candidates": len(cands), "evidence": len(ev),
            "echoed_requests": sum(1 for n, k in ev if k == n), "canaries": n_can, "echoed": n_echo,
            "rate": round(rate, 4), "lower_bound": round(lb, 4), "observed": round(observed, 3),
            "met": not why, "why": "; ".join(why)}


def power_line(pw: dict) -> str:
    """One line of per-class figures."""
    parts = []
    for name, f in pw["classes"].items():
        if f.get("thin"):
            parts.append(f"{name}: {f['broken']} of its {f['requests']} requests broken on purpose, the "
                         f"{f['evidence']} it left served with all their own canaries recited")
            continue
        parts.append(f"{name}: {f['evidence']}/{f['candidates']} requests, {f['echoed']}/{f['canaries']} canaries "
                     f"(lb {f['lower_bound']:.3f})" + ("" if f["met"] else f" — NOT MET: {f['why']}"))
    return "; ".join(parts)


def sensitivity(h, echo_rate: float = ECHO_RATE, floor: SensitivityFloor | None = None, registry=None) -> Verdict:
    """The power report as a verdict: PASS when every exercised class meets its floor, else UNKNOWN."""
    pw = power(h, floor or DEFAULT_FLOOR, echo_rate)
    a = pw["classes"]["all"]
    stats = {"eligible": a["evidence"], "echoed": a["echoed_requests"], "canaries": a["canaries"],
             "canaries_echoed": a["echoed"], "rate": a["rate"], "lower_bound": a["lower_bound"], "power": pw}
    what = power_line(pw)
    if not pw["met"]:
        return Verdict("sensitivity", UNKNOWN, f"this run cannot show that a leak would be seen — {what}",
                       pw["misses"], stats)
    return Verdict("sensitivity", PASS, what, pw["misses"], stats)


# --------------------------------------------------------------------------- matching
def known_canaries(h: History, registry=None) -> list[tuple]:
    """(rid, tenant, canary, source) of every canary this judgement knows: this log's plans (source
    None) and the registry's (by canary: another log may reuse a rid for other canaries)."""
    minted = [(rid, p.get("tenant"), c, None) for rid, p in h.plans.items() for c in p.get("canaries") or []]
    if registry is not None:
        own = {c for _r, _t, c, _s in minted}
        minted += [(m.rid, m.tenant, m.canary, m.source) for m in registry.entries() if m.canary not in own]
    return minted


def automaton(minted, partial_len: int):
    a = ahocorasick.Automaton()
    owners: dict[str, list] = defaultdict(list)
    for rid, tenant, c, source in minted:
        pay = canary.payload(c)
        owners[pay].append((rid, tenant, c, "exact", source))
        for i in range(len(pay) - partial_len + 1):
            owners[pay[i:i + partial_len]].append((rid, tenant, c, "partial", source))
    for key, val in owners.items():
        a.add_word(key, (key, val))
    if len(a):
        a.make_automaton()
    return a


def scan(text: str, auto) -> list[tuple[int, int, str, list]]:
    """(start, end, matched, owners) for every exact or partial canary hit in ``text``."""
    if not len(auto):
        return []
    return [(end - len(key) + 1, end + 1, key, owners) for end, (key, owners) in auto.iter(text)]


def isolation(h, partial_len: int = 8, echo_rate: float = ECHO_RATE, registry=None,
              floor: SensitivityFloor | None = None, auto=None) -> Verdict:
    """LEAK (FAIL): a client received a canary minted for another request, or one nobody known
    minted. Otherwise PASS only with power in every exercised class, else UNKNOWN. ``auto``: the
    matcher of every known canary, built beforehand (:meth:`Isolation.live`); else built here from
    ``h``'s plans and ``registry``."""
    h = as_history(h)
    if auto is None:
        auto = automaton(known_canaries(h, registry), partial_len)
    witnesses, seen = [], set()
    for rid in h.responses() + [None]:  # None: records naming no request
        victim = h.plans.get(rid, {}) if rid else {}
        common = {"victim_rid": rid, "victim_tenant": victim.get("tenant"), "status": h.statuses.get(rid),
                  "outcome": h.outcome(rid), "complete": (h.bodies.get(rid) or {}).get("complete", True)}
        base = 0
        for view in (h.client_views(rid) if rid else h.unattributed_views()):
            text = view.text
            hits = scan(text, auto)
            exact_spans = [(s, e) for s, e, _k, own in hits if any(o[3] == "exact" for o in own)]
            for s, e, key, owners in hits:
                # own: minted for this request in this log (a registry entry of the same rid is another request)
                foreign = [o for o in owners if not (o[0] == rid and o[4] is None)]
                if not foreign or len(foreign) < len(owners):
                    continue  # own canary (or a window of one)
                kind = "exact" if any(o[3] == "exact" for o in foreign) else "partial"
                if kind == "partial" and any(a <= s and e <= b for a, b in exact_spans):
                    continue  # window inside an exact hit already reported
                for owner_rid, owner_tenant, c, source in {(o[0], o[1], o[2], o[4]) for o in foreign}:
                    if (rid, owner_rid, c, kind) in seen:
                        continue  # the same canary in another view of the same reply
                    seen.add((rid, owner_rid, c, kind))
                    witnesses.append(Witness({**common, "owner_rid": owner_rid, "owner_tenant": owner_tenant,
                                              "origin": "this log" if source is None else f"session ({source})",
                                              "canary": c, "matched": key, "match": kind, "view": view.name,
                                              "offsets": [base + s, base + e],
                                              "same_tenant": owner_tenant == victim.get("tenant"),
                                              "excerpt": text[max(0, s - 40):e + 40]}))
            for s, e, piece in _unknown_runs(text, view.name, hits, partial_len):
                if (rid, None, piece, "unknown") in seen:
                    continue
                seen.add((rid, None, piece, "unknown"))
                witnesses.append(Witness({**common, "owner_rid": None, "owner_tenant": None, "origin": "unknown",
                                          "canary": f"[{piece}]" if len(piece) == canary.PAYLOAD_LEN else None,
                                          "matched": piece, "match": "unknown-origin", "view": view.name,
                                          "offsets": [base + s, base + e], "same_tenant": False,
                                          "excerpt": text[max(0, s - 40):e + 40],
                                          "problem": "a recital of a canary nobody known to this judgement minted"}))
            base += len(text) + 1
    pw = power(h, floor or DEFAULT_FLOOR, echo_rate)
    n = len(h.responses())
    stats = {"responses": n, "power": pw, "partial_len": partial_len,
             "registry": len(registry) if registry is not None else None}
    if witnesses:
        victims = sorted({w["victim_rid"] for w in witnesses}, key=str)
        w0 = witnesses[0]
        owner = (f"{w0['owner_rid']} ({w0['owner_tenant']})" if w0["owner_rid"] else "nobody: canary of unknown origin")
        stats["victims"] = len(victims)
        return Verdict("isolation", FAIL,
                       f"LEAK: {len(victims)} of {n} responses hold canaries minted for other requests "
                       f"(first: {w0['victim_rid']} ({w0['victim_tenant']}) got {w0['matched']!r} of "
                       f"{owner}, HTTP {w0['status']}, {w0['outcome']}, in {w0['view']})"
                       + ("" if pw["met"] else f" — power NOT met: {power_line(pw)}"), witnesses, stats)
    if not pw["met"]:
        return Verdict("isolation", UNKNOWN, f"no foreign canary in {n} responses, but this run cannot show that "
                       f"a leak would be seen: {power_line(pw)}", [], stats)
    return Verdict("isolation", PASS, f"no foreign canary in {n} responses; {power_line(pw)}", [], stats)


def _unknown_runs(text: str, view: str, hits, partial_len: int):
    """Runs of the canary alphabet, anchored as a recital is, that no known canary's hit covers:
    (start, end, the uncovered piece) for each uncovered piece of at least ``partial_len`` that could
    be part of a canary (:func:`kvchaos.canary.canary_shaped`)."""
    covered = sorted((s, e) for s, e, _k, _o in hits)
    text_view = view.startswith(TEXT_VIEWS)
    for m in RUN.finditer(text):
        s, e = m.span()
        if e - s < partial_len:
            continue
        if not ((s > 0 and text[s - 1] == "[") or text[e:e + 1] == "]" or (s == 0 and text_view)):
            continue
        pos, pieces = s, []
        for a, b in covered:
            if b <= pos or a >= e:
                continue
            if a - pos >= partial_len:
                pieces.append((pos, a))
            pos = max(pos, b)
        if e - pos >= partial_len:
            pieces.append((pos, e))
        for a, b in pieces:
            if canary.canary_shaped(text[a:b], partial_len):  # "EEEEEEEE": degenerate output, not a canary
                yield a, b, text[a:b]


# --------------------------------------------------------------------------- checkers
class Isolation(Checker):
    """Options bound here; the canary registry comes with the call (``check(history, registry)``):
    the runner hands every checker the session's."""
    name, leak, log_only = "isolation", True, True

    def __init__(self, partial_len: int = 8, echo_rate: float = ECHO_RATE, floor: SensitivityFloor = DEFAULT_FLOOR):
        if partial_len < 4 or partial_len > canary.PAYLOAD_LEN:
            raise ValueError(f"partial_len must be 4..{canary.PAYLOAD_LEN}, got {partial_len}")
        self.partial_len, self.echo_rate, self.floor = partial_len, echo_rate, floor

    def check(self, history, registry=None):
        return isolation(history, self.partial_len, self.echo_rate, registry, self.floor)

    def live(self, plans: dict, registry=None):
        """A judge of replies as they end, for a run whose ``plans`` (rid -> its plan record: canaries,
        tenant) are these: ``judge(part) -> Verdict`` on a history holding some of the run's replies.
        Its FAIL is this checker's FAIL on the whole run: every witness names a reply against canaries
        known before it was judged, and the rest of the run can only add witnesses. Anything else it
        says is about the part only (never the run's PASS)."""
        auto = automaton(known_canaries(SimpleNamespace(plans=plans), registry), self.partial_len)
        return lambda part: isolation(part, self.partial_len, self.echo_rate, None, self.floor, auto=auto)


class Sensitivity(Checker):
    name = "sensitivity"

    def __init__(self, echo_rate: float = ECHO_RATE, floor: SensitivityFloor = DEFAULT_FLOOR):
        self.echo_rate, self.floor = echo_rate, floor

    def check(self, history, registry=None):
        return sensitivity(history, self.echo_rate, self.floor)
