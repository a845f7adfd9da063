"""kvchaos command line.

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

Configuration: ``--config FILE`` (a TOML file with a ``[kvchaos]`` or ``[tool.kvchaos]`` table, or the
keys at top level); without it ``[tool.kvchaos]`` of ./pyproject.toml. Flags override the file. Every
key has a flag: profile model reports suites markers k attach backends verbose prefill decode router
strict timeout releases trials release_table lb_probe lb_disconnect_ms deployment seed. An unknown key is an error naming it.

Exit status: ``run``/``repro`` pytest's; ``bisect`` 0 every trial measured, 3 some not; ``audit`` 0 no FAIL, 1 FAIL (``--strict``: or UNKNOWN);
``report`` 0 pass or accepted KNOWN only, 1 fail, 3 unknown or no chaos verdict (``kvchaos.policy.EXIT``); ``replay`` 0 every repetition
reproduced, 1 not; ``shrink`` 0 shrunk, 1 the failure did not re-run; ``digests`` 0 no scenario's plans differ between the runs, 1 some do; ``soak`` 0 no test red
in any run, 1 otherwise; ``judge`` 0 every log PASS (or KNOWN accepted), 1 any log FAIL,
3 otherwise (UNKNOWN, or KNOWN not accepted); 2 for bad input everywhere.

``judge``: each log is read by the one loader (``kvchaos.history``) and judged on its own by the policy
(``kvchaos.policy``): the default checkers (``--checkers`` names the ones to run, each then required to
PASS) plus every leak checker that always runs (isolation, kv_lifecycle, retraction: no flag switches
one off; one not named is "not claimed" — its FAIL is red, its UNKNOWN shown). Every FAIL is red;
isolation must PASS unless not claimed. The canaries minted in any of the given logs are known to all
of them: another log's canary in a reply is a leak with origin ``session (<file>)``; a recital of a
canary minted in none is of unknown origin. Known findings apply only when the log's ``experiment``
header names the engine version. A log that cannot be read, a line that is not a JSON object
(``file:line``), a key given twice in one record, a record without ``ev``, a second plan / send /
body / end or final status for one rid, a plan without a rid or with a malformed canary, or a log
without plans is bad input (exit 2, nothing judged). A cut LAST line (a crash mid-write) makes the log
incomplete: it is judged, but nothing in it can PASS (a lost record could have been the leak).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG_KEYS = {"profile": str, "model": str, "reports": str, "suites": list, "markers": str, "k": str, "attach": str,
               "backends": str, "verbose": bool, "prefill": str, "decode": str, "router": str, "strict": bool,
               "timeout": (int, float), "accept_known": bool, "blind_model": bool, "releases": str, "trials": int,
               "release_table": str, "lb_probe": str, "lb_disconnect_ms": (int, float),
               "deployment": str, "seed": (int, str)}


class UsageError(SystemExit):
    def __init__(self, msg: str):
        print(f"kvchaos: {msg}", file=sys.stderr)
        super().__init__(2)


def load_config(path: str | None) -> dict:
    """The ``[kvchaos]`` / ``[tool.kvchaos]`` table of ``path`` (or ./pyproject.toml), checked."""
    explicit = path is not None
    p = Path(path) if explicit else Path.cwd() / "pyproject.toml"
    if not p.exists():
        if explicit:
            raise UsageError(f"--config {p}: no such file")
        return {}
    try:
        doc = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{p}: invalid TOML: {e}")
    cfg = doc.get("tool", {}).get("kvchaos") or doc.get("kvchaos")
    if cfg is None:
        cfg = {k: v for k, v in doc.items() if k != "tool"} if explicit else {}
    if not isinstance(cfg, dict):
        raise UsageError(f"{p}: [kvchaos] must be a table")
    for k, v in cfg.items():
        if k not in CONFIG_KEYS:
            raise UsageError(f"{p}: unknown key {k!r} in the kvchaos table; known: {', '.join(sorted(CONFIG_KEYS))}")
        want = CONFIG_KEYS[k]
        if not isinstance(v, want) or (want is list and not all(isinstance(x, str) for x in v)):
            raise UsageError(f"{p}: key {k!r} = {v!r}: expected "
                             f"{'a list of strings' if want is list else getattr(want, '__name__', 'a number')}")
    return cfg


# --------------------------------------------------------------------------- up
def cmd_up(args) -> int:
    from faults import open_network_proxy
    from kvchaos.cluster import Cluster, ClusterSpec

    spec = ClusterSpec.load(args.profile, model=args.model)
    run_dir = Path(args.reports) / ("up-" + time.strftime("%Y%m%d-%H%M%S"))
    c = Cluster(spec, run_dir, proxy_factory=open_network_proxy)
    print(f"kvchaos: starting {spec.name} cluster (logs in {run_dir}/logs) ...", flush=True)
    stop = {"now": False}

    def on_term(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        c.start()
        e = c.endpoints
        urls = {"router": e.router, "prefill": e.prefill, "decode": e.decode, "router_direct": e.router_direct,
                "bootstrap_port": e.bootstrap_port, "timings_s": c.timings, "logs": str(run_dir / "logs")}
        print(json.dumps(urls, indent=2), flush=True)
        if args.urls_file:
            tmp = Path(args.urls_file).with_suffix(".tmp")
            tmp.write_text(json.dumps(urls, indent=2))
            tmp.rename(args.urls_file)  # appears whole: a script may poll for it
        print("kvchaos: attach with --kvchaos-attach "
              f"router={e.router},prefill={e.prefill},decode={e.decode}  (Ctrl-C to stop)", flush=True)
        while not stop["now"]:
            time.sleep(1.0)
            c.check_alive()
    except KeyboardInterrupt:
        pass
    finally:
        left = c.stop()
        print(f"kvchaos: cluster stopped; leftover processes: {left or 'none'}", flush=True)
    return 0


# --------------------------------------------------------------------------- run
def _pytest_cmd(args, run_dir: Path, suites: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *suites, "-p", "no:cacheprovider", "-o", "testpaths=",
           "--kvchaos-profile", args.profile, "--kvchaos-reports", str(run_dir.parent),
           f"--junitxml={run_dir / 'junit.xml'}", "-m", args.markers, "-rA"]
    for opt, val in (("--kvchaos-model", args.model), ("--kvchaos-attach", args.attach),
                     ("--kvchaos-backends", args.backends), ("-k", args.k),
                     ("--kvchaos-seed", getattr(args, "seed", None))):
        if val:
            cmd += [opt, str(val)]
    for flag, on in (("--kvchaos-accept-known", args.accept_known), ("--kvchaos-strict", args.strict),
                     ("--kvchaos-blind-model", args.blind_model)):
        if on:
            cmd.append(flag)
    return cmd


class _Watcher:
    """Follows ``progress.jsonl`` (written by the pytest plugin) and shows it with rich."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0
        self.total, self.done, self.current = None, 0, ""
        self.counts: dict = {}
        self.failed: list = []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            chunk = f.read()
        lines = chunk.split("\n")
        complete, rest = lines[:-1], lines[-1]
        self.pos += len(chunk) - len(rest)
        out = []
        for line in complete:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append(e)
            if e["ev"] == "collected":
                self.total = e["n"]
            elif e["ev"] == "start":
                self.current = e["nodeid"]
            elif e["ev"] == "end":
                self.done += 1
                self.counts[e["outcome"]] = self.counts.get(e["outcome"], 0) + 1
                if e["outcome"] in ("failed", "error"):
                    self.failed.append(e["nodeid"])
        return out


