"""``kvchaos bisect``: the GLM-5.3 incident, unmodified, on each SGLang release (each in its own
environment), then the release table. Exit status: 0 every trial measured, 3 some not, 2 bad input."""

from __future__ import annotations

from pathlib import Path

from kvchaos.commands._common import REPO, UsageError, common, subparser, usage_errors, verbose
from kvchaos.commands._pytest import run_suites

NAME = "bisect"
HELP = "run the GLM-5.3 incident unmodified on several SGLang releases; print the table"
DESCRIPTION = " ".join("""
Each release in its own environment (scripts/setup-engine.sh), the incident's deployment (prefill
pool < context), a fresh cluster and planted-leak self-test per trial, no mutation. Prints per
release: leaked / hung / rejected with 4xx, with the first witness. Exit 0 every trial measured, 3
some trial could not see a leak (blind) or did not run, 2 bad input (e.g. a release without a
recipe).
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    common(sp, cfg)
    sp.add_argument("--releases", default=cfg.get("releases", "0.5.19,0.5.20,0.5.21,0.5.22,0.5.23"),
                    help="comma-separated SGLang releases (default: 0.5.19,...,0.5.23)")
    sp.add_argument("--trials", type=int, default=int(cfg.get("trials", 3)), help="trials per release (default 3)")
    sp.add_argument("--deployment", default=cfg.get("deployment", "incident"),
                    help="incident (prefill pool < context; default) or auto-truncate (the same with "
                         "--allow-auto-truncate on both roles)")
    sp.add_argument("--out", help="also write release_table.json/.md here (e.g. reports/releases to commit it)")
    verbose(sp, cfg)
    # the incident runs as shipped: none of run's knobs that would change what it measures
    sp.set_defaults(backends=None, accept_known=False, strict=False, blind_model=False)
    return sp


def _check_input(args, releases) -> list[str]:
    """The releases to run; every environment exists before any cluster starts (a missing recipe is
    bad input)."""
    try:
        rels = releases.parse_releases(args.releases)
    except ValueError as e:
        raise UsageError(f"bisect: --releases: {e}") from None
    if args.trials < 1:
        raise UsageError(f"bisect: --trials {args.trials}: at least 1")
    if args.deployment not in releases.DEPLOYMENTS:
        raise UsageError(f"bisect: --deployment {args.deployment!r}: one of {', '.join(releases.DEPLOYMENTS)}")
    for r in rels:
        with usage_errors("bisect", releases.ReleaseError):
            print(f"kvchaos bisect: sglang {r}: {releases.engine_python(r)}", flush=True)
    return rels


def run(args) -> int:
    from kvchaos import releases  # imported here: only bisect needs it, and --help imports every command

    rels = _check_input(args, releases)
    args.suites = [str(REPO / "suites" / "incidents" / "test_release_matrix.py")]
    args.markers, args.k, args.attach = "bisect", None, None
    rc, run_dir = run_suites(args, {"KVCHAOS_RELEASES": ",".join(rels), "KVCHAOS_TRIALS": str(args.trials),
                                    "KVCHAOS_DEPLOYMENT": args.deployment})
    table = releases.aggregate(releases.load_trials(run_dir / "releases"), releases.load_code_reading(),
                               releases=rels, deployment=args.deployment)
    cmd = f"kvchaos bisect --releases {','.join(rels)} --trials {args.trials}" + (
        "" if args.deployment == "incident" else f" --deployment {args.deployment}")
    outs = [run_dir / "releases"] + ([Path(args.out)] if args.out else [])
    for d in outs:
        j, m = releases.write_table(table, d, cmd)
        print(f"kvchaos bisect: {j}\n                {m}")
    print(releases.render_markdown(table, cmd))
    if rc not in (0, 1):
        return rc
    unmeasured = [r for r, row in table["releases"].items() if row["verdict"] == releases.UNMEASURED
                  or row["trials"] < args.trials]
    if unmeasured:
        print(f"kvchaos bisect: not every trial measured: {', '.join(unmeasured)} (exit 3)")
        return 3
    return 0 if rc == 0 else rc
