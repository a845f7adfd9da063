"""``kvchaos repro NAME | --list``: reproduce a known incident (its suite, as ``run`` runs suites), then
show the incident's last summaries. Exit status: pytest's; 2 for an unknown incident."""

from __future__ import annotations

from pathlib import Path

from kvchaos.commands._common import REPO, UsageError, common, running, subparser
from kvchaos.commands._pytest import run_suites

NAME = "repro"
HELP = "reproduce a known incident (see --list)"

INCIDENTS = {
    "glm53": ("suites/incidents/test_glm53_kv_leak.py",
              "GLM-5.3 KV leak: prefill pool < context, rejected prompt handed to decode, stale pages served "
              "(pre-fix sglang 0.5.19 in its own env; bug replay on 0.5.23; the fixed 0.5.23)"),
}


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    common(sp, cfg)
    running(sp, cfg)
    sp.add_argument("name", nargs="?", help="incident name, e.g. glm53")
    sp.add_argument("--list", action="store_true", help="list known incidents")
    return sp


def run(args) -> int:
    if args.list or not args.name:
        for k, (path, what) in INCIDENTS.items():
            print(f"{k:8s} {path}\n         {what}")
        if not args.list:
            raise UsageError("repro: name an incident (see above)")
        return 0
    if args.name not in INCIDENTS:
        raise UsageError(f"repro: unknown incident {args.name!r}; known: {', '.join(sorted(INCIDENTS))}")
    args.suites = [str(REPO / INCIDENTS[args.name][0])]
    args.markers = "not gpu"
    args.k = args.attach = None
    rc = run_suites(args)[0]
    runs = sorted(Path(args.reports).resolve().glob("*/incidents/*/summary.json"), key=lambda p: p.stat().st_mtime)
    for sfile in runs[-3:]:
        print(f"{sfile.parent}: {sfile.read_text()}")
    return rc
