"""``kvchaos shrink RUN_DIR SCENARIO``: a failing scenario shrunk to a minimal one that still fails the
same way: ``minimal.json``, the minimal log, ``repro.py`` and ``BUG.md``. ``kvchaos shrink
FILE.scenario.json``: a scenario file shrunk (its nemesis ops, live knobs, plans and prompts) into a
``minimal.json`` scenario. Exit status: 0 shrunk, 1 the failure did not re-run, 2 bad input."""

from __future__ import annotations

import sys

from kvchaos.commands._common import REPO, subparser, usage_errors
from kvchaos.commands.fuzz import shrink_file
from kvchaos.replay import ReplayError, shrink
from kvchaos.workload.scenario import ScenarioError

NAME = "shrink"
HELP = "shrink a failing scenario to a minimal one that still fails the same way"
DESCRIPTION = " ".join("""
Re-runs the scenario's test with the run's seed; once its experiment is judged, the same session
(same cluster) delta-debugs it: fewer requests, faults, tenants, less concurrency, keeping only
changes after which the same checker still FAILs with a witness of the same kind. Writes
minimal.json, the minimal log, repro.py and BUG.md. Given a scenario file (*.json) instead, starts a
cluster of its deployment and shrinks its nemesis ops, live knobs, plans and prompts, each step run
as on a fresh cluster (caches flushed, canaries re-minted) and kept only when every run of it shows
the same mechanism. Exit 0 shrunk, 1 the failure did not re-run, 2 bad input.
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("run_dir", help="a run directory (reports/<run-id>), or a scenario file (*.json)")
    sp.add_argument("scenario", nargs="?", help="the experiment's name (or id, or its test id); not with a file")
    sp.add_argument("--budget-s", type=float, default=1200.0, help="wall-clock bound of the search (default 1200)")
    sp.add_argument("--steps", type=int, default=40, help="at most this many attempts (default 40)")
    sp.add_argument("--attach", help="router=URL,prefill=URL,decode=URL: against running servers")
    sp.add_argument("--checker", help="the checker whose FAIL to keep (default: the first leak checker that failed: "
                                      "isolation, kv_lifecycle, cache_isolation, differential, http_semantics)")
    sp.add_argument("--profile", default=cfg.get("profile", "cpu"), help="with a scenario file: the cluster profile")
    sp.add_argument("--out", help="with a scenario file: output directory (default reports/shrinks/<name>-<stamp>)")
    return sp


def run(args) -> int:
    if str(args.run_dir).endswith(".json"):
        with usage_errors("shrink", ScenarioError):
            if args.scenario or args.attach:
                raise ScenarioError("a scenario file is shrunk whole, on a cluster of its own: no SCENARIO, no --attach")
            return shrink_file(args.run_dir, args.profile, None, args.checker, args.budget_s, args.steps, args.out)
    with usage_errors("shrink", ReplayError):
        if not args.scenario:
            raise ReplayError("name the scenario to shrink (an experiment's name, id or test id)")
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
