"""The probe's reply contract: what a probe model must answer to a prompt, known before it is sent.

The circuit (``kvchaos.probe.circuit``) is deterministic: at the trigger ``[`` that ends a probe prompt
it recites every canary of its context, each once, in ascending order of the first payload character
(the order of :data:`kvchaos.canary.ALPHABET`, not of ASCII: ``A`` .. ``Z`` then ``2`` .. ``7``), each
closed by ``]`` and followed by ``[``; when none is left the ``[`` -> EOS bigram ends the reply. So
the reply to a prompt whose context holds canaries C1 .. Ck is exactly ``p1][p2][ .. pk][`` (``p``
the payloads, sorted) and then EOS: 12 characters a canary, one token each, plus the EOS token.

Where the recital is defined (:func:`expected`), from the prompt's own text:

* the prompt ends in the trigger;
* its distinct canaries have distinct first payload characters — two canaries with the same first
  character are one ``[``-then-character start for the selection head, which then splits between them;
* no trigram of one canary occurs in another — the induction head copies a canary by trigram, so a
  shared one makes the next character ambiguous (a canary repeated verbatim is harmless: both copies
  continue the same way);
* no canary character within the ``MIN_TAIL`` characters before the trigger — the selection head reads
  the character 11 back from the trigger as "the last canary recited" and would skip canaries.

A prompt that the engine truncated to its first ``L`` tokens (``--allow-auto-truncate`` keeps the head:
SGLang ``managers/utils.py`` ``validate_input_length``) has lost its trigger: the model then writes the
``[`` itself (the filler -> ``[`` bigram) and recites the canaries wholly inside the kept head —
``[p1][p2]..[pk][`` — defined only when no canary is cut by the truncation (:func:`truncated`).

Nothing here is a tolerance: a clean engine gives exactly this reply, measured on every layout
(``docs/reference/checkers.md``, "integrity"); a reply that differs is the engine's doing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchaos import canary
from kvchaos.probe import MIN_TAIL, TRIGGER

_ORDER = {c: i for i, c in enumerate(canary.ALPHABET)}
EOS_TOKENS = 1  # the EOS token that ends a complete recital counts toward completion_tokens


@dataclass(frozen=True)
class Contract:
    """The expected reply of one prompt (``text``), or why it is not defined (``why``, ``text`` None).
    ``canaries``: the context's canaries in recital order; ``head``: the prompt characters the model
    reads (all of them unless truncated)."""
    text: str | None
    canaries: tuple = ()
    why: str = ""
    head: int | None = None

    @property
    def defined(self) -> bool:
        return self.text is not None

    @property
    def tokens(self) -> int | None:
        """Tokens of the whole reply, EOS included (the probe tokenizer: one token a character)."""
        return None if self.text is None else len(self.text) + EOS_TOKENS


def recital(canaries) -> str:
    """The recital of ``canaries`` (each once, whatever order given): ``p1][p2][ .. pk][``."""
    payloads = sorted({canary.payload(c) for c in canaries}, key=lambda p: _ORDER[p[0]])
    return "".join(p + canary.END + canary.START for p in payloads)


def _collision(cs: list[str]) -> str:
    """Why the recital of these (distinct) canaries is ambiguous, or ''."""
    firsts: dict[str, str] = {}
    for c in cs:
        other = firsts.setdefault(c[1], c)
        if other != c:
            return f"two canaries of its context share the first character {c[1]!r} ({other}, {c})"
    owner: dict[str, str] = {}
    for c in cs:
        for i in range(len(c) - 2):
            g = c[i:i + 3]
            other = owner.setdefault(g, c)
            if other != c:
                return f"two canaries of its context share the trigram {g!r} ({other}, {c})"
    return ""


def expected(prompt: str | None, canaries=None) -> Contract:
    """The contract of ``prompt`` read whole. Without the prompt's text (a log that does not record it),
    the recital of ``canaries`` (the plan's list: what the prompt carried by the plan's word)."""
    if prompt is None:
        cs = sorted(set(canaries or ()))
        if not cs:
            return Contract(None, why="neither the prompt nor its canaries are recorded")
        bad = _collision(cs)
        return Contract(None, why=bad) if bad else Contract(recital(cs), tuple(_in_order(cs)))
    if not prompt.endswith(TRIGGER):
        return Contract(None, why="the prompt does not end in the probe's trigger '[' (not a probe prompt)")
    found = canary.find(prompt)
    cs = sorted({c for _at, c in found})
    bad = _collision(cs)
    if bad:
        return Contract(None, why=bad)
    tail = len(prompt) - len(TRIGGER) - MIN_TAIL
    late = [c for at, c in found if at + len(c) > tail]
    if late:
        return Contract(None, why=f"canary {late[0]} ends within {MIN_TAIL} characters of the trigger (the selection "
                                  "head would read it as already recited)")
    return Contract(recital(cs), tuple(_in_order(cs)), head=len(prompt))


def truncated(prompt: str, keep: int) -> Contract:
    """The contract of ``prompt`` cut to its first ``keep`` tokens (characters): the model writes the
    trigger itself, then recites the canaries wholly inside the head."""
    if not 0 < keep < len(prompt):
        raise ValueError(f"keep={keep}: a truncation keeps 1..{len(prompt) - 1} of {len(prompt)} characters")
    found = canary.find(prompt)
    cut = [c for at, c in found if at < keep < at + len(c)]
    if cut:
        return Contract(None, why=f"the truncation at {keep} tokens cuts canary {cut[0]} (its recital is not defined)",
                        head=keep)
    cs = sorted({c for at, c in found if at + len(c) <= keep})
    bad = _collision(cs)
    if bad:
        return Contract(None, why=bad, head=keep)
    late = [c for at, c in found if keep - MIN_TAIL < at + len(c) <= keep]
    if late:
        return Contract(None, why=f"canary {late[0]} ends within {MIN_TAIL} characters of the truncation at {keep} "
                                  "tokens (the selection head would read it as already recited)", head=keep)
    return Contract(TRIGGER + recital(cs), tuple(_in_order(cs)), head=keep)


def _in_order(cs) -> list[str]:
    return sorted(set(cs), key=lambda c: _ORDER[c[1]])


def first_difference(expected_text: str, got: str) -> int | None:
    """The index of the first character where ``got`` differs from ``expected_text`` (a ``got`` longer
    or shorter than it differs at the shorter one's end); None when equal."""
    if got == expected_text:
        return None
    n = min(len(got), len(expected_text))
    return next((i for i in range(n) if got[i] != expected_text[i]), n)
