"""``kvchaos shrink RUN_DIR SCENARIO``: a failing scenario shrunk to a minimal one that still fails the
same way: ``minimal.json``, the minimal log, ``repro.py`` and ``BUG.md``. Exit status: 0 shrunk, 1 the
failure did not re-run, 2 bad input."""

from __future__ import annotations

import sys

from kvchaos.commands._common import REPO, subparser, usage_errors
from kvchaos.replay import ReplayError, shrink

NAME = "shrink"
HELP = "shrink a failing scenario to a minimal one that still fails the same way"
DESCRIPTION = " ".join("""
Re-runs the scenario's test with the run's seed; once its experiment is judged, the same session
(same cluster) delta-debugs it: fewer requests, faults, tenants, less concurrency, keeping only
changes after which the same checker still FAILs with a witness of the same kind. Writes
minimal.json, the minimal log, repro.py and BUG.md. Exit 0 shrunk, 1 the failure did not re-run, 2
bad input.
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("run_dir", help="a run directory (reports/<run-id>)")
    sp.add_argument("scenario", help="the experiment's name (or id, or its test id)")
    sp.add_argument("--budget-s", type=float, default=1200.0, help="wall-clock bound of the search (default 1200)")
    sp.add_argument("--steps", type=int, default=40, help="at most this many attempts (default 40)")
    sp.add_argument("--attach", help="router=URL,prefill=URL,decode=URL: against running servers")
    sp.add_argument("--checker", help="the checker whose FAIL to keep (default: the first leak checker that failed: "
                                      "isolation, kv_lifecycle, cache_isolation, differential, http_semantics)")
    return sp


def run(args) -> int:
    with usage_errors("shrink", ReplayError):
        res = shrink(args.run_dir, args.scenario, budget_s=args.budget_s, max_steps=args.steps, attach=args.attach,
                     checker=args.checker)
    if res.get("refused"):
        print(f"{res['experiment']}: not shrunk — {res['refused']} (verdicts this time: {res.get('verdicts')})")
        return 1
    o, m = res["original"], res["minimal"]
    if not res["reproduced"]:
        print(f"{res['experiment']}: the scenario did not FAIL {res['target']['oracle']} the same way when re-run from "
              f"data ({res['attempts'][0].get('verdicts')}): not shrunk; see {res['dir']}/minimal.json")
        return 1
    print(f"{res['experiment']}: {res['target']['oracle']} FAIL kept; requests {o['requests']} -> {m['requests']}, "
          f"tenants {o['tenants']} -> {m['tenants']}, faults {o['faults']} -> {m['faults']}, concurrency "
          f"{o['concurrency']} -> {m['concurrency']}, prompt characters {o.get('prompt_chars')} -> {m.get('prompt_chars')} "
          f"({res['steps']} attempts, {res['wall_s']} s); the minimal one "
          f"failed again {res.get('confirmed')}/{res.get('confirm_runs')}")
    print(f"repro: cd {REPO} && {sys.executable} {res['dir']}/repro.py\nbug report: {res['dir']}/BUG.md")
    return 0 if res["reproduced"] else 1
