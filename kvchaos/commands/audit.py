"""``kvchaos audit``: the incident's operator checklist against running servers. Exit status: 0 no FAIL,
1 FAIL (``--strict``: or UNKNOWN), 2 bad input."""

from __future__ import annotations

import argparse
import json

from kvchaos.commands._common import UsageError, subparser, usage_errors

NAME = "audit"
HELP = "the incident's operator checklist against running servers"


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP)
    sp.add_argument("--prefill", default=cfg.get("prefill"), help="prefill server URL")
    sp.add_argument("--decode", default=cfg.get("decode"), help="decode server URL")
    sp.add_argument("--router", default=cfg.get("router"), help="router URL (optional)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.add_argument("--lb-probe", default=cfg.get("lb_probe", "stream,nonstream"), metavar="MODES",
                    help="with --router: checklist item 5, one /generate per mode (stream, nonstream) whose client "
                         "leaves before the first token; 'none' sends nothing (default: stream,nonstream)")
    sp.add_argument("--lb-disconnect-ms", type=float, default=float(cfg.get("lb_disconnect_ms", 50)), metavar="MS",
                    help="how long after sending the probe's client leaves (default 50)")
    sp.add_argument("--release-table", default=cfg.get("release_table"), metavar="JSON",
                    help="the measured release table engine_version is judged by (default: the committed "
                         "reports/releases/release_table.json, written by kvchaos bisect --out)")
    sp.add_argument("--strict", action=argparse.BooleanOptionalAction, default=cfg.get("strict", False),
                    help="UNKNOWN counts as FAIL in the exit status")
    sp.add_argument("--timeout", type=float, default=float(cfg.get("timeout", 15)), help="per-request timeout, s")
    return sp


def _print_table(args, res: dict) -> None:
    from rich.console import Console  # imported here: rich is needed only for this output
    from rich.table import Table

    style = {"pass": "green", "fail": "bold red", "unknown": "yellow"}
    t = Table(title=f"kvchaos audit — prefill {args.prefill}, decode {args.decode}"
                    + (f", router {args.router}" if args.router else ""), show_lines=True)
    for col in ("check", "role", "status", "numbers", "detail"):
        t.add_column(col, overflow="fold")
    for c in res["checks"]:
        t.add_row(c["id"], c["role"], f"[{style[c['status']]}]{c['status'].upper()}[/]",
                  json.dumps(c["numbers"], default=str), c["detail"])
    con = Console(width=max(160, Console().width))
    con.print(t)
    con.print(f"{res['counts']['pass']} PASS, {res['counts']['fail']} FAIL, {res['counts']['unknown']} UNKNOWN"
              f" (environment read from: {res['environment_source']})")


def run(args) -> int:
    # imported here: the audit's HTTP client stack is heavy, and --help imports every command module
    from kvchaos.audit import LB_MODES, AuditError, audit, exit_code

    if not args.prefill or not args.decode:
        raise UsageError("audit: --prefill URL and --decode URL are required (or prefill/decode in the config)")
    with usage_errors("audit", AuditError):
        modes = () if args.lb_probe in ("", "none") else tuple(m.strip() for m in args.lb_probe.split(",") if m.strip())
        bad = [m for m in modes if m not in LB_MODES]
        if bad:
            raise UsageError(f"audit: --lb-probe {args.lb_probe!r}: unknown mode(s) {bad}; "
                             f"one of {', '.join(LB_MODES)} or none")
        res = audit(args.prefill, args.decode, args.router, timeout=args.timeout, release_table=args.release_table,
                    lb_modes=modes, lb_disconnect_ms=args.lb_disconnect_ms)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        _print_table(args, res)
    return exit_code(res, args.strict)
