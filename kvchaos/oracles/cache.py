"""Prefix-cache oracles: who may reuse whose cached prefix, seen in what the engine reports and in
how fast it answers.

* :func:`cache_isolation` — every reply's ``cached_tokens`` (``meta_info``) must be explained by a
  prefix its own namespace (its ``cache_salt``) had already been sent: the longest common prefix
  with an earlier same-salt prompt (+ its reply). More is a FAIL whose witness says whose prefix it
  was: another salt's (the salt did not isolate it) or nobody's in the log (the cache matched a
  different token sequence: a collision). Green also needs evidence that the property was
  exercised: same-salt requests that could reuse a prefix did (the cache is on and reported), and
  requests that another salt's longer prefix could have served exist. With the in-engine agent the
  verdict also says which salt the engine itself received (``prefix_match`` events): salts the
  client sent that never reached the engine make a clean-looking run UNKNOWN, never PASS.
* :func:`timing_isolation` — the timing side channel (Gu et al., ICML 2025; vLLM CVE-2025-46570):
  time to first token of a prompt whose prefix another salt cached must be indistinguishable from
  one never cached (two-sample Kolmogorov-Smirnov, ``alpha``), while the same-salt hit-vs-miss
  control must be distinguishable at the same ``alpha`` (else the probe had no power: UNKNOWN), and
  the salts must have reached the engine (agent evidence; else UNKNOWN: the arms were not separated).

Characters are tokens for the probe model's tokenizer (one token per character, no BOS); the
checker verifies it per request (``prompt_tokens`` = prompt length) and says UNKNOWN otherwise.
"""

from __future__ import annotations

import os

from kvchaos.history import agent_kind
from kvchaos.history import as_history as Run

from .base import FAIL, PASS, UNKNOWN, Checker, Verdict
from .kvpages import kv_page_size

TIMING_ARMS = ("same_salt_hit", "same_salt_miss", "cross_salt", "never_cached")


def _lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _cached(body: dict) -> int | None:
    meta = (body or {}).get("meta") or {}
    if "cached_tokens" in meta:  # /generate meta_info
        return meta.get("cached_tokens")
    details = meta.get("prompt_tokens_details") or {}  # OpenAI usage (needs --enable-cache-report)
    return details.get("cached_tokens") if isinstance(details, dict) else None


def _engine_salts(events: list[dict]) -> dict[str, list]:
    """rid -> the cache_salt values the engine's prefix lookups used (the agent's ``prefix_match``)."""
    out: dict[str, list] = {}
    for e in events:
        if agent_kind(e) == "prefix_match" and e.get("rid"):
            out.setdefault(e["rid"], []).append(e.get("cache_salt"))
    return out


def _cache_requests(run) -> tuple[list, list, list, list]:
    """Each request the checker may judge as (rid, plan, send t, end t, cached, prompt + reply text),
    then the rids whose plan carries no prompt, the completed replies that report no cached_tokens,
    and (rid, prompt tokens, characters) where characters are not tokens."""
    reqs = []
    no_prompt, no_report, untokenized = [], [], []
    for rid, p in run.plans.items():
        end, send = run.ends.get(rid), run.sends.get(rid)
        if send is None or p.get("oversized"):
            continue
        if "prompt" not in p:
            no_prompt.append(rid)
            continue
        body = run.bodies.get(rid) or {}
        ok = end is not None and end.get("outcome") == "ok" and run.statuses.get(rid) == 200
        cached = _cached(body) if ok else None
        if ok and cached is None:
            no_report.append(rid)
        pt = ((body.get("meta") or {}).get("prompt_tokens")) if ok else None
        if ok and pt is not None and pt != len(p["prompt"]):
            untokenized.append((rid, pt, len(p["prompt"])))
        # what the tree can hold for it afterwards: the prompt and the reply's tokens
        reqs.append((rid, p, send["t"], (end or {}).get("t", float("inf")), cached,
                     p["prompt"] + ((body.get("text") or "") if ok else "")))
    return reqs, no_prompt, no_report, untokenized


