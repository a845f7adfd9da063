"""``kvchaos fuzz``: search the space of deployments, traffic and fault schedules for engine behaviour no
suite names (:mod:`kvchaos.fuzz`). Exit status: 0 nothing NEW was confirmed, 1 a NEW find was confirmed
(or, with ``--replay``, the scenario's non-PASS verdicts did not come back in every run; with ``--verify``, the
shrunk scenario showed its find's mechanism in fewer than 9 of 10 runs), 2 bad input."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from kvchaos.commands._common import REPO, UsageError, subparser, usage_errors

NAME = "fuzz"
HELP = "search scenarios (deployment x traffic x faults) for engine bugs: KNOWN or NEW, with repros"
DESCRIPTION = " ".join("""
Generates and mutates scenarios, runs them on reused clusters grouped by deployment, keeps those whose
engine events show a new state, and triages every verdict that is not PASS against the findings
registry (KNOWN) or as NEW (confirmed by reruns and a control, written to OUT/finds/). --strategy both
runs guided then random with the same budget and seed and prints them side by side. --replay FILE runs
one scenario --times times, each on a fresh cluster. --verify FIND_DIR runs a find's shrunk scenario
--times times (default 10 there), each on a fresh cluster, and makes it the find's minimal.json only
where at least 9 in 10 showed the find's mechanism. A cluster's planted-leak self-test that saw the engine
leak (what nothing planted explains) is triaged like a run and written up (not re-run: its scenario carries
the planted leaks); the search goes on. Exit 1 when a NEW find was confirmed or a self-test saw a NEW leak,
2 on bad input or a cluster whose self-test missed what it planted, else 0.
""".split())
VERIFY_TIMES = 10
VERIFY_SHARE = 0.9  # a minimal repro shows its find in at least 9 of 10 runs, each on a fresh cluster
_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_budget(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--budget {text!r}: a positive duration such as 90s, 30m or 1h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def add_parser(sub, cfg: dict):
    sp = subparser(sub, NAME, help=HELP, description=DESCRIPTION)
    sp.add_argument("--budget", default="3m", help="wall time of the search, e.g. 90s, 30m, 1h [3m]")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--corpus", help="corpus directory to resume and grow (default: OUT/corpus)")
    sp.add_argument("--engine-version", help="an SGLang release (its environment: scripts/setup-engine.sh)")
    sp.add_argument("--strategy", choices=("guided", "random", "both"), default="guided")
    sp.add_argument("--profile", default=cfg.get("profile", "cpu"))
    sp.add_argument("--layout", help="a KV layout (default: the profile's own)")
    sp.add_argument("--out", help="output directory (default: reports/fuzz/<stamp>)")
    sp.add_argument("--confirm", choices=("all", "leaks"), default="all",
                    help="which NEW finds to confirm by reruns and a control and to shrink: all, or leaks only "
                         "(the others are written up unconfirmed) [all]")
    sp.add_argument("--replay", metavar="SCENARIO", help="run this scenario.json instead of searching")
    sp.add_argument("--verify", metavar="FIND_DIR",
                    help="run a find's shrunk.json --times times (10 unless given), each on a fresh cluster; "
                         "write verify.json, and minimal.json where >= 90%% showed the find's mechanism")
    sp.add_argument("--times", type=int, default=None,
                    help="with --replay: runs, each on a fresh cluster [3]; with --verify [10]")
    return sp


def launch(profile: str, layout: str | None, workdir: Path, say=print):
    """``(start, stop)`` for :class:`kvchaos.fuzz.loop.Clusters`: a cluster of the profile with a
    deployment's restart knobs, the in-engine agent and the fault proxy, its own planted-leak self-test
    gating the policy (a cluster whose model cannot show a leak never passes anything)."""
    import dataclasses

    # imported here: the cluster, the fault proxy and the engines are heavy, and ``kvchaos --help``
    # imports every command module
    from faults import AGENT_MODULE, FaultKit, open_network_proxy
    from kvchaos.cluster import Cluster, ClusterSpec
    from kvchaos.cluster.layouts import apply, parse
    from kvchaos.policy import Policy, load_policy_table
    from kvchaos.releases import engine_python
    from kvchaos.fuzz.loop import settle
    from kvchaos.fuzz.loop import FuzzError
    from kvchaos.selftest import SelfTestFailed, planted_leak_selftest
    from kvchaos.workload import EventLog

    spec0 = ClusterSpec.load(profile)
    if layout:
        spec0 = ClusterSpec.from_dict(apply(spec0.to_dict(), parse(layout)), source=f"{profile} + {layout}")
    prof = Path(profile) if str(profile).endswith(".toml") else REPO / "kvchaos" / "profiles" / f"{profile}.toml"
    table = load_policy_table(prof)
    n = {"i": 0}

    def start(dep):
        spec = spec0
        if dep.restart.get("layout"):
            spec = ClusterSpec.from_dict(apply(spec.to_dict(), parse(dep.restart["layout"])), source="fuzz")
        spec = dataclasses.replace(spec, **dep.spec_overrides(spec))
        want = dep.restart.get("engine_version")
        if want and want != _installed_sglang():  # another release: its own environment
            spec = dataclasses.replace(spec, engine_python=engine_python(want))
        n["i"] += 1
        wd = workdir / f"cluster-{n['i']}"
        t0 = time.monotonic()
        c = Cluster(spec, wd, proxy_factory=open_network_proxy, agent_module=AGENT_MODULE).start()
        try:
            policy = Policy(accept_known=table.get("accept_known", False))
            try:
                policy.selftest = planted_leak_selftest(c, wd, policy)
            except SelfTestFailed as e:  # the harness cannot see what it planted: no search on this cluster
                raise FuzzError(f"cluster {n['i']}: {e}") from None
            # the search's first run starts as every later one does: idle, caches flushed. The
            # self-test's planted leak went into decode's radix cache where one was on, and the first
            # run after it on 0.5.19 recited the self-test's canaries (4d2886894a4e, 2026-12-05:
            # a 128-token cached prefix, no fault on a victim; confirmations after a flush did not)
            settle(c)
            kit = FaultKit(c, EventLog())
        except BaseException:
            c.stop()
            raise
        say(f"cluster {n['i']} up in {time.monotonic() - t0:.0f} s ({dep.restart_key()}); planted-leak "
            f"self-test: {(policy.selftest or {}).get('status')}")
        return c, kit, policy

    def stop(cur):
        c, kit, _policy = cur
        try:
            kit.heal_all()
        finally:
            c.stop()

    return start, stop


def _installed_sglang() -> str | None:
    """The SGLang release of the harness's own environment (what a profile without engine_python runs)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def run(args) -> int:
    # imported here: the cluster, the fault proxy and the engines are heavy, and ``kvchaos --help``
    # imports every command module
    from kvchaos.fuzz.corpus import Corpus, CorpusError
    from kvchaos.fuzz.loop import Clusters, Fuzzer, FuzzError, table
    from kvchaos.policy import Registry
    from kvchaos.workload.scenario import Deployment, Scenario, ScenarioError

    with usage_errors("fuzz", ScenarioError, CorpusError, FuzzError):
        budget = parse_budget(args.budget)
        if args.replay and args.verify:
            raise UsageError("--replay and --verify: one at a time")
        if args.times is None:
            args.times = VERIFY_TIMES if args.verify else 3
        if args.times < 1:
            raise UsageError(f"--times {args.times}: at least 1")
        if args.verify:
            d = Path(args.verify)
            if not (d / "shrunk.json").is_file() or not (d / "find.json").is_file():
                raise UsageError(f"--verify {d}: not a find with a shrunk scenario (shrunk.json and find.json)")
            return verify(d, args, Path(args.out) if args.out else d / "verify")
        out = Path(args.out) if args.out else REPO / "reports" / "fuzz" / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        if args.replay:
            return _replay(Scenario.load(args.replay), args, out)
        registry = Registry.load()
        runs = []
        for strategy in (("guided", "random") if args.strategy == "both" else (args.strategy,)):
            sub = out / strategy if args.strategy == "both" else out
            corpus = Corpus(args.corpus or sub / "corpus")
            start, stop = launch(args.profile, args.layout, sub / "clusters")
            clusters = Clusters(start, stop)
            first = start_base(clusters, Deployment({"engine_version": args.engine_version} if args.engine_version
                                                    else {}, {}))
            print(f"kvchaos fuzz: {strategy}, budget {budget:.0f} s, seed {args.seed}, corpus {corpus.dir} "
                  f"({len(corpus)} entries{', resumed' if corpus.resumed else ''}); out {sub}", flush=True)
            fz = Fuzzer(clusters=clusters, base=first, registry=registry, out=sub, corpus=corpus, seed=args.seed,
                        budget_s=budget, strategy=strategy, engine_version=args.engine_version,
                        confirm_all=args.confirm == "all", say=lambda m: print(m, flush=True))
            runs.append(fz.run())
        print(table(runs))
        (out / "summary.txt").write_text(table(runs) + "\n")
        confirmed = [s for r in runs for s, n in r["new"].items() if n.get("confirmed")]
        # a leak a cluster's self-test saw is not re-run (its scenario carries the planted leaks), and never green
        selftest = sorted({s for r in runs for s, n in r["new"].items() if n.get("during") and n.get("leak")})
        print(f"kvchaos fuzz: {sum(r['execs'] for r in runs)} scenarios run; known findings "
              f"{sorted({k for r in runs for k in r['known']})}; NEW confirmed {confirmed}"
              + (f"; NEW leaks seen in a cluster's self-test {selftest}" if selftest else "") + f"; {out}")
        return 1 if confirmed or selftest else 0


