"""The leak-sensitive probe model and the prompts it answers (see ``kvchaos.probe.build``)."""

from __future__ import annotations

import random

from kvchaos import canary

TRIGGER = canary.START  # a probe prompt ends in "[": the model then recites the canaries it sees
MIN_TAIL = 12  # filler characters between the last canary and the trigger (the δ=11 head must see filler)
MIN_HEAD = 12  # filler characters before the first canary (offset heads have no history there)


def prompt(rng: random.Random, n_tokens: int, canaries: list[str]) -> str:
    """A prompt of exactly ``n_tokens`` characters (= tokens for the char-level tokenizer): filler
    with ``canaries`` at random non-overlapping places (never adjacent, never in the first
    ``MIN_HEAD`` or last ``MIN_TAIL`` characters), ending in the trigger."""
    body = n_tokens - 1 - MIN_TAIL - MIN_HEAD
    need = sum(len(c) + 2 for c in canaries)
    if need > body:
        raise ValueError(f"{len(canaries)} canaries need more than {n_tokens} tokens (minimum {need + 1 + MIN_TAIL + MIN_HEAD})")
    free = body - need
    cuts = sorted(rng.randrange(free + 1) for _ in canaries)
    parts, prev = [canary.filler(rng, MIN_HEAD)], 0
    for c, cut in zip(canaries, cuts):
        parts.append(canary.filler(rng, cut - prev))
        parts.append(" " + c + " ")  # canaries never touch each other
        prev = cut
    parts.append(canary.filler(rng, free - prev))
    text = "".join(parts)
    text += canary.filler(rng, MIN_TAIL) + TRIGGER
    assert len(text) == n_tokens, (len(text), n_tokens)
    return text


def max_new_tokens(n_canaries: int) -> int:
    """Enough tokens to recite ``n_canaries`` canaries plus the closing ``[``."""
    return n_canaries * canary.LENGTH + 2
