"""Measure a served model's leak sensitivity over HTTP (``/generate`` of a router or a server).

* echo rate — a prompt holding 1..4 canaries in filler: does the reply contain every one?
* contamination rate — the context also holds another request's canary (its prompt text spliced
  in before or after the requester's own text): does the reply contain that foreign canary?
* determinism — the same prompts, sent one by one and then concurrently mixed with other traffic,
  give identical token ids.
* stale-KV sensitivity inside SGLang (:func:`measure_stale_kv`) — what the incident does: decode's
  pages are filled with donor requests' KV, a victim's transfer is cut short by the in-engine agent
  (``short``: prefill sends only its first pages, decode reports success), and decode generates over
  the victim's unwritten pages. Which donor tokens sit there is reconstructed from the agent's
  transfer events (:func:`stale_map`); a trial counts when a whole donor canary lies in consecutive
  stale slots in order (:func:`judge_stale_trial`), and is a hit when the victim's reply recites it.

A model that does not repeat its context (the random tiny model) scores ~0 on the first two: the
isolation oracle must then say ``unknown``, and ``tests/test_probe_model.py`` checks exactly that.

The echo and foreign measurements also run without a server, in transformers (:class:`LocalModel`, in
place of the URL): ``python -m kvchaos.probe.measure --kind like:llama-3.1-8b --quick`` builds the probe
of a kind (``kvchaos.probe.ensure_probe``) and prints its rates and, for a like probe, its KV bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvchaos import canary, cpucompat
from kvchaos.probe import MIN_HEAD, MIN_TAIL, TRIGGER, ensure_probe, like, max_new_tokens, prompt

ECHO_THRESHOLD = 0.99
CONTAMINATION_THRESHOLD = 0.95


@dataclass
class Rate:
    name: str
    hits: int = 0
    trials: int = 0
    failures: list = field(default_factory=list)
    collisions: int = 0  # trials where a foreign canary shared its first character with an own one
    notes: dict = field(default_factory=dict)  # what else a measurement reports (excluded trials, ...)

    @property
    def rate(self) -> float:
        return self.hits / self.trials if self.trials else 0.0

    def add(self, ok: bool, detail=None):
        self.trials += 1
        self.hits += bool(ok)
        if not ok and len(self.failures) < 20:
            self.failures.append(detail)

    def __str__(self):
        extra = f" (first-character collisions in {self.collisions} trials)" if self.collisions else ""
        return f"{self.name}: {self.hits}/{self.trials} = {100 * self.rate:.2f} %{extra}"

    def to_dict(self) -> dict:
        return {"name": self.name, "hits": self.hits, "trials": self.trials, "rate": self.rate,
                "collisions": self.collisions, **self.notes, "failures": self.failures[:5]}


async def _generate(client: httpx.AsyncClient, url: str, text: str, max_new: int, timeout: float,
                    rid: str | None = None) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    if rid is not None:
        body["rid"] = rid
    r = await client.post(f"{url}/generate", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:300]}")
    return r.json()


async def _run_all(url: str, jobs: list[tuple], concurrency: int, timeout: float) -> list[dict]:
    """``jobs``: (text, max_new_tokens) or (text, max_new_tokens, rid)."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(text, max_new, rid=None):
            async with sem:
                return await _generate(client, url, text, max_new, timeout, rid)

        return await asyncio.gather(*(one(*j) for j in jobs))


def run_all(url, jobs, concurrency=8, timeout=120.0, registry=None) -> list[dict]:
    """``registry``: the cluster's canary registry (``cluster.canaries``) — what it sends may stay in
    the engines' KV pages, so its canaries are registered there and have an origin when recited.
    ``url`` may be a :class:`LocalModel` instead of a server: the jobs then run in transformers."""
    if registry is not None:
        for job in jobs:
            registry.add_text(job[0], job[2] if len(job) > 2 else None, "probe measurement")
    if isinstance(url, LocalModel):
        return [url.generate(job[0], job[1]) for job in jobs]
    return asyncio.run(_run_all(url, jobs, concurrency, timeout))


