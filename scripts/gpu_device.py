#!/usr/bin/env python3
"""The GPU check for a lent GPU machine, in at most 10 minutes, with one JSON of figures.

A lent machine (an H100 or H200, 16 cores) comes bare: no SGLang, a fresh copy of this repository. In
order, each step under a time limit of its own (the limits sum to under 10 minutes; a step that runs
past its limit is stopped, recorded as timed out, and the next one runs):

  host        nvidia-smi: the GPUs, their memory, the driver
  install     a venv with SGLang 0.5.23's CUDA stack from PyPI — the pins the nightly GPU job installs
              (.github/workflows/nightly-gpu.yml: sglang 0.5.23, sglang-router 0.3.2,
              mooncake-transfer-engine 0.3.13.post1, env/requirements-harness.txt), CUDA wheels where
              scripts/setup.sh installs the CPU ones (torch from sglang's own metadata, mooncake's CUDA
              build); kvchaos itself editable, without its deps. Skipped with --python (an interpreter
              that has them)
  versions    torch, CUDA, the GPUs as torch sees them, the engine packages' versions
  readiness   scripts/gpu-check.sh: per layout the smoke suite and the probe-model benchmark (echo rates)
  matrix      the detection matrix, one class per layout (one trial, mutated arm), in one pytest session
              over every layout; with --defences the defence arm is on (KVCHAOS_DEFENCES=1: SGLang's
              KV checksum and kv-canary on both roles, every experiment judged by them too)
  defences    (--defences) the table fault class x (kvchaos oracle, checksum, kv-canary) of that session

Layouts: the GPU profile's [suites] layouts and the production-shaped probes like:llama-3.1-8b-p64-bf16
and like:deepseek-v3-p64-bf16 (--layouts to choose). Figures: ONE JSON (--out; default
reports/gpu-device-<time>/figures.json, and a copy in $OUT when the device runner sets it), rewritten
after every step: versions, and per step its command, exit status, wall time, whether it timed out,
the figures parsed from its output, and its output's tail.

    python3 scripts/gpu_device.py --dry                 # the plan and its input checks (any machine)
    python3 scripts/gpu_device.py                       # on the GPU machine
    python3 scripts/gpu_device.py --defences --limit install=240 --limit readiness=120

--dry prints each step, its command and time limit, and checks the inputs: the repository files the
steps run, the GPU profile's layouts and the like: layouts (kvchaos.cluster.layouts.parse; a name it
does not parse is a warning, an error with --strict-layouts), the matrix classes. Exit: 0 every step
ran and passed (--dry: the inputs are usable), 1 a step failed or timed out, 2 refused — bad input, or
not a GPU machine (without --dry it refuses by name where nvidia-smi lists no GPU).

Standard library only at import time: it runs under any python3 before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # an older python3 on the lent machine: the few keys read here by pattern
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 600            # the device's limit for one command
MARGIN_S = 15             # what the script itself needs besides its steps (start, figures, kills)
KILL_GRACE_S = 5          # at a step's limit: SIGTERM, 3 s, SIGKILL, 2 s — inside the step's own limit
LIKE_LAYOUTS = ("like:llama-3.1-8b-p64-bf16", "like:deepseek-v3-p64-bf16")
# the nightly GPU job's pins (.github/workflows/nightly-gpu.yml); sglang's metadata brings the CUDA torch
PINS = ("sglang==0.5.23", "sglang-router==0.3.2", "mooncake-transfer-engine==0.3.13.post1")
# the matrix classes in the order layouts get them: those that need no reference server first
CLASS_ORDER = ("reject_admitted", "early_free", "salt_ignored", "prefix_collision", "short_transfer", "double_alloc")
LIMITS = {"host": 10, "install": 210, "versions": 25, "readiness": 150, "matrix": 170, "defences": 15}
FILES = ("scripts/gpu-check.sh", "suites/test_detection_matrix.py", "suites/test_smoke.py", "bench/probe_model.py",
         "kvchaos/profiles/gpu.toml", "env/requirements-harness.txt", "pyproject.toml")
VERSIONS_PY = """
import json, torch
from importlib import metadata as m
out = {"python": __import__("sys").version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(),
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for pkg in ("sglang", "sglang-router", "mooncake-transfer-engine", "flashinfer-python", "sgl-kernel", "nixl"):
    try:
        out[pkg] = m.version(pkg)
    except m.PackageNotFoundError:
        out[pkg] = None
print(json.dumps(out))
"""


class Refused(Exception):
    """Input the plan cannot run with (exit 2)."""


# --------------------------------------------------------------------------- the plan
def gpu_profile() -> dict:
    """The GPU profile's tables this script reads (``[suites] layouts``, whether it has ``[defences]``)."""
    text = (REPO / "kvchaos/profiles/gpu.toml").read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    m = re.search(r"^\[suites\][^\[]*?^layouts\s*=\s*\[(.*?)\]", text, re.S | re.M)
    return {"suites": {"layouts": re.findall(r'"([^"]+)"', m.group(1)) if m else []},
            "defences": {"table": True} if re.search(r"^\[defences\]", text, re.M) else {}}


def profile_layouts() -> list[str]:
    return list(gpu_profile().get("suites", {}).get("layouts", []))


def matrix_classes() -> list[str]:
    """The detection matrix's classes, read from its source (nothing of it is imported)."""
    src = (REPO / "suites/test_detection_matrix.py").read_text()
    m = re.search(r"^CLASSES = \{(.*?)^\}", src, re.S | re.M)
    return re.findall(r'^\s*"(\w+)":', m.group(1), re.M) if m else []


def assign(layouts: list[str], classes: list[str]) -> list[tuple[str, str]]:
    """One matrix class per layout, in CLASS_ORDER (the classes the suite has), round robin."""
    order = [c for c in CLASS_ORDER if c in classes] + [c for c in classes if c not in CLASS_ORDER]
    if not order:
        raise Refused("suites/test_detection_matrix.py: no CLASSES found")
    return [(lay, order[i % len(order)]) for i, lay in enumerate(layouts)]


def k_expr(pairs: list[tuple[str, str]]) -> str:
    return "test_mutation_is_detected and (" + " or ".join(f"({lay} and {cls})" for lay, cls in pairs) + ")"


def plan(args) -> list[dict]:
    """The steps: name, argv, extra environment, time limit, why (a step that does not run says so)."""
    work = Path(args.work)
    py = args.python or str(Path(args.venv) / "bin" / "python")
    lays = ",".join(args.layouts)
    pairs = assign(args.layouts, matrix_classes())
    steps = [{"name": "host", "argv": ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                       "--format=csv,noheader"]}]
    if args.python:
        steps.append({"name": "install", "argv": None, "skip": f"--python {args.python}: nothing installed"})
    else:
        find = f" --no-index --find-links {shlex.quote(args.wheelhouse)}" if args.wheelhouse else ""
        pip = f"{shlex.quote(py)} -m pip install -q --disable-pip-version-check{find}"
        script = (f"set -euo pipefail; [ -x {shlex.quote(py)} ] || {shlex.quote(args.base_python)} -m venv "
                  f"{shlex.quote(args.venv)}; {pip} {' '.join(PINS)} -r env/requirements-harness.txt; "
                  f"{pip} --no-deps{' --no-build-isolation' if args.wheelhouse else ''} -e .")
        steps.append({"name": "install", "argv": ["bash", "-c", script]})
    steps.append({"name": "versions", "argv": [py, "-c", VERSIONS_PY]})
    steps.append({"name": "readiness", "argv": ["bash", "scripts/gpu-check.sh"],
                  "env": {"KVCHAOS_GPU_PYTHON": py, "KVCHAOS_GPU_LAYOUTS": lays, "KVCHAOS_GPU_QUICK": "1"}})
    matrix = [py, "-m", "pytest", "suites/test_detection_matrix.py", "-p", "no:cacheprovider", "-q", "-o", "testpaths=",
              "--kvchaos-profile", "gpu", "--kvchaos-layouts", lays, "--kvchaos-backends", args.backend,
              "--kvchaos-reports", str(work / "matrix"), f"--junitxml={work / 'matrix' / 'junit.xml'}",
              "-m", "not slow", "-k", k_expr(pairs)]
    env = {"KVCHAOS_MATRIX_TRIALS": "1", "KVCHAOS_MATRIX_CLEAN_TRIALS": "0"}
    if args.defences:
        matrix[4:4] = ["-p", "kvchaos.plugin.defences"]  # registered here too, whether or not the plugin lists it
        env["KVCHAOS_DEFENCES"] = "1"
    steps.append({"name": "matrix", "argv": matrix, "env": env, "pairs": pairs})
    if args.defences:
        steps.append({"name": "defences", "argv": [py, "-m", "kvchaos.report.defences", "{matrix_run_dir}", "--json"]})
    for s in steps:
        s["limit_s"] = args.limits.get(s["name"], LIMITS[s["name"]])
        s.setdefault("env", {})
    total = sum(s["limit_s"] for s in steps if s.get("argv"))
    if total > BUDGET_S - MARGIN_S:
        raise Refused(f"the steps' time limits sum to {total} s: more than {BUDGET_S - MARGIN_S} s "
                      f"({BUDGET_S} s a command, {MARGIN_S} s for the script itself)")
    return steps