def _prefixes(rid: str, prompt: str, salt, t_send: float, t_end: float, reqs: list) -> tuple[int, int, list]:
    """What the cache could hold for this request: the longest prefix its own salt had sent
    (``same``), that of same-salt requests done before it was sent (``done_same``), and every other
    salt's request as (common prefix, rid, plan, done before it was sent)."""
    limit = len(prompt) - 1  # the engine always computes at least the last token
    same, other, done_same = 0, [], 0
    for rid2, p2, s2, e2, _c2, held2 in reqs:
        if rid2 == rid or s2 >= t_end:
            continue  # a request sent after this one ended cannot have cached anything for it
        lcp = min(_lcp(prompt, held2), limit)
        if p2.get("cache_salt") == salt:
            same = max(same, lcp)
            if e2 < t_send:
                done_same = max(done_same, min(_lcp(prompt, p2["prompt"]), limit))
        else:
            other.append((lcp, rid2, p2, e2 < t_send))
    return same, done_same, other


def _witness(rid: str, p: dict, got: list | None, cached: int, same: int, other: list) -> dict:
    """A request that reported more cached tokens than its own salt explains: whose prefix it was."""
    salt = p.get("cache_salt")
    owners = sorted((o for o in other if o[0] >= cached), key=lambda o: -o[0])
    w = {"victim_rid": rid, "victim_tenant": p.get("tenant"), "victim_salt": salt, "cached_tokens": cached,
         "same_salt_prefix": same, "prompt_tokens": len(p["prompt"]),
         "engine_salt": (got or [None])[0] if got else "(no agent evidence)"}
    if owners:
        lcp, orid, op, _done = owners[0]
        w.update(owner_rid=orid, owner_tenant=op.get("tenant"), owner_salt=op.get("cache_salt"),
                 common_prefix=lcp, problem="cached tokens of another salt's prefix: the salt did not "
                                            "isolate this request")
    else:
        w.update(owner_rid=None, owner_tenant=None, owner_salt=None,
                 common_prefix=max([o[0] for o in other], default=0),
                 problem="cached tokens beyond every prefix sent before it: the cache matched a "
                         "different token sequence (collision), or a prefix from outside this log")
    return w


def _scan(reqs: list, seen_salts: dict, flushes: list, page: int) -> tuple[list, dict, list]:
    """Every judged request against the prefixes its salt explains: the witnesses, the counts
    (judged, unsalted_skipped, hit_chances, hits, cross_salt_chances) and the salts lost on the way
    to the engine as (rid, salt sent, salt the engine used)."""
    witnesses, lost_salts = [], []  # lost: sent with a salt, looked up by the engine without it
    n = {"judged": 0, "unsalted_skipped": 0, "hit_chances": 0, "hits": 0, "cross_salt_chances": 0}
    for rid, p, t_send, t_end, cached, _held in reqs:
        salt = p.get("cache_salt")
        got = seen_salts.get(rid)
        if salt is not None and got and all(s != salt for s in got):
            lost_salts.append((rid, salt, got[0]))
        if cached is None:
            continue
        if salt is None and not (flushes and min(flushes) < t_send):
            n["unsalted_skipped"] += 1  # the unsalted namespace holds traffic from outside this log: no bound
            continue
        n["judged"] += 1
        same, done_same, other = _prefixes(rid, p["prompt"], salt, t_send, t_end, reqs)
        if done_same >= max(page, 16):
            n["hit_chances"] += 1
            n["hits"] += cached > 0
        if any(done and lcp >= same + max(page, 16) for lcp, _r, _p, done in other):
            n["cross_salt_chances"] += 1
        if cached > same:
            witnesses.append(_witness(rid, p, got, cached, same, other))
    return witnesses, n, lost_salts