class LocalModel:
    """A probe model in transformers, answering jobs as ``/generate`` would (``text``, ``output_ids``),
    greedy. Its greedy decoding is checked against a draft: the recital the probe should give (the
    prompt's canaries in order of first character, the closing ``[``, EOS) goes through the model in
    one forward pass; the reply is the draft up to the first token greedy would not pick, that token,
    and whatever ``generate`` continues with from there — the greedy reply, in one pass when the model
    recites as drafted (transformers' DeepSeek-V2 re-expands its whole latent cache at every decode
    step: a 61-layer like probe would take seconds a token)."""

    def __init__(self, model_dir, dtype: str = "bfloat16"):
        cpucompat.install()  # transformers imports torchvision, which needs the CPU patch here
        import torch  # the engine's libraries: only a local measurement pays for them
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.dir = Path(model_dir)
        self.tok = AutoTokenizer.from_pretrained(self.dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=getattr(torch, dtype)).eval()
        self.eos = self.model.config.eos_token_id
        self.drafted = self.continued = 0  # replies the draft gave whole / that needed generate after it

    def draft(self, text: str) -> list[int]:
        """The recital the probe should give for ``text`` (ending in the trigger): each first character
        once (the first canary with it), in alphabet order, then ``[`` and EOS."""
        seen, order = set(), []
        for _, c in canary.find(text):
            if c[1] not in seen:
                seen.add(c[1])
                order.append(c)
        order.sort(key=lambda c: canary.ALPHABET.index(c[1]))
        return self.tok("".join(order)[1:] + canary.START).input_ids + [self.eos] if order else [self.eos]

    def generate(self, text: str, max_new: int) -> dict:
        torch = self.torch
        ids = self.tok(text, return_tensors="pt").input_ids
        want = self.draft(text)[:max_new]
        with torch.no_grad():
            picked = self.model(torch.cat([ids[0], torch.tensor(want[:-1], dtype=ids.dtype)])[None]).logits
        picked = picked[0, ids.shape[1] - 1:].argmax(-1).tolist()
        n = next((i for i, (a, b) in enumerate(zip(picked, want)) if a != b), len(want))
        out = want[:n] if n == len(want) else want[:n] + [picked[n]]
        if out[-1] != self.eos and len(out) < max_new:  # off the draft: greedy from there
            self.continued += 1
            with torch.no_grad():
                more = self.model.generate(torch.cat([ids[0], torch.tensor(out, dtype=ids.dtype)])[None],
                                           max_new_tokens=max_new - len(out), do_sample=False,
                                           eos_token_id=self.eos, pad_token_id=self.eos)
            out += more[0, ids.shape[1] + len(out):].tolist()
        else:
            self.drafted += 1
        if out and out[-1] == self.eos:
            out = out[:-1]
        return {"text": self.tok.decode(out), "output_ids": out, "meta_info": {"prompt_tokens": ids.shape[1]}}


def echo_jobs(rng: random.Random, n: int, lengths: list[int]):
    jobs, meta = [], []
    for i in range(n):
        k = rng.randint(1, 4)
        length = max(lengths[i % len(lengths)], k * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1)
        cs = canary.mint(rng, k)
        jobs.append((prompt(rng, length, cs), max_new_tokens(k)))
        meta.append((length, cs))
    return jobs, meta


def measure_echo(url: str, n: int, lengths: list[int], seed: int = 0, concurrency: int = 8, registry=None) -> Rate:
    rng = random.Random(seed)
    jobs, meta = echo_jobs(rng, n, lengths)
    out = run_all(url, jobs, concurrency, registry=registry)
    rate = Rate("own-canary echo")
    for (length, cs), body in zip(meta, out):
        missing = [c for c in cs if canary.payload(c) not in body["text"]]
        rate.add(not missing, {"length": length, "missing": missing, "reply": body["text"][:120]})
    return rate


