"""One seed per run, from which every suite's workload and every fault's randomness derive.

A run has one integer seed (``--kvchaos-seed``, default: a fresh random one, printed and recorded).
Each suite names its random streams with small integer *labels* (``seeds(101)``: the transfer-delay
workload) and each fault armed in a test takes the next seed of that test's fault stream; both are
functions of (run seed, test, label) only, so the same run seed on the same engine and layout
rebuilds the same plans — rids, prompts, canaries, kinds, abort points — and the same fault
parameters (jitter draws, toxicity draws), which is what ``kvchaos replay`` relies on and what a
plan digest (``kvchaos.workload.plan.plans_digest``) checks.

Run seed :data:`REFERENCE` (0) is the reviewed one: each label is its own workload seed, i.e. the
plans every suite was written and reviewed against (``make test`` runs it, so CI's gate is
reproducible; ``make soak`` runs fresh seeds). Any other run seed mixes (seed, label) through
SHA-256 into an unrelated 31-bit seed.
"""

from __future__ import annotations

import hashlib
import secrets

REFERENCE = 0
MAX = 2**31 - 1


class SeedError(ValueError):
    pass


def parse(value) -> int:
    """A run seed from an option value: a non-negative integer, or ``random`` / empty for a fresh one."""
    if value is None or str(value).strip().lower() in ("", "random"):
        return fresh()
    try:
        s = int(str(value).strip(), 0)
    except ValueError:
        raise SeedError(f"--kvchaos-seed {value!r}: an integer 0..{MAX} or 'random'") from None
    if not 0 <= s <= MAX:
        raise SeedError(f"--kvchaos-seed {value!r}: out of range 0..{MAX}")
    return s


def fresh() -> int:
    return 1 + secrets.randbelow(MAX)


def derive(run_seed: int, *labels) -> int:
    """The seed of the stream named ``labels`` in a run of ``run_seed``. Under the reference seed an
    integer label is its own seed (the reviewed plans); otherwise a SHA-256 mix, stable across
    processes and Python versions (unlike ``hash``)."""
    if run_seed == REFERENCE and len(labels) == 1 and isinstance(labels[0], int) and not isinstance(labels[0], bool):
        return labels[0]
    h = hashlib.sha256(repr((int(run_seed),) + tuple(labels)).encode()).digest()
    return int.from_bytes(h[:8], "big") % MAX + 1


class Seeds:
    """One test's seeds: ``seeds(label)`` for a workload stream, :meth:`fault` for the next armed
    fault. ``scope`` is the test's id without its layout/backend parameters, so one test draws the
    same plans on every layout (the page size still shapes diverging prompts)."""

    def __init__(self, run_seed: int, scope: str = ""):
        self.run, self.scope = int(run_seed), scope
        self._faults = 0
        self.used: dict[int, int] = {}

    def __call__(self, label: int) -> int:
        if not isinstance(label, int) or isinstance(label, bool) or label < 0:
            raise SeedError(f"seeds({label!r}): a workload stream label is a non-negative integer")
        s = derive(self.run, label)
        self.used[label] = s
        return s

    def fault(self) -> int:
        """The seed for the next fault this test arms (in arming order)."""
        self._faults += 1
        return derive(self.run, self.scope, "fault", self._faults)

    def __repr__(self):
        return f"Seeds(run={self.run}, scope={self.scope!r})"
