"""Scenarios: what a property draws (a class of shape, its variant, primitive parameters), the
registry of the builders that render each class into logs, every variant each class must produce,
and the parts every leak scenario shares (the clean requests around the leak, the foreign canary's
owner, the victim whose reply shows it)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from kvchaos import canary
from kvchaos.workload.plan import RequestPlan

from .clean import DELIVERIES, Mint, clean_request, reply_wire
from .logs import LogSpec, Req
from .replies import ERROR_SHAPES, order, recite, twin_payload

# --------------------------------------------------------------------------- scenarios
@dataclass
class Scenario:
    """What a property draws: a class of shape, its variant and the drawn parameters (``params``,
    primitive values: this is what Hypothesis prints). ``build(leak)`` makes the logs."""
    cls: str
    variant: str
    params: dict
    malformed: bool = False          # the shape is malformed input: exit 2 (bad input) is acceptable
    accept_known: bool = False       # the scenario is about an accepted known finding
    twin_green: bool = True          # its leak-free twin is a clean, powered log (judge 0, suite green)

    def __repr__(self):
        if self.cls == "mirror":
            return f"Scenario(cls='mirror', {mirror_summary(self)})"
        p = dict(self.params)
        return f"Scenario(cls={self.cls!r}, variant={self.variant!r}, params={p!r})"

    def _repr_pretty_(self, p, cycle):  # what Hypothesis prints for a falsifying example
        p.text(repr(self))

    def build(self, leak: bool = True) -> list[LogSpec]:
        return BUILDERS[self.cls](self, leak)

    def write(self, d: Path, leak: bool = True) -> dict:
        """Write the logs under ``d``; returns {"judged": [paths], "all": [paths], "specs": [LogSpec],
        "main": the path of the log holding the leak, "meta": what was planted there}."""
        d.mkdir(parents=True, exist_ok=True)
        specs = self.build(leak)
        paths = [s.write(d / f"{i}-{s.name}.events.jsonl") for i, s in enumerate(specs)]
        main = next((i for i, s in enumerate(specs) if s.meta), 0)  # the log holding the planted leak
        return {"judged": [p for p, s in zip(paths, specs) if s.judged], "all": paths, "specs": specs,
                "main": paths[main], "meta": specs[main].meta}


BUILDERS = {}


def builder(cls):
    def deco(fn):
        BUILDERS[cls] = fn
        return fn
    return deco


def mirror_summary(sc: Scenario) -> str:
    return "; ".join(f"log {i}: clean {lg['base']}, noise {lg['noise']}, pd={lg['pd']}, version={lg['version']}, "
                     f"seed={lg['seed']}" for i, lg in enumerate(sc.params["logs"]))


# ----------------------------------------------------------------- shared parts of the leak scenarios
EP = {"g": "generate", "c": "completions", "h": "chat"}
COMBOS = tuple((e, d) for e in "gch" for d in DELIVERIES)
# the clean requests around a leak: 35 of 3 canaries, >= 100 canaries echoed (one own canary a leak
# displaced cannot take the run below the power floor); "plain": all /generate complete, "mixed": every
# endpoint, complete and streamed, drawn from the seed (few dimensions: quick to shrink)
LEAK_BASE_N = 35
leak_base = st.sampled_from(("plain", "mixed"))
owner_kinds = st.sampled_from(("log", "other-log", "nobody"))
# where a split canary's payload is cut between two stream events: 1..9, shrinking towards 5 (two halves
# of 5: neither holds the 8 characters a partial match needs)
splits = st.integers(-4, 4).map(lambda d: 5 + d)


class _Ctx:
    """Building one leak scenario: the main log's plans, the owner of the leaked canary, the victim."""

    def __init__(self, sc: Scenario, leak: bool, pd: bool = False):
        self.sc, self.leak, self.pd = sc, leak, pd
        seed = sc.params.get("seed", 0)
        self.m = Mint("main", seed)
        self.other = Mint("other", seed)
        self.nobody = random.Random(f"nobody/{seed}")
        self.reqs: list[Req] = []
        if "base" in sc.params:
            brng = random.Random(f"base/{seed}")
            for _ in range(LEAK_BASE_N):
                ep, delivery = ("g", "complete") if sc.params["base"] == "plain" else brng.choice(COMBOS)
                self.reqs.append(clean_request(self.m, "generate" if pd else EP[ep], delivery, 3))
        self.other_reqs: list[Req] = []
        self.twin_rng = random.Random(f"twin/{seed}")
        self._shown: dict = {}
        self.planted: str | None = None
        self.victims: list = []

    def foreign(self, owner: str, avoid_first=()) -> str:
        """The foreign canary (minted for the owner: a request of this log, of another log, or nobody)."""
        while True:
            if owner == "log":
                pool = [c for r in self.reqs for c in r.plan.canaries]
                c = self.m.rng.choice(pool)
            elif owner in ("other-log", "unjudged-log"):
                if not self.other_reqs:  # another experiment's log: powered and clean on its own
                    self.other_reqs = [clean_request(self.other, "generate", "complete", 3) for _ in range(35)]
                p = self.other.plan("generate", "plain", 3)
                self.other_reqs.append(Req(p, reply_wire(self.other, p, recite(p.canaries), "complete")))
                c = self.other.rng.choice(p.canaries)
            else:
                c = canary.mint(self.nobody, 1)[0]
            if c[1] not in avoid_first and c[1] != canary.ALPHABET[-1]:
                self.planted = c
                return c

    def show(self, c: str) -> str:
        """The canary as it appears in the client's bytes: itself, or the twin's lower-case stand-in."""
        if c not in self._shown:
            self._shown[c] = c if self.leak else "[" + twin_payload(self.twin_rng) + "]"
        return self._shown[c]

    def victim_plan(self, endpoint, kind, foreign, ncan=None, expect_echo=True):
        """A victim whose own canaries avoid the foreign canary's first character and one of which
        recites after it (so a displaced recitation shows the whole foreign canary)."""
        rng = self.m.rng
        n = ncan or rng.randint(1, 3)
        while True:
            cs = canary.mint(rng, n, avoid_first=[foreign[1]])
            if max(canary.ALPHABET.index(c[1]) for c in cs) > canary.ALPHABET.index(foreign[1]):
                break
        return self.m.plan(endpoint, kind, canaries=cs, expect_echo=expect_echo)

    def victim(self, owner: str, endpoint: str, kind: str) -> tuple[str, RequestPlan, str]:
        """The foreign canary (of ``owner``: :meth:`foreign`), a victim of ``endpoint`` and ``kind``
        (:meth:`victim_plan`) and the text of its reply (:meth:`displaced`)."""
        f = self.foreign(owner)
        p = self.victim_plan(endpoint, kind, f)
        return f, p, self.displaced(p, f)

    def displaced(self, p: RequestPlan, foreign: str) -> str:
        """The victim's reply: its context held the foreign canary where one of its own was (stale KV):
        the probe recites the foreign one in its place, in ascending order."""
        own = list(p.canaries)
        later = [c for c in own if canary.ALPHABET.index(c[1]) > canary.ALPHABET.index(foreign[1])]
        own.remove(later[-1])
        shown = self.show(foreign)
        return "".join((canary.payload(c) + "][") if c != foreign else shown[1:-1] + "]["
                       for c in order(own + [foreign]))

    def insert(self, i: int, req: Req) -> None:
        self.reqs.insert(min(i, len(self.reqs)), req)
        self.victims.append(req.plan.rid)

    def place(self, req: Req, owner: str, **kw) -> list[LogSpec]:
        """The victim's request at its drawn place (``at``) among the clean ones, then the logs."""
        self.insert(self.sc.params["at"], req)
        return self.logs(owner, **kw)

    def logs(self, owner: str, **kw) -> list[LogSpec]:
        out = [LogSpec("main", self.reqs, pd=self.pd, meta=self.meta(owner), **kw)]
        if self.other_reqs:
            out.append(LogSpec("other", self.other_reqs, judged=(owner != "unjudged-log")))
        return out

    def meta(self, owner: str) -> dict:
        return {"foreign": self.planted, "shown": self._shown.get(self.planted), "owner": owner,
                "victims": list(self.victims)}


