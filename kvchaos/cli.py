"""kvchaos command line: the dispatcher. Each command is a module of :mod:`kvchaos.commands` that owns
its subparser, options and body; this builds the parser from them and runs the one asked for.

  kvchaos up     [--profile P] [--model M] [--urls-file F]   stand up a cluster, print its URLs until Ctrl-C
  kvchaos run    [--profile P] [SUITE ...]              chaos suites -> reports/<run-id>/ (live progress)
  kvchaos repro  NAME | --list                          reproduce a known incident
  kvchaos bisect [--releases A,B] [--trials N] [--deployment D] [--out DIR]
                                                        the incident, unmodified, per SGLang release
  kvchaos audit  --prefill URL --decode URL [--router URL [--lb-probe MODES]] [--json] [--strict]
                                                        the incident's operator checklist on a deployment
  kvchaos report DIR                                    (re)build verdicts.json + report.html of a run dir
  kvchaos replay RUN_DIR [SCENARIO] [--times N] [--attach A]
                                                        re-run a recorded scenario with the run's seed; reproduced?
  kvchaos shrink RUN_DIR SCENARIO [--checker C] [--budget-s S] [--steps N]
                                                        a failing scenario shrunk to a minimal one: repro + bug report
  kvchaos digests RUN_DIR [RUN_DIR ...]                  plan digest per scenario; where two runs differ
  kvchaos soak   [--times K] [--seed S] [SUITE ...] | --from RUN_DIR ...
                                                        suites K times (fresh seeds): outcomes per test, flakes,
                                                        engine failures per run and per 1,000 requests
  kvchaos judge  LOG [LOG ...] [--bound-s S] [--accept-known] [--checkers A,B] [--json]
                                                        judge event logs on disk with the default checkers
  kvchaos fuzz   [--budget D] [--seed N] [--corpus DIR] [--strategy guided|random|both] [--engine-version V]
                 | --replay SCENARIO [--times N]        search scenarios for engine bugs: KNOWN or NEW, with repros

Configuration: ``--config FILE`` (a TOML file with a ``[kvchaos]`` or ``[tool.kvchaos]`` table, or the
keys at top level); without it ``[tool.kvchaos]`` of ./pyproject.toml. Flags override the file. Every
key has a flag: profile model reports suites markers k attach backends verbose prefill decode router
strict timeout releases trials release_table lb_probe lb_disconnect_ms deployment seed. An unknown key is an error naming it.

Exit status: ``run``/``repro`` pytest's; ``bisect`` 0 every trial measured, 3 some not; ``audit`` 0 no FAIL, 1 FAIL (``--strict``: or UNKNOWN);
``report`` 0 pass or accepted KNOWN only, 1 fail, 3 unknown or no chaos verdict (``kvchaos.policy.EXIT``); ``replay`` 0 every repetition
reproduced, 1 not; ``shrink`` 0 shrunk, 1 the failure did not re-run; ``digests`` 0 no scenario's plans differ between the runs, 1 some do; ``soak`` 0 no test red
in any run, 1 otherwise; ``judge`` 0 every log PASS (or KNOWN accepted), 1 any log FAIL,
3 otherwise (UNKNOWN, or KNOWN not accepted); ``fuzz`` 0 no NEW find confirmed, 1 one was (``--replay``:
1 when a run's verdicts differ from the first's); 2 for bad input everywhere. docs/reference/cli.md has
every command's options; :mod:`kvchaos.commands.judge` how ``judge`` judges.
"""

from __future__ import annotations

import argparse
import sys

from kvchaos.commands import COMMANDS
# re-exported: tests and callers import these from kvchaos.cli
from kvchaos.commands._common import CONFIG_KEYS, REPO, UsageError, load_config

__all__ = ["CONFIG_KEYS", "REPO", "UsageError", "build_parser", "load_config", "main"]


def build_parser(cfg: dict) -> argparse.ArgumentParser:
    """The ``kvchaos`` parser: one subparser per command module, defaults from the config table ``cfg``."""
    p = argparse.ArgumentParser(prog="kvchaos", description="Chaos harness for disaggregated LLM inference")
    p.add_argument("--config", help="TOML file with a [kvchaos] table (default: [tool.kvchaos] of ./pyproject.toml)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for mod in COMMANDS:
        mod.add_parser(sub, cfg).set_defaults(fn=mod.run)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    args = build_parser(load_config(known.config)).parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