def check_inputs(args) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the inputs: repository files, layouts, classes, the defence arm."""
    errors, warnings = [], []
    for f in FILES:
        if not (REPO / f).is_file():
            errors.append(f"{f}: missing")
    if not args.layouts:
        errors.append("no layouts to run")
    if not matrix_classes():
        errors.append("suites/test_detection_matrix.py: no CLASSES found")
    parse, why = (None, "--no-layout-check") if args.no_layout_check else layout_parser()
    if parse is None:
        warnings.append(f"layouts not checked: {why}"[:300])
    args.dropped = []
    for lay in args.layouts if parse else ():
        try:
            parse(lay)
        except Exception as e:  # noqa: BLE001 - LayoutError, or whatever a layout module in flux raises
            if args.strict_layouts or not lay.startswith("like:"):
                errors.append(f"layout {lay!r} does not parse here: {e}"[:300])
            else:  # a production-shaped probe this checkout does not know yet: the run goes on without it
                args.dropped.append(lay)
                warnings.append(f"layout {lay!r} does not parse here, left out of the run: {e}"[:300])
    args.layouts = [lay for lay in args.layouts if lay not in args.dropped]
    if args.dropped and not args.layouts:
        errors.append("no layout left to run")
    if args.defences:
        try:
            if not gpu_profile().get("defences"):
                errors.append("--defences: kvchaos/profiles/gpu.toml has no [defences] table")
        except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError is a ValueError
            errors.append(f"kvchaos/profiles/gpu.toml: {e}")
        if not (REPO / "kvchaos/plugin/defences.py").is_file():
            errors.append("--defences: kvchaos/plugin/defences.py missing")
    if args.wheelhouse and not Path(args.wheelhouse).is_dir():
        errors.append(f"--wheelhouse {args.wheelhouse}: not a directory")
    return errors, warnings


def layout_parser():
    """(kvchaos.cluster.layouts.parse, None), or (None, why not): imported from this checkout when its
    package imports here, else the module alone from its file (it needs only the standard library)."""
    sys.path.insert(0, str(REPO))
    try:
        from kvchaos.cluster.layouts import parse  # the harness's own parser, where the harness imports
        return parse, None
    except Exception as first:  # noqa: BLE001 - a bare python3: kvchaos' package needs what is not installed yet
        import importlib.util  # the module alone, by its path

        try:
            spec = importlib.util.spec_from_file_location("_kvchaos_layouts", REPO / "kvchaos/cluster/layouts.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses looks the module up while it builds the classes
            spec.loader.exec_module(mod)
            return mod.parse, None
        except Exception as e:  # noqa: BLE001 - the check is skipped, and says so
            return None, f"kvchaos.cluster.layouts cannot be loaded here ({first!r}; alone: {e!r})"
    finally:
        sys.path.remove(str(REPO))


def gpus() -> tuple[bool, str]:
    """Whether this machine has a CUDA GPU (nvidia-smi lists one), and what it said."""
    if shutil.which("nvidia-smi") is None:
        return False, "nvidia-smi not found"
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"nvidia-smi -L failed: {e}"
    if r.returncode != 0 or "GPU" not in r.stdout:
        return False, f"nvidia-smi -L listed no GPU: {(r.stdout + r.stderr).strip()[:300]}"
    return True, r.stdout.strip()


# --------------------------------------------------------------------------- running a step
def run_step(step: dict, work: Path) -> dict:
    """Run one step under its limit in a process group of its own (stopped whole at the limit)."""
    rec = {"name": step["name"], "command": step["argv"], "env": step["env"], "limit_s": step["limit_s"]}
    log = work / f"{step['name']}.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        try:
            p = subprocess.Popen(step["argv"], cwd=REPO, env={**os.environ, **step["env"]}, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            return {**rec, "exit": None, "timed_out": False, "wall_s": 0.0, "error": f"{e}", "log": str(log)}
        try:
            code = p.wait(timeout=max(1, step["limit_s"] - KILL_GRACE_S))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(p)
            code = p.returncode
    text = log.read_text(errors="replace")
    return {**rec, "exit": code, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 1),
            "log": str(log), "tail": text[-3000:]}


def _kill(p) -> None:
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, KILL_GRACE_S - 3)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------- figures
def parse_host(text: str) -> dict:
    out = []
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0]:
            out.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return {"gpus": out}


def parse_versions(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {}


_READY = re.compile(r"^gpu-check: (?P<layout>\S+)\s+(?P<status>PASS|FAIL)\s+smoke=(?P<smoke>\S+)\s+bench=(?P<bench>\S+)"
                    r"\s+(?P<rest>.*?)\s*\((?P<s>\d+) s\)\s*$")
_RATE = re.compile(r"(?P<name>\w+)=(?P<pct>[0-9.]+)%\((?P<hits>\d+)/(?P<trials>\d+)\)")


def parse_readiness(text: str) -> dict:
    """Per layout: PASS/FAIL, smoke, bench, echo rates, seconds (gpu-check.sh's per-layout lines); the
    directory it kept everything in."""
    layouts = {}
    for line in text.splitlines():
        m = _READY.match(line.strip())
        if m:
            rates = {r["name"]: {"rate": round(float(r["pct"]) / 100, 4), "hits": int(r["hits"]),
                                 "trials": int(r["trials"])}
                     for r in _RATE.finditer(m["rest"])}
            layouts[m["layout"]] = {"status": m["status"], "smoke": m["smoke"], "bench": m["bench"], "rates": rates,
                                    "seconds": int(m["s"])}
    d = re.search(r"gpu-check summary \((?P<dir>[^,]+), backend (?P<b>\S+)\)", text)
    return {"layouts": layouts, "out_dir": d["dir"] if d else None, "backend": d["b"] if d else None}


def parse_junit(path: Path) -> dict:
    """tests / failures / errors / skipped, and each test case's outcome, from a JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"{path}: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = []
    for c in root.iter("testcase"):
        kind = next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")
        cases.append({"name": c.get("name"), "outcome": kind, "time_s": float(c.get("time", 0) or 0)})
    out["cases"] = cases
    return out


def parse_matrix(reports: Path) -> dict:
    """The matrix session's run directory: its JUnit, detection_matrix.json, each experiment's status."""
    runs = sorted((d for d in reports.glob("*") if d.is_dir()), key=lambda d: d.stat().st_mtime) \
        if reports.is_dir() else []
    out = {"junit": parse_junit(reports / "junit.xml") if (reports / "junit.xml").exists() else None,
           "run_dir": str(runs[-1]) if runs else None}
    if runs:
        dm = runs[-1] / "detection_matrix.json"
        try:
            out["detection_matrix"] = json.loads(dm.read_text()) if dm.exists() else None
        except ValueError as e:
            out["detection_matrix"] = {"error": str(e)}
        exps = []
        ej = runs[-1] / "experiments.jsonl"
        for line in (ej.read_text(errors="replace").splitlines() if ej.exists() else ()):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict):
                exps.append({k: r.get(k) for k in ("name", "kv_layout", "status", "planted", "verdicts")})
        out["experiments"] = exps
    return out


