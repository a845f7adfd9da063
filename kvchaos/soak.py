"""Flake accounting: the default suites K times, outcome counts per test, engine failures per run
and per 1,000 requests.

``soak`` runs the suites ``times`` times (each a pytest session of its own with a fresh run seed
unless one is given) and ``account`` reads any set of finished run directories — a soak's, CI's, a
colleague's — so the same table comes from both. Per test: how many runs ended passed, failed,
error, known, skipped; a test with more than one outcome class is *flaky* and each of its red runs
names the seed that replays it. Per engine-failure signature (``engine_errors.jsonl``, e.g. the
Mooncake transfer thread's death): runs in which it happened, occurrences, and the rate per run and
per 1,000 requests sent (requests: the experiments' plans, each experiment counted once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RED = ("failed", "error")


class SoakError(ValueError):
    pass


def _lines(p: Path) -> list[dict]:
    out = []
    if not p.exists():
        return out
    for line in p.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a truncated last line of a killed run
    return out


def read_run(run_dir: Path) -> dict:
    """One run directory: its seed, each test's outcome (progress.jsonl), requests sent, engine failures."""
    run_dir = Path(run_dir)
    if not (run_dir / "progress.jsonl").exists():
        raise SoakError(f"{run_dir}: no progress.jsonl — not a kvchaos run directory")
    try:
        seed = json.loads((run_dir / "run.json").read_text()).get("seed")
    except (OSError, json.JSONDecodeError):
        seed = None
    prog = _lines(run_dir / "progress.jsonl")
    outcomes = {e["nodeid"]: e["outcome"] for e in prog if e.get("ev") == "end" and e.get("nodeid")}
    finished = next((e for e in prog if e.get("ev") == "finished"), None)
    # this run's own experiments only: replays/ and shrinks/ beneath it are runs of their own
    exps = {r["id"]: r for r in _lines(run_dir / "experiments.jsonl") if r.get("id")}
    requests = 0
    for r in exps.values():
        if r.get("n") is not None:
            requests += int(r["n"])
        elif r.get("events"):  # recorded before experiments.jsonl held n: the plans in its log
            p = Path(r["events"]) if Path(r["events"]).is_absolute() else run_dir / r["events"]
            requests += sum(1 for e in _lines(p) if e.get("ev") == "plan")
    errors = _lines(run_dir / "engine_errors.jsonl")
    return {"run_dir": str(run_dir), "seed": seed, "outcomes": outcomes, "requests": requests,
            "exit": finished.get("exitstatus") if finished else None,
            "engine_errors": [{"signature": e.get("signature"), "role": e.get("role"), "test": e.get("test"),
                               "cause": e.get("cause")} for e in errors]}


def account(run_dirs) -> dict:
    runs = [read_run(Path(d)) for d in run_dirs]
    if not runs:
        raise SoakError("no run directories to account")
    tests: dict[str, dict] = {}
    for r in runs:
        for nodeid, oc in r["outcomes"].items():
            t = tests.setdefault(nodeid, {"counts": {}, "red_seeds": []})
            t["counts"][oc] = t["counts"].get(oc, 0) + 1
            if oc in RED:
                t["red_seeds"].append({"seed": r["seed"], "run_dir": r["run_dir"]})
    for t in tests.values():
        t["runs"] = sum(t["counts"].values())
        t["flaky"] = len(t["counts"]) > 1 and any(k in RED for k in t["counts"])
    total_req = sum(r["requests"] for r in runs)
    sigs: dict[str, dict] = {}
    for r in runs:
        for e in r["engine_errors"]:
            s = sigs.setdefault(e["signature"], {"occurrences": 0, "runs": set(), "tests": []})
            s["occurrences"] += 1
            s["runs"].add(r["run_dir"])
            s["tests"].append(e["test"])
    engine = {k: {"occurrences": v["occurrences"], "runs_with": len(v["runs"]), "of_runs": len(runs),
                  "per_run": v["occurrences"] / len(runs),
                  "per_1000_requests": (1000 * v["occurrences"] / total_req) if total_req else None,
                  "tests": v["tests"]} for k, v in sigs.items()}
    red = {k: v for k, v in tests.items() if any(c in RED for c in v["counts"])}
    return {"runs": [{k: r[k] for k in ("run_dir", "seed", "exit", "requests")} | {"engine_errors": len(r["engine_errors"])}
                     for r in runs],
            "requests": total_req, "tests": tests, "red": sorted(red), "flaky": sorted(k for k, v in tests.items() if v["flaky"]),
            "engine_errors": engine}


def render(res: dict) -> str:
    lines = [f"{len(res['runs'])} run(s), {res['requests']} requests"]
    for r in res["runs"]:
        lines.append(f"  {r['run_dir']}: seed {r['seed']}, exit {r['exit']}, {r['requests']} requests, "
                     f"{r['engine_errors']} engine failure(s)")
    n = len(res["runs"])
    lines.append("")
    lines.append("tests with an outcome other than passed:" if any(
        set(v["counts"]) != {"passed"} for v in res["tests"].values()) else f"every test passed in every run it ran in")
    for k, v in sorted(res["tests"].items()):
        if set(v["counts"]) == {"passed"}:
            continue
        tag = "FLAKY " if v["flaky"] else ("RED   " if k in res["red"] else "      ")
        counts = " ".join(f"{o} {c}" for o, c in sorted(v["counts"].items()))
        lines.append(f"  {tag}{k}: {counts}" + "".join(
            f"\n         red with seed {s['seed']}: kvchaos replay {s['run_dir']} '{k}'" if s["seed"] is not None else
            f"\n         red in {s['run_dir']} (no seed recorded: not replayable)" for s in v["red_seeds"]))
    lines.append("")
    if not res["engine_errors"]:
        lines.append("engine failures: none")
    for sig, e in sorted(res["engine_errors"].items()):
        per_k = f"{e['per_1000_requests']:.3f}" if e["per_1000_requests"] is not None else "-"
        lines.append(f"engine failure {sig}: {e['occurrences']} in {e['runs_with']} of {e['of_runs']} run(s) — "
                     f"{e['per_run']:.2f} per run, {per_k} per 1,000 requests")
    return "\n".join(lines)


def soak(times: int, out: Path, suites: list[str], markers: str, seed=None, extra: list[str] | None = None,
         timeout_s: float = 5400.0, say=print) -> dict:
    """Run the suites ``times`` times (fresh seeds unless ``seed``), then account them."""
    if times < 1:
        raise SoakError(f"--times {times}: at least 1")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for i in range(1, times + 1):
        run_id = f"soak-{i}"
        cmd = [sys.executable, "-m", "pytest", *suites, "-p", "no:cacheprovider", "-m", markers, "-q",
               "--kvchaos-reports", str(out)] + (["--kvchaos-seed", str(seed)] if seed is not None else []) + (extra or [])
        say(f"soak {i}/{times}: {' '.join(cmd[3:])}")
        t0 = time.monotonic()
        with open(out / f"{run_id}.log", "w") as log:
            try:
                p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "KVCHAOS_RUN_ID": run_id}, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout_s)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = None
        dirs.append(out / run_id)
        say(f"  exit {rc} in {time.monotonic() - t0:.0f} s ({out / run_id})")
    res = account([d for d in dirs if (d / "progress.jsonl").exists()])
    (out / "soak.json").write_text(json.dumps(res, indent=2, default=str))
    (out / "soak.txt").write_text(render(res) + "\n")
    return res
