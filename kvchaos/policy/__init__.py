"""Verdict policy — the one place that decides what verdicts mean: which checkers always run, what is
a leak, how verdicts merge into an experiment's and a run's status, which exit code that is, and when
a verdict is a known engine finding.

Every checker says PASS, FAIL or UNKNOWN and declares (its class attribute ``leak``) whether its FAIL
is a leak. Here:

* **Always run.** Every leak checker that needs nothing but the history (``log_only``: isolation,
  integrity, kv_lifecycle, page_ownership, retraction) runs on every history, whatever a test or
  ``--checkers`` named
  (:func:`with_always`). One the test did not name is *not claimed*: its FAIL is red like any leak,
  its UNKNOWN is shown ("not claimed") but does not decide the status.
* **Claimed.** A checker a test named or required is claimed. A claimed leak checker must not FAIL;
  claimed isolation must PASS (UNKNOWN — no power — is red) unless a blind model was declared.
  ``required``: oracle -> wanted status, held exactly.
* **Incomplete history.** A history the loader found incomplete (a cut last line) cannot PASS: every
  PASS becomes UNKNOWN naming the lost record (:meth:`Policy.gate`).
* **Self-test.** A session whose planted-leak self-test did not catch its leak cannot PASS isolation.
* **Known findings.** A non-PASS verdict is KNOWN only when it matches an entry of the findings
  registry (``kvchaos/findings.toml``: data, not code) for the engine and version that ran, with
  every witness showing the entry's mechanism in the engines' own events. A leak can be KNOWN only
  where the run had the power to see it (isolation's per-class power met): a blind run is never
  covered. KNOWN is red unless accepted; accepted KNOWN is its own outcome, never PASS. A liveness
  finding cannot make an isolation, kv_lifecycle or differential FAIL anything but red: findings
  match per checker.
* **Merge and exit codes.** An experiment's status: fail > unknown > known > pass over its items;
  a run's: the worst of its experiments (:func:`merge`); :data:`EXIT` maps a status to an exit code.

Everything else — the CLI, the pytest plugin, the report, shrink — renders or consumes the serialized
:class:`Judgement` (``to_dict``); none of them decides.

Modules: :mod:`.core` (the checker set, merge, ranks, exit codes, a scenario's status),
:mod:`.context` (what a signature may look at), :mod:`.signatures` (mechanism signatures and power
gating), :mod:`.findings` (the findings registry, ``kvchaos/findings.toml``), :mod:`.judge`
(:class:`Policy`, :class:`Judgement`, reading a verdicts file back). Every name is importable from
``kvchaos.policy`` itself.
"""

from __future__ import annotations

from .context import Context
from .core import (EXIT, EXIT_BAD_INPUT, KNOWN, RANK, STATUSES, PolicyError, always_run, exit_code, is_leak_checker,
                   leak_verdict, merge, scenario_status, status_from_rows, with_always)
from .findings import FINDINGS_FILE, Finding, Match, Registry, not_reproduced, version_matches
from .judge import Item, Judgement, Policy, load_policy_table, status_of
from .signatures import SIGNATURES, power_met

__all__ = [
    "EXIT", "EXIT_BAD_INPUT", "FINDINGS_FILE", "KNOWN", "RANK", "SIGNATURES", "STATUSES", "Context", "Finding",
    "Item", "Judgement", "Match", "Policy", "PolicyError", "Registry", "always_run", "exit_code", "is_leak_checker",
    "leak_verdict", "load_policy_table", "merge", "not_reproduced", "power_met", "scenario_status", "status_from_rows",
    "status_of", "version_matches", "with_always",
]
