"""A pytest session of suites as ``run``, ``repro`` and ``bisect`` start it: its command line, its own
process group (Ctrl-C, SIGTERM and kvchaos' own death stop the whole tree), a live progress bar read
from the plugin's ``progress.jsonl``, and the run directory's ``run.json`` and summary afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvchaos.cluster.reaper import Reaper
from kvchaos.commands._common import REPO, UsageError


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
    # imported here, not at the top: rich and kvchaos.cluster are only needed once a run starts, and
    # every command module is imported for ``kvchaos --help``
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    log_path = run_dir / "pytest.log"
    out = None if verbose else open(log_path, "w")
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
                    elif e["ev"] == "experiment" and e.get("phase") == "leak":  # red the moment it is seen
                        bar.console.print(f"[red]LEAK[/] {e.get('name')}: {e.get('oracle')} FAIL {e.get('after_s')} s "
                                          f"into its run — {str(e.get('summary'))[:160]}")
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
    # imported here: rich and kvchaos.report (~0.7 s: it reads logs through kvchaos.workload) are heavy, and only a finished run needs
    # them (kvchaos.report not even then when there is no report to summarise)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    vfile = run_dir / "verdicts.json"
    if not vfile.exists():
        err = run_dir / "report-error.txt"
        console.print(f"kvchaos: no report for {run_dir}" + (f": {err.read_text()}" if err.exists() else ""))
        return
    from kvchaos.report import summary_lines  # on use (above)

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


def run_suites(args, extra_env: dict | None = None) -> tuple[int, Path]:
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