def contamination_jobs(rng: random.Random, n: int, lengths: list[int]):
    """Own prompt (1-2 canaries) + another tenant's prompt text (with its canary) spliced in before
    or after. The foreign canary is minted independently: with probability own_k/32 it shares its
    first character with an own canary, and the probe recites only one of the two (see
    kvchaos.probe.build) — that is the expected miss rate, reported as ``first_char_collisions``."""
    jobs, meta = [], []
    for i in range(n):
        own_k = rng.randint(1, 2)
        length = lengths[i % len(lengths)]
        own = canary.mint(rng, own_k)
        foreign = canary.mint(rng, 1)[0]  # minted independently, like another tenant's
        f_len = max(length // 3, canary.LENGTH + MIN_HEAD + MIN_TAIL + 4)
        foreign_text = prompt(rng, f_len, [foreign])[:-1]  # the other tenant's prompt, minus its trigger
        own_len = max(length - f_len, own_k * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1)
        own_text = prompt(rng, own_len, own)
        if i % 2 == 0:  # foreign text first: it sits at a different position than it was written at
            text = foreign_text + " " + own_text
        else:  # foreign text last, before the trigger
            text = own_text[:-1 - MIN_TAIL] + " " + foreign_text + " " + canary.filler(rng, MIN_TAIL) + TRIGGER
        jobs.append((text, max_new_tokens(own_k + 1)))
        meta.append((len(text), own, foreign))
    return jobs, meta


def measure_contamination(url: str, n: int, lengths: list[int], seed: int = 1, concurrency: int = 8,
                          registry=None) -> Rate:
    rng = random.Random(seed)
    jobs, meta = contamination_jobs(rng, n, lengths)
    out = run_all(url, jobs, concurrency, registry=registry)
    rate = Rate("foreign-canary sensitivity")
    for (length, own, foreign), body in zip(meta, out):
        collide = any(o[1] == foreign[1] for o in own)
        rate.collisions += collide
        rate.add(canary.payload(foreign) in body["text"],
                 {"length": length, "foreign": foreign, "own": own, "first_char_collision": collide,
                  "reply": body["text"][:120]})
    return rate


def measure_determinism(url: str, n: int = 24, seed: int = 2, lengths=(64, 300, 900), registry=None) -> Rate:
    """Same prompts alone (concurrency 1) vs. in a concurrent mix with other prompts (batches)."""
    rng = random.Random(seed)
    jobs, _ = echo_jobs(rng, n, list(lengths))
    noise, _ = echo_jobs(rng, 2 * n, list(lengths))
    alone = run_all(url, jobs, concurrency=1, registry=registry)
    mixed_jobs = [j for pair in zip(jobs, noise[:n], noise[n:]) for j in pair]
    mixed = run_all(url, mixed_jobs, concurrency=12, registry=registry)[0::3]
    rate = Rate("deterministic across runs and batch compositions")
    for a, b in zip(alone, mixed):
        rate.add(a["output_ids"] == b["output_ids"], {"alone": a["text"][:60], "mixed": b["text"][:60]})
    return rate


def sensitive_enough(echo: Rate, contamination: Rate | None = None) -> tuple[bool, str]:
    """Can an isolation check against this served model see a leak at all?"""
    why = []
    if echo.rate < ECHO_THRESHOLD:
        why.append(f"own-canary echo {100 * echo.rate:.1f} % < {100 * ECHO_THRESHOLD:.0f} %")
    if contamination is not None and contamination.rate < CONTAMINATION_THRESHOLD:
        why.append(f"foreign-canary sensitivity {100 * contamination.rate:.1f} % < {100 * CONTAMINATION_THRESHOLD:.0f} %")
    return (not why, "; ".join(why) or "sensitive")


# =========================================================================== stale KV inside SGLang
#
# Per trial: donors (probe prompts with one canary each, max_new_tokens 1: decode writes nothing of
# theirs — a request that ends at its first token is released by decode before any decode forward)
# are sent until decode's pool has gone round once more than the victim needs; then the victim, with
# the agent's ``short`` fault armed on its rid: prefill sends only its first ``keep`` pages and reports
# success, decode generates over the rest of its reservation. The victim's own canary lies in the
# written pages and starts with the first character the probe recites, so its reply is
# ``OWN][`` followed by whatever canaries decode can attend to in the stale pages.
#
# The agent's transfer events name the decode pages of every write (``dst_pages``, in the request's
# token order from ``dst_page_offset``): the last writer of a decode page before the victim's transfer
# is the most recent ``write_end`` listing it. Only writes since the trial began count: decode itself
# writes the KV of the tokens it generates (earlier victims, earlier measurements) and those writes
# leave no event, so a page whose last event-visible write is older is unknown.

OWN_FIRST = canary.ALPHABET[0]  # the probe recites canaries in ALPHABET order: the victim's own comes first
STALE_KEEP_TOKENS = 32  # prefill sends the pages covering the victim's first 32 tokens (its own canary)
STALE_MAX_RECITE = 8  # the victim may recite its own canary and up to 7 stale ones
# The probe's first-layer heads read the token exactly δ positions back (kvchaos.probe.build.OFFSETS);
# their keys carry the position a token was *written* at, so a stale slot a donor wrote at position p
# competes with whatever the victim has at p (reported per trial as position collisions).
PROBE_OFFSETS = (1, 2, 3, 11)


@dataclass
class StaleMap:
    """What decode's pages hold for a victim whose transfer was cut short, as far as the agent's
    transfer events tell. Victim page i (of its decode reservation) holds its token positions
    ``[i * page_size, (i + 1) * page_size)``."""

    rid: str
    page_size: int
    reserved: dict  # victim page index -> decode page
    written: set  # victim page indices prefill wrote
    slots: dict  # stale victim position -> (donor rid, donor token position), where the last writer is known
    unknown: int = 0  # stale slots whose content is not known (no write since ``since``, a failed write)
    resets: int = 0  # writes whose page list was incomplete: what was known before them was dropped

    @property
    def stale_pages(self) -> list[int]:
        return sorted(i for i in self.reserved if i not in self.written)


@dataclass(frozen=True)
class StaleCanary:
    rid: str  # the donor whose canary it is
    canary: str
    victim_pos: int  # first victim position of the canary's "["
    donor_pos: int  # where the donor's prompt had it


def _dst(e: dict):
    """(offset, listed pages, total) of an event's decode page fields; None when it has none."""
    pages = e.get("dst_pages")
    if not isinstance(pages, list):
        return None
    total = e.get("dst_pages_total")
    return int(e.get("dst_page_offset") or 0), pages, int(total) if total is not None else len(pages)


def stale_map(events: list[dict], victim_rid: str, since: float | None = None,
              page_size: int | None = None) -> StaleMap | None:
    """Reconstruct which donor tokens sit in the victim's unwritten decode pages.

    ``events``: the prefill agent's events in the order they happened (``AgentClient.events``).
    The victim's reservation comes from its ``transfer_start`` and ``short`` firings (each chunk's
    reserved ``dst_pages``), what prefill wrote from its ``write_end`` (a prefix of each chunk). Every
    other request's ``write_end`` before the victim's transfer began (and at or after ``since``) makes
    it the last writer of the pages it lists: its page ``dst_page_offset + j`` holds its tokens
    ``[(offset + j) * page_size, ...)``. A write whose list was cut at the agent's bound drops
    everything known (it may have overwritten any page); a write that did not return success makes
    its pages unknown. None when the events do not describe the victim's reservation."""
    last: dict[int, tuple | None] = {}
    reserved: dict[int, int] = {}
    written: set[int] = set()
    started, resets, ps = False, 0, page_size
    for e in events:
        ev, rid = e.get("ev"), e.get("rid")
        if rid == victim_rid:
            if ev in ("transfer_start", "write_end") or (ev == "fault_fired" and e.get("kind") == "short"):
                started = True
                ps = ps or e.get("page_size")
                d = _dst(e)
                if d is None:
                    continue
                off, pages, total = d
                if ev == "write_end":  # written pages are a prefix of the chunk: known even past the bound
                    written.update(range(off, off + total))
                else:
                    reserved.update((off + j, int(p)) for j, p in enumerate(pages))
            continue
        if started or ev != "write_end" or (since is not None and e.get("wall", 0.0) < since):
            continue
        d = _dst(e)
        if d is None or d[2] > len(d[1]):
            last.clear()
            resets += 1
            continue
        off, pages, _ = d
        ok = e.get("ret") in (0, "handles") and rid is not None
        for j, p in enumerate(pages):
            last[int(p)] = (rid, off + j) if ok else None
    if not reserved:
        return None
    ps = int(ps or 1)
    slots: dict[int, tuple[str, int]] = {}
    unknown = 0
    for i, page in reserved.items():
        if i in written:
            continue
        w = last.get(page)
        for r in range(ps):
            if w is None:
                unknown += 1
            else:
                slots[i * ps + r] = (w[0], w[1] * ps + r)
    return StaleMap(victim_rid, ps, reserved, written, slots, unknown, resets)


def stale_canaries(smap: StaleMap | None, donor_texts: dict[str, str], victim_len: int) -> list[StaleCanary]:
    """Every donor canary lying whole (``[``, payload, ``]``) in consecutive stale slots of the
    victim's prompt, in order: victim positions v..v+11 hold the donor's positions s..s+11."""
    if smap is None:
        return []
    out = []
    for v in sorted(smap.slots):
        if v + canary.LENGTH > victim_len:  # past the prompt: decode's own tokens of the victim
            continue
        rid, pos = smap.slots[v]
        text = donor_texts.get(rid)
        if text is None or not canary.is_canary(text[pos:pos + canary.LENGTH]):
            continue
        if all(smap.slots.get(v + t) == (rid, pos + t) for t in range(canary.LENGTH)):
            out.append(StaleCanary(rid, text[pos:pos + canary.LENGTH], v, pos))
    return out


def judge_stale_trial(smap: StaleMap | None, donor_texts: dict[str, str], victim_len: int, reply: str) -> dict:
    """``eligible``: a whole donor canary lies in the stale slots (else the trial is excluded);
    ``hit``: the reply contains the payload of one of them."""
    whole = stale_canaries(smap, donor_texts, victim_len)
    recited = [w for w in whole if canary.payload(w.canary) in reply]
    donors = {c for t in donor_texts.values() for _, c in canary.find(t)}
    return {"eligible": bool(whole), "hit": bool(recited),
            "whole": [w.canary for w in whole], "recited": [w.canary for w in recited],
            "any_donor_canary_in_reply": sorted(c for c in donors if canary.payload(c) in reply)}


def _check_one_token_per_char(body: dict, text: str, rid: str) -> None:
    n = (body.get("meta_info") or {}).get("prompt_tokens")
    if n is not None and n != len(text):
        raise RuntimeError(f"{rid}: {n} prompt tokens for {len(text)} characters — the stale-KV reconstruction "
                           "needs the probe's one token per character (no BOS)")


def _stale_donors(url: str, rng: random.Random, trial: int, tenant: int, need: int, lmin: int, lmax: int,
                  ps: int, concurrency: int, timeout: float, registry) -> tuple[dict[str, str], int]:
    """Donors (probe prompts with one canary each, max_new_tokens 1) sent until ``need`` tokens of
    decode's pool went by: rid -> prompt text, and the tenant counter after them."""
    texts: dict[str, str] = {}
    sent = 0
    while sent < need:  # decode's pool goes round once more than the victim needs
        jobs = []
        for _ in range(concurrency):
            dl = rng.randint(lmin, lmax)
            tenant += 1
            rid = f"stale{trial:03d}-d{len(texts):03d}-t{tenant % 1000:03d}"
            texts[rid] = prompt(rng, dl, canary.mint(rng, 1, avoid_first=(OWN_FIRST,)))
            jobs.append((texts[rid], 1, rid))
            sent += math.ceil(dl / ps) * ps
        for (text, _, rid), body in zip(jobs, run_all(url, jobs, concurrency, timeout, registry)):
            _check_one_token_per_char(body, text, rid)
    return texts, tenant


def _stale_victim_reply(url: str, fault, vtext: str, vrid: str, timeout: float, registry, rec: dict) -> str:
    """The victim's reply while ``fault`` (the armed ``short``) cuts its transfer; the pages prefill
    sent go into ``rec``."""
    body = run_all(url, [(vtext, max_new_tokens(STALE_MAX_RECITE), vrid)], 1, timeout, registry)[0]
    _check_one_token_per_char(body, vtext, vrid)
    reply = body["text"]
    fired = fault.verify(timeout=10)
    rec["pages_sent"] = [e.get("pages_sent") for e in fired]
    return reply


def _score_stale_trial(rate: Rate, rec: dict, smap: StaleMap | None, texts: dict[str, str], vlen: int, reply: str,
                       own: str, ps: int) -> tuple[dict, bool, int]:
    """Judge one trial into ``rate`` (and its notes) and ``rec``: the trial's verdict
    (:func:`judge_stale_trial`), whether the reply got through the victim's own canary, and the
    tail collisions."""
    notes = rate.notes
    verdict = judge_stale_trial(smap, texts, vlen, reply)
    rec.update(reply=reply[:160], whole=verdict["whole"], recited=verdict["recited"],
               donor_canaries_in_reply=verdict["any_donor_canary_in_reply"])
    if smap is not None:
        stale = sum(1 for v in range(vlen) if v // ps not in smap.written)
        rec.update(stale_pages=len(smap.stale_pages), written_pages=len(smap.written),
                   known_stale_slots=sum(1 for v, (rid, pos) in smap.slots.items()
                                         if v < vlen and pos < len(texts.get(rid, ""))), stale_slots=stale,
                   resets=smap.resets)
        notes["stale_slots"] += stale
        notes["unknown_stale_slots"] += stale - rec["known_stale_slots"]
    else:
        rec["error"] = "no transfer events for the victim"
    # diagnostics: did the reply get through the victim's own canary (its first decode steps read
    # the stale tail of the prompt), and did donors write stale slots at positions the probe's
    # offset heads read while the victim recited (prompt tail and reply positions)?
    intact = reply.startswith(canary.payload(own) + canary.END + canary.START)
    window = range(vlen - max(PROBE_OFFSETS), vlen + len(reply))
    # a slot past the end of its donor's prompt (the rest of its last page) holds what prefill's page
    # held: not a donor token, its position unknown
    real = {v: (rid, pos) for v, (rid, pos) in (smap.slots.items() if smap else ())
            if v < vlen and pos < len(texts.get(rid, ""))}
    coll = sum(1 for _, pos in real.values() if pos in window)
    rec.update(own_recital_intact=intact, tail_collisions=coll)
    notes["whole_canaries"] += len(verdict["whole"])
    notes["whole_canaries_recited"] += len(verdict["recited"])
    if verdict["eligible"]:
        rate.add(verdict["hit"], {"victim": rec["victim"], "whole": verdict["whole"], "reply": reply[:120]})
        notes["own_recital_intact"] += intact
        notes["hits_with_own_recital_intact"] += intact and verdict["hit"]
        notes["without_tail_collision"] += not coll
        notes["hits_without_tail_collision"] += (not coll) and verdict["hit"]
        notes["hits_with_tail_collision"] += bool(coll) and verdict["hit"]
    else:
        notes["no_whole_canary"] += 1
        notes["excluded_with_donor_canary_in_reply"] += bool(verdict["any_donor_canary_in_reply"])
    return verdict, intact, coll


def measure_stale_kv(url: str, agent, n: int, pool_tokens: int, page_size: int, context_length: int,
                     seed: int = 3, concurrency: int = 4, timeout: float = 120.0, progress=None,
                     registry=None) -> Rate:
    """Stale-KV sensitivity measured inside SGLang with the in-engine agent (``agent``: a
    ``faults.client.AgentClient`` of the cluster, or anything with its ``arm`` / ``events``).

    ``n`` trials; the rate is over the trials where a whole donor canary lay in the victim's stale
    slots (``notes["no_whole_canary"]`` counts the others, ``notes["errors"]`` the trials that could
    not be judged)."""
    rng = random.Random(seed)
    ps = max(1, int(page_size))
    keep = max(1, math.ceil(STALE_KEEP_TOKENS / ps))
    cap = context_length * 9 // 10
    # donors and victims come from one length distribution (as tenants' prompts would)
    lmin = min(cap, max(128, 4 * keep * ps, pool_tokens // 32))
    lmax = min(cap, max(lmin, pool_tokens // 4))
    rate = Rate("stale-KV sensitivity inside SGLang (short transfer; whole donor canary in the stale pages)")
    notes = rate.notes
    notes.update(attempted=n, no_whole_canary=0, errors=0, keep_pages=keep, page_size=ps,
                 lengths=[lmin, lmax], donors=0, donor_tokens=0,
                 whole_canaries=0, whole_canaries_recited=0, excluded_with_donor_canary_in_reply=0,
                 stale_slots=0, unknown_stale_slots=0,
                 own_recital_intact=0, hits_with_own_recital_intact=0,
                 without_tail_collision=0, hits_without_tail_collision=0, hits_with_tail_collision=0,
                 trials_log=[])
    tenant = 0
    for trial in range(n):
        since = time.time()
        vlen = rng.randint(lmin, lmax)
        texts, tenant = _stale_donors(url, rng, trial, tenant, pool_tokens + 2 * vlen, lmin, lmax, ps, concurrency,
                                      timeout, registry)
        notes["donors"] += len(texts)
        notes["donor_tokens"] += sum(len(t) for t in texts.values())
        own = canary.mint(rng, 1, avoid_first=canary.ALPHABET[1:])[0]  # starts with OWN_FIRST
        head = canary.filler(rng, MIN_HEAD) + " " + own + " "
        vtext = head + canary.filler(rng, vlen - len(head) - 1) + TRIGGER
        tenant += 1
        vrid = f"stale{trial:03d}-victim-t{tenant % 1000:03d}"
        rec = {"trial": trial, "victim": vrid, "victim_len": vlen, "donors": len(texts), "own": own}
        f = agent.arm("prefill", "short", target={"rid": vrid}, params={"pages": keep}, count=100, ttl_s=300)
        try:
            reply = _stale_victim_reply(url, f, vtext, vrid, timeout, registry, rec)
        except Exception as e:  # noqa: BLE001 - a trial that cannot be judged is reported, not fatal
            notes["errors"] += 1
            rec["error"] = repr(e)[:300]
            notes["trials_log"].append(rec)
            continue
        finally:
            f.heal()
        smap = stale_map(agent.events("prefill"), vrid, since=since)
        verdict, intact, coll = _score_stale_trial(rate, rec, smap, texts, vlen, reply, own, ps)
        notes["trials_log"].append(rec)
        if progress is not None:
            progress(f"stale trial {trial + 1}/{n}: victim {vlen} tokens, {len(texts)} donors, "
                     f"{len(verdict['whole'])} whole stale canaries, recited {len(verdict['recited'])}; "
                     f"own recital {'intact' if intact else 'broken'}, {coll} tail collisions; reply {reply[:60]!r}")
    return rate


# =========================================================================== command line (transformers)
QUICK = {"echo": 50, "contamination": 50}
FULL = {"echo": 500, "contamination": 300}
LOCAL_LENGTHS = (32, 64, 128, 256, 512, 1024)  # prompt tokens: transformers on CPU, not a server's 90 % of context


def main(argv=None) -> int:
    """Own-canary echo and foreign-canary rates of a probe in transformers (no server)."""
    ap = argparse.ArgumentParser(prog="python -m kvchaos.probe.measure", description=main.__doc__)
    ap.add_argument("--kind", default="mha", help="probe kind: mha | gqa | mla | like:<name> [mha]")
    ap.add_argument("--model", default=None, help="a model directory instead of a probe kind")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['echo']}/{QUICK['contamination']} echo/foreign trials")
    ap.add_argument("--echo", type=int, default=None)
    ap.add_argument("--contamination", type=int, default=None)
    ap.add_argument("--lengths", default=",".join(map(str, LOCAL_LENGTHS)), help="prompt lengths in tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page", type=int, default=64, help="page size for a like probe's KV bytes [64]")
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    args = ap.parse_args(argv)
    counts = QUICK if args.quick else FULL
    n_echo = counts["echo"] if args.echo is None else args.echo
    n_cont = counts["contamination"] if args.contamination is None else args.contamination
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    try:
        model_dir = Path(args.model) if args.model else ensure_probe(args.kind)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.time()
    local = LocalModel(model_dir, args.dtype)
    load_s = time.time() - t0
    echo = measure_echo(local, n_echo, lengths, seed=args.seed)
    cont = measure_contamination(local, n_cont, lengths, seed=args.seed + 1)
    ok, why = sensitive_enough(echo, cont)
    out = {"kind": None if args.model else args.kind, "model": str(model_dir), "dtype": args.dtype,
           "lengths": lengths, "echo": echo.to_dict(), "contamination": cont.to_dict(), "sensitive": ok,
           "why": why, "replies_off_draft": local.continued, "load_s": round(load_s, 1),
           "measure_s": round(time.time() - t0 - load_s, 1)}
    name = like.name_of_kind(args.kind) if not args.model else None
    if name is not None:
        geo = like.geometry(name)
        out["kv"] = {"geometry": geo.to_dict(), "page_size": args.page,
                     "bytes_per_token": geo.bytes_per_token(), "bytes_per_page": geo.bytes_per_page(args.page),
                     "bytes_per_512_token_request": geo.request_bytes(512, args.page)}
    print(f"{out['kind'] or model_dir} in transformers ({args.dtype}, prompts of {lengths} tokens):")
    print(f"  {echo}\n  {cont}\n  sensitive: {ok} ({why}); {local.continued} replies left the draft; "
          f"load {out['load_s']} s, measured in {out['measure_s']} s")
    if "kv" in out:
        kv = out["kv"]
        print(f"  KV ({kv['geometry']['dtype']}): {kv['bytes_per_token']:,d} B/token, {kv['bytes_per_page']:,d} B per "
              f"page of {args.page}, {kv['bytes_per_512_token_request']:,d} B per 512-token request")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
