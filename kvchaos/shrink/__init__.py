"""Shrink a failing experiment to a minimal scenario that still fails the same way.

Runs inside the test's own session, right after the experiment it shrinks was judged (pytest
``--kvchaos-shrink NAME``, what ``kvchaos shrink RUN_DIR NAME`` starts): the cluster is up, so each
attempt costs one experiment, not a cluster start. A *scenario* is data — the plans, the faults as
armed (injector, role, kind, target, params with their seed, count), the concurrency and the path
(router / pd) — and an attempt re-runs it as an experiment of its own (same checkers, policy,
timeouts; its log under ``shrink/<name>/``), arming the recorded faults on entry.

The failure kept is the original's: the first leak checker that FAILed (isolation before
kv_lifecycle, cache_isolation, differential, http_semantics) with a witness of the same kind (a foreign canary
served with the same HTTP status; a late write after release; ...). Steps, each kept only when the
attempt still fails that way:

1. plans — delta debugging (ddmin: drop chunks, then complements, halving the chunk size);
2. faults — drop each one;
3. concurrency — halve down to 1;
4. tenants — drop every plan of a tenant that is not the witness's victim or owner;
5. prompts — halve the filler between a prompt's canaries (all prompts at once while that still
   fails twice in a row, then one prompt at a time), keeping its canaries, the probe's head and
   tail and its trigger, and any prefix it shares by design with a plan still in the scenario
   (:func:`shorten`).

The minimal scenario is then re-run ``CONFIRM`` times; when under half of those fail (it failed by
chance: a stale page that happened to hold other data), the step kept before it is confirmed
instead, up to ``BACKOFF`` steps back, and the one that failed most often is written.

Bounded by ``budget_s`` and ``max_steps``; an attempt that cannot run (a fault that cannot be armed)
counts as not failing. Writes ``minimal.json`` (the scenario, sizes before / after, every attempt),
the minimal attempt's log, ``repro.py`` (a script that needs only kvchaos and the engine: it starts
the recorded cluster, arms the faults, sends the plans and prints the verdicts) and ``BUG.md`` (an
upstream-style report: engine version and flags, steps, expected vs observed, witness).
"""

from __future__ import annotations

from .bugreport import EXPECTED, REPRO, bug_report  # noqa: F401
from .repro import reproduce  # noqa: F401 (a shrink's repro.py calls kvchaos.shrink.reproduce)
from .scenario import ShrinkError, arm, fault_records, kept_ops, shorten, shortenable, subset  # noqa: F401
from .search import BACKOFF, CONFIRM, Shrinker, refused, shrink_after  # noqa: F401
from .target import still_fails, target_of, witness_kind  # noqa: F401
