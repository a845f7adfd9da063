"""kvchaos command line.

  kvchaos up   [--profile P] [--model M]        stand up a cluster, print its URLs, wait for Ctrl-C
  kvchaos run  [--profile P] [SUITE ...]        run chaos suites against a cluster, write a report dir
  kvchaos repro NAME [--profile P]              reproduce a known incident (``kvchaos repro --list``)

Defaults come from ``[tool.kvchaos]`` in ./pyproject.toml (keys: profile, model, reports, suites),
then from flags.
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


def _config() -> dict:
    p = Path.cwd() / "pyproject.toml"
    if not p.exists():
        return {}
    try:
        return tomllib.loads(p.read_text()).get("tool", {}).get("kvchaos", {})
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"kvchaos: {p}: invalid TOML: {e}")


def cmd_up(args) -> int:
    from kvchaos.cluster import Cluster, ClusterSpec

    spec = ClusterSpec.load(args.profile, model=args.model)
    run_dir = Path(args.reports) / ("up-" + time.strftime("%Y%m%d-%H%M%S"))
    c = Cluster(spec, run_dir)
    print(f"kvchaos: starting {spec.name} cluster (logs in {run_dir}/logs) ...", flush=True)
    stop = {"now": False}

    def on_term(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        c.start()
        e = c.endpoints
        print(json.dumps({"router": e.router, "prefill": e.prefill, "decode": e.decode,
                          "bootstrap_port": e.bootstrap_port, "timings_s": c.timings}, indent=2), flush=True)
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


def cmd_run(args) -> int:
    run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    run_dir = Path(args.reports).resolve() / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    suites = args.suites or [str(REPO / "suites")]
    for s in suites:
        if not Path(s.split("::")[0]).exists():
            raise SystemExit(f"kvchaos run: suite path {s!r} does not exist")
    cmd = [sys.executable, "-m", "pytest", *suites, "-p", "no:cacheprovider", "-o", "testpaths=",
           "--kvchaos-profile", args.profile, "--kvchaos-reports", str(run_dir.parent),
           f"--junitxml={run_dir / 'junit.xml'}", "-m", args.markers, "-rA"]
    if args.model:
        cmd += ["--kvchaos-model", args.model]
    if args.attach:
        cmd += ["--kvchaos-attach", args.attach]
    if args.k:
        cmd += ["-k", args.k]
    env = {**os.environ, "KVCHAOS_RUN_ID": run_id}
    print(f"kvchaos run {run_id}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env=env, cwd=REPO)
    summary = {"run_id": run_id, "exit_code": rc, "wall_s": round(time.monotonic() - t0, 1),
               "profile": args.profile, "suites": suites, "junit": str(run_dir / "junit.xml")}
    (run_dir / "run.json").write_text(json.dumps(summary, indent=2))
    print(f"kvchaos: report in {run_dir} (exit {rc})", flush=True)
    return rc


INCIDENTS = {
    "glm53": ("suites/incidents/test_glm53_kv_leak.py",
              "GLM-5.3 KV leak: prefill pool < context, rejected prompt handed to decode, stale pages served "
              "(pre-fix sglang 0.5.19 in its own env; bug replay on 0.5.23; the fixed 0.5.23)"),
}


def cmd_repro(args) -> int:
    if args.list or not args.name:
        for k, (path, what) in INCIDENTS.items():
            print(f"{k:8s} {path}\n         {what}")
        return 0 if args.list else 2
    if args.name not in INCIDENTS:
        raise SystemExit(f"kvchaos repro: unknown incident {args.name!r}; known: {sorted(INCIDENTS)}")
    path = str(REPO / INCIDENTS[args.name][0])
    ns = argparse.Namespace(reports=args.reports, suites=[path], profile=args.profile, markers="not gpu",
                            model=args.model, attach=None, k=None)
    rc = cmd_run(ns)
    runs = sorted(Path(args.reports).resolve().glob("*/incidents/*/summary.json"), key=lambda p: p.stat().st_mtime)
    for sfile in runs[-3:]:
        print(f"{sfile.parent}: {sfile.read_text()}")
    return rc


def build_parser() -> argparse.ArgumentParser:
    cfg = _config()
    p = argparse.ArgumentParser(prog="kvchaos", description="Chaos harness for disaggregated LLM inference")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--profile", default=cfg.get("profile", "cpu"), help="cluster profile name or TOML path")
        sp.add_argument("--model", default=cfg.get("model"), help="tiny:SEED or a model directory")
        sp.add_argument("--reports", default=cfg.get("reports", "reports"), help="reports directory")

    up = sub.add_parser("up", help="stand up a cluster and print its URLs until Ctrl-C")
    common(up)
    up.set_defaults(fn=cmd_up)
    run = sub.add_parser("run", help="run chaos suites and write reports/<run-id>/")
    common(run)
    run.add_argument("suites", nargs="*", default=cfg.get("suites"), help="suite files/dirs (default: suites/)")
    run.add_argument("--attach", default=None, help="router=URL,prefill=URL,decode=URL instead of launching")
    run.add_argument("-k", default=None, help="pytest -k expression")
    run.add_argument("-m", dest="markers", default="not slow and not gpu", help="pytest marker expression")
    run.set_defaults(fn=cmd_run)
    rp = sub.add_parser("repro", help="reproduce a known incident (see --list)")
    common(rp)
    rp.add_argument("name", nargs="?", help="incident name, e.g. glm53")
    rp.add_argument("--list", action="store_true", help="list known incidents")
    rp.set_defaults(fn=cmd_repro)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
