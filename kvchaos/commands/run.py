"""``kvchaos run``: chaos suites in a pytest session of their own -> ``reports/<run-id>/`` (live progress,
then the verdict summary). Exit status: pytest's."""

from __future__ import annotations

from kvchaos.commands._common import common, running, subparser
from kvchaos.commands._pytest import run_suites

NAME = "run"
HELP = "run chaos suites and write reports/<run-id>/"


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    common(sp, cfg)
    running(sp, cfg)
    sp.add_argument("suites", nargs="*", default=cfg.get("suites"), help="suite files/dirs (default: suites/)")
    sp.add_argument("--attach", default=cfg.get("attach"), help="router=URL,prefill=URL,decode=URL instead of launching")
    sp.add_argument("-k", default=cfg.get("k"), help="pytest -k expression")
    sp.add_argument("--seed", default=cfg.get("seed"), help="the run's seed (default: a fresh random one, recorded)")
    sp.add_argument("-m", dest="markers", default=cfg.get("markers", "not slow and not gpu"),
                    help="pytest marker expression")
    return sp


def run(args) -> int:
    return run_suites(args)[0]
