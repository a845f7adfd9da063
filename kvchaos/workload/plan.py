"""Tenants, their canaries, and per-request plans — all derived from one seed, so a run replays.

A :class:`Workload` with the same seed, tenants, salts and mix produces the same plans (rids,
prompts, canaries, kinds, abort times, shared prefixes, salts) in the same order.

Prefix sharing (``sharing``; what a prefix cache is given to reuse). Every shared part is built from
the workload's seed, so two workloads never share more than chance:

* ``none``: random filler with the request's own canaries (nothing to reuse);
* ``public``: the workload's public system prompt (filler, no canary) that every tenant sends first;
* ``tenant``: the public prompt, then the tenant's own system prompt, which carries one canary of
  the tenant's (in every plan of that tenant: its own; in another tenant's reply: a leak);
* ``conversation``: turn *k* resends turn *k-1*'s prompt (without its trigger) and adds a new part
  with new canaries; it is sent only after turn *k-1* ended (``after``);
* ``diverge``: two tenants' prompts share a long public prefix and part ways exactly at the first
  payload character of a canary, on a page boundary (``at="page"``) or mid-page (``at="mid"``) of
  the cluster's KV page size — what a prefix cache that matches one token (or page) too far serves
  as the other tenant's canary;
* ``identical``: several tenants send the same prompt (its canary is each one's own).

``cache_salt`` (per tenant, optional: ``salts``) is what the request asks the prefix cache to
namespace it by; the plan records it and the driver sends it. ``salts="tenant"`` salts are fresh
for each ``Workload`` object (a nonce), so a replay never finds the original run's cache entries:
everything else replays identically.
"""

from __future__ import annotations

import random
import hashlib
import json
import secrets
from dataclasses import asdict, dataclass, field
from itertools import count

from kvchaos import canary
from kvchaos.probe import MIN_HEAD, MIN_TAIL, TRIGGER, max_new_tokens, prompt