def figures_of(step: dict, rec: dict, work: Path) -> dict:
    text = rec.get("tail", "")
    try:
        full = Path(rec["log"]).read_text(errors="replace") if rec.get("log") else text
    except OSError:
        full = text
    name = step["name"]
    if name == "host":
        return parse_host(full)
    if name == "versions":
        return parse_versions(full)
    if name == "readiness":
        return parse_readiness(full)
    if name == "matrix":
        return {"classes": dict(step.get("pairs", [])), **parse_matrix(work / "matrix")}
    if name == "defences":
        try:
            return {"table": json.loads(full[full.index("["):])}
        except ValueError:
            return {}
    return {}


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_device.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="print the plan and check its inputs; run nothing")
    ap.add_argument("--json", action="store_true", help="--dry: the plan as JSON")
    ap.add_argument("--defences", action="store_true", help="the matrix with the defence arm on, and its table")
    ap.add_argument("--layouts", default=None,
                    help="comma-separated layouts [the GPU profile's [suites] layouts, then "
                         + ",".join(LIKE_LAYOUTS) + "]")
    ap.add_argument("--strict-layouts", action="store_true",
                    help="a like: layout that does not parse is an error, not a warning (and left out of the run)")
    ap.add_argument("--no-layout-check", action="store_true",
                    help="do not parse the layouts here (each run step then meets any bad name itself)")
    ap.add_argument("--venv", default=str(Path.home() / ".cache/kvchaos/venv-gpu"),
                    help="the venv to build [%(default)s]")
    ap.add_argument("--python", default=None, help="an interpreter that already has the engine: skip the install")
    ap.add_argument("--base-python", default=sys.executable, help="the interpreter the venv is made from [this one]")
    ap.add_argument("--wheelhouse", default=None, help="install from this directory of wheels only (no index)")
    ap.add_argument("--backend", default="mooncake_tcp", help="KV transfer backend [mooncake_tcp: one host, no RDMA]")
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=S", help="a step's time limit in seconds")
    ap.add_argument("--out", default=None, help="the figures JSON [reports/gpu-device-<time>/figures.json]")
    args = ap.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.work = str(REPO / "reports" / f"gpu-device-{stamp}")
    try:
        args.limits = {}
        for item in args.limit:
            k, _, v = item.partition("=")
            if k not in LIMITS or not v.isdigit() or int(v) < 1:
                raise Refused(f"--limit {item!r}: STEP=SECONDS, STEP one of {', '.join(LIMITS)}")
            args.limits[k] = int(v)
        args.layouts = ([x.strip() for x in args.layouts.split(",") if x.strip()] if args.layouts is not None
                        else profile_layouts() + list(LIKE_LAYOUTS))
        errors, warnings = check_inputs(args)
        if errors:
            raise Refused("; ".join(errors))
        steps = plan(args)
    except Refused as e:
        print(f"gpu_device: refused: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"gpu_device: warning: {w}", file=sys.stderr)
    if args.dry:
        return show(steps, warnings, args)
    ok, said = gpus()
    if not ok:
        print(f"gpu_device: refused: no CUDA device on this machine ({said}): this script runs on a lent GPU "
              "machine; --dry prints its plan", file=sys.stderr)
        return 2
    return execute(steps, warnings, args)


def show(steps, warnings, args) -> int:
    total = sum(s["limit_s"] for s in steps if s.get("argv"))
    if args.json:
        print(json.dumps({"steps": [{k: s.get(k) for k in ("name", "argv", "env", "limit_s", "skip", "pairs")}
                                    for s in steps], "total_limit_s": total, "budget_s": BUDGET_S,
                          "layouts": args.layouts, "layouts_left_out": args.dropped, "warnings": warnings},
                         indent=2))
        return 0
    print(f"gpu_device plan: {len(steps)} steps, limits summing to {total} s of {BUDGET_S} s; layouts "
          f"{', '.join(args.layouts)}" + (f" (left out: {', '.join(args.dropped)})" if args.dropped else ""))
    for s in steps:
        if not s.get("argv"):
            print(f"  {s['name']:10s}  skipped: {s['skip']}")
            continue
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s["env"].items())
        print(f"  {s['name']:10s}  {s['limit_s']:4d} s  {(env + ' ') if env else ''}{shlex.join(s['argv'])}")
        if s.get("pairs"):
            print("              classes: " + ", ".join(f"{lay} -> {cls}" for lay, cls in s["pairs"]))
    print(f"  figures: {args.out or Path(args.work) / 'figures.json'}")
    return 0


