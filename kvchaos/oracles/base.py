"""What every checker shares: the three statuses, :class:`Verdict`, :class:`Checker` and ``compose``.

A checker is an oracle with its options bound at construction (Jepsen's shape): ``checker.check(
history, registry)`` returns one :class:`Verdict`. ``history`` is a :class:`kvchaos.history.History`
(a list of records is indexed into one); ``registry`` is the canary registry of the session (every
canary minted anywhere the judgement knows of: :class:`kvchaos.canary.Registry`), handed to every
checker explicitly — checkers that do not need it ignore it.

Each checker class declares ``leak``: whether its FAIL is a leak (or the engine's own evidence of
one). What that means for red or green — which checkers always run, what is merged how, which exit
code — is decided by :mod:`kvchaos.policy` alone.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, field

from kvchaos.history import History, Witness, as_history

PASS, FAIL, UNKNOWN = "pass", "fail", "unknown"
STATUSES = (PASS, FAIL, UNKNOWN)


@dataclass
class Verdict:
    oracle: str
    status: str
    summary: str
    witnesses: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r}: one of {STATUSES}")
        self.witnesses = [w if isinstance(w, Witness) or not isinstance(w, dict) else Witness(w)
                          for w in self.witnesses]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["witnesses"] = [dict(w) if isinstance(w, dict) else w for w in self.witnesses]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        return cls(d.get("oracle", "?"), d.get("status", UNKNOWN), d.get("summary", ""),
                   list(d.get("witnesses") or []), dict(d.get("stats") or {}))

    def __str__(self):
        return f"{self.oracle}: {self.status.upper()} — {self.summary}"


def ladder(name: str, stats: dict, witnesses: list, fail, unknown=(), passed: str = "") -> Verdict:
    """The order every verdict is decided in: any witness is a FAIL (``fail(witnesses)`` says what);
    else the first ``(condition, why)`` of ``unknown`` that holds is UNKNOWN (``why`` a string, or a
    callable for one that may only be built when its condition holds); else PASS (``passed``)."""
    if witnesses:
        return Verdict(name, FAIL, fail(witnesses), witnesses, stats)
    for cond, why in unknown:
        if cond:
            return Verdict(name, UNKNOWN, why() if callable(why) else why, [], stats)
    return Verdict(name, PASS, passed, [], stats)


class Checker:
    """An oracle with its options bound at construction: ``checker.check(history, registry) -> Verdict``.

    Build them once (``Liveness(bound_s=60)``), pass them to an experiment, and :func:`compose`
    several into one. ``name`` is the verdict's oracle name; ``leak``: a FAIL of this checker is a
    leak (the policy never hides it); ``log_only``: it needs nothing but the history (no reference
    server, no thresholds a test must choose) — the policy runs such leak checkers on every history."""

    name = ""
    leak = False
    log_only = False

    def __call__(self, history, registry=None) -> Verdict:
        return self.check(history, registry)

    def check(self, history, registry=None) -> Verdict:
        raise NotImplementedError

    def live(self, plans: dict, registry=None):
        """A judge of a run's replies as they end (``judge(part) -> Verdict``), or None: this checker
        judges whole runs only. Only a checker whose FAIL on part of a run is its FAIL on the whole run
        answers one (:class:`kvchaos.oracles.Isolation`)."""
        return None

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({opts})"


def check_safe(checker: Checker, h: History, registry=None) -> Verdict:
    """``checker``'s verdict, or UNKNOWN naming the crash (Jepsen's ``check-safe``): a checker that
    cannot judge a history proves nothing about it, and never passes it."""
    try:
        v = checker.check(h, registry)
        if not isinstance(v, Verdict) or v.oracle != checker.name:
            raise TypeError(f"returned {v!r}, not a {checker.name!r} Verdict")
        return v
    except Exception as e:  # noqa: BLE001 - a crash is an UNKNOWN of that checker, with its cause
        tb = traceback.format_exc(limit=6)
        return Verdict(checker.name, UNKNOWN, f"the checker crashed: {type(e).__name__}: {e}"[:600], [],
                       {"crashed": f"{type(e).__name__}: {e}"[:2000], "traceback": tb[-4000:]})


class Composite(Checker):
    """Several checkers as one: ``check`` returns one verdict per checker, in order."""

    def __init__(self, checkers):
        flat = []
        for c in checkers:
            flat += c.checkers if isinstance(c, Composite) else [c]
        for c in flat:
            if not isinstance(c, Checker):
                raise TypeError(f"not a checker: {c!r} (build one, e.g. oracles.Liveness(bound_s=60))")
        names = [c.name for c in flat]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"checker(s) {dup} given twice: each oracle judges a history once")
        self.checkers = flat

    def check(self, history, registry=None) -> list[Verdict]:
        h = history if isinstance(history, History) else None
        if h is None:
            try:
                h = as_history(history)
            except Exception as e:  # noqa: BLE001 - an unreadable history: every checker says so
                return [Verdict(c.name, UNKNOWN, f"the history cannot be read: {e}"[:600], [],
                                {"crashed": f"{type(e).__name__}: {e}"[:2000]}) for c in self.checkers]
        return [check_safe(c, h, registry) for c in self.checkers]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.checkers]


def compose(*checkers) -> Composite:
    return Composite(checkers)
