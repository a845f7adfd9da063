"""``kvchaos replay RUN_DIR [SCENARIO]``: re-run a recorded scenario with its run's seed; reproduced?
``kvchaos replay FILE.scenario.json``: run a scenario file (any experiment's, a fuzz find's, a shrink's
``minimal.json``), each time on a fresh cluster of its deployment. Exit status: 0 every repetition
reproduced, 1 not, 2 bad input."""

from __future__ import annotations

from kvchaos.commands._common import subparser, usage_errors
from kvchaos.commands.fuzz import replay_file
from kvchaos.replay import ReplayError, replay
from kvchaos.workload.scenario import ScenarioError

NAME = "replay"
HELP = "re-run a recorded scenario with its run's seed and say if it reproduced"
DESCRIPTION = " ".join("""
Re-runs the scenario's test with the run's seed, profile and layouts (run.json), each repetition a
pytest session of its own (a fresh cluster, or --attach), under RUN_DIR/replays/. A repetition
reproduced when the plans are the same (digest) and every verdict that was not PASS has its original
status again. Given a scenario file (*.json: every experiment writes one beside its log) instead, runs
it --times times, each on a fresh cluster of the scenario's deployment, and says whether every run
gave the first run's verdicts. Exit 0 all reproduced, 1 not, 2 bad input.
""".split())


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("run_dir", help="a run directory (reports/<run-id>), or a scenario file (*.json)")
    sp.add_argument("scenario", nargs="?", help="experiment name, id or test id (default: every experiment not PASS)")
    sp.add_argument("--times", type=int, default=1, help="repetitions (a reproduction rate)")
    sp.add_argument("--attach", help="router=URL,prefill=URL,decode=URL: replay against running servers")
    sp.add_argument("--timeout", type=float, default=1800.0, help="per repetition, seconds (default 1800)")
    sp.add_argument("--profile", default=cfg.get("profile", "cpu"), help="with a scenario file: the cluster profile")
    sp.add_argument("--out", help="with a scenario file: output directory (default reports/replays/<name>-<stamp>)")
    return sp


def run(args) -> int:
    if str(args.run_dir).endswith(".json"):
        with usage_errors("replay", ScenarioError):
            if args.scenario or args.attach:
                raise ScenarioError("a scenario file is replayed whole, on fresh clusters: no SCENARIO, no --attach")
            if args.times < 1:
                raise ScenarioError(f"--times {args.times}: at least 1")
            return replay_file(args.run_dir, args.profile, None, args.times, args.out)
    with usage_errors("replay", ReplayError):
        res = replay(args.run_dir, args.scenario, times=args.times, attach=args.attach, timeout_s=args.timeout)
    for sc in res["scenarios"]:
        print(f"{sc['test']}: reproduced {sc['reproduced']}/{sc['of']} (seed {res['seed']}); original "
              + ", ".join(f"{o['name']} {o['status']} {o['verdicts']}" for o in sc["original"]))
    print(f"kvchaos replay: {res['file']}")
    return 0 if all(sc["reproduced"] == sc["of"] for sc in res["scenarios"]) else 1