def start_base(clusters, dep):
    """Start the first cluster and read the numbers the search's edges come from off its engines."""
    from kvchaos.fuzz.grammar import Base  # imported here: see run

    (cluster, _kit, _policy), _ = clusters.get(dep)
    return Base.of_cluster(cluster)


def _replay(sc, args, out: Path) -> int:
    """Run one scenario ``--times`` times, each on a fresh cluster of its deployment; reproduced when
    every run's non-PASS verdicts are the first run's (a PASS scenario: PASS every time)."""
    if not sc.origin.get("complete", True):
        print(f"kvchaos fuzz --replay: warning: {sc.name} is not the whole experiment it came from: "
              + "; ".join(sc.origin.get("why_incomplete") or []), flush=True)
    seen = []
    for i, ex, err in _on_fresh_clusters(sc, args.times, launch(args.profile, args.layout, out / "clusters"), out,
                                         "replay"):
        if err is not None:
            raise err
        got = {v.oracle: v.status for v in ex.verdicts if v.status != "pass"}
        seen.append(got)
        print(f"replay {i + 1}/{args.times}: {got or 'every verdict PASS'}", flush=True)
    same = sum(g == seen[0] for g in seen)
    (out / "replay.json").write_text(json.dumps({"scenario": sc.digest(), "runs": seen, "same_as_first": same}, indent=1))
    print(f"kvchaos fuzz --replay: {same}/{args.times} runs gave the first run's verdicts; {out}")
    return 0 if same == args.times else 1