def execute(steps, warnings, args) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else work / "figures.json"
    figs = {"script": "scripts/gpu_device.py", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "layouts": args.layouts,
            "layouts_left_out": args.dropped, "defences": args.defences, "warnings": warnings, "versions": None,
            "limits_s": {s["name"]: s["limit_s"] for s in steps}, "steps": []}
    failed, broken = False, None
    t_start = time.monotonic()
    for s in steps:
        if not s.get("argv") or broken:
            figs["steps"].append({"name": s["name"], "skipped": s.get("skip") or broken, "limit_s": s["limit_s"]})
            _write(figs, out)
            continue
        if s["name"] == "defences":
            run_dir = (figs["steps"][-1].get("figures") or {}).get("run_dir")
            if not run_dir:
                figs["steps"].append({"name": s["name"], "skipped": "the matrix session wrote no run directory"})
                continue
            s = {**s, "argv": [run_dir if a == "{matrix_run_dir}" else a for a in s["argv"]]}
        print(f"gpu_device: {s['name']} (limit {s['limit_s']} s) ...", flush=True)
        rec = run_step(s, work)
        rec["figures"] = figures_of(s, rec, work)
        figs["steps"].append(rec)
        if s["name"] == "versions":
            figs["versions"] = rec["figures"]
        bad = rec.get("exit") != 0 or rec.get("timed_out")
        failed |= bool(bad)
        print(f"gpu_device: {s['name']}: exit {rec.get('exit')}{' (timed out)' if rec.get('timed_out') else ''} in "
              f"{rec['wall_s']} s", flush=True)
        if bad and s["name"] in ("install", "versions"):
            broken = f"no engine environment: the {s['name']} step failed (exit {rec.get('exit')})"
        _write(figs, out)
    figs["wall_s"] = round(time.monotonic() - t_start, 1)
    _write(figs, out)
    if os.environ.get("OUT") and Path(os.environ["OUT"]).is_dir():
        shutil.copy(out, Path(os.environ["OUT"]) / "gpu-device-figures.json")
    print(f"gpu_device: figures: {out}")
    return 1 if failed else 0


def _write(figs: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(figs, indent=2, default=str))
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