def _run_pytest(cmd, env, run_dir: Path, verbose: bool) -> int:
    """pytest in its own process group (Ctrl-C stops the whole tree, bounded); progress with rich."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    log_path = run_dir / "pytest.log"
    out = None if verbose else open(log_path, "w")
    from kvchaos.cluster.reaper import Reaper

    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)
    # SIGTERM (a CI job cancelled, kill PID) stops the run like Ctrl-C; were kvchaos itself SIGKILLed,
    # the out-of-process reaper sees its pipe close and kills pytest's whole tree
    reaper = Reaper(f"kvc-run-{os.getpid()}", grace_s=20)
    reaper.register(proc.pid)
    prev_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    w = _Watcher(run_dir / "progress.jsonl")
    try:
        if verbose:
            return proc.wait()
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[counts]}"), TimeElapsedColumn(), console=console,
                      transient=False) as bar:
            task = bar.add_task("collecting", total=None, counts="")
            while True:
                rc = proc.poll()
                for e in w.poll():
                    if e["ev"] == "end" and e["outcome"] in ("failed", "error"):
                        bar.console.print(f"[red]{e['outcome'].upper()}[/] {e['nodeid']}")
                    elif e["ev"] == "end" and e["outcome"] == "known":  # an accepted known engine finding
                        bar.console.print(f"[yellow]KNOWN[/] {e['nodeid']} — {str(e.get('message'))[6:126]}")
                    elif e["ev"] == "end" and e["outcome"] == "xfailed":
                        bar.console.print(f"[yellow]XFAIL[/] {e['nodeid']} — {str(e.get('message'))[:120]}")
                counts = " ".join(f"{k} {v}" for k, v in sorted(w.counts.items()))
                bar.update(task, total=w.total, completed=w.done, counts=counts,
                           description=(w.current.split("::")[-1][:48] if w.current else "starting the cluster"))
                if rc is not None:
                    return rc
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("kvchaos: interrupted — stopping pytest and its cluster (≤ 60 s)")
        _stop_group(proc, signal.SIGINT, 60)
        return 130
    finally:
        signal.signal(signal.SIGTERM, prev_term)
        if proc.poll() is None:
            _stop_group(proc, signal.SIGTERM, 30)
        reaper.close()
        if out:
            out.close()


def _raise_interrupt(*_):
    raise KeyboardInterrupt


def _stop_group(proc, sig, grace_s: float) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _print_summary(run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    vfile = run_dir / "verdicts.json"
    if not vfile.exists():
        err = run_dir / "report-error.txt"
        console.print(f"kvchaos: no report for {run_dir}" + (f": {err.read_text()}" if err.exists() else ""))
        return
    from kvchaos.report import summary_lines

    v = json.loads(vfile.read_text())
    for line in summary_lines(v):  # the verdict and the findings first, as the report leads with them
        console.print(line, markup=False, highlight=False)
    t = Table(title=f"run {v['run_id']}: {v['overall'].upper()}")
    for col in ("scenario", "status", "test", "oracles"):
        t.add_column(col)
    style = {"pass": "green", "fail": "red", "unknown": "yellow", "known": "yellow"}
    for s in v["scenarios"]:
        ors = " ".join(f"{x['oracle']}={x['status']}" for x in s["verdicts"])
        t.add_row(s["name"], f"[{style.get(s['status'], '')}]{s['status']}[/]",
                  f"{s.get('test') or ''} {s.get('test_outcome') or ''}".strip(), ors)
    if v["scenarios"]:
        console.print(t)
    else:
        console.print(f"run {v['run_id']}: {v['overall'].upper()} (no judged scenario in this run)")
    console.print("tests: " + ", ".join(f"{n} {k}" for k, n in sorted(v["tests"]["counts"].items())))
    console.print(f"report: {run_dir / 'report.html'}")


def cmd_run(args) -> int:
    return _run(args)[0]


def _run(args, extra_env: dict | None = None) -> tuple[int, Path]:
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    run_dir = Path(args.reports).resolve() / run_id
    suites = args.suites or [str(REPO / "suites")]
    for s in suites:
        if not Path(s.split("::")[0]).exists():
            raise UsageError(f"run: suite path {s!r} does not exist")
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = _pytest_cmd(args, run_dir, suites)
    env = {**os.environ, **(extra_env or {}), "KVCHAOS_RUN_ID": run_id}
    print(f"kvchaos run {run_id}: {' '.join(cmd)}" + ("" if args.verbose else f"\n  pytest output: {run_dir / 'pytest.log'}"),
          flush=True)
    t0 = time.monotonic()
    rc = _run_pytest(cmd, env, run_dir, args.verbose)
    summary = {"run_id": run_id, "exit_code": rc, "wall_s": round(time.monotonic() - t0, 1),
               "profile": args.profile, "suites": suites, "junit": str(run_dir / "junit.xml"),
               "command": cmd}
    meta = run_dir / "run.json"  # the plugin wrote the seed and the cluster options there: keep them
    try:
        before = json.loads(meta.read_text()) if meta.exists() else {}
    except json.JSONDecodeError:
        before = {}
    meta.write_text(json.dumps({**before, **summary}, indent=2))
    _print_summary(run_dir)
    print(f"kvchaos: run directory {run_dir} (exit {rc})", flush=True)
    return rc, run_dir


# --------------------------------------------------------------------------- repro
INCIDENTS = {
    "glm53": ("suites/incidents/test_glm53_kv_leak.py",
              "GLM-5.3 KV leak: prefill pool < context, rejected prompt handed to decode, stale pages served "
              "(pre-fix sglang 0.5.19 in its own env; bug replay on 0.5.23; the fixed 0.5.23)"),
}


def cmd_repro(args) -> int:
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
    rc = cmd_run(args)
    runs = sorted(Path(args.reports).resolve().glob("*/incidents/*/summary.json"), key=lambda p: p.stat().st_mtime)
    for sfile in runs[-3:]:
        print(f"{sfile.parent}: {sfile.read_text()}")
    return rc


# --------------------------------------------------------------------------- bisect
def cmd_bisect(args) -> int:
    from kvchaos import releases

    try:
        rels = releases.parse_releases(args.releases)
    except ValueError as e:
        raise UsageError(f"bisect: --releases: {e}") from None
    if args.trials < 1:
        raise UsageError(f"bisect: --trials {args.trials}: at least 1")
    if args.deployment not in releases.DEPLOYMENTS:
        raise UsageError(f"bisect: --deployment {args.deployment!r}: one of {', '.join(releases.DEPLOYMENTS)}")
    for r in rels:  # every environment exists before any cluster starts (a missing recipe is bad input)
        try:
            print(f"kvchaos bisect: sglang {r}: {releases.engine_python(r)}", flush=True)
        except releases.ReleaseError as e:
            raise UsageError(f"bisect: {e}") from None
    args.suites = [str(REPO / "suites" / "incidents" / "test_release_matrix.py")]
    args.markers, args.k, args.attach = "bisect", None, None
    rc, run_dir = _run(args, {"KVCHAOS_RELEASES": ",".join(rels), "KVCHAOS_TRIALS": str(args.trials),
                              "KVCHAOS_DEPLOYMENT": args.deployment})
    table = releases.aggregate(releases.load_trials(run_dir / "releases"), releases.load_code_reading(), releases=rels, deployment=args.deployment)
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


# --------------------------------------------------------------------------- audit
def cmd_audit(args) -> int:
    from kvchaos.audit import LB_MODES, AuditError, audit, exit_code

    if not args.prefill or not args.decode:
        raise UsageError("audit: --prefill URL and --decode URL are required (or prefill/decode in the config)")
    try:
        modes = () if args.lb_probe in ("", "none") else tuple(m.strip() for m in args.lb_probe.split(",") if m.strip())
        bad = [m for m in modes if m not in LB_MODES]
        if bad:
            raise UsageError(f"audit: --lb-probe {args.lb_probe!r}: unknown mode(s) {bad}; one of {', '.join(LB_MODES)} or none")
        res = audit(args.prefill, args.decode, args.router, timeout=args.timeout, release_table=args.release_table,
                    lb_modes=modes, lb_disconnect_ms=args.lb_disconnect_ms)
    except AuditError as e:
        raise UsageError(f"audit: {e}")
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        from rich.console import Console
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
    return exit_code(res, args.strict)


# --------------------------------------------------------------------------- report
def cmd_report(args) -> int:
    from kvchaos.report import ReportError, build

    try:
        r = build(args.dir)
    except ReportError as e:
        raise UsageError(f"report: {e}")
    m = r["model"]
    for s in m.scenarios:
        print(f"  {s.status.upper():8s} {s.name}" + (f"  [{s.context}]" if s.context else ""))
    for line in r["lines"]:
        print(line)
    print(f"kvchaos report: {r['html']} and {r['verdicts']}: {r['label']}")
    # accepted known findings only: not red (KNOWN, never PASS); no chaos verdict at all: 3
    from kvchaos.policy import exit_code

    return exit_code(r["overall"])  # "none" (no chaos verdict): 3, as unknown


# --------------------------------------------------------------------------- judge
JUDGE_WITNESSES = 3  # witnesses printed per verdict (--json has them all)


def _load_history(path: str):
    """One event log, read and validated by the one loader (kvchaos.history): bad input is exit 2."""
    from kvchaos.history import HistoryError, load

    try:
        h = load(path)
    except HistoryError as e:
        raise UsageError(f"judge: {e}") from None
    if not h.plans:
        raise UsageError(f"judge: {path}: no requests to judge (no \"plan\" events among {len(h.records)} records)")
    warnings = list(h.warnings)
    if not h.header:
        warnings.append(f"{path}: no \"experiment\" header: engine version unknown, known findings not applied")
    return h, warnings


def _judge_checkers(names: list[str] | None, bound_s: float):
    """The default checkers (or those named), and the names they claim."""
    from kvchaos import oracles

    checks = oracles.default_checkers(bound_s=bound_s).checkers
    if names is None:
        return oracles.compose(*checks)
    by = {c.name: c for c in checks}
    return oracles.compose(*(by[n] for n in names))


def _parse_checkers(spec: str | None) -> list[str] | None:
    from kvchaos import oracles

    if spec is None:
        return None
    allowed = [c.name for c in oracles.default_checkers().checkers]
    names = [x.strip() for x in spec.split(",") if x.strip()]
    if not names:
        raise UsageError(f"judge: --checkers: name at least one of {', '.join(allowed)}")
    bad = [n for n in names if n not in allowed]
    if bad:
        raise UsageError(f"judge: --checkers: unknown checker(s) {', '.join(bad)}; allowed: {', '.join(allowed)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"judge: --checkers: {', '.join(dup)} given twice")
    return names


def cmd_replay(args) -> int:
    from kvchaos.replay import ReplayError, replay

    try:
        res = replay(args.run_dir, args.scenario, times=args.times, attach=args.attach, timeout_s=args.timeout)
    except ReplayError as e:
        raise UsageError(f"replay: {e}") from None
    for sc in res["scenarios"]:
        print(f"{sc['test']}: reproduced {sc['reproduced']}/{sc['of']} (seed {res['seed']}); original "
              + ", ".join(f"{o['name']} {o['status']} {o['verdicts']}" for o in sc["original"]))
    print(f"kvchaos replay: {res['file']}")
    return 0 if all(sc["reproduced"] == sc["of"] for sc in res["scenarios"]) else 1


def cmd_shrink(args) -> int:
    from kvchaos.replay import ReplayError, shrink

    try:
        res = shrink(args.run_dir, args.scenario, budget_s=args.budget_s, max_steps=args.steps, attach=args.attach,
                     checker=args.checker)
    except ReplayError as e:
        raise UsageError(f"shrink: {e}") from None
    if res.get("refused"):
        print(f"{res['experiment']}: not shrunk — {res['refused']} (verdicts this time: {res.get('verdicts')})")
        return 1
    o, m = res["original"], res["minimal"]
    if not res["reproduced"]:
        print(f"{res['experiment']}: the scenario did not FAIL {res['target']['oracle']} the same way when re-run from "
              f"data ({res['attempts'][0].get('verdicts')}): not shrunk; see {res['dir']}/minimal.json")
        return 1
    print(f"{res['experiment']}: {res['target']['oracle']} FAIL kept; requests {o['requests']} -> {m['requests']}, "
          f"tenants {o['tenants']} -> {m['tenants']}, faults {o['faults']} -> {m['faults']}, concurrency "
          f"{o['concurrency']} -> {m['concurrency']}, prompt characters {o.get('prompt_chars')} -> {m.get('prompt_chars')} "
          f"({res['steps']} attempts, {res['wall_s']} s); the minimal one "
          f"failed again {res.get('confirmed')}/{res.get('confirm_runs')}")
    print(f"repro: cd {REPO} && {sys.executable} {res['dir']}/repro.py\nbug report: {res['dir']}/BUG.md")
    return 0 if res["reproduced"] else 1


def cmd_digests(args) -> int:
    from kvchaos.replay import ReplayError, digests

    try:
        res = digests(args.run_dirs)
    except ReplayError as e:
        raise UsageError(f"digests: {e}") from None
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        for d, s in res["runs"].items():
            print(f"run {d}: seed {s}")
        for r in res["scenarios"]:
            vals = list(r["digests"].values())
            mark = "DIFFER" if len(set(vals)) > 1 else ("same" if len(vals) > 1 else "")
            print(f"{mark:6s} {' '.join(vals)}  {r['test']} :: {r['name']} [{r['kv_layout']}]")
        print(f"{len(res['scenarios'])} scenarios, {len(res['differ'])} differ, {len(res['missing'])} not in every run")
    return 1 if res["differ"] else 0


def cmd_soak(args) -> int:
    from kvchaos.soak import SoakError, account, render, soak

    try:
        if args.from_dirs:
            res = account(args.from_dirs)
        else:
            out = Path(args.reports).resolve() / time.strftime("soak-%Y%m%d-%H%M%S")
            res = soak(args.times, out, args.suites or [str(REPO / "suites")], args.markers, seed=args.seed)
            print(f"kvchaos soak: {out / 'soak.json'}")
    except SoakError as e:
        raise UsageError(f"soak: {e}") from None
    print(render(res))
    return 1 if res["red"] else 0


def cmd_judge(args) -> int:
    from kvchaos import canary, oracles
    from kvchaos.history import render_witness
    from kvchaos.policy import KNOWN, Context, Policy, PolicyError, exit_code, merge

    if not args.bound_s > 0:
        raise UsageError(f"judge: --bound-s must be > 0, got {args.bound_s}")
    names = _parse_checkers(args.checkers)
    seen = {}
    for path in args.logs:
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"judge: {path}: given twice (as {seen[key]})")
        seen[key] = path
    logs, warnings = {}, {}
    for path in args.logs:  # every log is read and checked before any is judged
        logs[path], warnings[path] = _load_history(path)
    # every canary minted in any given log: a canary of another log in a reply is a leak naming that log
    reg = canary.Registry()
    for path, h in logs.items():
        reg.add_plans(h.plans, path)
    try:
        policy = Policy(accept_known=bool(args.accept_known))
    except PolicyError as e:
        raise UsageError(f"judge: {e}")

    results = []
    for path, h in logs.items():
        for w in warnings[path]:
            print(f"kvchaos: warning: {w}", file=sys.stderr)
        for w in h.problems:
            print(f"kvchaos: history incomplete: {w}", file=sys.stderr)
        # what was asked for, plus every leak checker that always runs (no flag switches one off)
        checks, claimed = policy.checks(_judge_checkers(names, args.bound_s))
        required = {n: oracles.PASS for n in names} if names else {}
        engine_errors = h.by_ev.get("engine_error", [])
        verdicts = policy.gate(checks.check(h, reg), h)
        try:
            j = policy.judge(verdicts, Context.of(h, engine_errors, reg), required=required, claimed=claimed,
                             every_fail_counts=True)
        except PolicyError as e:
            raise UsageError(f"judge: {path}: {e}")
        results.append((path, h, j))

    status = merge(j.status for _p, _h, j in results)
    rc = exit_code(status)
    if args.json:
        out = {"logs": [], "exit_code": rc, "status": status, "accept_known": bool(args.accept_known),
               "checkers": [c.name for c in _judge_checkers(names, args.bound_s).checkers], "bound_s": args.bound_s}
        for path, h, j in results:
            out["logs"].append({"file": path, "engine": j.ctx.engine, "version": j.ctx.version, "schema": h.schema,
                                "requests": len(h.plans), "warnings": warnings[path], **j.to_dict()})
        print(json.dumps(out, indent=2, default=str))
        return rc
    for path, h, j in results:
        eng = f"{j.ctx.engine} {j.ctx.version}" if j.ctx.version else f"{j.ctx.engine}, version unknown"
        print(f"== {path} ({len(h.plans)} requests; {eng})")
        for p in j.problems:
            print(f"  history incomplete: {p}")
        for i in j.items:
            v = i.verdict
            print(f"  {v}")
            if i.finding:
                print(f"    KNOWN {i.finding.id}: {i.finding.title} "
                      f"({'accepted' if i.accepted else 'not accepted: --accept-known'})")
            elif i.note:
                print(f"    ({i.note})")
            elif i.outcome == "ok" and v.status != oracles.PASS:
                print("    (informational: does not decide this log's status)")
            if i.not_known:
                print(f"    not a known finding: {i.not_known[:300]}")
            for w in v.witnesses[:JUDGE_WITNESSES]:
                print(f"    witness: {render_witness(w)}")
            if len(v.witnesses) > JUDGE_WITNESSES:
                print(f"    ... and {len(v.witnesses) - JUDGE_WITNESSES} more (--json has every witness)")
        st = j.status.upper()
        if j.status == KNOWN:
            st += " " + ", ".join(f"{i.finding.id} ({'accepted' if i.accepted else 'not accepted: --accept-known'})"
                                  for i in j.known)
        print(f"  status: {st}")
    counts = {}
    for _p, _h, j in results:
        counts[j.status] = counts.get(j.status, 0) + 1
    print(f"kvchaos judge: {len(results)} log{'s' if len(results) != 1 else ''}: "
          + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) + f" (exit {rc})")
    return rc


# --------------------------------------------------------------------------- parser
def build_parser(cfg: dict) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvchaos", description="Chaos harness for disaggregated LLM inference")
    p.add_argument("--config", help="TOML file with a [kvchaos] table (default: [tool.kvchaos] of ./pyproject.toml)")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--profile", default=cfg.get("profile", "cpu"), help="cluster profile name or TOML path")
        sp.add_argument("--model", default=cfg.get("model"), help="tiny:SEED or a model directory")
        sp.add_argument("--reports", default=cfg.get("reports", "reports"), help="reports directory")

    def running(sp):
        sp.add_argument("--backends", default=cfg.get("backends"), help="KV transfer backends, e.g. mooncake_tcp,nixl")
        sp.add_argument("--verbose", action=argparse.BooleanOptionalAction, default=cfg.get("verbose", False),
                        help="stream pytest's output instead of the progress bar")
        sp.add_argument("--accept-known", action="store_true", default=cfg.get("accept_known", False),
                        help="known engine findings (kvchaos/findings.toml) matched for the running version are "
                             "KNOWN, not red [the profile's [policy] accept_known]")
        sp.add_argument("--strict", action="store_true", default=cfg.get("strict", False),
                        help="fail when a listed finding did not reproduce on a version it lists")
        sp.add_argument("--blind-model", action="store_true", default=cfg.get("blind_model", False),
                        help="declare a model that cannot echo canaries: isolation is not claimed (not red)")

    _add = sub.add_parser

    def add_parser(*a, **kw):  # --config is accepted after the subcommand too (read before parsing)
        sp = _add(*a, **kw)
        sp.add_argument("--config", help=argparse.SUPPRESS)
        return sp

    sub.add_parser = add_parser
    up = sub.add_parser("up", help="stand up a cluster and print its URLs until Ctrl-C")
    common(up)
    up.add_argument("--urls-file", help="also write the URLs as JSON to this file once the cluster serves")
    up.set_defaults(fn=cmd_up)
    run = sub.add_parser("run", help="run chaos suites and write reports/<run-id>/")
    common(run)
    running(run)
    run.add_argument("suites", nargs="*", default=cfg.get("suites"), help="suite files/dirs (default: suites/)")
    run.add_argument("--attach", default=cfg.get("attach"), help="router=URL,prefill=URL,decode=URL instead of launching")
    run.add_argument("-k", default=cfg.get("k"), help="pytest -k expression")
    run.add_argument("--seed", default=cfg.get("seed"), help="the run's seed (default: a fresh random one, recorded)")
    run.add_argument("-m", dest="markers", default=cfg.get("markers", "not slow and not gpu"), help="pytest marker expression")
    run.set_defaults(fn=cmd_run)
    rp = sub.add_parser("repro", help="reproduce a known incident (see --list)")
    common(rp)
    running(rp)
    rp.add_argument("name", nargs="?", help="incident name, e.g. glm53")
    rp.add_argument("--list", action="store_true", help="list known incidents")
    rp.set_defaults(fn=cmd_repro)
    bi = sub.add_parser("bisect", help="run the GLM-5.3 incident unmodified on several SGLang releases; print the table",
                        description="Each release in its own environment (scripts/setup-engine.sh), the incident's "
                                    "deployment (prefill pool < context), a fresh cluster and planted-leak self-test "
                                    "per trial, no mutation. Prints per release: leaked / hung / rejected with 4xx, "
                                    "with the first witness. Exit 0 every trial measured, 3 some trial could not see "
                                    "a leak (blind) or did not run, 2 bad input (e.g. a release without a recipe).")
    common(bi)
    bi.add_argument("--releases", default=cfg.get("releases", "0.5.19,0.5.20,0.5.21,0.5.22,0.5.23"),
                    help="comma-separated SGLang releases (default: 0.5.19,...,0.5.23)")
    bi.add_argument("--trials", type=int, default=int(cfg.get("trials", 3)), help="trials per release (default 3)")
    bi.add_argument("--deployment", default=cfg.get("deployment", "incident"),
                    help="incident (prefill pool < context; default) or auto-truncate (the same with "
                         "--allow-auto-truncate on both roles)")
    bi.add_argument("--out", help="also write release_table.json/.md here (e.g. reports/releases to commit it)")
    bi.add_argument("--verbose", action=argparse.BooleanOptionalAction, default=cfg.get("verbose", False),
                    help="stream pytest's output instead of the progress bar")
    bi.set_defaults(fn=cmd_bisect, backends=None, accept_known=False, strict=False, blind_model=False)
    au = sub.add_parser("audit", help="the incident's operator checklist against running servers")
    au.add_argument("--prefill", default=cfg.get("prefill"), help="prefill server URL")
    au.add_argument("--decode", default=cfg.get("decode"), help="decode server URL")
    au.add_argument("--router", default=cfg.get("router"), help="router URL (optional)")
    au.add_argument("--json", action="store_true", help="print the result as JSON")
    au.add_argument("--lb-probe", default=cfg.get("lb_probe", "stream,nonstream"), metavar="MODES",
                    help="with --router: checklist item 5, one /generate per mode (stream, nonstream) whose client "
                         "leaves before the first token; 'none' sends nothing (default: stream,nonstream)")
    au.add_argument("--lb-disconnect-ms", type=float, default=float(cfg.get("lb_disconnect_ms", 50)), metavar="MS",
                    help="how long after sending the probe's client leaves (default 50)")
    au.add_argument("--release-table", default=cfg.get("release_table"), metavar="JSON",
                    help="the measured release table engine_version is judged by (default: the committed "
                         "reports/releases/release_table.json, written by kvchaos bisect --out)")
    au.add_argument("--strict", action=argparse.BooleanOptionalAction, default=cfg.get("strict", False),
                    help="UNKNOWN counts as FAIL in the exit status")
    au.add_argument("--timeout", type=float, default=float(cfg.get("timeout", 15)), help="per-request timeout, s")
    au.set_defaults(fn=cmd_audit)
    rep = sub.add_parser("report", help="(re)build verdicts.json and report.html of a run directory")
    rep.add_argument("dir", help="a run directory, e.g. reports/20261201-101500-1234 or reports/incidents/glm53-replay")
    rep.set_defaults(fn=cmd_report)
    rl = sub.add_parser("replay", help="re-run a recorded scenario with its run's seed and say if it reproduced",
                        description="Re-runs the scenario's test with the run's seed, profile and layouts (run.json), "
                                    "each repetition a pytest session of its own (a fresh cluster, or --attach), "
                                    "under RUN_DIR/replays/. A repetition reproduced when the plans are the same "
                                    "(digest) and every verdict that was not PASS has its original status again. "
                                    "Exit 0 all reproduced, 1 not, 2 bad input.")
    rl.add_argument("run_dir", help="a run directory (reports/<run-id>)")
    rl.add_argument("scenario", nargs="?", help="experiment name, id or test id (default: every experiment not PASS)")
    rl.add_argument("--times", type=int, default=1, help="repetitions (a reproduction rate)")
    rl.add_argument("--attach", help="router=URL,prefill=URL,decode=URL: replay against running servers")
    rl.add_argument("--timeout", type=float, default=1800.0, help="per repetition, seconds (default 1800)")
    rl.set_defaults(fn=cmd_replay)
    sh = sub.add_parser("shrink", help="shrink a failing scenario to a minimal one that still fails the same way",
                        description="Re-runs the scenario's test with the run's seed; once its experiment is judged, "
                                    "the same session (same cluster) delta-debugs it: fewer requests, faults, tenants, "
                                    "less concurrency, keeping only changes after which the same checker still FAILs "
                                    "with a witness of the same kind. Writes minimal.json, the minimal log, repro.py "
                                    "and BUG.md. Exit 0 shrunk, 1 the failure did not re-run, 2 bad input.")
    sh.add_argument("run_dir", help="a run directory (reports/<run-id>)")
    sh.add_argument("scenario", help="the experiment's name (or id, or its test id)")
    sh.add_argument("--budget-s", type=float, default=1200.0, help="wall-clock bound of the search (default 1200)")
    sh.add_argument("--steps", type=int, default=40, help="at most this many attempts (default 40)")
    sh.add_argument("--attach", help="router=URL,prefill=URL,decode=URL: against running servers")
    sh.add_argument("--checker", help="the checker whose FAIL to keep (default: the first leak checker that failed: "
                                      "isolation, kv_lifecycle, cache_isolation, differential, http_semantics)")
    sh.set_defaults(fn=cmd_shrink)
    dg = sub.add_parser("digests", help="plan digest of every scenario of run directories; where they differ",
                        description="Same seed, engine and layout => same plans: this lists each scenario's plan "
                                    "digest per run directory (a dry run's plans.jsonl or a run's experiments.jsonl). "
                                    "Exit 0 none differ, 1 some differ, 2 bad input.")
    dg.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    dg.add_argument("--json", action="store_true")
    dg.set_defaults(fn=cmd_digests)
    so = sub.add_parser("soak", help="the suites K times with fresh seeds: outcome counts per test, flakes, engine failures",
                        description="Runs the suites --times times, each a pytest session with a fresh seed (or "
                                    "--seed), under REPORTS/soak-<stamp>/, or accounts finished run directories "
                                    "(--from). Prints per test the outcome counts (FLAKY: red in some runs only, with "
                                    "the seed and replay command of each red run) and per engine-failure signature "
                                    "its rate per run and per 1,000 requests. Exit 0 no test red in any run, 1 otherwise.")
    so.add_argument("suites", nargs="*", help="suite files/dirs (default: suites/)")
    so.add_argument("--times", type=int, default=3, help="runs (default 3)")
    so.add_argument("--seed", help="one seed for every run (default: a fresh one per run)")
    so.add_argument("-m", dest="markers", default=cfg.get("markers", "not slow and not gpu"), help="pytest marker expression")
    so.add_argument("--reports", default=cfg.get("reports", "reports"), help="reports directory")
    so.add_argument("--from", dest="from_dirs", nargs="+", metavar="RUN_DIR", help="account these run directories instead")
    so.set_defaults(fn=cmd_soak)
    ju = sub.add_parser("judge", help="judge event logs on disk with the default checkers and print the verdicts",
                        description="Judge each event log (JSONL) on its own with the default checkers; the "
                                    "canaries minted in any of the logs are known to all of them. Exit 0 every log "
                                    "PASS (or KNOWN accepted), 1 any FAIL, 3 UNKNOWN or KNOWN not accepted, 2 bad "
                                    "input. A truncated last line is a warning; the rest of that log is judged.")
    ju.add_argument("logs", nargs="+", metavar="LOG", help="event log(s), e.g. reports/<run-id>/events/<test>.jsonl")
    ju.add_argument("--bound-s", type=float, default=60.0, metavar="SECONDS",
                    help="liveness bound: a request must end within it (default 60)")
    ju.add_argument("--accept-known", action="store_true",
                    help="accept known findings (kvchaos/findings.toml) for the engine version the log's header names")
    ju.add_argument("--checkers", metavar="A,B",
                    help="judge only these checkers, each required to PASS (default: all of isolation, sensitivity, "
                         "http_semantics, liveness, kv_lifecycle; each held to not-FAIL, isolation also to "
                         "not-UNKNOWN, other UNKNOWNs informational)")
    ju.add_argument("--json", action="store_true", help="print per log the verdicts and the policy status as JSON")
    ju.set_defaults(fn=cmd_judge)
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
