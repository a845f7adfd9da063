"""Replay a recorded run's scenario, and compare plan digests across runs.

A run directory holds what a replay needs: ``run.json`` (the run's seed, profile, layouts,
backends, model, attach target — written by the pytest plugin) and ``experiments.jsonl`` (per
experiment: its test id, seed, plan digest, verdicts and policy status). Because every workload and
fault draws from the run seed (``kvchaos.workload.seed``), running the scenario's test again with
the same seed, profile and layouts rebuilds the same plans and fault parameters; what cannot be
replayed bit for bit is the engine's own timing, which is exactly why a replay is repeated and a
*rate* is reported.

``replay`` runs the scenario's test ``times`` times, each in a pytest session of its own (a fresh
cluster, or the one named by ``attach``), under ``<run dir>/replays/``, and says per repetition:
whether the plans were the same (digest), each verdict's status against the original's, and
whether the original outcome reproduced — every verdict that was not PASS in the original has the
same status again (for a PASS scenario: every verdict PASS again). ``digests`` lists the plan
digest of every scenario of one or more run directories (dry or live) and tells where two differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvchaos.report.collect import ReportError, experiment_records
from kvchaos.workload.scenario import Scenario, ScenarioError

REPO = Path(__file__).resolve().parent.parent


class ReplayError(ValueError):
    pass


# --------------------------------------------------------------------------- reading a run
def load_run(run_dir) -> dict:
    d = Path(run_dir)
    if not d.is_dir():
        raise ReplayError(f"{d}: not a directory")
    meta = d / "run.json"
    if not meta.exists():
        raise ReplayError(f"{d}: no run.json — not a run directory written by kvchaos (or older than seeds)")
    try:
        run = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise ReplayError(f"{meta}: not JSON ({e})") from None
    if run.get("seed") is None:
        raise ReplayError(f"{meta}: the run recorded no seed (written before --kvchaos-seed existed): it cannot be replayed")
    return run


def scenarios(run_dir) -> list[dict]:
    """The run's experiments (``kvchaos.report.collect.experiment_records``: the last record per id
    stands), or its dry-run plan records."""
    d = Path(run_dir)
    try:
        out = experiment_records(d)
    except ReportError as e:
        raise ReplayError(str(e)) from None
    f = d / "plans.jsonl"
    for i, line in enumerate(f.read_text().splitlines() if f.exists() else (), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise ReplayError(f"{f}:{i}: not JSON") from None
    return out


def scenario_files(run_dir) -> dict:
    """Which of the run's experiments wrote a ``scenario.json`` that replays: ``{"experiments": n,
    "complete": [...], "incomplete": [(name, why), ...], "missing": [(name, why), ...]}``. A scenario is
    complete when it loads back as the same scenario and says everything the experiment did is in it
    (``origin.complete``: no custom drive, no during action beyond a nemesis schedule)."""
    d = Path(run_dir)
    out = {"experiments": 0, "complete": [], "incomplete": [], "missing": []}
    try:
        recs = experiment_records(d)
    except ReportError:
        return out
    for r in recs:
        out["experiments"] += 1
        name = r.get("name") or r.get("id")
        if not r.get("scenario"):
            out["missing"].append((name, r.get("scenario_error") or "no scenario.json written"))
            continue
        try:
            sc = Scenario.load(d / r["scenario"])
            if Scenario.from_dict(sc.to_dict()).digest() != sc.digest():
                raise ScenarioError("does not load back as the same scenario")
        except (OSError, ScenarioError, ValueError) as e:
            out["missing"].append((name, f"{r['scenario']}: {e}"))
            continue
        if sc.origin.get("complete", True):
            out["complete"].append(name)
        else:
            out["incomplete"].append((name, "; ".join(sc.origin.get("why_incomplete") or ["incomplete"])))
    return out


def select(recs: list[dict], scenario: str | None) -> list[dict]:
    """``scenario``: an experiment id, an experiment name, or a test id (or a unique part of one).
    Without it: every experiment that was not PASS."""
    if scenario is None:
        got = [r for r in recs if r.get("status") not in (None, "pass")]
        if not got:
            raise ReplayError("every experiment of this run passed: name the scenario to replay "
                              f"(one of: {', '.join(sorted({r['name'] for r in recs}))})")
        return got
    for exact in (lambda r: r.get("id") == scenario, lambda r: r.get("name") == scenario,
                  lambda r: r.get("test") == scenario):
        got = [r for r in recs if exact(r)]
        if got:
            return got
    got = [r for r in recs if scenario in (r.get("test") or "") or scenario in (r.get("name") or "")]
    if not got:
        raise ReplayError(f"no scenario {scenario!r} in this run; scenarios: "
                          f"{', '.join(sorted({r['name'] for r in recs}))}")
    tests = {r.get("test") for r in got}
    if len(tests) > 1:
        raise ReplayError(f"{scenario!r} names experiments of {len(tests)} tests ({', '.join(sorted(map(str, tests)))}): "
                          "be more precise")
    return got


# --------------------------------------------------------------------------- replaying
def pytest_command(run: dict, test: str, reports: Path, attach: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", test, "-p", "no:cacheprovider", "-o", "testpaths=", "-q",
           "--kvchaos-seed", str(run["seed"]), "--kvchaos-reports", str(reports)]
    for opt, key in (("--kvchaos-profile", "profile"), ("--kvchaos-layouts", "layouts"),
                     ("--kvchaos-backends", "backends"), ("--kvchaos-model", "model")):
        if run.get(key):
            cmd += [opt, str(run[key])]
    if attach or run.get("attach"):
        cmd += ["--kvchaos-attach", attach or run["attach"]]
    return cmd


def compare(orig: dict, again: dict | None) -> dict:
    """One repetition against the original experiment record."""
    if again is None:
        return {"ran": False, "reproduced": False, "why": "the replayed test ran no experiment of this name"}
    same_plans = bool(orig.get("plans_digest")) and orig.get("plans_digest") == again.get("plans_digest")
    ov, av = orig.get("verdicts") or {}, again.get("verdicts") or {}
    diff = {k: {"original": ov.get(k), "replay": av.get(k)} for k in sorted(set(ov) | set(av)) if ov.get(k) != av.get(k)}
    salient = {k: s for k, s in ov.items() if s != "pass"} or dict(ov)
    reproduced = same_plans and all(av.get(k) == s for k, s in salient.items())
    return {"ran": True, "same_plans": same_plans, "plans_digest": again.get("plans_digest"),
            "status": again.get("status"), "verdicts": av, "differs": diff, "reproduced": reproduced,
            "why": None if reproduced else ("plans differ: not the same scenario (engine answers shape its plans?)"
                                            if not same_plans else f"verdicts differ: {diff}")}


def replay(run_dir, scenario: str | None = None, times: int = 1, attach: str | None = None,
           timeout_s: float = 1800.0, say=print) -> dict:
    if times < 1:
        raise ReplayError(f"--times {times}: at least 1")
    run_dir = Path(run_dir).resolve()
    run = load_run(run_dir)
    picked = select(scenarios(run_dir), scenario)
    tests = sorted({r["test"] for r in picked if r.get("test")})
    if not tests:
        raise ReplayError("the selected experiments name no test id: nothing to re-run")
    out_dir = run_dir / "replays"
    out_dir.mkdir(exist_ok=True)
    result = {"run": str(run_dir), "seed": run["seed"], "times": times, "scenarios": []}
    for test in tests:
        origs = [r for r in picked if r["test"] == test]
        reps = []
        for i in range(1, times + 1):
            run_id = f"{run_dir.name}-replay-{_slug(test)}-{i}-{int(time.time())}"
            cmd = pytest_command(run, test, out_dir, attach)
            say(f"replay {i}/{times}: {test} (seed {run['seed']}) -> {out_dir / run_id}")
            t0 = time.monotonic()
            try:
                p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "KVCHAOS_RUN_ID": run_id},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
                rc, tail = p.returncode, p.stdout[-3000:]
            except subprocess.TimeoutExpired as e:
                rc, tail = None, f"timed out after {timeout_s} s: {str(e.stdout or '')[-2000:]}"
            (out_dir / f"{run_id}.log").write_text(tail)
            again = {r.get("name"): r for r in scenarios(out_dir / run_id)} if (out_dir / run_id).exists() else {}
            per = []
            for o in origs:
                c = compare(o, again.get(o["name"]))
                per.append({"experiment": o["name"], "original_status": o.get("status"), **c})
            ok = all(c["reproduced"] for c in per)
            reps.append({"rep": i, "run_dir": str(out_dir / run_id), "pytest_exit": rc,
                         "wall_s": round(time.monotonic() - t0, 1), "reproduced": ok, "experiments": per})
            say(f"  {'REPRODUCED' if ok else 'not reproduced'} in {reps[-1]['wall_s']} s: " + "; ".join(
                f"{c['experiment']}: {c.get('status')} {c.get('verdicts')}" + ("" if c["reproduced"] else f" ({c['why']})")
                for c in per))
        n = sum(r["reproduced"] for r in reps)
        result["scenarios"].append({"test": test, "original": [{k: o.get(k) for k in ("name", "status", "verdicts",
                                                                                     "plans_digest", "n")}
                                                               for o in origs],
                                    "reproduced": n, "of": times, "rate": n / times, "repetitions": reps})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"replay-{stamp}.json").write_text(json.dumps(result, indent=2, default=str))
    result["file"] = str(out_dir / f"replay-{stamp}.json")
    return result


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s.split("::")[-1])[:60]


# --------------------------------------------------------------------------- digests
def digests(run_dirs) -> dict:
    """Per scenario (test, experiment name, layout) the plan digest in each run directory; ``differ``
    lists the scenarios present in several whose digests are not all equal."""
    table: dict[tuple, dict] = {}
    seeds = {}
    for d in run_dirs:
        d = Path(d)
        try:
            seeds[str(d)] = load_run(d)["seed"]
        except ReplayError:
            seeds[str(d)] = None
        recs = scenarios(d)
        if not recs:
            raise ReplayError(f"{d}: no experiments.jsonl or plans.jsonl")
        for r in recs:
            if not r.get("plans_digest"):
                continue
            key = (r.get("test"), r.get("name"), r.get("kv_layout"))
            table.setdefault(key, {})[str(d)] = r["plans_digest"]
    rows = [{"test": k[0], "name": k[1], "kv_layout": k[2], "digests": v} for k, v in sorted(table.items(), key=str)]
    differ = [r for r in rows if len(r["digests"]) > 1 and len(set(r["digests"].values())) > 1]
    missing = [r for r in rows if len(r["digests"]) < len(run_dirs)]
    return {"runs": seeds, "scenarios": rows, "differ": differ, "missing": missing}


# --------------------------------------------------------------------------- shrinking
def shrink(run_dir, scenario: str, budget_s: float = 1200.0, max_steps: int = 40, attach: str | None = None,
           checker: str | None = None, timeout_s: float = 3600.0, say=print) -> dict:
    """Re-run the scenario's test with the run's seed and ``--kvchaos-shrink`` (kvchaos.shrink): once its
    experiment is judged, the same session shrinks it on the same cluster. Returns ``minimal.json``."""
    run_dir = Path(run_dir).resolve()
    run = load_run(run_dir)
    picked = select(scenarios(run_dir), scenario)
    names = sorted({r["name"] for r in picked})
    if len(names) != 1:
        raise ReplayError(f"{scenario!r} names {len(names)} experiments ({', '.join(names)}): shrink takes one")
    (rec,) = [r for r in picked if r["name"] == names[0]][-1:]
    if rec.get("status") == "pass" and not rec.get("planted"):
        say(f"note: {rec['name']} passed in the original run; shrinking needs it to fail again")
    out_dir = run_dir / "shrinks"
    out_dir.mkdir(exist_ok=True)
    run_id = f"{run_dir.name}-shrink-{_slug(rec['name'])}-{int(time.time())}"
    cmd = pytest_command(run, rec["test"], out_dir, attach) + [
        "--kvchaos-shrink", rec["name"], "--kvchaos-shrink-budget-s", str(budget_s),
        "--kvchaos-shrink-steps", str(max_steps), "-s"] + (["--kvchaos-shrink-checker", checker] if checker else [])
    say(f"shrink {rec['name']} of {rec['test']} (seed {run['seed']}) -> {out_dir / run_id}")
    log = out_dir / f"{run_id}.log"
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "KVCHAOS_RUN_ID": run_id}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout_s
            for line in p.stdout:  # progress: the shrinker's own lines
                fh.write(line)
                if line.startswith("shrink "):
                    say(line.rstrip())
                if time.monotonic() > deadline:
                    p.kill()
                    break
        finally:
            p.wait(timeout=60)
    res_file = out_dir / run_id / "shrink" / rec["name"] / "minimal.json"
    if not res_file.exists():
        raise ReplayError(f"the shrinking run wrote no {res_file} (pytest exit {p.returncode}); see {log}")
    res = json.loads(res_file.read_text())
    res["dir"] = str(res_file.parent)
    return res