def _cache_verdict(witnesses: list, n: dict, lost_salts: list, stats: dict, min_hits: int,
                   min_cross: int) -> Verdict:
    judged, skipped, hits, hit_chances = n["judged"], n["unsalted_skipped"], n["hits"], n["hit_chances"]
    cross_chances = n["cross_salt_chances"]
    lost_note = ""
    if lost_salts:
        rid, s, g = lost_salts[0]
        lost_note = (f"; {len(lost_salts)} requests sent with a cache_salt reached the engine with another "
                     f"(first: {rid} sent {s!r}, engine used {g!r})")
    if witnesses:
        w0 = witnesses[0]
        whose = (f"{w0['owner_rid']} ({w0['owner_tenant']}, salt {w0['owner_salt']!r})" if w0["owner_rid"]
                 else "no prefix in this log")
        return Verdict("cache_isolation", FAIL,
                       f"{len(witnesses)} of {judged} requests reported cached tokens their own salt had not sent "
                       f"(first: {w0['victim_rid']} salt {w0['victim_salt']!r}: {w0['cached_tokens']} cached, "
                       f"its salt's prefixes explain {w0['same_salt_prefix']}; from {whose}){lost_note}",
                       witnesses, stats)
    if lost_salts:
        return Verdict("cache_isolation", UNKNOWN, f"no foreign cached prefix seen, but the salts did not reach the "
                       f"engine{lost_note}: isolation by salt was not exercised", [], stats)
    if judged == 0:
        return Verdict("cache_isolation", UNKNOWN, f"no request could be judged ({skipped} unsalted requests on a "
                       "cache that also holds traffic from outside this log)", [], stats)
    if hits < min_hits:
        return Verdict("cache_isolation", UNKNOWN, f"the cache was not exercised: {hits} of {hit_chances} requests "
                       f"that could reuse their own salt's prefix reported a hit (need >= {min_hits})", [], stats)
    if cross_chances < min_cross:
        return Verdict("cache_isolation", UNKNOWN, f"only {cross_chances} requests had another salt's longer prefix "
                       f"cached before them (need >= {min_cross}): cross-salt reuse was not tried", [], stats)
    return Verdict("cache_isolation", PASS,
                   f"{judged} requests: every cached token explained by the request's own salt's prefixes; "
                   f"{hits}/{hit_chances} same-salt reuse chances hit, {cross_chances} requests had another "
                   f"salt's longer prefix cached and did not take it", [], stats)


