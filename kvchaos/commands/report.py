"""``kvchaos report DIR``: (re)build ``verdicts.json`` and ``report.html`` of a run directory. Exit status
(:data:`kvchaos.policy.EXIT`): 0 pass or accepted KNOWN only, 1 fail, 3 unknown or no chaos verdict,
2 bad input."""

from __future__ import annotations

from kvchaos.commands._common import subparser, usage_errors

NAME = "report"
HELP = "(re)build verdicts.json and report.html of a run directory"


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    sp.add_argument("dir", help="a run directory, e.g. reports/20261201-101500-1234 or reports/incidents/glm53-replay")
    return sp


def run(args) -> int:
    # imported here: kvchaos.report takes ~0.7 s to import, and --help imports every command
    from kvchaos.policy import exit_code
    from kvchaos.report import ReportError, build

    with usage_errors("report", ReportError):
        r = build(args.dir)
    m = r["model"]
    for s in m.scenarios:
        print(f"  {s.status.upper():8s} {s.name}" + (f"  [{s.context}]" if s.context else ""))
    for line in r["lines"]:
        print(line)
    print(f"kvchaos report: {r['html']} and {r['verdicts']}: {r['label']}")
    # accepted known findings only: not red (KNOWN, never PASS); no chaos verdict at all: 3
    return exit_code(r["overall"])  # "none" (no chaos verdict): 3, as unknown
