"""Canary format.

A canary is ``[`` + 10 characters of the RFC 4648 base32 alphabet (``A-Z2-7``) + ``]``, e.g.
``[K7QZ2MXA4D]``: 50 bits of entropy, 12 characters, each one token in kvchaos' character-level
tokenizers (and few tokens in any BPE vocabulary: no spaces, no lower case). Filler text kvchaos
generates never contains ``[``, ``]``, upper case letters or the digits 2-7, so a canary cannot
appear by accident and a scan is one regular expression or one Aho-Corasick pass.

The probe model (``kvchaos.probe``) recites every canary in its context in ascending order of the
first payload character, so canaries minted for one request have distinct first characters.
"""

from __future__ import annotations

import random
import re
from array import array
from dataclasses import dataclass

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
START, END = "[", "]"
PAYLOAD_LEN = 10
LENGTH = PAYLOAD_LEN + 2
BITS = PAYLOAD_LEN * 5
PATTERN = re.compile(r"\[[A-Z2-7]{10}\]")
# filler: lower-case words, spaces and light punctuation — disjoint from the canary alphabet
FILLER_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which or are have "
    "had not but were all their one there been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()


def trigrams(s: str) -> set[str]:
    return {s[i:i + 3] for i in range(len(s) - 2)}


def canary_shaped(piece: str, width: int = 8) -> bool:
    """Could ``piece`` (characters of the alphabet) be part of a recited canary: some ``width``
    characters of it without a repeated trigram (:func:`mint` never makes a canary with one). A run
    of one repeated character is a model's degenerate output, not a canary."""
    for i in range(len(piece) - width + 1):
        w = piece[i:i + width]
        grams = [w[j:j + 3] for j in range(len(w) - 2)]
        if len(set(grams)) == len(grams):
            return True
    return False


def mint(rng: random.Random, n: int = 1, distinct_first: bool = True, avoid_first=(), beside=()) -> list[str]:
    """``n`` fresh canaries minted together (for one request).

    With ``distinct_first`` their first payload characters differ (the probe model recites in
    ascending order of it), and no trigram occurs twice across the set (the probe copies by
    trigram; a repeated one would make the recitation ambiguous). ``beside``: canaries already in
    the same context (a shared system prompt, earlier turns): the new ones avoid their first
    characters and trigrams too.
    """
    beside = list(beside)
    avoid_first = set(avoid_first) | {c[1] for c in beside}
    if distinct_first and n + len(avoid_first) > len(ALPHABET):
        raise ValueError(f"cannot mint {n} canaries with distinct first characters beside {len(avoid_first)} "
                         f"others (max {len(ALPHABET)} in one context)")
    firsts = [c for c in ALPHABET if c not in avoid_first]
    rng.shuffle(firsts)
    out: list[str] = []
    seen: set[str] = {c[j:j + 3] for c in beside for j in range(len(c) - 2)}
    for i in range(n):
        while True:
            first = firsts[i] if distinct_first else rng.choice(ALPHABET)
            c = START + first + "".join(rng.choice(ALPHABET) for _ in range(PAYLOAD_LEN - 1)) + END
            grams = [c[j:j + 3] for j in range(len(c) - 2)]
            if len(set(grams)) == len(grams) and not seen.intersection(grams):
                break
        seen.update(grams)
        out.append(c)
    return out


def payload(c: str) -> str:
    """What a reply must contain for the canary to count as echoed (the probe's trigger supplies
    the first ``[``, so the opening bracket is not part of the match)."""
    return c[1:-1]


