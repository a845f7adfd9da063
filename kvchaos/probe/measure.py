"""Measure a served model's leak sensitivity over HTTP (``/generate`` of a router or a server).

* echo rate — a prompt holding 1..4 canaries in filler: does the reply contain every one?
* contamination rate — the context also holds another request's canary (its prompt text spliced
  in before or after the requester's own text): does the reply contain that foreign canary?
* determinism — the same prompts, sent one by one and then concurrently mixed with other traffic,
  give identical token ids.

A model that does not repeat its context (the random tiny model) scores ~0 on the first two: the
isolation oracle must then say ``unknown``, and ``tests/test_probe_model.py`` checks exactly that.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import httpx

from kvchaos import canary
from kvchaos.probe import MIN_HEAD, MIN_TAIL, TRIGGER, max_new_tokens, prompt

ECHO_THRESHOLD = 0.99
CONTAMINATION_THRESHOLD = 0.95


@dataclass
class Rate:
    name: str
    hits: int = 0
    trials: int = 0
    failures: list = field(default_factory=list)
    collisions: int = 0  # trials where a foreign canary shared its first character with an own one

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


async def _generate(client: httpx.AsyncClient, url: str, text: str, max_new: int, timeout: float) -> dict:
    r = await client.post(f"{url}/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:300]}")
    return r.json()


async def _run_all(url: str, jobs: list[tuple[str, int]], concurrency: int, timeout: float) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(text, max_new):
            async with sem:
                return await _generate(client, url, text, max_new, timeout)

        return await asyncio.gather(*(one(t, m) for t, m in jobs))


def run_all(url, jobs, concurrency=8, timeout=120.0) -> list[dict]:
    return asyncio.run(_run_all(url, jobs, concurrency, timeout))


def echo_jobs(rng: random.Random, n: int, lengths: list[int]):
    jobs, meta = [], []
    for i in range(n):
        k = rng.randint(1, 4)
        length = max(lengths[i % len(lengths)], k * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1)
        cs = canary.mint(rng, k)
        jobs.append((prompt(rng, length, cs), max_new_tokens(k)))
        meta.append((length, cs))
    return jobs, meta


def measure_echo(url: str, n: int, lengths: list[int], seed: int = 0, concurrency: int = 8) -> Rate:
    rng = random.Random(seed)
    jobs, meta = echo_jobs(rng, n, lengths)
    out = run_all(url, jobs, concurrency)
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


def measure_contamination(url: str, n: int, lengths: list[int], seed: int = 1, concurrency: int = 8) -> Rate:
    rng = random.Random(seed)
    jobs, meta = contamination_jobs(rng, n, lengths)
    out = run_all(url, jobs, concurrency)
    rate = Rate("foreign-canary sensitivity")
    for (length, own, foreign), body in zip(meta, out):
        collide = any(o[1] == foreign[1] for o in own)
        rate.collisions += collide
        rate.add(canary.payload(foreign) in body["text"],
                 {"length": length, "foreign": foreign, "own": own, "first_char_collision": collide,
                  "reply": body["text"][:120]})
    return rate


def measure_determinism(url: str, n: int = 24, seed: int = 2, lengths=(64, 300, 900)) -> Rate:
    """Same prompts alone (concurrency 1) vs. in a concurrent mix with other prompts (batches)."""
    rng = random.Random(seed)
    jobs, _ = echo_jobs(rng, n, list(lengths))
    noise, _ = echo_jobs(rng, 2 * n, list(lengths))
    alone = run_all(url, jobs, concurrency=1)
    mixed_jobs = [j for pair in zip(jobs, noise[:n], noise[n:]) for j in pair]
    mixed = run_all(url, mixed_jobs, concurrency=12)[0::3]
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