REQUEST_KINDS = ("plain", "stream", "oversized", "abort_after", "disconnect_before_first_token")
CLIENT_CUTS = ("abort_after", "disconnect_before_first_token")  # the kinds whose client cuts its own request
ENDPOINTS = ("generate", "completions", "chat")
SHARING = ("none", "public", "tenant", "conversation", "diverge", "identical")
PUBLIC_LEN = 128  # the public system prompt (characters = probe tokens)
TENANT_SYS_LEN = 96  # a tenant's system prompt after it, with the tenant's canary


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
    cache_salt: str | None = None  # sent as ``cache_salt``: the prefix-cache namespace asked for
    sharing: str = "none"  # what the prompt shares with others (module doc)
    shared_chars: int = 0  # the prompt's first characters that other plans share by design
    group: str | None = None  # the shared part's id (a conversation, a diverging pair, ...)
    after: str | None = None  # rid that must end before this one is sent (a conversation's previous turn)
    timing: str | None = None  # the timing probe's arm this request measures (kvchaos.oracles.timing_isolation)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The ``plan`` event: everything, the prompt text included (prefix-cache checkers compute
        common prefixes from it; a replay resends it)."""
        d = asdict(self)
        d["prompt_chars"] = len(self.prompt)
        return d


class Workload:
    """``salts``: None (no request carries a salt), ``"tenant"`` (each tenant its own salt,
    unique to this workload), or a dict tenant name -> salt (str; a tenant left out sends none)."""

    def __init__(self, seed: int, n_tenants: int = 8, prefix: str = "r", salts=None, page_size: int = 1):
        if n_tenants < 1:
            raise ValueError(f"n_tenants must be >= 1, got {n_tenants}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int (the cluster's KV page size), got {page_size!r}")
        self.seed = seed
        self.rng = random.Random(seed)
        self.tenants = [Tenant(f"t{i:03d}", random.Random(f"{seed}/t{i}")) for i in range(n_tenants)]
        self.prefix = prefix
        self.page_size = page_size
        self.salts = _salts(salts, [t.name for t in self.tenants], f"{prefix}{seed}")
        self._n = 0
        self._groups = count(1)
        srng = random.Random(f"{seed}/shared")
        # the public system prompt: filler only; a word that names the workload first, so two
        # workloads' prompts part within a few characters
        self.public = _segment(srng, PUBLIC_LEN, [], lead=f"system {_word(srng)} ")
        self.tenant_sys: dict[str, tuple[str, list[str]]] = {}
        for t in self.tenants:
            cs = canary.mint(srng, 1)
            self.tenant_sys[t.name] = (_segment(srng, TENANT_SYS_LEN, cs), cs)

    def tenant(self, name: str) -> Tenant:
        for t in self.tenants:
            if t.name == name:
                return t
        raise ValueError(f"no tenant {name!r} in this workload ({', '.join(t.name for t in self.tenants)})")

    def _rid(self, tenant: str) -> str:
        """``<prefix><seed>-<n>-<tenant>``: the tenant is in the rid so in-engine faults can target
        a tenant (``{"tenant": "t003"}``) from the engine side, where only the rid is known."""
        self._n += 1
        return f"{self.prefix}{self.seed}-{self._n:06d}-{tenant}"

    def request(self, tenant: Tenant | None = None, kind: str = "plain", n_tokens: int | None = None,
                n_canaries: int | None = None, endpoint: str = "generate", abort_after_ms: float | None = None,
                sharing: str = "none") -> RequestPlan:
        """One plan. ``sharing``: ``none``, ``public`` or ``tenant`` (the multi-plan kinds have
        their own methods: :meth:`conversation`, :meth:`diverging`, :meth:`identical`)."""
        self._check(kind, endpoint)
        if sharing not in ("none", "public", "tenant"):
            raise ValueError(f"sharing {sharing!r} for one request: one of none, public, tenant "
                             "(conversation, diverge and identical make several plans: their own methods)")
        t = tenant or self.rng.choice(self.tenants)
        head, head_cs = self._head(t.name, sharing)
        k = n_canaries if n_canaries is not None else t.rng.randint(1, 3)
        floor = len(head) + k * (canary.LENGTH + 2) + MIN_HEAD + MIN_TAIL + 1
        n = max(n_tokens if n_tokens is not None else t.rng.randrange(64, 600), floor)
        cs = canary.mint(t.rng, k, beside=head_cs)
        text = head + prompt(t.rng, n - len(head), cs)
        return self._plan(t, text, head_cs + cs, kind=kind, endpoint=endpoint, abort_after_ms=abort_after_ms,
                          sharing=sharing, shared_chars=len(head), group=None if sharing == "none" else
                          ("public" if sharing == "public" else f"sys-{t.name}"))

    # ------------------------------------------------------------------ shared prefixes
    def conversation(self, tenant: Tenant | str, turns: int = 3, first: int = 200, step: int = 120,
                     kind: str = "plain", endpoint: str = "generate") -> list[RequestPlan]:
        """``turns`` plans of one conversation: the first is the public and the tenant's system
        prompt plus ``first`` characters with 1-2 canaries; each next turn resends the previous
        prompt (its trigger dropped) and adds ``step`` characters with 1-2 new canaries, and waits
        for the previous turn to end. A turn's canaries are all of the conversation's so far."""
        t = tenant if isinstance(tenant, Tenant) else self.tenant(tenant)
        if turns < 1:
            raise ValueError(f"a conversation needs >= 1 turn, got {turns}")
        self._check(kind, endpoint)
        gid = f"conv-{self._gid()}"
        head, cs = self._head(t.name, "tenant")
        text, out = head, []
        for i in range(turns):
            new = canary.mint(t.rng, t.rng.randint(1, 2), beside=cs)
            shared = len(text)
            text = text + prompt(t.rng, (first if i == 0 else step), new)
            cs = cs + new
            out.append(self._plan(t, text, list(cs), kind=kind, endpoint=endpoint, sharing="conversation",
                                  shared_chars=shared, group=gid, after=out[-1].rid if out else None,
                                  extra={"turn": i + 1}))
            text = text[:-len(TRIGGER)]
        return out

    def diverging(self, a: Tenant | str, b: Tenant | str, shared: int = 256, at: str = "page",
                  tail: int = 96, kind: str = "plain", salts: tuple | None = None) -> list[RequestPlan]:
        """Two plans (of tenants ``a`` and ``b``) whose prompts are the same ``shared``-odd characters
        of public filler and then part at the first payload character of each one's own canary:
        at a KV page boundary (``at="page"``: the first differing token starts a page) or
        mid-page (``at="mid"``). ``a`` is listed first (send it first: the cached one)."""
        ta = a if isinstance(a, Tenant) else self.tenant(a)
        tb = b if isinstance(b, Tenant) else self.tenant(b)
        if at not in ("page", "mid"):
            raise ValueError(f"at={at!r}: 'page' (divergence on a KV page boundary) or 'mid' (inside a page)")
        ps = self.page_size
        # the first differing character is the canary's first payload character: index len(S) + 1
        want = 0 if at == "page" else max(1, ps // 2)
        d = max(shared, MIN_HEAD + 2)
        if ps > 1:
            d += (want - (d + 1)) % ps
            if at == "mid" and (d + 1) % ps == 0:  # page size 2: mid-page is offset 1
                d += 1
        gid = f"div-{self._gid()}"
        srng = random.Random(f"{self.seed}/{gid}")
        common = self.public[:d - 1] if d - 1 <= len(self.public) else self.public + canary.filler(srng, d - 1 - len(self.public))
        common += " "
        out, firsts = [], []
        for t in (ta, tb):
            c = canary.mint(t.rng, 1, avoid_first=firsts)[0]  # the pair parts at this character
            firsts.append(c[1])
            rest = prompt(t.rng, tail, canary.mint(t.rng, 1, beside=[c]))
            cs_rest = [x for _o, x in canary.find(rest)]
            text = common + c + " " + rest
            out.append(self._plan(t, text, [c] + cs_rest, kind=kind, sharing="diverge", shared_chars=len(common) + 1,
                                  group=gid, extra={"diverge_at": len(common) + 1, "page_size": ps, "at": at}))
        return out

    def identical(self, tenants, n_tokens: int = 240, kind: str = "plain") -> list[RequestPlan]:
        """One prompt (public prompt, filler and one canary), sent by each of ``tenants``."""
        ts = [t if isinstance(t, Tenant) else self.tenant(t) for t in tenants]
        if len(ts) < 2:
            raise ValueError("identical prompts need >= 2 tenants")
        gid = f"same-{self._gid()}"
        srng = random.Random(f"{self.seed}/{gid}")
        cs = canary.mint(srng, 1)
        text = self.public + prompt(srng, max(n_tokens - len(self.public), canary.LENGTH + MIN_HEAD + MIN_TAIL + 3), cs)
        return [self._plan(t, text, list(cs), kind=kind, sharing="identical", shared_chars=len(text) - 1, group=gid)
                for t in ts]

    def timing_probe(self, a: Tenant | str, b: Tenant | str, n_per_arm: int = 20, prefix: int = 800,
                     suffix: int = 100) -> list[RequestPlan]:
        """The timing side-channel probe (``kvchaos.oracles.timing_isolation``): ``n_per_arm``
        streamed requests in each of four arms, in a seeded random order, one at a time (each is
        sent after the previous ended), every one on a fresh ``prefix``-character prefix:
        ``same_salt_hit`` (``a`` cached it just before), ``same_salt_miss``, ``cross_salt`` (``a``
        cached it, ``b`` asks), ``never_cached`` (``b``). Each timed request follows an untimed one
        of ``a`` (the same prefix on the hit arms, another on the miss arms)."""
        ta = a if isinstance(a, Tenant) else self.tenant(a)
        tb = b if isinstance(b, Tenant) else self.tenant(b)
        sa, sb = self.salts.get(ta.name), self.salts.get(tb.name)
        if sa is None or sb is None or sa == sb:
            raise ValueError(f"the timing probe needs two tenants with different salts; {ta.name}: {sa!r}, "
                             f"{tb.name}: {sb!r} (Workload(salts='tenant'))")
        if n_per_arm < 1:
            raise ValueError(f"n_per_arm must be >= 1, got {n_per_arm}")
        arms = [arm for arm in ("same_salt_hit", "same_salt_miss", "cross_salt", "never_cached") for _ in range(n_per_arm)]
        self.rng.shuffle(arms)
        gid = f"timing-{self._gid()}"
        srng = random.Random(f"{self.seed}/{gid}")
        out: list[RequestPlan] = []

        def add(t, text, cs, kind, arm):
            out.append(self._plan(t, text, cs, kind=kind, sharing="public", shared_chars=prefix, group=gid,
                                  after=out[-1].rid if out else None, timing=arm))

        for arm in arms:
            head = f"probe {_word(srng)} " + canary.filler(srng, prefix - 15)
            # every timed request follows one untimed request of ``a`` of the same size: on the hit
            # arms it caches the timed one's prefix, on the miss arms another (an engine that was
            # just busy answers faster than an idle one: only the cache may differ between arms)
            warm = head if arm in ("same_salt_hit", "cross_salt") else f"probe {_word(srng)} " + canary.filler(srng, prefix - 15)
            cs = canary.mint(srng, 1)
            add(ta, warm + prompt(srng, suffix, cs), cs, "plain", None)
            cs = canary.mint(srng, 1)
            add(ta if arm.startswith("same") else tb, head + prompt(srng, suffix, cs), cs, "stream", arm)
        return out

    # ------------------------------------------------------------------ helpers
    def _check(self, kind, endpoint):
        if kind not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {kind!r}; one of {REQUEST_KINDS}")
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; one of {ENDPOINTS}")

    def _gid(self) -> str:
        return f"{self.prefix}{self.seed}-{next(self._groups)}"

    def _head(self, tenant: str, sharing: str) -> tuple[str, list[str]]:
        if sharing == "public":
            return self.public, []
        if sharing == "tenant":
            sys_text, cs = self.tenant_sys[tenant]
            return self.public + sys_text, list(cs)
        return "", []

    def _plan(self, t: Tenant, text: str, cs: list[str], kind: str = "plain", endpoint: str = "generate",
              abort_after_ms=None, **kw) -> RequestPlan:
        self._check(kind, endpoint)
        p = RequestPlan(rid=self._rid(t.name), tenant=t.name, kind=kind, endpoint=endpoint, prompt=text,
                        canaries=cs, n_tokens=len(text), max_new_tokens=max_new_tokens(len(cs)),
                        abort_after_ms=abort_after_ms, oversized=(kind == "oversized"),
                        cache_salt=self.salts.get(t.name), **kw)
        if kind == "abort_after" and abort_after_ms is None:
            p.abort_after_ms = t.rng.uniform(5, 200)
        return p

    def mix(self, n: int, weights: dict | None = None, lengths=(64, 600), endpoints=("generate",),
            sharing: dict | None = None) -> list[RequestPlan]:
        """``n`` plans over all tenants; ``weights`` maps kind -> relative frequency, ``sharing``
        maps a sharing mode (module doc) -> relative frequency (default :data:`DEFAULT_SHARING`, which
        is :data:`SHARED_MIX`: most traffic shares a prefix with other traffic; ``{"none": 1}``: none). Oversized requests never share. A
        conversation adds 2 turns, a diverging pair 2 plans, identical prompts 2; the mix stops at
        ``n`` plans."""
        weights = weights or {"plain": 1.0}
        bad = set(weights) - set(REQUEST_KINDS)
        if bad:
            raise ValueError(f"unknown request kinds {sorted(bad)}; one of {REQUEST_KINDS}")
        sharing = DEFAULT_SHARING if sharing is None else sharing
        bad = set(sharing) - set(SHARING)
        if bad or not sharing or any(v < 0 for v in sharing.values()) or not sum(sharing.values()):
            raise ValueError(f"sharing {sharing!r}: weights >= 0 (not all 0) over {SHARING}")
        lo, hi = lengths
        kinds, w = zip(*weights.items())
        modes, mw = zip(*sharing.items())
        out: list[RequestPlan] = []
        i = 0
        while len(out) < n:
            t = self.tenants[i % len(self.tenants)]
            u = self.tenants[(i + 1) % len(self.tenants)]
            i += 1
            kind = self.rng.choices(kinds, w)[0]
            mode = self.rng.choices(modes, mw)[0]
            endpoint = self.rng.choice(endpoints)
            length = t.rng.randrange(*lengths)
            room = n - len(out)
            if kind == "oversized" or mode == "none" or (mode in ("conversation", "diverge", "identical") and room < 2):
                mode = "none" if kind == "oversized" else ("public" if mode not in ("none", "public", "tenant") else mode)
            head = PUBLIC_LEN + (TENANT_SYS_LEN if mode in ("tenant", "conversation") else 0)
            if mode in ("public", "tenant") and length < head + 2 * 64:
                mode = "none"  # too short for a shared head and a body of its own
            if mode in ("none", "public", "tenant"):
                out.append(self.request(t, kind, n_tokens=length, endpoint=endpoint, sharing=mode))
            elif mode == "conversation":
                turns = min(3, room)
                first = max(64, min(hi, length) - head - 120 * (turns - 1))
                out += self.conversation(t, turns=turns, first=first, step=120, kind=kind, endpoint=endpoint)
            else:  # a pair: the second is sent once the first ended (its prefix is then cached)
                pair = (self.diverging(t, u, shared=max(64, min(length, hi) - 120), at=self.rng.choice(("page", "mid")),
                                       tail=96, kind=kind) if mode == "diverge" else
                        self.identical([t, u], n_tokens=length, kind=kind))
                pair[1].after = pair[0].rid
                out += pair
        return out[:n]


# per draw (a conversation is 3 plans, a pair or identical prompts 2); a draw too short for a shared
# head shares nothing: with lengths (200, 600) about a third of the plans share nothing
SHARED_MIX = {"none": 4, "public": 3, "tenant": 3, "conversation": 1, "diverge": 1, "identical": 1}
# what mix() uses unless told: every suite's traffic exercises the prefix cache. ({"none": 1} gives
# all-unique prompts.) The one fresh-clone failure seen with it (2026-12-01: decode idle, 30 timeouts)
# was prefill's Mooncake transfer thread dying on its KeyError race (finding
# sglang-mooncake-transfer-worker-dies), which a fault that could not fire then reported as a blind run
DEFAULT_SHARING = SHARED_MIX


def plans_digest(plans) -> str:
    """A digest of what ``plans`` would send: rids, tenants, kinds, endpoints, prompts, canaries,
    abort points, sharing and ordering — everything a plan holds. Per-workload salt nonces (fresh on
    purpose, so a replay never hits the original run's cache entries) are replaced by their order of
    first use: two runs of one seed have the same digest, two seeds (almost surely) do not."""
    salts: dict = {}
    rows = []
    for p in plans:
        d = p.to_dict() if hasattr(p, "to_dict") else dict(p)
        if d.get("cache_salt") is not None:
            d["cache_salt"] = salts.setdefault(d["cache_salt"], f"salt#{len(salts)}")
        rows.append(d)
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _salts(salts, names: list[str], scope: str) -> dict:
    if salts is None:
        return {}
    if salts == "tenant":  # fresh per workload: a replay must not find the original run's cache entries
        nonce = secrets.token_hex(3)
        return {n: f"{scope}-{nonce}-{n}" for n in names}
    if not isinstance(salts, dict):
        raise ValueError(f"salts={salts!r}: None, 'tenant' or a dict tenant -> salt (a non-empty str)")
    unknown = set(salts) - set(names)
    if unknown:
        raise ValueError(f"salts for tenants this workload does not have: {sorted(unknown)}")
    for name, v in salts.items():
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"cache_salt of tenant {name} must be a non-empty str (SGLang answers 400 "
                             f"to anything else), got {type(v).__name__} {v!r}")
    return {k: v for k, v in salts.items() if v is not None}


def _segment(rng: random.Random, n: int, canaries: list[str], lead: str = "") -> str:
    """``n`` characters of filler (starting with ``lead``) holding ``canaries`` the way a probe
    prompt does (not in the first or last characters, never adjacent), without the trigger."""
    body = prompt(rng, n - len(lead) + len(TRIGGER), canaries)[:-len(TRIGGER)]
    return lead + body


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
