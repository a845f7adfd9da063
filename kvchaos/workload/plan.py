"""Tenants, their canaries, and per-request plans — all derived from one seed, so a run replays.

A :class:`Workload` with the same seed, tenants and mix produces the same plans (rids, prompts,
canaries, kinds, abort times) in the same order.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from kvchaos import canary
from kvchaos.probe import MIN_HEAD, MIN_TAIL, max_new_tokens, prompt

KINDS = ("plain", "stream", "oversized", "abort_after", "disconnect_before_first_token")
ENDPOINTS = ("generate", "completions", "chat")


@dataclass
class Tenant:
    name: str
    rng: random.Random = field(repr=False, default=None)


@dataclass
class RequestPlan:
    rid: str
    tenant: str
    kind: str = "plain"
    endpoint: str = "generate"
    prompt: str = ""
    canaries: list = field(default_factory=list)
    n_tokens: int = 0
    max_new_tokens: int = 16
    abort_after_ms: float | None = None
    expect_echo: bool = True  # the prompt is a probe prompt: a sensitive model recites its canaries
    oversized: bool = False  # longer than the engine admits: must be rejected with 4xx
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("prompt")
        d["prompt_chars"] = len(self.prompt)
        return d


class Workload:
    def __init__(self, seed: int, n_tenants: int = 8, prefix: str = "r"):
        if n_tenants < 1:
            raise ValueError(f"n_tenants must be >= 1, got {n_tenants}")
        self.seed = seed
        self.rng = random.Random(seed)
        self.tenants = [Tenant(f"t{i:03d}", random.Random(f"{seed}/t{i}")) for i in range(n_tenants)]
        self.prefix = prefix
        self._n = 0

    def _rid(self, tenant: str) -> str:
        """``<prefix><seed>-<n>-<tenant>``: the tenant is in the rid so in-engine faults can target
        a tenant (``{"tenant": "t003"}``) from the engine side, where only the rid is known."""
        self._n += 1
        return f"{self.prefix}{self.seed}-{self._n:06d}-{tenant}"

    def request(self, tenant: Tenant | None = None, kind: str = "plain", n_tokens: int | None = None,
                n_canaries: int | None = None, endpoint: str = "generate", abort_after_ms: float | None = None) -> RequestPlan:
        if kind not in KINDS:
            raise ValueError(f"unknown request kind {kind!r}; one of {KINDS}")
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; one of {ENDPOINTS}")
        t = tenant or self.rng.choice(self.tenants)
        k = n_canaries if n_canaries is not None else t.rng.randint(1, 3)
        floor = k * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1
        n = max(n_tokens if n_tokens is not None else t.rng.randrange(64, 600), floor)
        cs = canary.mint(t.rng, k)
        p = RequestPlan(rid=self._rid(t.name), tenant=t.name, kind=kind, endpoint=endpoint, prompt=prompt(t.rng, n, cs),
                        canaries=cs, n_tokens=n, max_new_tokens=max_new_tokens(k), abort_after_ms=abort_after_ms,
                        oversized=(kind == "oversized"))
        canary.SESSION.add_plans({p.rid: {"canaries": cs, "tenant": t.name}}, f"workload seed {self.seed}")
        if kind == "abort_after" and abort_after_ms is None:
            p.abort_after_ms = t.rng.uniform(5, 200)
        return p

    def mix(self, n: int, weights: dict | None = None, lengths=(64, 600), endpoints=("generate",)) -> list[RequestPlan]:
        """``n`` plans over all tenants; ``weights`` maps kind -> relative frequency."""
        weights = weights or {"plain": 1.0}
        bad = set(weights) - set(KINDS)
        if bad:
            raise ValueError(f"unknown request kinds {sorted(bad)}; one of {KINDS}")
        kinds, w = zip(*weights.items())
        out = []
        for i in range(n):
            t = self.tenants[i % len(self.tenants)]
            kind = self.rng.choices(kinds, w)[0]
            out.append(self.request(t, kind, n_tokens=t.rng.randrange(*lengths), endpoint=self.rng.choice(endpoints)))
        return out