def cache_isolation(events, min_hits: int = 5, min_cross: int = 3) -> Verdict:
    run = Run(events)
    events = run.records
    page = kv_page_size(events)
    # unsalted requests are judged only when sent after the prefix cache was flushed (before that,
    # the unsalted namespace holds traffic from outside this log)
    flushes = [e["t"] for e in run.by_ev.get("cache_flushed", [])]
    reqs, no_prompt, no_report, untokenized = _cache_requests(run)
    stats = {"requests": len(reqs), "page_size": page, "cache_flushed": bool(flushes)}
    if no_prompt:
        return Verdict("cache_isolation", UNKNOWN, f"{len(no_prompt)} plans carry no prompt text (a log older than "
                       "prompt recording): common prefixes cannot be computed", [], stats)
    if untokenized:
        rid, pt, n = untokenized[0]
        return Verdict("cache_isolation", UNKNOWN, f"characters are not tokens for this model ({rid}: {pt} prompt "
                       f"tokens for {n} characters): cached_tokens cannot be compared with common prefixes", [], stats)
    if not any(r[4] is not None for r in reqs):
        why = (f"none of {len(no_report)} completed replies reports cached_tokens (OpenAI endpoints report it "
               "only with --enable-cache-report)") if no_report else "no request completed"
        return Verdict("cache_isolation", UNKNOWN, why, [], stats)
    witnesses, n, lost_salts = _scan(reqs, _engine_salts(events), flushes, page)
    stats.update(n, salts_lost=len(lost_salts))
    return _cache_verdict(witnesses, n, lost_salts, stats, min_hits, min_cross)


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and two-sided p-value (scipy's exact/asymptotic)."""
    # here, not at the top: scipy is heavy and only the timing probe needs it (kvchaos.oracles is
    # imported by every checker user)
    from scipy.stats import ks_2samp as _ks

    r = _ks(a, b)
    return float(r.statistic), float(r.pvalue)


def ttfts(events: list[dict], run: Run | None = None) -> dict[str, list[float]]:
    """Arm -> time to first token (seconds, client side: ``send`` to the first streamed event) of
    the timing probe's requests that completed."""
    run = run or Run(events)
    first = {}
    for e in run.by_ev.get("first_byte", []):
        first.setdefault(e.get("rid"), e["t"])
    out: dict[str, list[float]] = {a: [] for a in TIMING_ARMS}
    for rid, p in run.plans.items():
        arm = p.get("timing")
        end = run.ends.get(rid) or {}
        if arm in out and end.get("outcome") == "ok" and rid in first and rid in run.sends:
            out[arm].append(first[rid] - run.sends[rid]["t"])
    return out


def timing_isolation(events, alpha: float = 1e-3, min_n: int = 15) -> Verdict:
    run = Run(events)
    events = run.records
    got = _engine_salts(events)
    arms = ttfts(events, run)
    n = {a: len(v) for a, v in arms.items()}
    salted = [r for r, p in run.plans.items() if p.get("timing") and p.get("cache_salt")]
    lost = [r for r in salted if got.get(r) and all(s != run.plans[r]["cache_salt"] for s in got[r])]
    stats = {"alpha": alpha, "n": n, "median_ms": {a: round(1000 * sorted(v)[len(v) // 2], 1) if v else None
                                                  for a, v in arms.items()},
             "salted": len(salted), "salts_lost": len(lost) if got else None}
    short = [a for a in TIMING_ARMS if n[a] < min_n]
    if short:
        return Verdict("timing_isolation", UNKNOWN, f"too few timed requests in {short} ({n}; need >= {min_n} each)",
                       [], stats)
    d_ctl, p_ctl = ks_2samp(arms["same_salt_hit"], arms["same_salt_miss"])
    d_x, p_x = ks_2samp(arms["cross_salt"], arms["never_cached"])
    stats.update(control={"D": round(d_ctl, 4), "p": p_ctl}, cross={"D": round(d_x, 4), "p": p_x})
    med = stats["median_ms"]
    what = (f"KS same-salt hit vs miss D={d_ctl:.2f} p={p_ctl:.2g} (n={n['same_salt_hit']}/{n['same_salt_miss']}, "
            f"median {med['same_salt_hit']}/{med['same_salt_miss']} ms); cross-salt vs never cached "
            f"D={d_x:.2f} p={p_x:.2g} (n={n['cross_salt']}/{n['never_cached']}, median "
            f"{med['cross_salt']}/{med['never_cached']} ms); alpha {alpha:g}")
    if p_x < alpha:
        return Verdict("timing_isolation", FAIL, f"TIMING SIDE CHANNEL: a prefix another salt cached is told apart "
                       f"from a never-cached one by time to first token — {what}",
                       [{"arms": ["cross_salt", "never_cached"], "D": d_x, "p": p_x, "n": [n["cross_salt"],
                         n["never_cached"]], "median_ms": [med["cross_salt"], med["never_cached"]],
                         "salts_lost": stats["salts_lost"], "salted": len(salted),
                         "problem": "TTFT distinguishes another salt's cached prefix"}], stats)
    if p_ctl >= alpha:
        return Verdict("timing_isolation", UNKNOWN, f"no power: a same-salt hit is not told apart from a miss either "
                       f"— {what}", [], stats)
    if lost:
        return Verdict("timing_isolation", UNKNOWN, f"{len(lost)} of {len(salted)} timed requests reached the engine "
                       f"without the cache_salt they were sent with: the arms were not separated by salt, so "
                       f"not telling them apart says nothing — {what}", [], stats)
    return Verdict("timing_isolation", PASS, what, [], stats)


class CacheIsolation(Checker):
    name, leak = "cache_isolation", True

    def __init__(self, min_hits: int = 5, min_cross: int = 3):
        if min_hits < 1 or min_cross < 1:
            raise ValueError(f"min_hits and min_cross must be >= 1 (a control that cannot fail is no control), "
                             f"got {min_hits}, {min_cross}")
        self.min_hits, self.min_cross = min_hits, min_cross

    def check(self, events, registry=None):
        return cache_isolation(events, self.min_hits, self.min_cross)


class TimingIsolation(Checker):
    name, leak = "timing_isolation", True

    def __init__(self, alpha: float = 1e-3, min_n: int = 15):
        if not 0 < alpha < 0.5:
            raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
        if min_n < 5:
            raise ValueError(f"min_n must be >= 5 (KS has no power below), got {min_n}")
        self.alpha, self.min_n = alpha, min_n

    def check(self, events, registry=None):
        return timing_isolation(events, self.alpha, self.min_n)
