"""Cold time-to-verdict of ``kvchaos repro glm53``: from typing the command to the first leak verdict.

Runs the command as a user would (nothing started beforehand; the venvs exist), then reads what the run
left: ``progress.jsonl`` (when each experiment saw its first leak and was judged — the plugin's
``experiment`` records, phase leak and close — and
when each incident test ended), each ``cluster.json`` (the clusters' own start times: the session's and
the pre-fix release's), ``incidents/glm53-*/summary.json`` (when, inside each scenario, the first leak
was seen). Prints
the time to the first verdict and to the whole reproduction, with the cluster's cold start — the
baseline no harness can beat — as the ratio's denominator.

Usage: python bench/repro_cold.py [--reports DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvchaos.workload.events import load_events  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", default=None, help="keep the run here (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reports = Path(args.reports or tmp)
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "kvchaos", "repro", "glm53", "--reports", str(reports)],
                           cwd=REPO, capture_output=True, text=True, timeout=1800)
        total = time.time() - t0
        if p.returncode != 0:
            raise SystemExit(f"kvchaos repro glm53 failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        (run,) = [d for d in reports.iterdir() if (d / "progress.jsonl").exists()]
        progress = load_events(run / "progress.jsonl")
        clusters = {c.parent.name if c.parent != run else "session": json.loads(c.read_text())
                    for c in [run / "cluster.json", *run.glob("*/cluster.json")] if c.exists()}
        sums = {s.parent.name: json.loads(s.read_text()) for s in run.glob("incidents/*/summary.json")}
    rows = sorted((e["wall_end"] - t0, e["nodeid"].split("::")[-1], e["outcome"], e["duration"])
                  for e in progress if e.get("ev") == "end")
    # the plugin's record of each experiment as it is judged (before its test's audit and teardown)
    judged = sorted((e["wall"] - t0, e["name"], e["verdicts"]) for e in progress
                    if e.get("ev") == "experiment" and "verdicts" in e)
    # and the moment the experiment's live watch saw a leak: its isolation FAIL, final (the runner keeps it)
    seen = sorted((e["wall"] - t0, e["name"], e.get("after_s")) for e in progress
                  if e.get("ev") == "experiment" and e.get("phase") == "leak" and e.get("oracle") == "isolation")
    leaks = sorted([(at, name, "seen while the run went") for at, name, _ in seen if name.startswith("glm53-")]
                   + [(at, name, "judged whole") for at, name, v in judged
                      if name.startswith("glm53-") and v.get("isolation") == "fail"])
    print("kvchaos repro glm53, cold (exit 0):")
    for at, name, outcome, dur in rows:
        print(f"  {at:7.1f} s  {outcome:8s} {name} ({dur:.1f} s)")
    for at, name, verdicts in judged:
        print(f"  {at:7.1f} s  judged   {name}: {verdicts}")
    for at, name, after in seen:
        print(f"  {at:7.1f} s  leak     {name}: isolation FAIL seen {after} s into the experiment")
    for mode, s in sorted(sums.items()):
        ttd = s.get("time_to_first_detection_s")
        print(f"  {mode}: verdicts {s['verdicts']}, first leak {ttd if ttd is None else round(ttd, 1)} s into the "
              f"scenario, scenario {s['wall_s']} s")
    if not leaks:
        raise SystemExit(f"no leak verdict in the run: judged {judged}, tests {rows}")
    at, name, how = leaks[0]
    # each leak test runs on a cluster started cold for it: the pre-fix release's own, or the session's (0.5.23)
    pre = {k: v for k, v in clusters.items() if "-sglang-" in k}  # own_cluster's <profile>-sglang-<version>
    own_name, own = next(iter(pre.items())) if name == "glm53-prefix" and pre else \
        next((k, v) for k, v in clusters.items() if k not in pre)
    start = (own.get("timings") or {}).get("router_ready_s")
    if start is None:
        raise SystemExit(f"cluster {own_name}'s cluster.json has no router_ready_s: {own.get('timings')}")
    print(f"cold time-to-verdict: first leak verdict {at:.1f} s after the command ({name}: isolation FAIL, {how}); its "
          f"cluster ({own_name}) cold start {start:.1f} s; ratio first-verdict/cluster-start = {at / start:.2f}")
    starts = ", ".join(f"{k} {(v.get('timings') or {}).get('router_ready_s', float('nan')):.1f} s" for k, v in clusters.items())
    print(f"whole reproduction {total:.1f} s ({len(judged)} experiments judged; cluster starts: {starts})")


if __name__ == "__main__":
    main()