def _leak_common(draw):
    return {"seed": draw(st.integers(0, 2**16)), "base": draw(leak_base), "at": draw(st.integers(0, 40))}


def _leak_draw(draw, cls, variant) -> tuple[str, dict]:
    """What every leak class draws first: its variant (:func:`_label`), then the common parameters."""
    return _label(draw, cls, variant), _leak_common(draw)


def _label(draw, cls, variant):
    """The variant of ``cls`` to build: ``variant`` when given, else one of :data:`VARIANTS` drawn."""
    if variant is not None:
        assert variant in VARIANTS[cls], (cls, variant)
        return variant
    return draw(st.sampled_from(sorted(VARIANTS[cls])))


# every variant each class must produce (the property run checks it saw each one)
VARIANTS = {
    "complete-generate": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "complete-openai": {f"{e}/{o}" for e in ("completions", "chat") for o in ("log", "other-log", "nobody")},
    "stream-generate": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "stream-openai-split": {f"{e}/{o}" for e in ("completions", "chat") for o in ("log", "other-log", "nobody")},
    "stream-cut-mid-line": {"generate-chunk-before-cut", "generate-in-cut-line", "openai-split-into-cut-line",
                            "openai-in-cut-line", "complete-body-cut", "reset-after-chunk"},
    "stream-after-done": {"openai-split", "openai-whole", "generate-cumulative", "another-reply"},
    "stream-after-malformed-line": {"openai-split", "openai-whole", "generate-cumulative", "another-reply"},
    "aborted": {"generate", "openai-merged", "openai-split-into-partial-line", "no-response-yet"},
    "disconnected": {"generate-buffered", "openai-whole-buffered", "openai-split-buffered"},
    "timeout": {"generate", "openai-merged", "openai-split-into-partial-line", "complete-body-partial"},
    "http-error": {f"{s}xx/{b}" for s in (4, 5) for b in ERROR_SHAPES + ("sse-error-event",)},
    "raw-missing": {f"{w}/{r}" for w in ("text", "meta", "output_ids", "error") for r in ("absent", "null")},
    "prefill-leg-error": {"decode-ok", "decode-error"},
    "cross-log": {"A,B", "B,A"},
    "unknown-origin": {f"{e}/{d}" for e in ("generate", "completions", "chat") for d in DELIVERIES},
    "duplicate-body-record": set(DELIVERIES),
    "duplicate-json-key": set(DELIVERIES),
    "cut-last-line": set(DELIVERIES),
    "short-blind-known": set(DELIVERIES),
    "short-owner-after-victim": set(DELIVERIES),
    "checkers-liveness": {f"generate/{o}" for o in ("log", "other-log", "nobody")},
    "cut-short-recital": {"log", "unjudged-log"},
}