def filler(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` of lower-case word filler (exact length)."""
    if n_chars <= 0:
        return ""
    parts, size = [], 0
    while size <= n_chars:
        w = rng.choice(FILLER_WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_chars]


def find(text: str) -> list[tuple[int, str]]:
    """(offset, canary) for every well-formed canary in ``text``."""
    return [(m.start(), m.group()) for m in PATTERN.finditer(text)]


def is_canary(s: str) -> bool:
    return bool(PATTERN.fullmatch(s))


class Registry:
    """Canaries with the request each was minted for: what a judgement knows was minted.

    The isolation checker scans replies against the registry it is handed, not only the canaries of
    the history it judges: a canary of an earlier experiment, another wave or the self-test turning
    up in a reply is a leak too, with its owner named. Nothing fills a registry behind anyone's
    back: the pytest plugin keeps one per session (fixture ``kvchaos_canaries``) and every experiment
    adds its plans to the one it is given; harness prompts sent outside an experiment (smoke, probe
    measurements) are added by whoever sends them; ``kvchaos judge`` builds one from the logs it
    is given. Thread-safe."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._by_canary: dict[str, Minted] = {}
        self._carriers: dict[str, set] = {}
        # rid -> what its KV holds on decode, for pages another request later reads unwritten
        # (kvchaos.oracles.provenance.context_text): its prompt, its reply, decode's kv_prealloc of it
        self._pages: dict[str, dict] = {}

    def add(self, c: str, rid: str, tenant: str | None, source: str) -> None:
        """``c`` was sent in ``rid``'s prompt (the first request that carried it stays its owner)."""
        if not is_canary(c):
            raise ValueError(f"not a canary: {c!r} (expected [ + 10 of {ALPHABET} + ])")
        with self._lock:
            self._by_canary.setdefault(c, Minted(c, rid, tenant, source))
            if rid:
                self._carriers.setdefault(c, set()).add(rid)

    def carriers(self, c: str) -> set:
        """Every request that carried ``c`` in its prompt (a conversation's turns, a tenant's system
        prompt): any of them may have left it in the engines' pages."""
        with self._lock:
            return set(self._carriers.get(c, ()))

    def add_text(self, text: str, rid: str | None, source: str) -> None:
        """Every canary in ``text`` (a prompt sent outside a workload: probe measurements, harness
        self-tests), so a reply that later recites it from stale KV names its origin instead of
        counting as a canary nobody minted."""
        for _at, c in find(text):
            self.add(c, rid or "", None, source)

    def add_plans(self, plans: dict, source: str) -> None:
        """``plans``: rid -> plan record (the event log's ``plan`` events); a plan's prompt is kept too."""
        for rid, p in plans.items():
            for c in p.get("canaries") or []:
                self.add(c, rid, p.get("tenant"), source)
            if isinstance(p.get("prompt"), str):
                with self._lock:
                    self._pages.setdefault(rid, {})["prompt"] = p["prompt"]

    def add_page_evidence(self, records) -> None:
        """From one experiment's log: each request's reply text and decode's ``kv_prealloc`` of it (the
        first; the canaries its input text held make it one of their carriers), so a later experiment on
        the same cluster can tell what those requests left in the pages it reads unwritten."""
        with self._lock:
            for e in records:
                rid = e.get("rid")
                if not rid:
                    continue
                if e.get("ev") == "body" and isinstance(e.get("text"), str):
                    self._pages.setdefault(rid, {}).setdefault("output", e["text"])
                elif e.get("ev") == "agent" and e.get("agent_ev") == "kv_prealloc":
                    # what decode read in its input text: the request (under the engine's own id, where the
                    # router did not pass the client's on) carried these, whoever they were minted for
                    for c in e.get("canaries") or ():
                        if is_canary(c):
                            self._carriers.setdefault(c, set()).add(rid)
                    if e.get("dst_pages"):
                        rec = {k: e.get(k) for k in ("dst_pages_total", "page_size", "room")}
                        rec["dst_pages"] = array("l", e["dst_pages"])  # a session's worth: 8 bytes a page, not 36
                        self._pages.setdefault(rid, {}).setdefault("prealloc", rec)

    def page_record(self, rid: str) -> dict:
        """What :meth:`add_plans` and :meth:`add_page_evidence` kept of ``rid`` (empty when nothing)."""
        with self._lock:
            return dict(self._pages.get(rid) or {})

    def carried_by(self, rid: str) -> set:
        """The canaries ``rid`` carried in its prompt."""
        with self._lock:
            return {c for c, rids in self._carriers.items() if rid in rids}

    def entries(self) -> list["Minted"]:
        with self._lock:
            return list(self._by_canary.values())

    def __len__(self) -> int:
        return len(self._by_canary)

    def __contains__(self, c: str) -> bool:
        return c in self._by_canary


@dataclass(frozen=True)
class Minted:
    canary: str
    rid: str
    tenant: str | None
    source: str

