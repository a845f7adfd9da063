"""``kvchaos soak [--times K] [SUITE ...] | --from RUN_DIR ...``: the suites K times with fresh seeds (or
finished run directories accounted): outcomes per test, flakes, engine failures per run and per 1,000
requests. Exit status: 0 no test red in any run, 1 otherwise, 2 bad input."""

from __future__ import annotations

import time
from pathlib import Path

from kvchaos.commands._common import REPO, subparser, usage_errors
from kvchaos.soak import SoakError, account, render, soak

NAME = "soak"
HELP = "the suites K times with fresh seeds: outcome counts per test, flakes, engine failures"
DESCRIPTION = " ".join("""
Runs the suites --times times, each a pytest session with a fresh seed (or --seed), under
REPORTS/soak-<stamp>/, or accounts finished run directories (--from). Prints per test the outcome
counts (FLAKY: red in some runs only, with the seed and replay command of each red run) and per
engine-failure signature its rate per run and per 1,000 requests. Exit 0 no test red in any run, 1
otherwise.
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("suites", nargs="*", help="suite files/dirs (default: suites/)")
    sp.add_argument("--times", type=int, default=3, help="runs (default 3)")
    sp.add_argument("--seed", help="one seed for every run (default: a fresh one per run)")
    sp.add_argument("-m", dest="markers", default=cfg.get("markers", "not slow and not gpu"),
                    help="pytest marker expression")
    sp.add_argument("--reports", default=cfg.get("reports", "reports"), help="reports directory")
    sp.add_argument("--from", dest="from_dirs", nargs="+", metavar="RUN_DIR",
                    help="account these run directories instead")
    return sp


def run(args) -> int:
    with usage_errors("soak", SoakError):
        if args.from_dirs:
            res = account(args.from_dirs)
        else:
            out = Path(args.reports).resolve() / time.strftime("soak-%Y%m%d-%H%M%S")
            res = soak(args.times, out, args.suites or [str(REPO / "suites")], args.markers, seed=args.seed)
            print(f"kvchaos soak: {out / 'soak.json'}")
    print(render(res))
    return 1 if res["red"] else 0
