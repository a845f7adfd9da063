"""``kvchaos digests RUN_DIR [RUN_DIR ...]``: the plan digest of every scenario per run directory, and
where two runs differ. Exit status: 0 no scenario's plans differ, 1 some do, 2 bad input."""

from __future__ import annotations

import json

from kvchaos.commands._common import subparser, usage_errors
from kvchaos.replay import ReplayError, digests

NAME = "digests"
HELP = "plan digest of every scenario of run directories; where they differ"
DESCRIPTION = " ".join("""
Same seed, engine and layout => same plans: this lists each scenario's plan digest per run directory
(a dry run's plans.jsonl or a run's experiments.jsonl). Exit 0 none differ, 1 some differ, 2 bad
input.
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    sp.add_argument("--json", action="store_true")
    return sp


def run(args) -> int:
    with usage_errors("digests", ReplayError):
        res = digests(args.run_dirs)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        for d, s in res["runs"].items():
            print(f"run {d}: seed {s}")
        for r in res["scenarios"]:
            vals = list(r["digests"].values())
            mark = "DIFFER" if len(set(vals)) > 1 else ("same" if len(vals) > 1 else "")
            print(f"{mark:6s} {' '.join(vals)}  {r['test']} :: {r['name']} [{r['kv_layout']}]")
        print(f"{len(res['scenarios'])} scenarios, {len(res['differ'])} differ, {len(res['missing'])} not in every run")
    return 1 if res["differ"] else 0
