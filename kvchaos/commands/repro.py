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
# --scale: the suite of an incident at a size other than the CI one (``slow``: never in make test); its
# scales are kvchaos.releases.SCALES, each test id carrying ``at-<scale>``
SCALED = {"glm53": ("suites/incidents/test_glm53_incident_scale.py",
                    "the incident's shape at size (kvchaos.releases.SCALES): 0.5.19 and 0.5.23, wall time and "
                    "peak memory; 'incident' is its own numbers (prefill pool 681,280, context 1,048,576)")}


def _scales() -> list[str]:
    # on use: the CLI's parser is built for every command, and releases pulls in the workload and runner
    from kvchaos.releases import SCALES

    return list(SCALES)


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    common(sp, cfg)
    running(sp, cfg)
    sp.add_argument("name", nargs="?", help="incident name, e.g. glm53")
    sp.add_argument("--list", action="store_true", help="list known incidents")
    sp.add_argument("--scale", default="ci", help="ci (default: the incident's shape, small), or one of "
                    "kvchaos.releases.SCALES: incident (glm53 at its own numbers), largest-fit (the largest that "
                    "fits 24 GiB); slow, GBs of KV pools")
    return sp


def run(args) -> int:
    if args.list or not args.name:
        for k, (path, what) in INCIDENTS.items():
            print(f"{k:8s} {path}\n         {what}")
            if k in SCALED:
                print(f"         --scale {', '.join(_scales())}: {SCALED[k][0]}\n           {SCALED[k][1]}")
        if not args.list:
            raise UsageError("repro: name an incident (see above)")
        return 0
    if args.name not in INCIDENTS:
        raise UsageError(f"repro: unknown incident {args.name!r}; known: {', '.join(sorted(INCIDENTS))}")
    args.k = args.attach = None
    if args.scale == "ci":
        args.suites, args.markers = [str(REPO / INCIDENTS[args.name][0])], "not gpu"
    elif args.name in SCALED and args.scale in _scales():
        args.suites, args.markers = [str(REPO / SCALED[args.name][0])], "slow and not gpu"
        args.k = f"at-{args.scale}"
    else:
        scales = ["ci"] + (_scales() if args.name in SCALED else [])
        raise UsageError(f"repro {args.name}: unknown scale {args.scale!r}; one of {', '.join(scales)}")
    rc = run_suites(args)[0]
    runs = sorted(Path(args.reports).resolve().glob("*/incidents/*/summary.json"), key=lambda p: p.stat().st_mtime)
    for sfile in runs[-3:]:
        print(f"{sfile.parent}: {sfile.read_text()}")
    return rc