def _on_fresh_clusters(sc, times: int, start_stop, out: Path, tag: str):
    """``(i, experiment, None)`` for each of ``times`` runs of ``sc``, each on a fresh cluster of its
    deployment (``start_stop``: :func:`launch`'s pair), stopped once the caller has read the run;
    ``(i, None, error)`` for a run the engines or faults refused."""
    import functools

    from kvchaos.experiment import Experiment, run_scenario  # imported here: see run

    start, stop = start_stop
    for i in range(times):
        cur = start(sc.deployment)
        c, kit, policy = cur
        try:
            try:
                ex = run_scenario(functools.partial(Experiment, cluster=c, run_dir=out / f"{tag}-{i + 1}", faults=kit,
                                                    policy=policy, test_id=f"fuzz-{tag}::{sc.name}"), sc, kit, c)
            except Exception as e:  # noqa: BLE001 - the caller says what a refused run counts as
                yield i, None, e
            else:
                yield i, ex, None
        finally:
            stop(cur)


def verify(d: Path, args, out: Path, start_stop=None) -> int:
    """A find's shrunk scenario (``d/shrunk.json``) run ``args.times`` times, each on a fresh cluster of
    its deployment: a run shows the find when triage (with today's registry) gives a verdict of the find's
    oracle the find's mechanism signature. Writes ``d/verify.json``; ``d/minimal.json`` (the find's minimal
    repro) only where at least :data:`VERIFY_SHARE` of the runs showed it, and removes a stale one where
    not. Exit 0 verified, 1 not."""
    from kvchaos.fuzz.triage import triage  # imported here: see run
    from kvchaos.policy import Registry
    from kvchaos.workload.scenario import Scenario

    find = json.loads((d / "find.json").read_text())
    sc = Scenario.load(d / "shrunk.json")
    registry = Registry.load()
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    start_stop = start_stop or launch(args.profile, args.layout, out / "clusters")
    for i, ex, err in _on_fresh_clusters(sc, args.times, start_stop, out, "verify"):
        if err is not None:  # a run that did not happen shows nothing: counted against it
            runs.append({"run": i + 1, "shows": False, "error": f"{type(err).__name__}: {err}"[:300]})
        else:
            got = [g for g in triage(ex.verdicts, ex.context(), registry, ex.events) if g.oracle == find["oracle"]]
            runs.append({"run": i + 1, "shows": any(g.signature == find["signature"] for g in got),
                         "signatures": sorted({g.signature for g in got}),
                         "known": sorted({g.finding for g in got if g.finding}), "events": str(ex.path)})
        print(f"verify {i + 1}/{args.times}: {'shows' if runs[-1]['shows'] else 'does not show'} "
              f"{find['oracle']} {find['signature']}", flush=True)
    shown = sum(r["shows"] for r in runs)
    ok = shown >= VERIFY_SHARE * args.times
    rec = {"find": find["signature"], "oracle": find["oracle"], "scenario": sc.digest(), "times": args.times,
           "shown": shown, "verified": ok, "runs": runs, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (d / "verify.json").write_text(json.dumps(rec, indent=1) + "\n")
    if ok:
        sc.save(d / "minimal.json")
    elif (d / "minimal.json").exists():
        (d / "minimal.json").unlink()
    print(f"kvchaos fuzz --verify: {shown}/{args.times} runs showed {find['oracle']} {find['signature']}; "
          + (f"minimal repro: {d / 'minimal.json'}" if ok else "not a minimal repro (needs 9 in 10)"))
    return 0 if ok else 1


def _target(ex, checker: str | None):
    """The verdict a shrink keeps: ``checker``'s FAIL, else the first leak checker's FAIL, else the first
    FAIL; None when the run failed nothing."""
    from kvchaos.policy.core import is_leak_checker  # imported here: see run

    fails = [v for v in ex.verdicts if v.status == "fail"]
    if checker:
        return next((v for v in fails if v.oracle == checker), None)
    return next((v for v in fails if is_leak_checker(v.oracle)), fails[0] if fails else None)


def shrink_file(path, profile: str, layout: str | None, checker: str | None, budget_s: float, steps: int,
                out: Path | None = None) -> int:
    """``kvchaos shrink FILE.scenario.json``: run it once on a cluster of its deployment, take the verdict
    to keep (``_target``), and shrink it (:func:`kvchaos.fuzz.shrink.shrink`: nemesis ops, live knobs,
    plans, prompts), every step as on a fresh cluster and shown by every run of it; writes
    ``minimal.json`` (a scenario) and ``shrink.json``. Exit 0 shrunk, 1 it did not fail as recorded."""
    import functools

    from kvchaos.experiment import Experiment, run_scenario  # imported here: see run
    from kvchaos.fuzz.loop import as_on_a_fresh_cluster
    from kvchaos.fuzz.shrink import shrink
    from kvchaos.fuzz.triage import mechanism, signature
    from kvchaos.workload.scenario import Scenario

    sc = Scenario.load(path)
    out = Path(out) if out else REPO / "reports" / "shrinks" / f"{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    start, stop = launch(profile, layout, out / "clusters")
    cur = start(sc.deployment)
    c, kit, policy = cur
    n = {"i": 0}

    def run(s):
        n["i"] += 1
        s = as_on_a_fresh_cluster(s, c, f"shrink{n['i']}")
        return run_scenario(functools.partial(Experiment, cluster=c, run_dir=out / "runs", faults=kit, policy=policy,
                                              test_id=f"shrink::{sc.name}"), s, kit, c)

    try:
        first = run(sc)
        v = _target(first, checker)
        if v is None:
            print(f"kvchaos shrink: {sc.name} failed nothing this run "
                  f"({ {x.oracle: x.status for x in first.verdicts} }): not shrunk", flush=True)
            return 1
        want = signature(mechanism(v, first.events))
        print(f"kvchaos shrink: keeping {v.oracle} FAIL, mechanism {want}: {mechanism(v, first.events)}", flush=True)

        def shows(cand):
            try:
                ex = run(cand)
            except Exception as e:  # noqa: BLE001 - a candidate the engines refused does not show it
                print(f"  attempt failed: {e}", flush=True)
                return False
            got = [x for x in ex.verdicts if x.oracle == v.oracle and x.status == "fail"]
            ok = any(signature(mechanism(x, ex.events)) == want for x in got)
            print(f"  attempt {n['i']}: {len(cand.traffic.plans)} plans, {len(cand.nemesis)} ops, "
                  f"{len(cand.deployment.live)} live knobs: {'shows it' if ok else 'does not'}", flush=True)
            return ok

        minimal, stats = shrink(sc, shows, budget_s=budget_s, max_attempts=steps)
    finally:
        stop(cur)
    minimal.save(out / "minimal.json")
    (out / "shrink.json").write_text(json.dumps({"scenario": sc.digest(), "target": v.oracle, "mechanism": want,
                                                 **stats}, indent=1, default=str) + "\n")
    print(f"kvchaos shrink: {stats['before']} -> {stats['after']} in {stats['attempts']} attempts "
          f"({stats['elapsed_s']} s); minimal: {out / 'minimal.json'}\n"
          f"reproduce it, each run on a fresh cluster: kvchaos replay {out / 'minimal.json'} --times 10", flush=True)
    return 0


def replay_file(path, profile: str, layout: str | None, times: int, out: Path | None = None) -> int:
    """``kvchaos replay FILE.scenario.json``: :func:`_replay` (each run on a fresh cluster)."""
    from types import SimpleNamespace

    from kvchaos.workload.scenario import Scenario  # imported here: see run

    sc = Scenario.load(path)
    out = Path(out) if out else REPO / "reports" / "replays" / f"{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return _replay(sc, SimpleNamespace(profile=profile, layout=layout, times=times), out)
